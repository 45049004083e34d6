"""Tests for transformer.py, sections 1-9: every piece against PyTorch's own.

Each component is compared with its PyTorch counterpart, weights copied, in eval
mode, float32, max abs difference <= 1e-5 (unless a test says otherwise). Each
mistake of GUIDE.md section 5 that these sections can make has a test named
after it (test_pitfallN_...), written so that the mistaken version would fail.

    python -m pytest -q test_transformer.py
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer as tf

TOL = 1e-5


@pytest.fixture(autouse=True)
def seed():
    """Every test starts from the same random state, in float32, on one thread
    (these tensors are tiny: handing them between threads costs more than the math,
    and a second busy process on 2 cores makes it 10x slower). Restored after."""
    torch.manual_seed(0)
    assert torch.get_default_dtype() == torch.float32
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def max_diff(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


def assert_close(a, b, tol=TOL):
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = max_diff(a, b)
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol:g}"


def randomize_norms(model):
    """Random LayerNorm weight and bias: ones/zeros would hide a swapped or doubled norm."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (tf.LayerNorm, nn.LayerNorm)):
                m.weight.copy_(1 + 0.5 * torch.randn_like(m.weight))
                m.bias.copy_(0.5 * torch.randn_like(m.bias))
    return model


# --- weight copying: ours -> PyTorch's --------------------------------------

@torch.no_grad()
def copy_mha(ours, ref):
    """nn.MultiheadAttention packs q, k, v along dim 0 of in_proj_weight."""
    ref.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight], 0))
    ref.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias], 0))
    ref.out_proj.weight.copy_(ours.w_o.weight)
    ref.out_proj.bias.copy_(ours.w_o.bias)


@torch.no_grad()
def copy_norm(ours, ref):
    ref.weight.copy_(ours.weight)
    ref.bias.copy_(ours.bias)


@torch.no_grad()
def copy_ffn(ours, ref_layer):
    ref_layer.linear1.weight.copy_(ours.fc1.weight)
    ref_layer.linear1.bias.copy_(ours.fc1.bias)
    ref_layer.linear2.weight.copy_(ours.fc2.weight)
    ref_layer.linear2.bias.copy_(ours.fc2.bias)


def copy_encoder_layer(ours, ref):
    copy_mha(ours.self_attn, ref.self_attn)
    copy_ffn(ours.ffn, ref)
    copy_norm(ours.norm1, ref.norm1)
    copy_norm(ours.norm2, ref.norm2)


def copy_decoder_layer(ours, ref):
    copy_mha(ours.self_attn, ref.self_attn)
    copy_mha(ours.cross_attn, ref.multihead_attn)
    copy_ffn(ours.ffn, ref)
    copy_norm(ours.norm1, ref.norm1)
    copy_norm(ours.norm2, ref.norm2)
    copy_norm(ours.norm3, ref.norm3)


def key_padding(mask):
    """Our [B, 1, 1, S] mask (True = attend) -> nn's key_padding_mask [B, S] (True = ignore)."""
    return ~mask[:, 0, 0, :]


# Shared toy batch: src padded with pad_id 0, S = 6 != T = 4, tgt padded at its end.
PAD = 0
SRC = torch.tensor([[5, 3, 7, 2, 9, 4],
                    [6, 8, 2, 0, 0, 0]])          # [B=2, S=6]
TGT = torch.tensor([[1, 4, 6, 3],
                    [1, 7, 2, 0]])                # [B=2, T=4]
SRC_VOCAB, TGT_VOCAB = 11, 13


# ===========================================================================
# 1. Positional encoding
# ===========================================================================

