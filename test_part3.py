"""Part III of transformer.py, proven: QK-norm and free head widths, mixture of
experts, multi-head latent attention, the DeepSeek-V3-style model, total and
active parameters. Run: python -m pytest -q test_part3.py"""

import itertools
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import transformer as tf

TOL = 1e-5


@pytest.fixture(autouse=True)
def seed():
    """Every test starts from the same random state, on one thread, in float32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.default_generator.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def max_diff(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def assert_close(a, b, tol=TOL):
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = max_diff(a, b)
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol:g}"


def randomize(module, scale=0.5):
    """Every RMSNorm weight random around 1: weights of 1 hide a norm in the wrong place."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, tf.RMSNorm):
                m.weight.copy_(1 + scale * torch.randn_like(m.weight))
    return module


def tiny_deepseek(**kw):
    config = dict(vocab_size=50, d_model=32, n_layers=3, n_heads=4, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4,
                  v_head_dim=6, d_ff=48, expert_d_ff=16, n_experts=8, top_k=2, q_lora_rank=24, n_shared=1,
                  n_dense_layers=1, n_groups=4, topk_groups=2, routed_scale=2.5, max_len=32)
    config.update(kw)
    return randomize(tf.DeepSeekV3(**config)).eval()


# ===========================================================================
# 17. QK-norm and free head widths
# ===========================================================================

