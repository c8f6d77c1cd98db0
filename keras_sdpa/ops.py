"""Scaled dot-product attention: the stateless, XLA-compiled core.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Shapes, used everywhere in this package:

    B  batch              T  query length        S  key/value length
    N  heads              H  query/key head size Hv value head size
    E  model width

Queries are `(B, T, N, H)`, keys `(B, S, N, H)` and values `(B, S, N, Hv)`, the
layout of `keras.ops.dot_product_attention`. Attention weights are `(B, N, T, S)`.

The public entry point, `scaled_dot_product_attention`, checks its arguments in
Python and then calls `_attention_xla`, a `tf.function(jit_compile=True)`: the
scores, the scaling, the softmax and the weighted sum of values all run as one
XLA program, and so does their gradient.

The rule for a fully masked query row (a query that may attend to nothing):
its weights are all zero and its output is zero, never NaN, on every path.
"""

import math

import tensorflow as tf

# Stands in for -inf on masked scores: finite, so `scores - max` never makes a NaN.
_MASKED_SCORE = -3.0e38


def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    is_causal=False,
    scale=None,
    dropout_rate=0.0,
    training=False,
    seed=None,
    return_weights=False,
):
    """Scaled dot-product attention, compiled by XLA.

    Computes `softmax(Q K^T * scale) V` (Vaswani et al., 2017, "Attention Is
    All You Need", eq. 1) in four steps: the scores `Q K^T`, the scaling by
    `scale` (default `1 / sqrt(H)`), a numerically stable softmax over the keys
    (the row maximum is subtracted before `exp`), and the weighted sum of the
    values.

    Scores and softmax are computed in float32 for `float16`, `bfloat16` and
    `float32` inputs (so mixed precision cannot overflow them), and in float64
    for float64 inputs; the results are cast back to the dtype of `query`.

    A query row whose keys are all masked gets zero weights and a zero output.

    Args:
        query: `(B, T, N, H)` floating tensor.
        key: `(B, S, N, H)` floating tensor.
        value: `(B, S, N, Hv)` floating tensor. `Hv` may differ from `H`.
        mask: optional boolean tensor broadcastable to `(B, N, T, S)`. `True`
            means "may attend". Non-boolean masks are read as `mask != 0`.
        is_causal: if `True`, query `t` attends only to keys `s <= t`
            (aligned at the top left when `T != S`, as in Keras). Combined
            with `mask` by logical and.
        scale: multiplies the scores. Defaults to `1 / sqrt(H)`.
        dropout_rate: fraction of attention weights to drop, in `[0, 1)`.
            Applied only when `training` is true.
        training: whether dropout is active.
        seed: seed for dropout: an int, a `(2,)` integer tensor (as returned
            by `keras.random.SeedGenerator.next()`), or `None` for a random one.
        return_weights: if `True`, also return the attention weights (before
            dropout, as `keras.layers.MultiHeadAttention` returns them).

    Returns:
        The output, `(B, T, N, Hv)`, and if `return_weights`, the weights,
        `(B, N, T, S)`, both in the dtype of `query`.

    Example:

    >>> q = tf.random.normal((2, 3, 4, 8))   # (B, T, N, H)
    >>> kv = tf.random.normal((2, 5, 4, 8))  # (B, S, N, H)
    >>> out, weights = scaled_dot_product_attention(q, kv, kv, return_weights=True)
    >>> out.shape, weights.shape
    (TensorShape([2, 3, 4, 8]), TensorShape([2, 4, 3, 5]))
    """
    query = tf.convert_to_tensor(query)
    key = tf.convert_to_tensor(key)
    value = tf.convert_to_tensor(value)
    _check_inputs(query, key, value)
    if mask is not None:
        mask = _check_mask(tf.convert_to_tensor(mask), query, key)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in [0, 1). Received: dropout_rate={dropout_rate}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    dropout_rate = float(dropout_rate) if training else 0.0
    if dropout_rate > 0.0:
        seed = _as_seed(seed)
    else:
        seed = None
    outputs = _attention_xla(
        query,
        key,
        value,
        mask,
        seed,
        is_causal=bool(is_causal),
        scale=float(scale),
        dropout_rate=dropout_rate,
        return_weights=bool(return_weights),
    )
    return outputs if return_weights else outputs[0]