def test_positional_encoding_closed_form():
    D, max_len = 8, 50
    pe = tf.PositionalEncoding(D, max_len=max_len, dropout=0.0).pe      # [1, max_len, D]
    assert pe.shape == (1, max_len, D)
    for pos in (0, 1, 2, 7, 49):
        for i in range(D // 2):
            angle = pos / 10000 ** (2 * i / D)
            assert abs(pe[0, pos, 2 * i].item() - math.sin(angle)) <= TOL, (pos, 2 * i)
            assert abs(pe[0, pos, 2 * i + 1].item() - math.cos(angle)) <= TOL, (pos, 2 * i + 1)


def test_positional_encoding_is_buffer_not_parameter():
    m = tf.PositionalEncoding(8, max_len=10)
    assert "pe" not in dict(m.named_parameters())
    assert list(m.parameters()) == []
    assert "pe" in dict(m.named_buffers())
    assert "pe" in m.state_dict()
    assert not m.pe.requires_grad


def test_positional_encoding_forward_adds_pe():
    m = tf.PositionalEncoding(16, max_len=20, dropout=0.5).eval()       # eval: dropout off
    x = torch.randn(3, 5, 16)
    assert_close(m(x), x + m.pe[:, :5])
    # start shifts the positions (a cached decoder's next token)
    assert_close(m(x, start=4), x + m.pe[:, 4:9])
    assert max_diff(m(x, start=4), m(x)) > 1e-2


def test_positional_encoding_too_long_raises():
    m = tf.PositionalEncoding(8, max_len=6)
    m(torch.zeros(1, 6, 8))  # exactly max_len is fine
    with pytest.raises(ValueError, match="max_len"):
        m(torch.zeros(1, 7, 8))
    with pytest.raises(ValueError, match="max_len is 6"):
        m(torch.zeros(1, 3, 8), start=4)


def test_positional_encoding_odd_d_model_raises():
    with pytest.raises(ValueError, match="7"):
        tf.PositionalEncoding(7)


# ===========================================================================
# 2. Scaled dot-product attention and masks
# ===========================================================================

def test_make_masks_shapes_and_convention():
    ids = torch.tensor([[4, 5, 0], [3, 0, 0]])
    pad = tf.make_pad_mask(ids, 0)
    assert pad.dtype == torch.bool and pad.shape == (2, 1, 1, 3)
    assert pad[:, 0, 0].tolist() == [[True, True, False], [True, False, False]]  # True = may attend
    causal = tf.make_causal_mask(4)
    assert causal.dtype == torch.bool and causal.shape == (1, 1, 4, 4)
    assert torch.equal(causal[0, 0], torch.tril(torch.ones(4, 4)).bool())
    assert causal[0, 0, 1, 0] and not causal[0, 0, 0, 1]  # query 0 never sees key 1


def _qkv(B=2, H=3, Tq=4, Tk=6, dk=5, dtype=torch.float32):
    return (torch.randn(B, H, Tq, dk, dtype=dtype), torch.randn(B, H, Tk, dk, dtype=dtype),
            torch.randn(B, H, Tk, dk, dtype=dtype))


def test_attention_no_mask_matches_sdpa():
    q, k, v = _qkv(Tq=4, Tk=6)
    out, w = tf.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 4, 5) and w.shape == (2, 3, 4, 6)
    assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert_close(w.sum(-1), torch.ones(2, 3, 4))
    assert_close(w, torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(5), -1))


def test_attention_padding_mask_matches_sdpa():
    q, k, v = _qkv(Tq=4, Tk=6)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [3, 4, 5, 0, 0, 0]])
    mask = tf.make_pad_mask(ids, 0)                                      # [B, 1, 1, Tk]
    out, w = tf.scaled_dot_product_attention(q, k, v, mask)
    assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert_close(w.sum(-1), torch.ones(2, 3, 4))
    assert (w[1, :, :, 3:] == 0).all()
    # padding changes nothing that reads only real keys: compare with the keys cut off
    out_cut, _ = tf.scaled_dot_product_attention(q[1:], k[1:, :, :3], v[1:, :, :3])
    assert_close(out[1:], out_cut)


def test_attention_causal_mask_matches_sdpa():
    q, k, v = _qkv(Tq=5, Tk=5)
    mask = tf.make_causal_mask(5)
    out, w = tf.scaled_dot_product_attention(q, k, v, mask)
    assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert_close(w.sum(-1), torch.ones(2, 3, 5))
    assert (w.triu(1) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_all_padding_row_gives_zeros_not_nan(dtype):
    q, k, v = _qkv(Tq=3, Tk=4, dtype=dtype)
    ids = torch.tensor([[5, 6, 0, 0], [0, 0, 0, 0]])                     # example 1: all padding
    out, w = tf.scaled_dot_product_attention(q, k, v, tf.make_pad_mask(ids, 0))
    assert out.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (out[1] == 0).all() and (w[1] == 0).all()
    assert (w[0, ..., 2:] == 0).all()
    assert_close(w[0].float().sum(-1), torch.ones(3, 3), tol=1e-2)


def test_attention_gradcheck_float64_with_mask():
    q, k, v = (t.requires_grad_() for t in _qkv(B=1, H=2, Tq=3, Tk=4, dk=3, dtype=torch.float64))
    mask = tf.make_pad_mask(torch.tensor([[1, 2, 3, 0]]), 0) & torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(
        lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, mask)[0], (q, k, v))


