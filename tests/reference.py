"""The specification of the core, read first: attention with every option, in float64 NumPy.

`keras_sdpa.scaled_dot_product_attention` computes this on every path (dense, chunked, decode)
and every backend; the tests compare against it. It is written for reading, not for speed:
every option is a line, in the order the core applies it.

    q (B, T, N, H)    k (B, S, K, H)    v (B, S, K, Hv)    weights (B, N, T, S)

Query head `n` reads key head `n // (N // K)` (grouped-query attention, as
`keras.layers.GroupQueryAttention` does by repeating the keys).
"""

import numpy as np


def attention(
    q,
    k,
    v,
    mask=None,
    bias=None,
    *,
    scale=None,
    score_mod=None,
    cap=None,
    is_causal=False,
    window=None,
    mask_mod=None,
    keep=None,
    dropout_rate=0.0,
):
    """`(out (B, T, N, Hv), weights (B, N, T, S))`, the weights before dropout.

    1. logits = scale * q k^T            (`scale` defaults to 1 / sqrt(H))
    2. logits = score_mod(logits, b, h, q_idx, kv_idx)
    3. logits = logits + bias            (broadcast to (B, N, T, S) by NumPy's rules)
    4. logits = cap * tanh(logits / cap) (Gemma 2's soft cap)
    5. allowed = mask & causal (s <= t, top-left aligned) & window (|t - s| < W) & mask_mod
    6. weights = softmax over the allowed keys; a row with none gets zeros, never NaN
    7. out = (weights * keep / (1 - dropout_rate)) v, with `keep` a given boolean keep-mask

    `score_mod` and `mask_mod` take NumPy index arrays that broadcast to `(B, N, T, S)`.
    """
    assert (keep is None) == (dropout_rate == 0.0), "dropout needs a keep-mask and a rate"
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)  # (B, S, N, H|Hv)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale  # (B, N, T, S)
    b, h, t, s = np.ogrid[tuple(slice(size) for size in logits.shape)]  # broadcastable indices
    if score_mod is not None:
        logits = score_mod(logits, b, h, t, s)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed &= np.broadcast_to(np.asarray(mask, bool), logits.shape)
    if is_causal:
        allowed &= t >= s
    if window is not None:
        allowed &= np.abs(t - s) < window
    if mask_mod is not None:
        allowed &= np.broadcast_to(mask_mod(b, h, t, s), logits.shape)
    logits = np.where(allowed, logits, -np.inf)
    row_max = logits.max(-1, keepdims=True)
    exp = np.where(allowed, np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    total = exp.sum(-1, keepdims=True)
    weights = exp / np.where(total > 0, total, 1.0)  # (B, N, T, S)
    applied = weights if keep is None else np.where(keep, weights / (1.0 - dropout_rate), 0.0)
    return np.einsum("bnts,bsnh->btnh", applied, v), weights  # (B, T, N, Hv)