def _gqa_reference(attn, x, cos, sin, norm="per_head_before_rope"):
    """GQA written out, with PyTorch's attention: q, k per head, normed where `norm` says."""
    B, T, _ = x.shape
    H, Hkv, dk = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.w_q(x), attn.w_k(x), attn.w_v(x)
    if norm == "whole_projection":     # OLMo 2: over all H * dk dims (the weight tiled over the heads)
        rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.repeat(t.size(-1) // len(w))  # noqa: E731
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q = q.view(B, T, H, dk).transpose(1, 2)
    k = k.view(B, T, Hkv, dk).transpose(1, 2)
    v = v.view(B, T, Hkv, dk).transpose(1, 2)
    rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    if norm == "per_head_before_rope":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k = tf.apply_rope(q, cos, sin), tf.apply_rope(k, cos, sin)
    if norm == "per_head_after_rope":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return attn.w_o(out.transpose(1, 2).reshape(B, T, H * dk))


def test_head_dim_decouples_head_width_from_d_model():
    attn = tf.GroupedQueryAttention(d_model=24, n_heads=4, n_kv_heads=2, head_dim=10)   # 4 x 10 = 40 > 24
    assert attn.w_q.weight.shape == (40, 24) and attn.w_k.weight.shape == (20, 24)
    assert attn.w_o.weight.shape == (24, 40) and not hasattr(attn, "q_norm")
    cos, sin = tf.rope_cos_sin(10, 16)
    x = torch.randn(2, 7, 24)
    assert_close(attn(x, cos[:7], sin[:7], tf.make_causal_mask(7)), _gqa_reference(attn, x, cos[:7], sin[:7], None))


def test_qk_norm_is_per_head_and_before_rope():
    attn = randomize(tf.GroupedQueryAttention(d_model=32, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True))
    assert attn.q_norm.weight.shape == (12,) and attn.k_norm.weight.shape == (12,)
    cos, sin = tf.rope_cos_sin(12, 16)
    x = 3 * torch.randn(2, 6, 32)
    ours = attn(x, cos[:6], sin[:6], tf.make_causal_mask(6))
    assert_close(ours, _gqa_reference(attn, x, cos[:6], sin[:6], "per_head_before_rope"))
    # the two other places a norm could go give other numbers
    assert max_diff(ours, _gqa_reference(attn, x, cos[:6], sin[:6], "per_head_after_rope")) > 1e-3
    assert max_diff(ours, _gqa_reference(attn, x, cos[:6], sin[:6], "whole_projection")) > 1e-3


def test_llama_passes_head_dim_and_qk_norm_through():
    model = tf.Llama(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True,
                     max_len=16)
    assert model.cos.shape == (16, 16) and all(layer.attn.qk_norm for layer in model.layers)
    randomize(model).eval()
    ids = torch.randint(0, 40, (2, 9))
    full = model(ids)
    cache = model.new_cache()
    steps = torch.cat([model(ids[:, :5], cache)] + [model(ids[:, :t], cache) for t in range(6, 10)], dim=1)
    assert_close(steps, full)
    assert cache[0].k.shape == (2, 2, 9, 16)


# ===========================================================================
# 18. Mixture of experts
# ===========================================================================

def _dense_moe(moe, x, weights):
    """Brute force: EVERY expert on every token, times a dense routing matrix [N, E]."""
    flat = x.reshape(-1, x.size(-1))
    every = torch.stack([expert(flat) for expert in moe.experts], dim=1)       # [N, E, D]
    out = (weights[:, :, None].to(flat.dtype) * every).sum(dim=1)
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.view(x.shape)


def _dense_weights(chosen, weights, E):
    return torch.zeros(len(chosen), E, dtype=weights.dtype).scatter(1, chosen, weights)


def _softmax_routing(logits, k, norm_topk):
    """Mixtral / Qwen3-MoE as Hugging Face writes it: softmax over all, top k, renormalize."""
    p = logits.float().softmax(dim=-1)
    w, chosen = p.topk(k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return _dense_weights(chosen, w, logits.size(-1))


def _brute_force_sigmoid_routing(logits, bias, k, n_groups, topk_groups, norm_topk, scale):
    """DeepSeek-V3, token by token in plain Python: every combination of topk_groups
    groups is tried, the one whose groups' (sum of two best s + bias) is largest
    wins; then the k best s + bias inside it; weights from s alone."""
    s = logits.float().sigmoid()
    N, E = s.shape
    size = E // n_groups
    dense = torch.zeros(N, E)
    for n in range(N):
        score = [s[n, e].item() + bias[e].item() for e in range(E)]
        group_score = [sum(sorted(score[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_groups)]
        best = max(itertools.combinations(range(n_groups), topk_groups),
                   key=lambda groups: sum(group_score[g] for g in groups))
        allowed = [e for e in range(E) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -score[e])[:k]
        total = sum(s[n, e].item() for e in chosen) if norm_topk else 1.0
        for e in chosen:
            dense[n, e] = s[n, e].item() / total * scale
    return dense


@pytest.mark.parametrize("k, norm_topk, n_shared", [(2, True, 0), (3, False, 0), (2, True, 2)])
def test_moe_softmax_sparse_dispatch_equals_dense_reference(k, norm_topk, n_shared):
    moe = tf.MoE(d_model=12, d_ff=20, n_experts=6, top_k=k, n_shared=n_shared, norm_topk=norm_topk)
    x = torch.randn(3, 5, 12)
    out = moe(x)
    weights = _softmax_routing(moe.router(x.reshape(-1, 12)), k, norm_topk)
    assert_close(out, _dense_moe(moe, x, weights))
    assert moe.router_logits.shape == (15, 6) and moe.tokens_per_expert.tolist() == (weights > 0).sum(0).tolist()


@pytest.mark.parametrize("n_groups, topk_groups, k, norm_topk", [(1, 1, 2, True), (4, 2, 3, True),
                                                                 (4, 1, 2, False), (8, 3, 4, True)])
def test_moe_sigmoid_group_routing_equals_brute_force_enumeration(n_groups, topk_groups, k, norm_topk):
    moe = tf.MoE(d_model=12, d_ff=20, n_experts=16, top_k=k, n_shared=1, router="sigmoid", norm_topk=norm_topk,
                 n_groups=n_groups, topk_groups=topk_groups, routed_scale=2.5)
    moe.router_bias.copy_(0.3 * torch.randn(16))                       # a bias that changes choices
    x = torch.randn(2, 12, 12)
    out = moe(x)
    logits = x.reshape(-1, 12) @ moe.router.weight.T
    dense = _brute_force_sigmoid_routing(logits, moe.router_bias, k, n_groups, topk_groups, norm_topk, 2.5)
    chosen, weights = moe.route(moe.router_logits)
    assert_close(_dense_weights(chosen, weights, 16), dense)
    assert_close(out, _dense_moe(moe, x, dense))
    if n_groups > 1:   # no token reaches outside its topk_groups groups
        groups = chosen // (16 // n_groups)
        assert all(len(set(row)) <= topk_groups for row in groups.tolist())


def test_softmax_topk_renormalized_equals_softmax_over_the_topk_logits():
    moe = tf.MoE(d_model=8, d_ff=16, n_experts=8, top_k=3)
    logits = 2 * torch.randn(50, 8)
    chosen, weights = moe.route(logits)
    assert_close(weights, logits.gather(1, chosen).softmax(dim=-1))


def test_pitfall_topk_before_or_after_softmax_differ_without_renormalization():
    """norm_topk=False (Qwen1.5-MoE): the top-k of the full softmax, summing to < 1;
    a softmax taken over the top-k logits instead is another model."""
    moe = tf.MoE(d_model=8, d_ff=16, n_experts=8, top_k=2, norm_topk=False)
    x = torch.randn(20, 1, 8)
    out = moe(x)
    logits = moe.router_logits
    chosen, weights = moe.route(logits)
    assert_close(weights, logits.softmax(dim=-1).gather(1, chosen))
    assert (weights.sum(dim=-1) < 1 - 1e-3).all()
    after = _dense_weights(chosen, logits.gather(1, chosen).softmax(dim=-1), 8)   # top-k, then softmax
    assert max_diff(out, _dense_moe(moe, x, after)) > 1e-3


def test_top_k_equal_to_n_experts_with_norm_topk_is_the_dense_mixture():
    moe = tf.MoE(d_model=10, d_ff=14, n_experts=5, top_k=5)
    x = torch.randn(2, 4, 10)
    p = moe.router(x.reshape(-1, 10)).softmax(dim=-1)                  # every expert, its full probability
    flat = x.reshape(-1, 10)
    mixture = sum(p[:, e:e + 1] * moe.experts[e](flat) for e in range(5))
    assert_close(moe(x), mixture.view(2, 4, 10))


def test_shared_expert_adds_exactly_its_swiglu():
    moe = tf.MoE(d_model=10, d_ff=14, n_experts=4, top_k=2, n_shared=2, router="sigmoid")
    assert moe.shared.w1.weight.shape == (28, 10)                      # n_shared * d_ff wide
    x = torch.randn(3, 4, 10)
    with_shared = moe(x)
    shared, moe.shared = moe.shared, None
    assert_close(with_shared - moe(x), shared(x))


def test_bias_changes_the_choice_and_never_the_weights():
    moe = tf.MoE(d_model=10, d_ff=14, n_experts=6, top_k=2, router="sigmoid", routed_scale=1.5)
    x = torch.randn(2, 1, 10)                                          # 4 slots: 2 of 6 experts go unchosen
    moe(x)
    logits = moe.router_logits
    before, _ = moe.route(logits)
    never = next(e for e in range(6) if e not in before)               # an expert no token chose
    moe.router_bias[never] = 10.0
    chosen, weights = moe.route(logits)
    assert (chosen == never).any(dim=1).all()                          # now every token chooses it
    s = logits.sigmoid()
    expected = s.gather(1, chosen) / s.gather(1, chosen).sum(dim=-1, keepdim=True) * 1.5   # s, not s + bias
    assert_close(weights, expected)
    # the pitfall: weighting with s + bias would give the biased expert almost all the weight
    biased = (s + moe.router_bias).gather(1, chosen)
    assert max_diff(weights, biased / biased.sum(dim=-1, keepdim=True) * 1.5) > 0.1


def test_gradients_reach_the_router_and_only_the_chosen_experts():
    moe = tf.MoE(d_model=10, d_ff=14, n_experts=8, top_k=2)
    moe(torch.randn(1, 2, 10)).pow(2).sum().backward()                 # 2 tokens: at most 4 of 8 experts
    used = moe.tokens_per_expert > 0
    assert moe.router.weight.grad.abs().sum() > 0
    assert 2 <= used.sum() <= 4
    for e, expert in enumerate(moe.experts):
        grads = [p.grad for p in expert.parameters()]
        if used[e]:
            assert all(g is not None and g.abs().sum() > 0 for g in grads)
        else:
            assert all(g is None for g in grads)


def test_pitfall_each_expert_runs_only_on_the_tokens_routed_to_it():
    """Counted with hooks: the experts see N * top_k rows in all, not N * E."""
    moe = tf.MoE(d_model=10, d_ff=14, n_experts=8, top_k=2, n_shared=1)
    rows = [0] * 8
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, inputs, out, e=e: rows.__setitem__(e, rows[e] + len(inputs[0])))
    moe(torch.randn(4, 5, 10))
    assert sum(rows) == 20 * 2 and rows == moe.tokens_per_expert.tolist()


def test_load_balancing_loss_is_top_k_when_uniform_and_equals_its_closed_form():
    assert tf.load_balancing_loss(torch.zeros(30, 8), top_k=2).item() == pytest.approx(2.0, abs=1e-6)
    # uniform probabilities with the slots spread evenly too: still exactly k
    assert tf.load_balancing_loss(torch.eye(4).repeat(5, 1) * 1e-7, top_k=1).item() == pytest.approx(1.0, abs=1e-6)
    logits = torch.randn(40, 6)
    p = logits.softmax(dim=-1)
    N, E, k = 40, 6, 3
    f = [0.0] * E
    for n in range(N):
        for e in sorted(range(E), key=lambda e: -p[n, e].item())[:k]:
            f[e] += 1 / N
    closed = E * sum(f[e] * p[:, e].mean().item() for e in range(E))
    assert tf.load_balancing_loss(logits, top_k=k).item() == pytest.approx(closed, abs=1e-5)
    skewed = torch.tensor([[4.0, 3.0, 0, 0, 0, 0]]).repeat(10, 1)    # all tokens to the same two
    assert tf.load_balancing_loss(skewed, top_k=2).item() > 2 * 1.5


def test_update_router_bias_brings_a_skewed_load_toward_uniform():
    """A router skewed toward experts 0 and 1 for 128 tokens: at first they take 251 of
    the 256 slots, the load's coefficient of variation (std / mean over the experts) is
    1.69. After 100 bias updates (rate 0.01, no training) it is 0.11 (measured; at most
    0.13 over the last 10 steps), every expert busy."""
    moe = tf.MoE(d_model=8, d_ff=4, n_experts=8, top_k=2, router="sigmoid")
    with torch.no_grad():
        moe.router.weight[:2] += 0.4
    x = (torch.randn(128, 8) + 1)[:, None]                             # mostly positive features: the skew holds
    moe(x)
    variation = lambda load: (load.float().std(unbiased=False) / load.float().mean()).item()  # noqa: E731
    assert moe.tokens_per_expert[:2].sum() >= 240 and variation(moe.tokens_per_expert) > 1.5
    late = []
    for step in range(100):
        assert tf.update_router_bias(moe, rate=0.01) == 1
        moe(x)
        late += [variation(moe.tokens_per_expert)] if step >= 90 else []
    assert max(late) < 0.3 and (moe.tokens_per_expert > 0).all()
    assert moe.router_bias[:2].max() < 0 and moe.router_bias[:2].max() < moe.router_bias[2:].min()
    softmax = tf.MoE(d_model=8, d_ff=4, n_experts=8, top_k=2)          # softmax MoEs are left alone
    softmax(x)
    assert tf.update_router_bias(softmax) == 0 and softmax.router_bias.abs().sum() == 0


def test_moe_bad_arguments_raise_value_errors_naming_them():
    for kwargs, message in [
            (dict(top_k=0), r"top_k must be an integer from 1 to n_experts=8, got 0"),
            (dict(top_k=9), r"top_k must be .* got 9"),
            (dict(router="relu"), r"router must be 'softmax' or 'sigmoid', got 'relu'"),
            (dict(n_groups=3), r"n_experts \(8\) must be divisible by n_groups \(3\)"),
            (dict(n_groups=2, topk_groups=3), r"topk_groups \(3\) must be at most n_groups \(2\)"),
            (dict(top_k=4, n_groups=4, topk_groups=1), r"leave 2 to choose from, fewer than top_k=4"),
            (dict(n_shared=-1), r"n_shared must be an integer >= 0, got -1"),
            (dict(routed_scale=0), r"routed_scale must be a number > 0, got 0"),
            (dict(n_experts=0), r"n_experts must be an integer >= 1, got 0")]:
        with pytest.raises(ValueError, match=message):
            tf.MoE(**{**dict(d_model=8, d_ff=8, n_experts=8, top_k=2), **kwargs})
    with pytest.raises(ValueError, match=r"top_k must be an integer from 1 to 4 \(the experts\), got 5"):
        tf.load_balancing_loss(torch.zeros(3, 4), top_k=5)
    with pytest.raises(ValueError, match=r"rate must be a number >= 0, got -0.1"):
        tf.update_router_bias(tf.MoE(8, 8, 4, 2), rate=-0.1)


def test_llama_with_experts_is_mixtral_shaped_and_decodes_with_its_cache():
    model = randomize(tf.Llama(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                               n_experts=4, top_k=2, max_len=24)).eval()
    assert all(isinstance(layer.ffn, tf.MoE) and layer.ffn.experts[0].w1.weight.shape == (24, 16)
               for layer in model.layers)
    qwen = tf.Llama(vocab_size=40, d_model=16, n_layers=1, n_heads=4, head_dim=8, qk_norm=True, n_experts=6,
                    top_k=3, expert_d_ff=10, norm_topk=False)
    assert qwen.layers[0].ffn.experts[0].w1.weight.shape == (10, 16) and not qwen.layers[0].ffn.norm_topk
    ids = torch.randint(0, 40, (2, 6))
    assert torch.equal(model.generate(ids, 8), model.generate(ids, 8, use_cache=False))
    with pytest.raises(ValueError, match=r"n_experts must be an integer >= 0 \(0: a dense SwiGLU\), got -1"):
        tf.Llama(vocab_size=40, d_model=16, n_layers=1, n_heads=4, n_experts=-1)
    with pytest.raises(ValueError, match=r"head_dim must be an integer >= 1, got 0"):
        tf.GroupedQueryAttention(16, 4, 2, head_dim=0)
    with pytest.raises(ValueError, match=r"expert_d_ff must be an integer >= 1, got 0"):
        tf.Llama(vocab_size=40, d_model=16, n_layers=1, n_heads=4, n_experts=2, expert_d_ff=0)


# ===========================================================================
# 19. Multi-head latent attention
# ===========================================================================

def _mla(dtype=torch.float32, **kw):
    config = dict(d_model=32, n_heads=4, kv_lora_rank=12, qk_nope_dim=6, qk_rope_dim=4, v_head_dim=5, q_lora_rank=20)
    config.update(kw)
    return randomize(tf.MultiHeadLatentAttention(**config)).to(dtype)


def _deepseek_rope(x, positions, theta=10000.0):
    """DeepSeek's own apply_rotary_emb (inference/model.py): neighbouring pairs as
    complex numbers, times e^(i pos theta_j). x [B, H, T, d]."""
    d = x.size(-1)
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs_cis = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64),
                            torch.outer(positions.double(), freqs))
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs_cis).flatten(-2).to(x.dtype)


