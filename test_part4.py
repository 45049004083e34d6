"""Tests of Part IV (long sequences, sections 22-25) of transformer.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import transformer as tf


def max_diff(a, b):
    return (a - b).abs().max().item()


def qkv(B, H, Tq, Tk, dk, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, dk, generator=g, dtype=dtype)               # [B, H, Tq, dk]
    k = torch.randn(B, H, Tk, dk, generator=g, dtype=dtype)               # [B, H, Tk, dk]
    v = torch.randn(B, H, Tk, dv or dk, generator=g, dtype=dtype)         # [B, H, Tk, dv]
    return q, k, v


def bottom_right(Tq, Tk):
    return tf.make_causal_mask(Tq, past=Tk - Tq)                          # [1, 1, Tq, Tk]


# ===========================================================================
# 22. FlashAttention's tiles
# ===========================================================================

CASES = [  # (Tq, Tk, causal, block_size): odd sizes, blocks of 1, 7 and larger than T
    (37, 53, False, 1), (37, 53, False, 7), (37, 53, False, 64), (53, 37, False, 7),
    (37, 53, True, 1), (37, 53, True, 7), (37, 53, True, 100), (53, 53, True, 7), (1, 53, True, 7),
    (37, 37, True, 16),
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("Tq, Tk, causal, block_size", CASES)
def test_flash_attention_equals_section_2_and_torch(Tq, Tk, causal, block_size, dtype, tol):
    q, k, v = qkv(2, 3, Tq, Tk, 16, dv=12, dtype=dtype)
    mask = bottom_right(Tq, Tk) if causal else None
    out, lse = tf.flash_attention(q, k, v, causal=causal, block_size=block_size)
    assert out.shape == (2, 3, Tq, 12) and lse.shape == (2, 3, Tq) and out.dtype == dtype
    ours, _ = tf.scaled_dot_product_attention(q, k, v, mask)
    assert max_diff(out, ours) <= tol
    assert max_diff(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) <= tol
    if not causal or Tq == Tk:  # where is_causal's top-left alignment is the same as ours
        assert max_diff(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal)) <= tol
    scores = q @ k.transpose(-2, -1) / math.sqrt(16)                      # [B, H, Tq, Tk]
    if causal:
        scores = scores.masked_fill(~mask, float("-inf"))
    assert max_diff(lse, torch.logsumexp(scores, dim=-1)) <= tol


def test_flash_attention_pitfall_is_causal_is_top_left_when_tq_below_tk():
    q, k, v = qkv(1, 2, 5, 9, 8)
    out, _ = tf.flash_attention(q, k, v, causal=True, block_size=4)
    assert max_diff(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right(5, 9))) < 1e-5
    # is_causal=True lets query i see keys 0..i only: the last query misses 4 keys it may see
    assert max_diff(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)) > 1e-2


def test_flash_attention_worked_example_of_the_comment():
    q, k = torch.ones(1, 1, 1, 1), torch.tensor([1.0, 2.0, 3.0, 0.0]).view(1, 1, 4, 1)
    v = torch.tensor([10.0, 20.0, 30.0, 40.0]).view(1, 1, 4, 1)
    out, lse = tf.flash_attention(q, k, v, block_size=2)
    w = torch.tensor([1.0, 2.0, 3.0, 0.0]).exp()
    assert abs(out.item() - (w * v.flatten()).sum().item() / w.sum().item()) < 1e-4
    assert abs(lse.item() - math.log(w.sum().item())) < 1e-6


@pytest.mark.parametrize("Tq, Tk, causal, block_size", [(37, 53, False, 7), (37, 53, True, 7), (20, 20, True, 1)])
def test_flash_attention_gradients_equal_autograd_through_the_plain_formula(Tq, Tk, causal, block_size):
    q, k, v = (t.requires_grad_() for t in qkv(2, 2, Tq, Tk, 8, dv=6, dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    d_out, d_lse = torch.randn(2, 2, Tq, 6, generator=g, dtype=torch.float64), torch.randn(2, 2, Tq, generator=g,
                                                                                          dtype=torch.float64)
    out, lse = tf.flash_attention(q, k, v, causal=causal, block_size=block_size)
    ours = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)                       # [B, H, Tq, Tk]
    if causal:
        scores = scores.masked_fill(~bottom_right(Tq, Tk), float("-inf"))
    plain_out = scores.softmax(-1) @ v                                    # [B, H, Tq, dv]
    plain_lse = torch.logsumexp(scores, -1)                               # [B, H, Tq]
    theirs = torch.autograd.grad((plain_out * d_out).sum() + (plain_lse * d_lse).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        assert max_diff(a, b) <= 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_gradcheck_float64(causal):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 5, 7, 4, dv=3, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, k, v: tf.flash_attention(q, k, v, causal, 3), (q, k, v))


def test_flash_attention_float32_gradients():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 37, 53, 8))
    out, _ = tf.flash_attention(q, k, v, causal=True, block_size=7)
    ours = torch.autograd.grad(out.sum(), (q, k, v))
    plain, _ = tf.scaled_dot_product_attention(q, k, v, bottom_right(37, 53))
    for a, b in zip(ours, torch.autograd.grad(plain.sum(), (q, k, v))):
        assert max_diff(a, b) <= 1e-5


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any operator returns while it is active."""

    def __init__(self):
        super().__init__()
        self.shapes, self.ops = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
                self.ops.append((func.overloadpacket.__name__, tuple(t.shape)))
        return out


