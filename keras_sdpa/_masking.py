"""What the dense and the chunked paths share: the grouped layout, the masks, the logits.

Both paths work on grouped tensors. With `N` query heads and `K = N_kv` key/value
heads (`G = N // K` query heads per key head, `G = 1` without grouping):

    q  (B, K, G, T, H)     k  (B, K, S, H)     v  (B, K, S, Hv)

Query head `n` reads key head `n // G`, as in `keras.layers.GroupQueryAttention`.
Keys and values are never repeated to `N` heads: a product `q k^T` runs on
`(B, K, G * T, H)` by `(B, K, S, H)`, the `G` heads of a group being extra rows.

Masks and biases are 5-D too, `(B|1, K|1, G|1, T|1, S|1)`: a size-1 axis
broadcasts. Which axes are full is static (a `pattern` of four bools over
`(B, N, T, S)`), so both paths know it at trace time.

The logits of a row are, in this order:

    1. s = scale * q k^T + bias
    2. s = cap * tanh(s / cap)                    (the soft cap of Gemma 2)
    3. masked: boolean mask, causal, window       (a masked key gets weight 0)

The products (`q k^T`, `p v` and the gradient's) go through `matmul`: for float32 and
float64 inputs it is `tf.matmul`; for bfloat16 and float16 inputs it multiplies in that
precision and accumulates in float32, and everything between the products (the scale, the
bias, the cap, the masks, the softmax) stays float32.
"""

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

try:
    from tensorflow.compiler.xla import xla_data_pb2
except ImportError:  # TensorFlow releases that ship XLA as `local_xla`
    from local_xla.xla import xla_data_pb2

# Inputs in these dtypes are multiplied in their own precision, with float32 accumulation.
HALF_DTYPES = (tf.bfloat16, tf.float16)

# Stands in for -inf on masked logits: finite, so `logits - max` never makes a NaN.
MASKED_SCORE = -3.0e38
# Added to a masked logit on the dense path: exp(logit + MASK_PENALTY - row max) is exactly 0
# for any logit a row can hold, and the sum stays finite (no -inf, so no inf - inf).
MASK_PENALTY = -1.0e30


def grouped(x, pattern, num_kv_heads, groups):
    """A `(B|1, N|1, T|1, S|1)` mask or bias as `(B|1, K|1, G|1, T|1, S|1)`.

    `pattern[1]` says whether the head axis is full (`N`) or broadcast (1).
    """
    if x is None:
        return None
    if not pattern[1]:
        return x[:, :, None]  # (B|1, 1, 1, T|1, S|1)
    shape = tf.shape(x)
    return tf.reshape(x, tf.stack([shape[0], num_kv_heads, groups, shape[2], shape[3]]))


def sum_over_broadcast(d_logits, pattern):
    """Sums `(B, K, G, T, S)` logit gradients over the axes a bias of `pattern` broadcasts on."""
    axes = [0] if not pattern[0] else []
    axes += [1, 2] if not pattern[1] else []
    axes += [3] if not pattern[2] else []
    axes += [4] if not pattern[3] else []
    return tf.reduce_sum(d_logits, axis=axes, keepdims=True) if axes else d_logits


def sum_to_bias(d_logits, bias_shape, pattern):
    """`d_logits` summed to the bias's own shape."""
    return tf.reshape(sum_over_broadcast(d_logits, pattern), bias_shape)


def band(queries, keys, is_causal, window):
    """The causal and window constraints, `(len(queries), len(keys))`, or None.

    Causal: key `s` is allowed for query `t` when `s <= t` (aligned at the top
    left when `T != S`, as in Keras). Window: when `|t - s| < window`, the
    symmetric band of `keras.layers.MultiHeadAttention(sliding_window=...)`;
    with causal, the causal band of Mistral.
    """
    if not is_causal and window is None:
        return None
    offset = queries[:, None] - keys[None, :]  # (Tq, Sk)
    allowed = None
    if is_causal:
        allowed = offset >= 0
    if window is not None:
        near = tf.abs(offset) < window
        allowed = near if allowed is None else tf.logical_and(allowed, near)
    return allowed