def _mla_reference(mla, x):
    """DeepSeek-V3's "naive" MLA, written as its inference/model.py does (q, k, v per
    head; RoPE on neighbour pairs by complex numbers), with PyTorch's attention."""
    B, T, _ = x.shape
    H, nope, rope, v_dim, r = mla.n_heads, mla.nope, mla.rope, mla.v_dim, mla.kv_lora_rank
    q = mla.w_q(x) if mla.q_lora_rank is None else mla.w_uq(mla.q_norm(mla.w_dq(x)))
    q = q.view(B, T, H, nope + rope).transpose(1, 2)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    kv, k_pe = mla.w_dkv(x).split([r, rope], dim=-1)
    positions = torch.arange(T)
    q_pe, k_pe = _deepseek_rope(q_pe, positions), _deepseek_rope(k_pe[:, None], positions)
    kv = mla.w_ukv(mla.kv_norm(kv)).view(B, T, H, nope + v_dim).transpose(1, 2)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, H, -1, -1)], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(nope + rope) ** -0.5)
    return mla.w_o(out.transpose(1, 2).reshape(B, T, H * v_dim))


@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_mla_matches_deepseeks_reference_form(q_lora_rank):
    mla = _mla(q_lora_rank=q_lora_rank)
    assert hasattr(mla, "w_q") == (q_lora_rank is None) and hasattr(mla, "w_uq") == (q_lora_rank is not None)
    assert mla.w_dkv.weight.shape == (12 + 4, 32) and mla.w_ukv.weight.shape == (4 * (6 + 5), 12)
    assert mla.w_o.weight.shape == (32, 4 * 5) and all(m.bias is None for m in mla.modules()
                                                      if isinstance(m, torch.nn.Linear))
    cos, sin = tf.rope_cos_sin(4, 16)
    x = torch.randn(2, 7, 32)
    assert_close(mla(x, cos[:7], sin[:7], tf.make_causal_mask(7)), _mla_reference(mla, x))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_mla_absorbed_equals_expanded(dtype, tol, q_lora_rank):
    mla = _mla(dtype, q_lora_rank=q_lora_rank)
    cos, sin = tf.rope_cos_sin(4, 16)
    x = torch.randn(2, 9, 32, dtype=dtype)
    mask = tf.make_causal_mask(9)
    expanded = mla(x, cos[:9], sin[:9], mask, absorb=False)
    assert_close(mla(x, cos[:9], sin[:9], mask, absorb=True), expanded, tol)
    # and with a cache: a prompt of 5, then 4 steps of one token each, both ways
    for absorb in (True, False):
        cache = tf.LatentCache()
        steps = [mla(x[:, :5], cos[:5], sin[:5], tf.make_causal_mask(5), cache, absorb=absorb)]
        steps += [mla(x[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], tf.make_causal_mask(1, past=t), cache, absorb=absorb)
                  for t in range(5, 9)]
        assert_close(torch.cat(steps, dim=1), expanded, tol)