def largest_matrix(shapes):
    return max(s[-2] * s[-1] for s in shapes if len(s) >= 2)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_never_allocates_a_tq_by_tk_tensor_forward_or_backward(causal):
    Tq, Tk, block = 37, 53, 8
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, Tq, Tk, 16))
    with ShapeRecorder() as recorder:
        out, lse = tf.flash_attention(q, k, v, causal=causal, block_size=block)
        (out.sum() + lse.sum()).backward()
    assert len(recorder.shapes) > 100  # it saw the tiles, the backward's too
    assert not [s for s in recorder.shapes if Tq in s and Tk in s]
    assert largest_matrix(recorder.shapes) <= Tk * 16  # k or v, [Tk, dk]: never Tq * Tk = 1961
    with ShapeRecorder() as plain:  # the recorder would see section 2's [Tq, Tk] weights
        tf.scaled_dot_product_attention(q, k, v, bottom_right(Tq, Tk) if causal else None)
    assert (1, 2, Tq, Tk) in plain.shapes


def test_flash_attention_causal_skips_key_blocks_above_the_diagonal():
    counts = {}
    for causal in (False, True):
        with ShapeRecorder() as recorder:
            tf.flash_attention(*qkv(1, 1, 64, 64, 4), causal=causal, block_size=8)
        counts[causal] = recorder.ops.count(("exp", (1, 1, 8, 8)))       # one e^(S - m) a tile
    # 8 x 8 tiles: 64 without a mask, 36 on or under the diagonal with one
    assert counts[True] * 64 == counts[False] * 36


def test_flash_attention_half_precision_inputs_sum_in_float32():
    q, k, v = qkv(1, 2, 37, 53, 16, dtype=torch.bfloat16)
    out, lse = tf.flash_attention(q, k, v, causal=True, block_size=16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    reference, _ = tf.scaled_dot_product_attention(q.float(), k.float(), v.float(), bottom_right(37, 53))
    assert max_diff(out.float(), reference) < 2e-2


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True, None])
def test_flash_attention_refuses_a_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        tf.flash_attention(*qkv(1, 1, 4, 4, 8), block_size=block_size)


def test_flash_attention_refuses_causal_with_more_queries_than_keys():
    with pytest.raises(ValueError, match=r"causal needs Tq <= Tk.*Tq 5 > Tk 3"):
        tf.flash_attention(*qkv(1, 1, 5, 3, 8), causal=True)
    tf.flash_attention(*qkv(1, 1, 5, 3, 8), causal=False)  # without causal any lengths go


def test_flash_attention_refuses_mismatched_shapes():
    q, k, v = qkv(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="expected q"):
        tf.flash_attention(q, k[..., :4], v)


# ===========================================================================
# 23. Sliding windows and the rolling cache
# ===========================================================================