def test_pitfall5_fp16_mask_no_overflow_no_nan():
    # the masked scores are filled with the dtype's own minimum: finite in fp16 and bf16,
    # and the result agrees with the float32 computation
    q, k, v = _qkv(Tq=4, Tk=6)
    ids = torch.tensor([[3, 4, 5, 6, 0, 0], [0, 0, 0, 0, 0, 0]])
    mask = tf.make_pad_mask(ids, 0)
    ref, _ = tf.scaled_dot_product_attention(q, k, v, mask)
    for dtype, tol in ((torch.float16, 1e-2), (torch.bfloat16, 5e-2)):
        out, w = tf.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert torch.isfinite(out).all() and torch.isfinite(w).all(), dtype
        assert_close(out, ref, tol=tol)
    # the -inf alternative: a row with nothing to attend to becomes 0/0 = NaN
    scores = torch.randn(2, 6).masked_fill(~mask[:, 0, 0], float("-inf"))
    assert torch.isnan(scores.softmax(-1)[1]).all()


def test_pitfall5_minus_1e9_overflows_float16():
    assert torch.tensor(-1e9, dtype=torch.float16).item() == float("-inf")
    scores16 = torch.randn(2, 4, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="overflow"):
        scores16.masked_fill(scores16 > 0, -1e9)
    q, k, v = _qkv(Tq=2, Tk=4, dtype=torch.float16)
    mask = tf.make_pad_mask(torch.tensor([[1, 2, 0, 0], [0, 0, 0, 0]]), 0)
    out, w = tf.scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()


def test_pitfall8_mask_3d_broadcasts_wrongly():
    # our masks are 4-D, so they broadcast over heads
    assert tf.make_pad_mask(torch.ones(2, 5, dtype=torch.long), 0).dim() == 4
    assert tf.make_causal_mask(5).dim() == 4
    # B == H == 2: a [B, T, T] mask lines its batch up with the heads axis, silently
    B, H, T = 2, 2, 4
    q, k, v = _qkv(B=B, H=H, Tq=T, Tk=T)
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 0, 0]])
    mask4 = tf.make_pad_mask(ids, 0) & tf.make_causal_mask(T)            # [B, 1, T, T]
    mask3 = mask4[:, 0]                                                  # [B, T, T]: the mistake
    right, _ = tf.scaled_dot_product_attention(q, k, v, mask4)
    wrong, _ = tf.scaled_dot_product_attention(q, k, v, mask3)
    for b in range(B):  # the 4-D mask is the per-example computation
        assert_close(right[b], F.scaled_dot_product_attention(q[b], k[b], v[b], attn_mask=mask4[b, 0]))
    assert max_diff(right, wrong) > 1e-2
    # B != H: the 3-D mask does not even broadcast
    q, k, v = _qkv(B=2, H=3, Tq=T, Tk=T)
    with pytest.raises(RuntimeError):
        tf.scaled_dot_product_attention(q, k, v, mask3)


# ===========================================================================
# 3. Multi-head attention
# ===========================================================================

def _mha_pair(D=16, H=4):
    ours = tf.MultiHeadAttention(D, H).eval()
    ref = nn.MultiheadAttention(D, H, dropout=0.0, batch_first=True).eval()
    copy_mha(ours, ref)
    return ours, ref


def test_mha_self_attention_matches_nn():
    ours, ref = _mha_pair()
    x = torch.randn(2, 5, 16)
    out = ours(x, x, x)
    ref_out, ref_w = ref(x, x, x, need_weights=True, average_attn_weights=True)
    assert out.shape == (2, 5, 16)
    assert_close(out, ref_out)
    assert ours.attn_weights.shape == (2, 4, 5, 5)
    assert_close(ours.attn_weights.mean(1), ref_w)


def test_mha_self_attention_causal_matches_nn():
    ours, ref = _mha_pair()
    x = torch.randn(2, 5, 16)
    causal = tf.make_causal_mask(5)
    ref_out, ref_w = ref(x, x, x, attn_mask=~causal[0, 0])
    assert_close(ours(x, x, x, causal), ref_out)
    assert_close(ours.attn_weights.mean(1), ref_w)