def test_pitfall_absorption_needs_the_decoupled_rope_key():
    """Were RoPE to turn the up-projected key R(n) W_uk c_n, folding W_uk into the query
    would lose R(n): the scores differ. On the part without position they agree."""
    torch.manual_seed(1)
    H, nope, r, T = 2, 8, 6, 5
    w_uk = torch.randn(H, nope, r, dtype=torch.float64)
    c = torch.randn(T, r, dtype=torch.float64)                        # the cached latents
    q = torch.randn(H, 1, nope, dtype=torch.float64)                  # one query at position T - 1
    cos, sin = tf.rope_cos_sin(nope, T)
    keys = torch.einsum("hnr,tr->htn", w_uk, c)                       # per-head keys W_uk c_t
    plain = q @ keys.transpose(-2, -1)                                # no rotation
    absorbed = torch.einsum("hqn,hnr->hqr", q, w_uk) @ c.T            # (W_uk^T q) . c
    assert_close(absorbed, plain, 1e-12)
    q_turned = tf.apply_rope(q, cos[T - 1:], sin[T - 1:])
    coupled = q_turned @ tf.apply_rope(keys, cos, sin).transpose(-2, -1)  # R(m) q . R(n) W_uk c_n
    # q^T R(n - m) W_uk c_n: the rotation between q and W_uk changes with n, so no one
    # query (W_uk^T q, turned or not) scores every cached c_n; the absorbed scores match
    # the coupled ones only at n = m, where the rotation is the identity
    assert_close(coupled[..., -1], absorbed[..., -1], 1e-5)         # (cos and sin are float32)
    assert max_diff(coupled[..., :-1], absorbed[..., :-1]) > 0.1
    turned_absorbed = torch.einsum("hqn,hnr->hqr", q_turned, w_uk) @ c.T
    assert max_diff(coupled, turned_absorbed) > 0.1


