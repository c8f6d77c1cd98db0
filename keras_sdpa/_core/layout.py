"""The grouped layout every path computes in, and the products in it.

With `N` query heads and `K` key/value heads (`G = N // K` query heads per key head, `G = 1`
without grouping):

    q  (B, K, G, T, H)     k  (B, K, S, H)     v  (B, K, S, Hv)

Query head `n` reads key head `n // G`, as in `keras.layers.GroupQueryAttention`. Keys and
values are never repeated to `N` heads: a product `q k^T` runs on `(B, K, G * T, H)` by
`(B, K, S, H)`, the `G` heads of a group being extra rows (`to_rows`, `from_rows`).

Masks and biases are 5-D too, `(B|1, K|1, G|1, T|1, S|1)`: a size-1 axis broadcasts. Which
axes are full is static (a `pattern` of four bools over `(B, N, T, S)`), so every path knows
it at trace time.

The products (`q k^T`, `p v` and the gradient's) go through `matmul`: for float32 and float64
inputs a plain product; for bfloat16 and float16 inputs it multiplies in that precision and
accumulates in float32, and everything between the products (the scale, the bias, the cap,
the masks, the softmax) stays float32.
"""

from keras import ops

from keras_sdpa import _backend

# Inputs in these dtypes are multiplied in their own precision, with float32 accumulation.
HALF_DTYPES = ("bfloat16", "float16")


def grouped(x, pattern, num_kv_heads, groups):
    """A `(B|1, N|1, T|1, S|1)` mask or bias as `(B|1, K|1, G|1, T|1, S|1)`.

    `pattern[1]` says whether the head axis is full (`N`) or broadcast (1).
    """
    if x is None:
        return None
    if not pattern[1]:
        return x[:, :, None]  # (B|1, 1, 1, T|1, S|1)
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], num_kv_heads, groups, shape[2], shape[3]))


def sum_over_broadcast(d_logits, pattern):
    """Sums `(B, K, G, T, S)` logit gradients over the axes a bias of `pattern` broadcasts on."""
    axes = [0] if not pattern[0] else []
    axes += [1, 2] if not pattern[1] else []
    axes += [3] if not pattern[2] else []
    axes += [4] if not pattern[3] else []
    return ops.sum(d_logits, axis=tuple(axes), keepdims=True) if axes else d_logits


def sum_to_bias(d_logits, bias_shape, pattern):
    """`d_logits` summed to the bias's own shape."""
    return ops.reshape(sum_over_broadcast(d_logits, pattern), bias_shape)


def matmul(a, b, operand=None, transpose_b=False, transpose_a=False):
    """`a @ b`, or `a @ b^T` with `transpose_b`, over the leading (batch) axes.

    With `operand=None` a plain product. With `operand` bfloat16 or float16, both sides are
    rounded to it and XLA's dot returns float32 (`preferred_element_type`): the products
    take half-precision operands and accumulate in float32, as FlashAttention, cuDNN and
    torch's SDPA multiply, and an accelerator's bfloat16/float16 units do the work. The
    float32 operands of a product (the softmax weights, the output's gradient) are rounded
    to `operand` only there. (`keras.ops.matmul` has neither the transposed operands nor
    the accumulation type: `_backend` says it for each backend.)
    """
    return _backend.get().matmul(a, b, operand, transpose_a=transpose_a, transpose_b=transpose_b)


def scaled(x, scale):
    """`x * scale`, or `x` itself when `scale` is None (the scale was folded into `q`)."""
    return x if scale is None else x * scale


def to_rows(x):
    """`(B, K, G, T, D)` as `(B, K, G * T, D)`: a group's heads become rows of one product."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], shape[2] * shape[3], shape[4]))


def from_rows(x, groups):
    """`(B, K, G * T, D)` back to `(B, K, G, T, D)`."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], groups, shape[2] // groups, shape[3]))


def keys_first(x):
    """`(…, G, T, S)` as `(…, S, G, T)`: the layout of the key-side gradient products."""
    return None if x is None else ops.transpose(x, (0, 1, 4, 2, 3))


def batch_index(batch):
    """`b`, `(B, 1, 1, 1)` int32. Made once, outside the chunked path's loops: inside an
    XLA conditional a range over a size from outside it would not be a constant."""
    return ops.reshape(ops.arange(batch, dtype="int32"), (-1, 1, 1, 1))