def test_mha_cross_attention_with_key_padding_matches_nn():
    ours, ref = _mha_pair()
    query, memory = torch.randn(2, 3, 16), torch.randn(2, 7, 16)         # Tq = 3, Tk = 7
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 0, 0, 0]])
    mask = tf.make_pad_mask(ids, 0)
    out = ours(query, memory, memory, mask)
    ref_out, ref_w = ref(query, memory, memory, key_padding_mask=key_padding(mask),
                         need_weights=True, average_attn_weights=True)
    assert out.shape == (2, 3, 16)
    assert_close(out, ref_out)
    assert ours.attn_weights.shape == (2, 4, 3, 7)
    assert_close(ours.attn_weights.mean(1), ref_w)


def test_pitfall4_cross_attention_with_different_lengths():
    # seed 002 reshaped K and V with the query's length: fails once S != T
    ours, ref = _mha_pair(D=24, H=3)
    for Tq, Tk in ((3, 8), (8, 3), (1, 5)):
        query, memory = torch.randn(2, Tq, 24), torch.randn(2, Tk, 24)
        out = ours(query, memory, memory)
        assert out.shape == (2, Tq, 24)
        assert_close(out, ref(query, memory, memory, need_weights=False)[0])


def test_mha_bad_heads_raises():
    with pytest.raises(ValueError) as err:
        tf.MultiHeadAttention(30, 4)
    assert "30" in str(err.value) and "4" in str(err.value)


def test_pitfall7_view_before_transpose():
    B, T, D, H = 2, 5, 12, 3
    dk = D // H
    mha = tf.MultiHeadAttention(D, H)
    x = torch.randn(B, T, D)
    heads = mha.split_heads(x)                                           # [B, H, T, dk]
    assert heads.shape == (B, H, T, dk)
    for h in range(H):  # head h is the h-th slice of width dk of every position
        assert torch.equal(heads[:, h], x[..., h * dk:(h + 1) * dk])
    # transposing first, then viewing, cuts across heads
    wrong1 = x.transpose(1, 2).contiguous().view(B, H, T, dk)
    wrong2 = x.reshape(B, H, T, dk)
    assert wrong1.shape == wrong2.shape == heads.shape
    assert max_diff(heads, wrong1) > 1e-2
    assert max_diff(heads, wrong2) > 1e-2


def test_pitfall1_seed000_mha_stores_heads():
    # seed 000's MultiHeadAttention never stored n_heads / d_model (crash on first use),
    # and its DecoderOnlyTransformer had no forward. Same structure, small vocab:
    # DecoderOnlyTransformer(vocab_size, d_model=512, n_layers=6, n_heads=8, d_ff=2048)
    assert "forward" in tf.DecoderOnlyTransformer.__dict__
    model = tf.DecoderOnlyTransformer(100, 512, 6, 8, 2048, max_len=64).eval()
    mha = model.layers[0].self_attn
    assert (mha.n_heads, mha.d_model, mha.dk) == (8, 512, 64)
    ids = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 5, 100)
    assert torch.isfinite(logits).all()
    assert mha.attn_weights.shape == (2, 8, 5, 5)


# ===========================================================================
# 4. Feed-forward
# ===========================================================================

@pytest.mark.parametrize("activation, act", [("relu", torch.relu), ("gelu", F.gelu)])
def test_feedforward_matches_manual(activation, act):
    ffn = tf.FeedForward(16, 40, activation=activation).eval()
    x = torch.randn(2, 5, 16)
    expected = act(x @ ffn.fc1.weight.T + ffn.fc1.bias) @ ffn.fc2.weight.T + ffn.fc2.bias
    assert_close(ffn(x), expected)
    assert ffn.fc1.weight.shape == (40, 16) and ffn.fc2.weight.shape == (16, 40)


def test_feedforward_activations_differ():
    relu, gelu = tf.FeedForward(16, 40, activation="relu"), tf.FeedForward(16, 40, activation="gelu")
    gelu.load_state_dict(relu.state_dict())
    x = torch.randn(2, 5, 16)
    assert max_diff(relu.eval()(x), gelu.eval()(x)) > 1e-3


def test_feedforward_bad_activation_raises():
    with pytest.raises(ValueError, match="tanh"):
        tf.FeedForward(16, 40, activation="tanh")


# ===========================================================================
# 5. Layer normalization
# ===========================================================================