def _half_split_copy(mla):
    """The same MLA with rope_interleave=False and the rope rows of w_uq (or w_q) and
    w_dkv permuted: neighbour pair (2i, 2i+1) -> half-split pair (i, i + rope/2)."""
    config = dict(d_model=32, n_heads=mla.n_heads, kv_lora_rank=mla.kv_lora_rank, qk_nope_dim=mla.nope,
                  qk_rope_dim=mla.rope, v_head_dim=mla.v_dim, q_lora_rank=mla.q_lora_rank)
    half = tf.MultiHeadLatentAttention(**config, rope_interleave=False)
    half.load_state_dict(mla.state_dict())
    perm = torch.cat([torch.arange(0, mla.rope, 2), torch.arange(1, mla.rope, 2)])   # [0, 2, 1, 3]
    width = mla.nope + mla.rope
    q_rows = torch.arange(mla.n_heads * width).view(mla.n_heads, width)
    q_rows[:, mla.nope:] = q_rows[:, mla.nope:][:, perm]
    kv_rows = torch.cat([torch.arange(mla.kv_lora_rank), mla.kv_lora_rank + perm])
    with torch.no_grad():
        w = half.w_q if mla.q_lora_rank is None else half.w_uq
        w.weight.copy_(w.weight[q_rows.flatten()])
        half.w_dkv.weight.copy_(half.w_dkv.weight[kv_rows])
    return half


@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_rope_interleave_equals_half_split_after_permuting_rope_rows(q_lora_rank):
    mla = _mla(q_lora_rank=q_lora_rank, qk_rope_dim=8)
    cos, sin = tf.rope_cos_sin(8, 16)
    x = torch.randn(2, 7, 32)
    mask = tf.make_causal_mask(7)
    interleaved = mla(x, cos[:7], sin[:7], mask)
    assert_close(_half_split_copy(mla)(x, cos[:7], sin[:7], mask), interleaved)
    # the pitfall: the same weights read with the other pairing convention, no error, other numbers
    mla.rope_interleave = False
    assert max_diff(mla(x, cos[:7], sin[:7], mask), interleaved) > 1e-3


def test_mla_bad_arguments_raise_value_errors_naming_them():
    base = dict(d_model=32, n_heads=4, kv_lora_rank=12, qk_nope_dim=6, qk_rope_dim=4, v_head_dim=5)
    for kwargs, message in [(dict(qk_rope_dim=3), r"qk_rope_dim must be even, got 3"),
                            (dict(kv_lora_rank=0), r"kv_lora_rank must be an integer >= 1, got 0"),
                            (dict(q_lora_rank=0), r"q_lora_rank must be an integer >= 1, got 0"),
                            (dict(v_head_dim=2.5), r"v_head_dim must be an integer >= 1, got 2.5")]:
        with pytest.raises(ValueError, match=message):
            tf.MultiHeadLatentAttention(**{**base, **kwargs})


# ===========================================================================
# 20. The DeepSeek-V3 model
# ===========================================================================

