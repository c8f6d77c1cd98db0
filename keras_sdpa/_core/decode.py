"""The decode path: one query row per head against a long key/value cache, in O(S).

A generating decoder calls attention with `T = 1` and a cache of `S` keys. The work is one
pass over the keys and one over the values; what costs is moving them. The dense path's
products want `k` and `v` as `(B, K, S, H)`, so a cache in keras-hub's `(B, S, K, H)` layout
is transposed, a copy of the whole cache, on every token. Here the two products are
multiply-and-reduce fusions that read the cache where it lies:

    logits[b, s, k, g, t] = sum_h q[b, k, g, t, h] * key[b, s, k, h]
    out[b, k, g, t, h]    = sum_s weights[b, s, k, g, t] * value[b, s, k, h]

and only the `(S, K, G, T)` logits, `1/H` of the cache, change layout. That is TensorFlow's
(`_backend/tensorflow.py`'s `cache_logits` and `cache_weighted_sum`); JAX's XLA does not fuse
those multiply-and-reduce passes into one read of the cache (in one run, 176 ms against 5.3 ms
a call for dots on the transposed cache, B=1, S=8,192, N=8, H=64, AMD EPYC; per token the dots
take 0.544x keras-hub's layer on JAX, BENCHMARKS.md), so on JAX the two products are dots on
the transposed cache (`_backend/jax.py`). The softmax, masks, bias, soft cap and mods are
the dense path's (`softmax.py`, `mod_calls.py`), at the same positions. The gradient is the
backend's autodiff of this program: the path serves decoding, where training's `(T, S)`
products belong to the dense and chunked paths.

This layout was chosen over two einsums, and one reduction over the keys over splitting them
into blocks whose partial outputs are summed after (flash-decoding's split-KV, which feeds a
GPU's many cores): on 2 CPU cores XLA's reduction already splits the key axis across the
cores. What it costs per token against keras-hub's layer is `benchmarks/decode.py`'s table in
BENCHMARKS.md.
"""

from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import layout, mod_calls, softmax
from keras_sdpa._mods import bands


def attend(q, key, value, plan, tensors):
    """softmax(logits) v for a few query rows, the keys and values in the caller's layout.

    `q` is grouped, `(B, K, G, T, H)` (scaled already unless `plan.logit_scale`); `key` and
    `value` are `(B, S, K, H)` and `(B, S, K, Hv)`, in any float dtype (half-precision
    caches are read as they are and multiplied in float32). The masks are `tensors.mask`,
    the mask_mod and the plan's causal band and window, combined.
    Returns the output `(B, K, G, T, Hv)` and the weights `(B, K, G, T, S)` or None.
    """
    compute = plan.compute
    q = ops.cast(q, compute)
    t, s = ops.shape(q)[3], ops.shape(key)[1]
    constraint = bands.band(ops.arange(t), ops.arange(s), plan.is_causal, plan.window)  # (T, S)
    allowed = softmax.combine(
        mod_calls.with_mask_mod(tensors.mask, q, s, plan, tensors.mask_mod), constraint
    )  # (B|1, K|1, G|1, T|1, S|1) or None
    shim = _backend.get()
    raw = shim.cache_logits(q, ops.cast(key, compute))  # (B, K, G, T, S)
    raw = layout.scaled(raw, plan.logit_scale)
    if tensors.score_mod is not None:
        raw = mod_calls.apply_score_mod(
            tensors.score_mod,
            raw,
            layout.batch_index(ops.shape(q)[0]),
            plan.num_heads,
            ops.arange(t),
            ops.arange(s),
        )
    scores = softmax.logits(raw, tensors.bias, plan.cap)
    penalty, any_allowed = softmax.additive(allowed, compute)  # (…, T|1, S|1), (…, T|1, 1)
    exp, inv_total, _ = softmax.parts(scores, penalty, any_allowed)
    weights = exp * inv_total  # (B, K, G, T, S)
    out = shim.cache_weighted_sum(weights, ops.cast(value, compute))  # (B, K, G, T, Hv)
    return out, weights if plan.return_weights else None