@pytest.mark.parametrize("D, eps", [(16, 1e-5), (4, 1e-1)])
def test_layernorm_matches_nn(D, eps):
    ours = randomize_norms(tf.LayerNorm(D, eps=eps))
    ref = nn.LayerNorm(D, eps=eps)
    copy_norm(ours, ref)
    x = 3 * torch.randn(2, 5, D) + 1
    assert_close(ours(x), ref(x))
    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]


def test_pitfall6_layernorm_eps_inside_sqrt_biased_var():
    D, eps = 4, 1e-1
    ours = tf.LayerNorm(D, eps=eps)
    x = torch.randn(3, 5, D)
    out = ours(x)
    assert_close(out, F.layer_norm(x, (D,), eps=eps))
    mean = x.mean(-1, keepdim=True)
    # seed 001: eps added to the (biased) std instead of to the variance
    std_plus_eps = (x - mean) / (x.std(-1, unbiased=False, keepdim=True) + eps)
    # the Annotated Transformer: unbiased std (divide by D - 1), eps added to it
    unbiased = (x - mean) / (x.std(-1, keepdim=True) + eps)
    # unbiased variance alone, eps in the right place
    unbiased_var = (x - mean) / torch.sqrt(x.var(-1, keepdim=True) + eps)
    for wrong in (std_plus_eps, unbiased, unbiased_var):
        assert max_diff(out, wrong) > 1e-2


# ===========================================================================
# 6. Encoder and decoder layers
# ===========================================================================

D, H, FF = 16, 4, 32


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("mask_kind", ["pad", "causal"])
def test_encoder_layer_matches_nn(norm_first, activation, mask_kind):
    ours = randomize_norms(tf.EncoderLayer(D, H, FF, dropout=0.1, norm_first=norm_first,
                                           activation=activation)).eval()
    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation,
                                     batch_first=True, norm_first=norm_first).eval()
    copy_encoder_layer(ours, ref)
    x = torch.randn(2, 6, D)
    pad = tf.make_pad_mask(SRC, PAD)                                     # [B, 1, 1, S]
    if mask_kind == "pad":
        out = ours(x, pad)
        ref_out = ref(x, src_key_padding_mask=key_padding(pad))
    else:  # causal and padding together, as a GPT block with padding would see them
        causal = tf.make_causal_mask(6)
        out = ours(x, pad & causal)
        ref_out = ref(x, src_mask=~causal[0, 0], src_key_padding_mask=key_padding(pad))
    assert_close(out, ref_out)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_matches_nn(norm_first, activation):
    ours = randomize_norms(tf.DecoderLayer(D, H, FF, dropout=0.1, norm_first=norm_first,
                                           activation=activation)).eval()
    ref = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, activation=activation,
                                     batch_first=True, norm_first=norm_first).eval()
    copy_decoder_layer(ours, ref)
    x, memory = torch.randn(2, 4, D), torch.randn(2, 6, D)               # T = 4 != S = 6
    causal = tf.make_causal_mask(4)
    memory_mask = tf.make_pad_mask(SRC, PAD)
    out = ours(x, memory, causal, memory_mask)
    ref_out = ref(x, memory, tgt_mask=~causal[0, 0], memory_key_padding_mask=key_padding(memory_mask))
    assert out.shape == (2, 4, D)
    assert_close(out, ref_out)


def test_residual_pre_ln_and_post_ln():
    x = torch.randn(2, 3, D)
    norm = randomize_norms(tf.LayerNorm(D))
    f = lambda h: 2 * h + 1  # noqa: E731
    assert_close(tf.residual(x, norm, f, norm_first=True), x + f(norm(x)))
    assert_close(tf.residual(x, norm, f, norm_first=False), norm(x + f(x)))


# ===========================================================================
# 7. The encoder-decoder Transformer
# ===========================================================================

def _seq2seq(norm_first, **kw):
    args = dict(d_model=D, n_heads=H, d_ff=FF, n_layers=2, dropout=0.1, max_len=16,
                norm_first=norm_first, pad_id=PAD)
    args.update(kw)
    return randomize_norms(tf.Transformer(SRC_VOCAB, TGT_VOCAB, **args)).eval()


def _nn_transformer(model, norm_first):
    ref = nn.Transformer(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=2,
                         dim_feedforward=FF, dropout=0.0, batch_first=True,
                         norm_first=norm_first).eval()
    for ours, theirs in zip(model.encoder_layers, ref.encoder.layers):
        copy_encoder_layer(ours, theirs)
    for ours, theirs in zip(model.decoder_layers, ref.decoder.layers):
        copy_decoder_layer(ours, theirs)
    return ref