def test_deepseek_layout_names_and_blocks():
    model = tiny_deepseek(n_layers=4, n_dense_layers=2)
    assert [type(layer.ffn).__name__ for layer in model.layers] == ["SwiGLU", "SwiGLU", "MoE", "MoE"]
    moe = model.layers[2].ffn
    assert moe.score_func == "sigmoid" and moe.routed_scale == 2.5 and moe.n_groups == 4
    names = set(model.state_dict())
    for name in ["token_embedding.weight", "layers.0.attn_norm.weight", "layers.0.attn.w_dq.weight",
                 "layers.0.attn.q_norm.weight", "layers.0.attn.w_uq.weight", "layers.0.attn.w_dkv.weight",
                 "layers.0.attn.kv_norm.weight", "layers.0.attn.w_ukv.weight", "layers.0.attn.w_o.weight",
                 "layers.0.ffn_norm.weight", "layers.0.ffn.w1.weight", "layers.2.ffn.router.weight",
                 "layers.2.ffn.router_bias", "layers.2.ffn.experts.7.w2.weight", "layers.2.ffn.shared.w3.weight",
                 "final_norm.weight", "lm_head.weight"]:
        assert name in names, name


def test_deepseek_prefill_then_cached_decoding_equals_full_forward():
    model = tiny_deepseek()
    ids = torch.randint(0, 50, (2, 12))
    full = model(ids)
    cache = model.new_cache()
    steps = [model(ids[:, :7], cache)] + [model(ids[:, :t], cache) for t in range(8, 13)]
    assert_close(torch.cat(steps, dim=1), full)
    # the cache holds exactly kv_lora_rank + rope values a token a layer, nothing per head
    for c in cache:
        assert c.latent.shape == (2, 12, 16) and c.k_rope.shape == (2, 12, 4)
        assert (c.latent.numel() + c.k_rope.numel()) / (2 * 12) == 16 + 4
    ids = torch.randint(0, 50, (1, 4))
    assert torch.equal(model.generate(ids, 10), model.generate(ids, 10, use_cache=False))


def test_deepseek_is_causal():
    model = tiny_deepseek()
    ids = torch.randint(0, 50, (2, 10))
    changed = ids.clone()
    changed[:, 6] = (ids[:, 6] + 1) % 50
    a, b = model(ids), model(changed)
    assert_close(a[:, :6], b[:, :6], 1e-6)       # experts batch other rows: rounding only
    assert max_diff(a[:, 6:], b[:, 6:]) > 1e-3


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 0.01), (torch.bfloat16, 0.05)])
def test_deepseek_no_nan_in_half_precision(dtype, tol):
    model = tiny_deepseek()
    ids = torch.randint(0, 50, (2, 9))
    reference = model(ids)
    half = model.to(dtype)
    logits = half(ids)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert max_diff(logits, reference) < tol * reference.abs().max().item() + tol
    cache = half.new_cache()
    steps = torch.cat([half(ids[:, :5], cache)] + [half(ids[:, :t], cache) for t in range(6, 10)], dim=1)
    assert torch.isfinite(steps).all() and max_diff(steps, reference) < tol * reference.abs().max().item() + tol


def test_deepseek_bad_arguments_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match=r"n_dense_layers must be an integer from 0 to n_layers=3, got 4"):
        tiny_deepseek(n_dense_layers=4)
    with pytest.raises(ValueError, match=r"expert_d_ff must be an integer >= 1, got 0"):
        tiny_deepseek(expert_d_ff=0)
    with pytest.raises(ValueError, match=r"topk_groups \(5\) must be at most n_groups \(4\)"):
        tiny_deepseek(topk_groups=5)
    with pytest.raises(ValueError, match=r"qk_rope_dim must be even, got 5"):
        tiny_deepseek(qk_rope_dim=5)
    with pytest.raises(ValueError, match=r"input_ids holds token id 50, outside the vocabulary \[0, 50\)"):
        tiny_deepseek()(torch.tensor([[1, 50]]))


def test_deepseek_checkpoint_round_trip(tmp_path):
    pairs = tf.make_toy_data(seed=0)[:60]
    vocab = tf.build_gpt_vocab(pairs)
    model = tiny_deepseek(vocab_size=len(vocab), tie_weights=True)
    model.layers[1].ffn.router_bias.copy_(torch.randn(8))           # a learned balance, kept
    path = tmp_path / "deepseek.pt"
    tf.save_checkpoint(str(path), "deepseek", model, vocab, vocab)
    kind, loaded, _, tv, _ = tf.load_checkpoint(str(path))
    assert kind == "deepseek" and loaded.config == model.config
    assert torch.equal(loaded.layers[1].ffn.router_bias, model.layers[1].ffn.router_bias)
    assert loaded.lm_head.weight.data_ptr() == loaded.token_embedding.weight.data_ptr()
    ids = torch.randint(0, len(vocab), (2, 7))
    assert torch.equal(loaded(ids), model(ids))
    sentences = [pinyin for pinyin, _ in pairs[:3]]
    assert (tf.translator(kind, loaded, tv, tv, beam_size=3)(sentences)
            == tf.translator(kind, model, vocab, vocab, beam_size=3)(sentences))


def test_moe_llama_checkpoint_round_trip(tmp_path):
    pairs = tf.make_toy_data(seed=0)[:60]
    vocab = tf.build_gpt_vocab(pairs)
    model = randomize(tf.Llama(vocab_size=len(vocab), d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=6, qk_norm=True, n_experts=4, top_k=2, expert_d_ff=12, max_len=32)).eval()
    tf.save_checkpoint(str(tmp_path / "moe.pt"), "llama", model, vocab, vocab)
    kind, loaded, *_ = tf.load_checkpoint(str(tmp_path / "moe.pt"))
    ids = torch.randint(0, len(vocab), (2, 7))
    assert kind == "llama" and loaded.config == model.config and torch.equal(loaded(ids), model(ids))


# ===========================================================================
# 21. Total and active parameters, the latent cache
# ===========================================================================

def _meta_count(kind, config):
    with torch.device("meta"):
        return tf.count_parameters(tf.MODEL_CLASSES[kind](**config))