@pytest.mark.parametrize("T, past, window", [(7, 0, 1), (7, 0, 3), (7, 0, 7), (7, 0, 20), (4, 6, 3), (1, 9, 5)])
def test_window_mask_equals_its_definition(T, past, window):
    mask = tf.make_causal_mask(T, past=past, window=window)[0, 0]         # [T, past+T]
    brute = torch.tensor([[p - window + 1 <= j <= p for j in range(past + T)] for p in range(past, past + T)])
    assert torch.equal(mask, brute)
    assert torch.equal(tf.make_causal_mask(T, past=past, window=None), tf.make_causal_mask(T, past=past))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_window_must_be_a_positive_integer(bad):
    for make in (lambda: tf.make_causal_mask(4, window=bad), lambda: tf.KVCache(window=bad),
                 lambda: tf.Llama(vocab_size=10, d_model=8, n_layers=1, n_heads=2, window=bad),
                 lambda: tf.window_reach(2, bad)):
        with pytest.raises(ValueError, match="window"):
            make()


def tiny_llama(seed=0, **kw):
    torch.manual_seed(seed)
    config = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, max_len=64)
    model = tf.Llama(**{**config, **kw}).eval()
    with torch.no_grad():  # larger weights than N(0, 0.02): attention that is far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    return model


@torch.no_grad()
def test_window_model_sees_within_the_reach_of_its_layers_and_nothing_beyond():
    model = tiny_llama(window=3)                                          # 2 layers reach back 2 * (3 - 1) = 4
    assert tf.window_reach(2, 3) == 4
    ids = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(0))
    last = model(ids)[0, -1]                                              # position 11

    def changed(position):
        other = ids.clone()
        other[0, position] = (other[0, position] + 1) % 40
        return max_diff(model(other)[0, -1], last)

    assert changed(10) > 1e-4 and changed(9) > 1e-4  # inside the window of the last layer
    assert changed(7) > 1e-6                          # exactly 4 back: through both layers
    assert changed(6) == 0.0 and changed(0) == 0.0    # beyond every layer's reach: not a bit
    assert max_diff(tiny_llama()(ids)[0, -1], last) > 1e-4  # without the window position 0 counts


@torch.no_grad()
def test_rolling_cache_generation_equals_the_full_cache_and_holds_at_most_window():
    model = tiny_llama(window=4)
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))  # a prompt longer than 4
    rolling, full = model.new_cache(), [tf.KVCache() for _ in model.layers]
    assert all(c.window == 4 for c in rolling)
    for step in range(15):
        a, b = model(ids, rolling), model(ids, full)                      # [2, Tn, V] each
        assert max_diff(a, b) < 1e-5
        assert max_diff(a[:, -1], model(ids)[:, -1]) < 1e-5               # and no cache at all
        assert all(c.k.size(2) <= 4 and len(c) == ids.size(1) for c in rolling)
        assert full[0].k.size(2) == ids.size(1)
        ids = torch.cat([ids, a[:, -1:].argmax(-1)], dim=1)               # [2, T+1]
    assert torch.equal(model.generate(ids[:, :7], 15), ids)               # generate uses the rolling cache


def llama_step(model, new_ids, cache, position):
    """Llama.forward for the new tokens, with their first position given: positions
    restart where position is the cache's held count instead of len(cache)."""
    Tn = new_ids.size(1)
    mask = tf.make_causal_mask(Tn, past=position, window=model.window)    # [1, 1, Tn, position+Tn]
    cos, sin = model.cos[position:position + Tn], model.sin[position:position + Tn]  # [Tn, dk] each
    x = model.token_embedding(new_ids)                                    # [B, Tn, D]
    for layer, c in zip(model.layers, cache):
        x = layer(x, cos, sin, mask, c)                                   # [B, Tn, D]
    return model.lm_head(model.final_norm(x))                             # [B, Tn, V]


@torch.no_grad()
def test_pitfall_rolling_cache_whose_positions_restart():
    model = tiny_llama(window=3)
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(2))
    expected = model(ids)[:, -1]                                          # [1, V]
    right, restarted = model.new_cache(), model.new_cache()
    for cache in (right, restarted):
        model(ids[:, :8], cache)
    assert len(right[0]) == 8 and right[0].k.size(2) == 3                 # seen 8, holds 3
    good = llama_step(model, ids[:, 8:], right, len(right[0]))            # position 8
    assert max_diff(good[:, -1], expected) < 1e-5
    assert max_diff(good, model(ids, model.new_cache())[:, -1:]) < 1e-5   # forward does the same
    bad = llama_step(model, ids[:, 8:], restarted, restarted[0].k.size(2))  # position 3: restarted
    assert max_diff(bad[:, -1], expected) > 1e-3


# ===========================================================================
# 24. The paged KV cache
# ===========================================================================