def _nn_logits(model, ref, src, tgt):
    """Run PyTorch's stacks on our embeddings, with PyTorch's mask conventions."""
    src_pad, tgt_pad = tf.make_pad_mask(src, PAD), tf.make_pad_mask(tgt, PAD)
    memory = ref.encoder(model.embed(model.src_embed, src), src_key_padding_mask=key_padding(src_pad))
    T = tgt.size(1)
    out = ref.decoder(model.embed(model.tgt_embed, tgt), memory,
                      tgt_mask=~tf.make_causal_mask(T)[0, 0],  # bool, True = not allowed
                      tgt_key_padding_mask=key_padding(tgt_pad),
                      memory_key_padding_mask=key_padding(src_pad))
    return memory, model.output_proj(out)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_matches_nn_transformer(norm_first):
    model = _seq2seq(norm_first)
    ref = _nn_transformer(model, norm_first)
    if norm_first:
        copy_norm(model.encoder_norm, ref.encoder.norm)
        copy_norm(model.decoder_norm, ref.decoder.norm)
    else:  # nn.Transformer ends a post-LN stack with an extra LayerNorm: remove it
        ref.encoder.norm = None
        ref.decoder.norm = None
    ref_memory, ref_logits = _nn_logits(model, ref, SRC, TGT)
    assert_close(model.encode(SRC), ref_memory)
    logits = model(SRC, TGT)
    assert logits.shape == (2, 4, TGT_VOCAB)
    assert_close(logits, ref_logits)
    assert_close(model.decode(TGT, model.encode(SRC), SRC), logits)


def test_pitfall10_post_ln_no_double_norm():
    post, pre = _seq2seq(norm_first=False), _seq2seq(norm_first=True)
    assert post.encoder_norm is None and post.decoder_norm is None
    assert isinstance(pre.encoder_norm, tf.LayerNorm) and isinstance(pre.decoder_norm, tf.LayerNorm)
    # nn.Transformer's default post-LN keeps its final encoder/decoder norm: a second LayerNorm
    ref = _nn_transformer(post, norm_first=False)
    assert isinstance(ref.encoder.norm, nn.LayerNorm) and isinstance(ref.decoder.norm, nn.LayerNorm)
    ref_memory, ref_logits = _nn_logits(post, ref, SRC, TGT)
    assert max_diff(post.encode(SRC), ref_memory) > 1e-2
    assert max_diff(post(SRC, TGT), ref_logits) > 1e-2


def test_transformer_share_embeddings_ties_three_ways():
    model = tf.Transformer(20, 20, d_model=D, n_heads=H, d_ff=FF, n_layers=1, share_embeddings=True)
    ptr = model.src_embed.weight.data_ptr()
    assert model.tgt_embed.weight.data_ptr() == ptr
    assert model.output_proj.weight.data_ptr() == ptr
    assert model.output_proj.weight is model.src_embed.weight
    untied = tf.Transformer(20, 20, d_model=D, n_heads=H, d_ff=FF, n_layers=1)
    assert untied.tgt_embed.weight.data_ptr() != untied.src_embed.weight.data_ptr()
    assert untied.output_proj.weight.data_ptr() != untied.tgt_embed.weight.data_ptr()


def test_transformer_share_embeddings_needs_one_vocab():
    with pytest.raises(ValueError) as err:
        tf.Transformer(20, 30, d_model=D, n_heads=H, d_ff=FF, n_layers=1, share_embeddings=True)
    assert "20" in str(err.value) and "30" in str(err.value)


def test_transformer_decoder_causality():
    model = _seq2seq(norm_first=False)
    src, tgt = SRC[:1], torch.tensor([[1, 4, 6, 3, 8]])
    logits = model(src, tgt)
    for j in range(1, tgt.size(1)):
        changed = tgt.clone()
        changed[0, j] = (tgt[0, j] % (TGT_VOCAB - 1)) + 1                # another non-pad id
        new = model(src, changed)
        assert max_diff(new[:, :j], logits[:, :j]) <= 1e-6, j
        assert max_diff(new[:, j:], logits[:, j:]) > 1e-4, j             # it did change something