LLAMA_SHAPES = [dict(),                                                     # dense
                dict(n_kv_heads=2, head_dim=6, qk_norm=True),
                dict(qkv_bias=True, tie_weights=True),
                dict(n_experts=4, top_k=2),                                 # Mixtral-like
                dict(n_kv_heads=1, head_dim=10, qk_norm=True, n_experts=6, top_k=3, expert_d_ff=7, tie_weights=True)]
DEEPSEEK_SHAPES = [dict(),
                   dict(q_lora_rank=None),
                   dict(n_shared=0, n_groups=1, topk_groups=1),
                   dict(n_shared=2, tie_weights=True),
                   dict(n_dense_layers=0),
                   dict(n_dense_layers=3),                                  # all dense
                   dict(q_lora_rank=None, n_shared=0, n_dense_layers=2, tie_weights=True, top_k=1)]


@pytest.mark.parametrize("extra", LLAMA_SHAPES)
def test_llama_formula_equals_count(extra):
    config = dict(vocab_size=30, d_model=16, n_layers=2, n_heads=4, d_ff=20, **extra)
    assert tf.llama_param_formula(**config) == _meta_count("llama", config)


@pytest.mark.parametrize("extra", DEEPSEEK_SHAPES)
def test_deepseek_formula_equals_count(extra):
    config = dict(vocab_size=30, d_model=16, n_layers=3, n_heads=2, kv_lora_rank=6, qk_nope_dim=4, qk_rope_dim=2,
                  v_head_dim=3, d_ff=20, expert_d_ff=5, n_experts=8, top_k=2, q_lora_rank=7, n_groups=4,
                  topk_groups=2)
    config.update(extra)
    assert tf.deepseek_param_formula(**config) == _meta_count("deepseek", config)


def _active_by_hooks(model, ids):
    """What one token's forward touches: the parameters of every module that ran
    (tied weights once), found with forward hooks, not from the formula."""
    ran, handles = set(), []
    for module in model.modules():
        if not list(module.children()) or isinstance(module, (tf.RMSNorm, tf.MoE)):
            handles.append(module.register_forward_hook(lambda m, i, o: ran.add(m)))
    model(ids)
    for h in handles:
        h.remove()
    # a sigmoid MoE multiplies its router's weight itself (in float32): the router counts when its MoE ran
    used = [p for m in ran for p in m.parameters(recurse=False)] + [m.router.weight for m in ran
                                                                    if isinstance(m, tf.MoE)]
    return sum(p.numel() for p in {id(p): p for p in used}.values())


@pytest.mark.parametrize("kind, extra", [("llama", LLAMA_SHAPES[3]), ("llama", LLAMA_SHAPES[4]),
                                         ("deepseek", DEEPSEEK_SHAPES[0]), ("deepseek", DEEPSEEK_SHAPES[3]),
                                         ("deepseek", DEEPSEEK_SHAPES[6])])
def test_active_formula_equals_what_one_token_runs(kind, extra):
    if kind == "llama":
        config = dict(vocab_size=30, d_model=16, n_layers=2, n_heads=4, d_ff=20, **extra)
        formula = tf.llama_param_formula
    else:
        config = dict(vocab_size=30, d_model=16, n_layers=3, n_heads=2, kv_lora_rank=6, qk_nope_dim=4,
                      qk_rope_dim=2, v_head_dim=3, d_ff=20, expert_d_ff=5, n_experts=8, top_k=2, q_lora_rank=7,
                      n_groups=4, topk_groups=2)
        config.update(extra)
        formula = tf.deepseek_param_formula
    model = tf.MODEL_CLASSES[kind](**config).eval()
    assert _active_by_hooks(model, torch.tensor([[3]])) == formula(**config, active=True)
    assert formula(**config, active=True) < formula(**config)


TABLE = {"Mixtral-8x7B": (46_702_792_704, 12_879_925_248), "Qwen3-30B-A3B": (30_532_122_624, 3_353_032_704),
         "DeepSeek-V3": (671_026_404_352, 37_552_282_624)}


def test_published_table_exactly_total_and_active():
    """The formulas give the issue's table; the meta-device count agrees at the
    released widths: the whole of Mixtral, and Qwen3 and DeepSeek-V3 at two depths
    (a count is affine in the number of layers, so two depths pin every layer's share;
    the full DeepSeek-V3 on the meta device takes seconds, the demo counts it)."""
    configs = {name: (kind, config) for name, kind, config, *_ in tf.FRONTIER_CONFIGS}
    assert set(configs) == set(TABLE)
    assert {name: (total, active) for name, _, _, total, active, _ in tf.FRONTIER_CONFIGS} == TABLE
    for name, (kind, config) in configs.items():
        formula = tf.PARAMETER_FORMULAS[kind]
        assert (formula(**config), formula(**config, active=True)) == TABLE[name], name
    assert _meta_count("llama", configs["Mixtral-8x7B"][1]) == TABLE["Mixtral-8x7B"][0]
    for name, depths in [("Qwen3-30B-A3B", (1, 2)), ("DeepSeek-V3", (4, 5))]:
        kind, config = configs[name]
        for n_layers in depths:
            shallow = dict(config, n_layers=n_layers)
            assert _meta_count(kind, shallow) == tf.PARAMETER_FORMULAS[kind](**shallow), (name, n_layers)
    expected = dict(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, d_ff=18432, expert_d_ff=2048, n_experts=256,
                    top_k=8, n_shared=1, n_dense_layers=3, n_groups=8, topk_groups=4, routed_scale=2.5)
    assert configs["DeepSeek-V3"][1] == expected