def _attention(query, key, value, mask, seed, *, is_causal, scale, dropout_rate, return_weights):
    """The whole computation, traced once per static configuration."""
    dtype = query.dtype
    compute = tf.float64 if dtype == tf.float64 else tf.float32  # never below float32
    # Heads become a batch axis, so each step is one batched matmul.
    # (Q K^T) * scale == (Q * scale) K^T: scaling the (T, H) queries is cheaper
    # than scaling the (T, S) scores, and is the same number.
    q = tf.transpose(tf.cast(query, compute), [0, 2, 1, 3]) * scale  # (B, N, T, H)
    k = tf.transpose(tf.cast(key, compute), [0, 2, 1, 3])  # (B, N, S, H)
    v = tf.transpose(tf.cast(value, compute), [0, 2, 1, 3])  # (B, N, S, Hv)

    if is_causal:
        t, s = tf.shape(q)[2], tf.shape(k)[2]
        causal = tf.range(t)[:, None] >= tf.range(s)[None, :]  # (T, S)
        mask = causal if mask is None else tf.logical_and(mask, causal)

    keep = None
    if dropout_rate > 0.0:
        shape = tf.stack([tf.shape(q)[0], tf.shape(q)[1], tf.shape(q)[2], tf.shape(k)[2]])
        # Philox explicitly: XLA's CPU default (ThreeFry) is about 100x slower here.
        keep = (
            tf.random.stateless_uniform(shape, seed, dtype=compute, alg="philox") >= dropout_rate
        )  # (B, N, T, S)

    out, weights = _attend(q, k, v, mask, keep, dropout_rate, return_weights)
    out = tf.cast(tf.transpose(out, [0, 2, 1, 3]), dtype)  # (B, T, N, Hv)
    if weights is not None:
        weights = tf.cast(weights, dtype)
    return out, weights


_attention_xla = tf.function(_attention, jit_compile=True, reduce_retracing=True)


def _softmax_parts(scores, mask):
    """The stable softmax of the scores, left unnormalized.

    Returns `exp`, `(B, N, T, S)`, with `exp(scores - row_max)` where allowed and
    0 where masked, its reciprocal row sum `inv_total`, `(B, N, T, 1)`, and the
    row log-sum-exp `lse`, so that `weights = exp * inv_total = exp(scores - lse)`.
    A fully masked row has `exp == 0`: its weights and its output are zero.
    """
    if mask is not None:
        scores = tf.where(mask, scores, _MASKED_SCORE)
    row_max = tf.reduce_max(scores, axis=-1, keepdims=True)  # (B, N, T, 1)
    exp = tf.exp(scores - row_max)  # (B, N, T, S)
    if mask is not None:
        exp = tf.where(mask, exp, 0.0)
    total = tf.reduce_sum(exp, axis=-1, keepdims=True)  # (B, N, T, 1)
    total = tf.where(total > 0.0, total, 1.0)  # fully masked rows: 0 / 1 = 0
    return exp, 1.0 / total, row_max + tf.math.log(total)