def test_pitfall3_decoder_is_causal_in_training(monkeypatch):
    # seed 002's forward gave the decoder no causal mask: position 0 read the answer
    model = _seq2seq(norm_first=True)
    src = SRC[:1]
    a, b = torch.tensor([[1, 4, 6, 3]]), torch.tensor([[1, 9, 2, 5]])   # same first token
    assert max_diff(model(src, a)[:, 0], model(src, b)[:, 0]) <= 1e-6
    # the mistaken version (no causal mask) fails this very check
    monkeypatch.setattr(tf, "make_causal_mask",
                        lambda T, device=None: torch.ones(1, 1, T, T, dtype=torch.bool, device=device))
    assert max_diff(model(src, a)[:, 0], model(src, b)[:, 0]) > 1e-4


def test_transformer_padding_never_changes_real_positions():
    model = _seq2seq(norm_first=False)
    logits = model(SRC, TGT)                                             # SRC[1] has 3 pads
    alone = model(SRC[1:, :3], TGT[1:])                                  # the same, unpadded
    assert_close(logits[1:], alone)
    assert_close(model.encode(SRC)[1:, :3], model.encode(SRC[1:, :3]))
    # more padding on the source changes nothing either
    more = torch.cat([SRC, torch.zeros(2, 3, dtype=torch.long)], 1)      # S = 9
    assert_close(model(more, TGT), logits)
    # nor does padding at the end of the target, for the real target positions
    assert_close(logits[1:, :3], model(SRC[1:], TGT[1:, :3]))


def test_transformer_bad_inputs_raise():
    model = _seq2seq(norm_first=False)                                   # max_len 16
    with pytest.raises(ValueError, match=r"id 11\b.*\[0, 11\)"):
        model(torch.tensor([[1, 11]]), TGT[:1])
    with pytest.raises(ValueError, match=r"id 13\b.*\[0, 13\)"):
        model(SRC[:1], torch.tensor([[1, 13]]))
    with pytest.raises(ValueError, match=r"id -1\b"):
        model(torch.tensor([[1, -1]]), TGT[:1])
    with pytest.raises(ValueError, match=r"length 17.*max_len=16"):
        model(torch.ones(1, 17, dtype=torch.long), TGT[:1])
    with pytest.raises(ValueError, match=r"2-D.*\[5\]"):
        model(torch.ones(5, dtype=torch.long), TGT[:1])
    with pytest.raises(ValueError, match=r"2-D.*\[1, 5\]"):
        model(torch.ones(1, 5), TGT[:1])                                 # float ids


# ===========================================================================
# 8. The decoder-only Transformer
# ===========================================================================

V = 23


def _gpt(tie_weights=False, **kw):
    args = dict(max_len=16, dropout=0.1, tie_weights=tie_weights)
    args.update(kw)
    return randomize_norms(tf.DecoderOnlyTransformer(V, D, 2, H, FF, **args)).eval()


def test_decoder_only_matches_nn_transformer_encoder():
    model = _gpt()
    assert all(isinstance(layer, tf.EncoderLayer) for layer in model.layers)
    assert all(layer.norm_first for layer in model.layers)
    ref = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation="gelu",
                                   batch_first=True, norm_first=True),
        2, norm=nn.LayerNorm(D), enable_nested_tensor=False).eval()
    for ours, theirs in zip(model.layers, ref.layers):
        copy_encoder_layer(ours, theirs)
    copy_norm(model.final_norm, ref.norm)
    ids = torch.randint(0, V, (2, 7))
    x = model.pos_encoding(model.token_embedding(ids) * math.sqrt(D))
    ref_logits = model.lm_head(ref(x, mask=~tf.make_causal_mask(7)[0, 0]))
    logits = model(ids)
    assert logits.shape == (2, 7, V)
    assert_close(logits, ref_logits)


def test_decoder_only_lm_head_and_tie_weights():
    untied, tied = _gpt(), _gpt(tie_weights=True)
    assert untied.lm_head.bias is None and tied.lm_head.bias is None
    assert tied.lm_head.weight is tied.token_embedding.weight
    assert tied.lm_head.weight.data_ptr() == tied.token_embedding.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.token_embedding.weight.data_ptr()


def test_decoder_only_causality():
    model = _gpt()
    ids = torch.randint(0, V, (1, 8))
    logits = model(ids)
    for j in range(1, 8):
        changed = ids.clone()
        changed[0, j] = (ids[0, j] + 1) % V
        new = model(changed)
        assert max_diff(new[:, :j], logits[:, :j]) <= 1e-6, j
        assert max_diff(new[:, j:], logits[:, j:]) > 1e-4, j