def test_cache_bytes_per_token_of_the_three_and_measured():
    assert tf.kv_cache_bytes_per_token(n_layers=32, n_kv_heads=8, head_dim=128) == 128 * 1024       # Mixtral
    assert tf.kv_cache_bytes_per_token(n_layers=48, n_kv_heads=4, head_dim=128) == 96 * 1024        # Qwen3-30B-A3B
    latent = tf.mla_cache_bytes_per_token(n_layers=61, kv_lora_rank=512, qk_rope_dim=64)
    assert latent == 70_272 and round(latent / 1024, 1) == 68.6
    per_head = 61 * 128 * ((128 + 64) + 128) * 2                                                  # keys 192, values 128
    assert round(per_head / 2 ** 20, 2) == 4.77 and per_head // latent == 71
    model = tiny_deepseek()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 50, (3, 10)), cache)
    stored = sum(c.latent.numel() * c.latent.element_size() + c.k_rope.numel() * c.k_rope.element_size()
                 for c in cache)
    assert stored / 30 == tf.mla_cache_bytes_per_token(n_layers=3, kv_lora_rank=16, qk_rope_dim=4, bytes_per_value=4)


# ===========================================================================
# The reader's contract: section 20 runs cut out of the file
# ===========================================================================

CORE_IMPORTS = ["import math", "import torch", "import torch.nn as nn", "import torch.nn.functional as F"]
BANNER = re.compile(r"^# =+\n# (\d+)\. (.+)$", re.M)
SOURCE = open(tf.__file__, encoding="utf-8").read()

CONTRACT_PART3 = {
    20: """ds = DeepSeekV3(vocab_size=50, d_model=32, n_layers=3, n_heads=4, kv_lora_rank=16, qk_nope_dim=8,
                qk_rope_dim=4, v_head_dim=8, d_ff=64, expert_d_ff=16, n_experts=8, top_k=2, q_lora_rank=24,
                n_groups=4, topk_groups=2, routed_scale=2.5, max_len=64)
assert ds(torch.randint(0, 50, (2, 6))).shape == (2, 6, 50)
assert ds.generate(torch.randint(0, 50, (2, 6)), max_new_tokens=5, top_k=5, temperature=0.8).shape == (2, 11)
assert len(ds.new_cache()) == 3""",
}


def text_through_section(n):
    """The file from line 1 to the end of section n (the line before the next banner)."""
    title_end = next(m.end() for m in BANNER.finditer(SOURCE) if int(m.group(1)) == n)
    body = SOURCE.index("\n", title_end + 1)
    following = re.search(r"^# =+$", SOURCE[body:], re.M)
    return SOURCE[:body + following.start()] if following else SOURCE


def test_section_20_runs_cut_out_of_the_file_with_only_the_core_imports(tmp_path):
    programs = {}
    for n, use in CONTRACT_PART3.items():
        text = text_through_section(n)
        assert "class DeepSeekV3" in text and "def deepseek_param_formula" not in text   # 20 in, 21 out
        imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
        assert imports == CORE_IMPORTS, (n, imports)
        programs[str(n)] = text + "\n\n" + use + "\n"
    path = tmp_path / "cuts.json"
    path.write_text(json.dumps(programs), encoding="utf-8")
    runner = ("import sys, json\nfor n, prog in json.load(open(sys.argv[1], encoding='utf-8')).items():\n"
              "    exec(compile(prog, 'section' + n, 'exec'), {'__name__': 'cut'})\n    print('ok', n)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", runner, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "20"]


# ===========================================================================
# On the toy task: the balancing in training, the experts' load shown
# ===========================================================================

def test_training_updates_the_router_bias_only_when_asked():
    pairs = tf.make_toy_data(n_sentences=40, seed=0)
    vocab = tf.build_gpt_vocab(pairs)
    dataset = tf.PromptDataset(pairs, vocab)
    biases = []
    for rate in (0.0, 0.01):
        torch.manual_seed(0)
        model = tiny_deepseek(vocab_size=len(vocab), max_len=40).train()
        result = tf.train(model, dataset, lambda: 0.0, epochs=1, batch_size=8, seed=0, log=lambda line: None,
                          router_bias_rate=rate)
        assert math.isfinite(result["loss"])
        biases.append(torch.stack([layer.ffn.router_bias for layer in model.layers[1:]]))   # [2, 8]
    assert biases[0].abs().sum() == 0
    steps = math.ceil(40 / 8)                                          # one update a step, each +-rate or 0
    assert 0 < biases[1].abs().max() <= steps * 0.01 + 1e-6
    assert torch.allclose(biases[1] / 0.01, (biases[1] / 0.01).round(), atol=1e-4)


def test_expert_load_counts_every_routed_slot_without_padding():
    pairs = tf.make_toy_data(n_sentences=30, seed=0)
    vocab = tf.build_gpt_vocab(pairs)
    model = tiny_deepseek(vocab_size=len(vocab), max_len=40)
    loads = tf.expert_load(model, pairs, vocab)
    assert list(loads) == [1, 2] and all(load.shape == (8,) for load in loads.values())
    slots = torch.zeros(8)
    for pinyin, hanzi in pairs:                                        # one sentence at a time, counted here
        ids = vocab.encode(pinyin.split() + [tf.SEP]) + vocab.encode(hanzi) + [tf.Vocab.EOS]
        model(torch.tensor([ids]))
        slots += model.layers[1].ffn.tokens_per_expert
    assert_close(loads[1], slots / slots.sum(), 1e-6)
    text = tf.render_expert_load(loads)
    assert text.count("expert ") == 16 and "uniform: 12.5% each" in text