def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return tf.DecoderOnlyTransformer(vocab_size=40, d_model=16, n_layers=2, n_heads=4, d_ff=32,
                                     max_len=64, dropout=0.0).eval()


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt])
@torch.no_grad()
def test_paged_cache_equals_the_contiguous_cache_for_sequences_sharing_one_pool(make):
    model = make()
    pool = tf.KVPool(n_blocks=40, block_size=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 40, (1, n), generator=g) for n in (3, 9, 5)]  # [1, T] each
    paged = [model.new_cache(pool=pool) for _ in prompts]
    contiguous = [model.new_cache() for _ in prompts]
    assert all(isinstance(c, tf.PagedKVCache) for c in paged[0])
    ids = list(prompts)
    for step in range(6):  # the sequences take turns, their blocks interleave; each holds prompt + 5
        for i in range(len(ids)):
            a, b = model(ids[i], paged[i]), model(ids[i], contiguous[i])  # [1, Tn, V] each
            assert max_diff(a, b) < 1e-5
            ids[i] = torch.cat([ids[i], a[:, -1:].argmax(-1)], dim=1)     # [1, T+1]
    for i, prompt in enumerate(prompts):
        assert torch.equal(ids[i], model.generate(prompt, 6))             # the same tokens
    blocks = [b for caches in paged for c in caches for b in c.blocks]
    assert len(blocks) == len(set(blocks))                               # no block is shared
    assert sorted(blocks) != blocks                                      # and they do interleave
    used = 2 * sum(-(-(p.size(1) + 5) // 4) for p in prompts)            # 2 layers, ceil(t / 4) blocks of t
    assert pool.n_free == 40 - used
    for caches in paged:
        for c in caches:
            c.free()
    assert pool.n_free == 40 and all(len(c) == 0 and not c.blocks for caches in paged for c in caches)


@torch.no_grad()
def test_paged_cache_blocks_come_back_and_a_full_pool_refuses():
    pool = tf.KVPool(n_blocks=3, block_size=2)
    first, second = tf.PagedKVCache(pool), tf.PagedKVCache(pool)
    k = torch.randn(1, 2, 5, 4)                                           # 5 tokens: 3 blocks of 2
    first.append(k, k)
    assert first.blocks == [0, 1, 2] and pool.n_free == 0
    with pytest.raises(ValueError, match="KVPool is full"):
        second.append(k[:, :, :1], k[:, :, :1])
    assert len(second) == 0 and not second.blocks                         # nothing half taken
    first.append(k[:, :, :1], k[:, :, :1])                                # the 6th slot: still block 2
    with pytest.raises(ValueError, match="KVPool is full"):
        first.append(k[:, :, :1], k[:, :, :1])
    assert len(first) == 6
    first.free()
    assert pool.n_free == 3
    keys, values = second.append(k, 2 * k)                                # the freed blocks serve another
    assert torch.equal(keys, k) and torch.equal(values, 2 * k) and len(second) == 5


def test_paged_cache_and_pool_refuse_bad_arguments():
    with pytest.raises(ValueError, match="n_blocks"):
        tf.KVPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        tf.KVPool(4, 0)
    cache = tf.PagedKVCache(tf.KVPool(4, 4))
    with pytest.raises(ValueError, match="one sequence"):
        cache.append(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    cache.append(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
    with pytest.raises(ValueError, match="this KVPool holds"):
        cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))


def test_padded_and_paged_slots():
    assert tf.padded_and_paged_slots([30, 4000, 7, 500], 16) == (4 * 4000, 32 + 4000 + 16 + 512)
    assert tf.padded_and_paged_slots([16, 16], 16) == (32, 32)


# ===========================================================================
# 25. RoPE for long context
# ===========================================================================

LLAMA31 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_len": 8192}


@pytest.mark.parametrize("scaling", [
    {"type": "linear", "factor": 1.0}, dict(LLAMA31, factor=1.0),
    {"type": "yarn", "factor": 1.0, "original_max_len": 16}])
def test_rope_scaling_with_factor_1_changes_nothing(scaling):
    cos, sin = tf.rope_cos_sin(16, 64)                                    # [64, 16] each
    scaled_cos, scaled_sin = tf.rope_cos_sin(16, 64, scaling=scaling)     # [64, 16] each
    assert max_diff(cos, scaled_cos) < 1e-6 and max_diff(sin, scaled_sin) < 1e-6


def base_inv_freq(dim, theta):
    return [theta ** (-2 * i / dim) for i in range(dim // 2)]


def test_rope_llama3_equals_hand_computed_frequencies():
    # Meta's apply_scaling for Llama 3.1, per frequency, in plain Python floats
    def expected(freq):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            return freq
        if wavelen > 8192 / 1.0:
            return freq / 8.0
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        return (1 - smooth) * freq / 8.0 + smooth * freq

    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)  # [64]
    ours, factor = tf.scaled_inv_freq(inv_freq, 128, 500000.0, LLAMA31)
    assert factor == 1.0
    freqs = base_inv_freq(128, 500000.0)
    for i in (0, 10, 28, 29, 31, 34, 35, 50, 63):  # kept, blended (29-34), slowed by 8
        assert abs(ours[i].item() - expected(freqs[i])) <= 1e-6 * expected(freqs[i])
    assert abs(ours[10].item() - freqs[10]) <= 1e-6 * freqs[10]
    assert abs(ours[50].item() - freqs[50] / 8) <= 1e-6 * freqs[50]
    assert freqs[31] / 8 * 1.01 < ours[31].item() < freqs[31] * 0.99
    cos, sin = tf.rope_cos_sin(128, 1001, 500000.0, LLAMA31)              # [1001, 128] each
    angle = 1000 * ours.double()                                          # [64]
    assert max_diff(cos[1000, :64].double(), angle.cos()) < 1e-3 and max_diff(sin[1000, 64:].double(), angle.sin()) < 1e-3


def test_rope_yarn_equals_hand_computed_frequencies_with_the_ramp_ends_rounded():
    dim, theta, factor, original = 128, 10000.0, 4.0, 4096
    # the pair that turns 32 times in 4096 positions is 20.94, the one that turns once 45.03:
    # rounded outwards, the ramp runs from pair 20 (kept) to pair 46 (divided by 4)
    turning = [dim * math.log(original / (r * 2 * math.pi)) / (2 * math.log(theta)) for r in (32, 1)]
    assert math.floor(turning[0]) == 20 and math.ceil(turning[1]) == 46
    scaling = {"type": "yarn", "factor": factor, "original_max_len": original, "beta_fast": 32, "beta_slow": 1}
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [64]
    ours, attention = tf.scaled_inv_freq(inv_freq, dim, theta, scaling)
    freqs = base_inv_freq(dim, theta)
    for i in (5, 20, 21, 30, 45, 46, 60):
        ramp = min(max((i - 20) / (46 - 20), 0.0), 1.0)
        hand = freqs[i] / factor * ramp + freqs[i] * (1 - ramp)
        assert abs(ours[i].item() - hand) <= 1e-6 * hand, i
    unrounded = min(max((30 - turning[0]) / (turning[1] - turning[0]), 0), 1)
    assert abs(ours[30].item() - (freqs[30] / factor * unrounded + freqs[30] * (1 - unrounded))) > 1e-3 * freqs[30]
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1)
    defaults, _ = tf.scaled_inv_freq(inv_freq, dim, theta, {"type": "yarn", "factor": factor, "original_max_len": original})
    assert torch.equal(defaults, ours)                                    # beta_fast 32, beta_slow 1 by default
    cos, sin = tf.rope_cos_sin(dim, 64, theta, scaling)                   # [64, 128] each
    assert max_diff((cos ** 2 + sin ** 2).sqrt(), torch.full_like(cos, 0.1 * math.log(4.0) + 1)) < 1e-5


def test_rope_linear_divides_every_frequency():
    cos, sin = tf.rope_cos_sin(16, 64, scaling={"type": "linear", "factor": 4})  # [64, 16] each
    plain_cos, plain_sin = tf.rope_cos_sin(16, 64)                        # [64, 16] each
    assert max_diff(cos[::4], plain_cos[:16]) < 1e-5 and max_diff(sin[::4], plain_sin[:16]) < 1e-5


@pytest.mark.parametrize("scaling, named", [
    ({"type": "ntk", "factor": 2.0}, "scaling type"), ({"factor": 2.0}, "scaling type"), ("linear", "scaling type"),
    ({"type": "linear"}, r"missing \['factor'\]"),
    ({"type": "yarn", "factor": 4.0}, r"missing \['original_max_len'\]"),
    (dict(LLAMA31, low=1), r"unknown \[.low.\]"),
    ({k: v for k, v in LLAMA31.items() if k != "low_freq_factor"}, r"missing \['low_freq_factor'\]"),
    ({"type": "linear", "factor": 0.5}, "factor"),
    (dict(LLAMA31, low_freq_factor=4.0), "low_freq_factor < high_freq_factor"),
    ({"type": "yarn", "factor": 2.0, "original_max_len": 0}, "original_max_len")])
def test_rope_scaling_refuses_bad_arguments(scaling, named):
    with pytest.raises(ValueError, match=named):
        tf.rope_cos_sin(16, 32, scaling=scaling)


@torch.no_grad()
def test_scaled_model_runs_past_original_max_len():
    scaling = {"type": "yarn", "factor": 4.0, "original_max_len": 16}
    model = tiny_llama(rope_scaling=scaling)                              # max_len 64 = 4 x 16
    ids = torch.randint(0, 40, (1, 64), generator=torch.Generator().manual_seed(4))
    full = model(ids)                                                     # [1, 64, V]
    assert torch.isfinite(full).all()
    cache = model.new_cache()
    steps = torch.cat([model(ids[:, :40], cache)] + [model(ids[:, :t], cache) for t in range(41, 65)], 1)
    assert max_diff(steps, full) < 1e-5                                   # cached, at positions 40-63 too
    assert max_diff(tiny_llama()(ids), full) > 1e-3                       # the scaling did change it
    clone = tf.Llama(**model.config).eval()                               # the config carries it (checkpoints)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(clone(ids), full)


@torch.no_grad()
def test_pitfall_scaling_turns_each_cached_key_once():
    scaling = {"type": "yarn", "factor": 4.0, "original_max_len": 8}
    cos, sin = tf.rope_cos_sin(8, 32, scaling=scaling)                    # [32, 8] each
    torch.manual_seed(5)
    attn = tf.GroupedQueryAttention(d_model=16, n_heads=2, n_kv_heads=1)
    x = torch.randn(1, 20, 16)                                            # [B, T, D]
    cache = tf.KVCache()
    attn(x, cos[:20], sin[:20], tf.make_causal_mask(20), cache)
    raw = attn.w_k(x).view(1, 20, 1, 8).transpose(1, 2)                   # [1, 1, 20, 8]: not yet turned
    assert max_diff(cache.k, tf.apply_rope(raw, cos[:20], sin[:20])) < 1e-6  # stored turned, at their positions
    # turning the cached keys again (to apply a scaling to them later) is a second rotation
    assert max_diff(tf.apply_rope(cache.k, cos[:20], sin[:20]), cache.k) > 1e-2


def test_pitfall_yarn_without_its_temperature():
    scaling = {"type": "yarn", "factor": 16.0, "original_max_len": 8}
    cos, sin = tf.rope_cos_sin(8, 32, scaling=scaling)                    # [32, 8] each
    t = 0.1 * math.log(16.0) + 1                                          # 1.277
    q, k = torch.randn(1, 1, 32, 8), torch.randn(1, 1, 32, 8)             # [1, 1, 32, 8] each
    with_temperature = tf.apply_rope(q, cos, sin) @ tf.apply_rope(k, cos, sin).transpose(-2, -1)  # [1, 1, 32, 32]
    without = tf.apply_rope(q, cos / t, sin / t) @ tf.apply_rope(k, cos / t, sin / t).transpose(-2, -1)
    # every score t^2 = 1.63 times larger: what DeepSeek-V3 puts in its softmax scale instead
    assert max_diff(with_temperature, t * t * without) < 1e-4
    assert max_diff(with_temperature, without) > 0.1
    model = tiny_llama(rope_scaling=dict(scaling, original_max_len=16))
    forgot = tiny_llama()
    forgot.cos, forgot.sin = model.cos / (0.1 * math.log(16.0) + 1), model.sin / (0.1 * math.log(16.0) + 1)
    ids = torch.randint(0, 40, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert max_diff(model(ids), forgot(ids)) > 1e-3                   # the model without it differs


def test_llama_3_1_8b_is_llama_3_8b_with_llama3_scaling():
    assert tf.llama_param_formula(**tf.LLAMA_3_1_8B) == 8_030_261_248
    with torch.device("meta"):
        model = tf.Llama(**tf.LLAMA_3_1_8B)
    assert tf.count_parameters(model) == 8_030_261_248 and model.cos.shape == (131072, 128)
    assert tf.LLAMA_3_1_8B["rope_scaling"] == LLAMA31