def combine(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return tf.logical_and(a, b)


def logits(raw, bias, cap):
    """Steps 1 and 2: `raw = scale * q k^T` plus the bias, then the soft cap."""
    if bias is not None:
        raw = raw + bias
    if cap is not None:
        raw = cap * tf.tanh(raw / cap)
    return raw


def cap_derivative(capped, cap):
    """d(cap * tanh(x / cap)) / dx = 1 - tanh^2, from the capped logits themselves."""
    ratio = capped / cap
    return 1.0 - ratio * ratio


def matmul(a, b, operand=None, transpose_b=False, transpose_a=False):
    """`a @ b`, or `a @ b^T` with `transpose_b`, over the leading (batch) axes.

    With `operand=None` this is `tf.matmul`. With `operand` bfloat16 or float16, both sides
    are rounded to it and XLA's dot returns float32 (`preferred_element_type`): the products
    take half-precision operands and accumulate in float32, as FlashAttention, cuDNN and
    torch's SDPA multiply, and an accelerator's bfloat16/float16 units do the work. The
    float32 operands of a product (the softmax weights, the output's gradient) are rounded
    to `operand` only there.
    """
    if operand is None:
        return tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    rank = a.shape.rank
    dims = xla_data_pb2.DotDimensionNumbers()
    dims.lhs_contracting_dimensions.append(rank - 2 if transpose_a else rank - 1)
    dims.rhs_contracting_dimensions.append(rank - 1 if transpose_b else rank - 2)
    dims.lhs_batch_dimensions.extend(range(rank - 2))
    dims.rhs_batch_dimensions.extend(range(rank - 2))
    a, b = tf.cast(a, operand), tf.cast(b, operand)
    return xla.dot_general(a, b, dims, preferred_element_type=tf.float32)


def scaled(x, scale):
    """`x * scale`, or `x` itself when `scale` is None (the scale was folded into `q`)."""
    return x if scale is None else x * scale


def to_rows(x):
    """`(B, K, G, T, D)` as `(B, K, G * T, D)`: a group's heads become rows of one product."""
    shape = tf.shape(x)
    return tf.reshape(x, tf.stack([shape[0], shape[1], shape[2] * shape[3], shape[4]]))


def from_rows(x, groups):
    """`(B, K, G * T, D)` back to `(B, K, G, T, D)`."""
    shape = tf.shape(x)
    return tf.reshape(x, tf.stack([shape[0], shape[1], groups, shape[2] // groups, shape[3]]))


def keys_first(x):
    """`(…, G, T, S)` as `(…, S, G, T)`: the layout of the key-side gradient products."""
    return None if x is None else tf.transpose(x, [0, 1, 4, 2, 3])


# ------------------------------------------------------------------ score_mod and mask_mod


def batch_index(batch):
    """`b`, `(B, 1, 1, 1)` int32. Made once, outside the chunked path's loops: inside an
    XLA conditional a range over a size from outside it would not be a constant."""
    return tf.reshape(tf.range(batch, dtype=tf.int32), [-1, 1, 1, 1])


def mod_indices(b, num_heads, q_pos, kv_pos):
    """FlexAttention's index tensors, int32 in the `(B, N, t, s)` layout of the logits:
    `b (B, 1, 1, 1)` (from `batch_index`), `h (1, N, 1, 1)`, `q_idx (1, 1, t, 1)`,
    `kv_idx (1, 1, 1, s)`."""
    h = tf.reshape(tf.range(num_heads, dtype=tf.int32), [1, -1, 1, 1])
    q = tf.reshape(tf.cast(q_pos, tf.int32), [1, 1, -1, 1])
    kv = tf.reshape(tf.cast(kv_pos, tf.int32), [1, 1, 1, -1])
    return b, h, q, kv


def apply_score_mod(score_mod, raw, b, num_heads, q_pos, kv_pos):
    """`score_mod` on grouped logits `(B, K, G, t, s)`, seen by the mod as `(B, N, t, s)`.

    Query head `h` is row `h // G, h % G` of the grouped layout: the reshape is free.
    """
    shape = tf.shape(raw)
    flat = tf.reshape(raw, tf.stack([shape[0], num_heads, shape[3], shape[4]]))  # (B, N, t, s)
    modded = score_mod(flat, *mod_indices(b, num_heads, q_pos, kv_pos))
    modded = tf.broadcast_to(tf.cast(modded, raw.dtype), tf.shape(flat))
    return tf.reshape(modded, shape)


def mod_mask(mask_mod, b, num_heads, num_kv_heads, q_pos, kv_pos):
    """`mask_mod` at the given positions, grouped: `(B|1, K|1, G|1, t|1, s|1)` booleans."""
    allowed = tf.convert_to_tensor(mask_mod(*mod_indices(b, num_heads, q_pos, kv_pos)))
    if allowed.dtype != tf.bool:
        raise ValueError(
            "`mask_mod` must return booleans (True: may attend). "
            f"Received: a {allowed.dtype.name} tensor"
        )
    while allowed.shape.rank < 4:
        allowed = allowed[None]
    if allowed.shape.rank != 4:
        raise ValueError(
            "`mask_mod` must return a tensor that broadcasts to (B, N, t, s). "
            f"Received: shape {tuple(allowed.shape)}"
        )
    pattern = (True, allowed.shape[1] != 1, True, True)
    if allowed.shape[1] is None:
        allowed = tf.broadcast_to(allowed, tf.concat([tf.shape(allowed)[:1], [num_heads],
                                                      tf.shape(allowed)[2:]], 0))
    return grouped(allowed, pattern, num_kv_heads, num_heads // num_kv_heads)


def mod_vjp(score_mod, raw, b, num_heads, q_pos, kv_pos, d_modded, params, variables):
    """The gradient of `score_mod`'s logits, back to `raw`, its tensors and its variables.

    Taken block by block with a tape, summed densely by the caller: no scatter with atomics,
    so the gradients are the same from run to run.
    """
    params, variables = list(params), list(variables)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(raw)
        tape.watch(params)
        tape.watch(variables)
        modded = apply_score_mod(score_mod, raw, b, num_heads, q_pos, kv_pos)
    d_raw, d_params, d_variables = tape.gradient(
        modded,
        [raw, params, variables],
        output_gradients=d_modded,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    return d_raw, d_params, d_variables