def test_generate_is_greedy():
    model = _gpt()
    prompt = torch.randint(0, V, (2, 3))
    out = model.generate(prompt, max_new_tokens=5)
    assert out.shape == (2, 8)
    assert torch.equal(out[:, :3], prompt)
    ids = prompt
    with torch.no_grad():
        for _ in range(5):  # step by step, by hand
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, ids)
        # and in one pass: every generated token is the argmax at the position before it
        assert torch.equal(out[:, 3:], model(out)[:, 2:-1].argmax(-1))


def test_generate_bad_inputs_raise():
    model = _gpt()                                                       # max_len 16
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 7.*max_len=16"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    model.generate(torch.zeros(1, 10, dtype=torch.long), 6)              # exactly max_len is fine
    with pytest.raises(ValueError, match=rf"id {V}\b.*\[0, {V}\)"):
        model.generate(torch.tensor([[1, V]]), 2)
    with pytest.raises(ValueError, match=rf"id {V}\b"):
        model(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match="max_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


# ===========================================================================
# 9. Parameter counts
# ===========================================================================

@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_transformer_param_formula(norm_first, share):
    tgt_vocab = 37 if share else 41
    cfg = dict(src_vocab_size=37, tgt_vocab_size=tgt_vocab, d_model=16, n_heads=4, d_ff=24,
               n_layers=2, norm_first=norm_first, share_embeddings=share)
    model = tf.Transformer(**cfg)
    n = tf.count_parameters(model)
    assert n == tf.transformer_param_formula(**cfg)
    assert n == sum(p.numel() for p in set(model.parameters()))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("n_layers, d_ff", [(1, 24), (3, 40)])
def test_decoder_only_param_formula(tie, n_layers, d_ff):
    cfg = dict(vocab_size=29, d_model=16, n_layers=n_layers, n_heads=4, d_ff=d_ff, tie_weights=tie)
    assert tf.count_parameters(tf.DecoderOnlyTransformer(**cfg)) == tf.decoder_only_param_formula(**cfg)


def test_tied_weights_counted_once():
    untied = tf.DecoderOnlyTransformer(29, 16, 1, 4, 24)
    tied = tf.DecoderOnlyTransformer(29, 16, 1, 4, 24, tie_weights=True)
    assert tf.count_parameters(untied) - tf.count_parameters(tied) == 29 * 16
    shared = tf.Transformer(29, 29, d_model=16, n_heads=4, d_ff=24, n_layers=1, share_embeddings=True)
    separate = tf.Transformer(29, 29, d_model=16, n_heads=4, d_ff=24, n_layers=1)
    assert tf.count_parameters(separate) - tf.count_parameters(shared) == 2 * 29 * 16
    # the positional table is a buffer, never counted
    assert tf.count_parameters(tf.PositionalEncoding(16)) == 0


@pytest.mark.parametrize("tie", [False, True])
def test_pitfall2_seed000_param_count(tie):
    # seed 000: vocab 50257, d 512, 6 layers, 8 heads, d_ff 2048, said to have "3000多万"
    V0, D0, L0, H0, F0 = 50257, 512, 6, 8, 2048
    with torch.device("meta"):  # shapes only: no memory, no time
        model = tf.DecoderOnlyTransformer(V0, D0, L0, H0, F0, tie_weights=tie)
    embeddings = V0 * D0                                  # 25,731,584
    attention = 4 * (D0 * D0 + D0)                        # w_q, w_k, w_v, w_o with biases: 1,050,624
    ffn = (D0 * F0 + F0) + (F0 * D0 + D0)                 # fc1, fc2 with biases: 2,099,712
    norms = 2 * (2 * D0)                                  # norm1, norm2: 2,048
    per_layer = attention + ffn + norms                   # 3,152,384
    final_norm = 2 * D0                                   # 1,024
    lm_head = 0 if tie else V0 * D0                       # no bias; tied shares the embedding
    expected = embeddings + L0 * per_layer + final_norm + lm_head
    assert expected == (44_646_912 if tie else 70_378_496)
    assert tf.count_parameters(model) == expected
    assert tf.decoder_only_param_formula(V0, D0, L0, F0, tie_weights=tie) == expected
    # pitfall 2: it is not "3000多万" (30-40 million), tied or not
    assert not 30_000_000 <= tf.count_parameters(model) < 40_000_000