def _attend(q, k, v, mask, keep, dropout_rate, return_weights):
    """softmax(q k^T) v on `(B, N, ., .)` tensors, with a hand-written gradient.

    Three choices make this faster than the softmax and gradient XLA derives
    on its own, on a CPU where every pass over the `(T, S)` matrix is the cost:

    - the forward pass never normalizes the `(T, S)` weights; it divides the
      `(T, Hv)` output by the row sums instead (`weights` are only formed when
      they are returned);
    - the gradient is FlashAttention's (Dao et al., 2022):
      `dS = P * (dP - rowsum(dO * O))`, so the softmax is not replayed;
    - XLA's CPU matmul is slow when the `(T, S)` matrix must be read transposed
      (`P^T dO`, `dS^T Q`), so the gradient recomputes `P^T` from `K Q^T` and
      the saved log-sum-exp, in the layout those two products want.
    """
    scale_keep = None if keep is None else 1.0 / (1.0 - dropout_rate)
    mask_t = None if mask is None else tf.linalg.matrix_transpose(mask)
    keep_t = None if keep is None else tf.linalg.matrix_transpose(keep)

    @tf.custom_gradient
    def attend(q, k, v):
        scores = tf.matmul(q, k, transpose_b=True)  # (B, N, T, S)
        exp, inv_total, lse = _softmax_parts(scores, mask)
        applied = exp if keep is None else tf.where(keep, exp * scale_keep, 0.0)
        out = tf.matmul(applied, v) * inv_total  # (B, N, T, Hv)
        weights = exp * inv_total if return_weights else None  # (B, N, T, S)

        def grad(d_out, d_weights=None):
            # rowsum(P * dP) == rowsum(dO * O), a (T, Hv) product, not a (T, S) one.
            row_dot = tf.reduce_sum(d_out * out, axis=-1, keepdims=True)  # (B, N, T, 1)
            d_probs = tf.matmul(d_out, v, transpose_b=True)  # (B, N, T, S)
            if keep is not None:
                d_probs = tf.where(keep, d_probs * scale_keep, 0.0)
            probs = exp * inv_total  # (B, N, T, S)
            if d_weights is not None:
                d_probs = d_probs + d_weights
                row_dot = row_dot + tf.reduce_sum(d_weights * probs, axis=-1, keepdims=True)
            d_scores = probs * (d_probs - row_dot)  # (B, N, T, S)
            d_q = tf.matmul(d_scores, k)  # (B, N, T, H)

            # The same in the (S, T) layout, for d_k and d_v.
            probs_t = tf.exp(
                tf.matmul(k, q, transpose_b=True) - tf.linalg.matrix_transpose(lse)
            )  # (B, N, S, T)
            if mask_t is not None:
                probs_t = tf.where(mask_t, probs_t, 0.0)
            applied_t = probs_t if keep_t is None else tf.where(keep_t, probs_t * scale_keep, 0.0)
            d_v = tf.matmul(applied_t, d_out)  # (B, N, S, Hv)
            d_probs_t = tf.matmul(v, d_out, transpose_b=True)  # (B, N, S, T)
            if keep_t is not None:
                d_probs_t = tf.where(keep_t, d_probs_t * scale_keep, 0.0)
            if d_weights is not None:
                d_probs_t = d_probs_t + tf.linalg.matrix_transpose(d_weights)
            d_scores_t = probs_t * (d_probs_t - tf.linalg.matrix_transpose(row_dot))
            d_k = tf.matmul(d_scores_t, q)  # (B, N, S, H)
            return d_q, d_k, d_v

        if return_weights:
            return (out, weights), grad
        return out, lambda d_out: grad(d_out)

    if return_weights:
        return attend(q, k, v)
    return attend(q, k, v), None


def _check_inputs(query, key, value):
    for name, tensor, layout in (
        ("query", query, "(B, T, N, H)"),
        ("key", key, "(B, S, N, H)"),
        ("value", value, "(B, S, N, Hv)"),
    ):
        if tensor.shape.rank != 4:
            raise ValueError(
                f"`{name}` must have rank 4, {layout}. Received: {name}.shape={tuple(tensor.shape)}"
            )
        if not tensor.dtype.is_floating:
            raise ValueError(
                f"`{name}` must be a floating tensor. Received: {name}.dtype={tensor.dtype.name}"
            )
    if not _compatible(query.shape[-1], key.shape[-1]):
        raise ValueError(
            "`query` and `key` must have the same head size H (last axis). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if not _compatible(key.shape[1], value.shape[1]):
        raise ValueError(
            "`key` and `value` must have the same length S (axis 1). "
            f"Received: key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    for axis, what in ((0, "batch size B"), (2, "number of heads N")):
        sizes = [query.shape[axis], key.shape[axis], value.shape[axis]]
        known = {size for size in sizes if size is not None}
        if len(known) > 1:
            raise ValueError(
                f"`query`, `key` and `value` must have the same {what} (axis {axis}). "
                f"Received: query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
            )


def _check_mask(mask, query, key):
    target = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])  # (B, N, T, S)
    rank = mask.shape.rank
    ok = rank is not None and rank <= 4
    if ok:
        for size, want in zip(reversed(mask.shape), reversed(target)):
            if size not in (None, 1) and want is not None and size != want:
                ok = False
    if not ok:
        raise ValueError(
            "`mask` must broadcast to (B, N, T, S) = "
            f"{tuple(target)}. Received: mask.shape={tuple(mask.shape)}"
        )
    if mask.dtype != tf.bool:
        mask = tf.not_equal(mask, tf.zeros((), mask.dtype))
    for _ in range(4 - rank):
        mask = mask[None]
    return mask  # rank 4


def _compatible(a, b):
    return a is None or b is None or a == b


def _as_seed(seed):
    """A `(2,)` int32 seed for the stateless dropout inside the XLA program."""
    if seed is None:
        return tf.random.uniform((2,), maxval=2**31 - 1, dtype=tf.int32)
    if isinstance(seed, int):
        return tf.constant([seed, 0], dtype=tf.int32)
    seed = tf.convert_to_tensor(seed)
    if seed.shape.rank != 1 or seed.shape[0] != 2 or not seed.dtype.is_integer:
        raise ValueError(
            f"`seed` must be an int, None, or a (2,) integer tensor. Received: seed={seed!r}"
        )
    return tf.cast(seed, tf.int32)
