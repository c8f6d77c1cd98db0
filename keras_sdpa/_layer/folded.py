"""A short query attends in the inputs' space: `W_K` folded into the query, `W_V` after
the weighted sum, so that the keys and values are never projected (attention pooling, `T = 1`).

The functions take the layer's settings and weights as values; the layer decides when they
run, and runs the attention between `fold` and `unfold` itself.
"""

import math

import keras


def folds(query, training, use_causal_mask, *, heads, sizes, dropout, unfoldable, projections):
    """Whether a short query attends in the inputs' space, without projecting every key.

    For a query of `T` positions against `S` keys, projecting the keys and values costs
    `S E N H` each; folding `W_K` into the query (`q W_K^T`, `(T, N, E)`) and `W_V`
    after the weighted sum costs `T S E N`. With `T` well below `H` (attention pooling,
    `T = 1`) the fold does a fraction of the work, to float rounding the same result:
    the key bias shifts each logit row by a constant, which the softmax ignores, and the
    value bias is weighted by the row's total weight. Only the plain configuration
    folds: self-attention-style axes, no grouped heads, no soft cap (not
    shift-invariant), no causal mask or window, no dropout while training, no activity
    regularizer, and projections that are neither quantized nor LoRA.

    `heads` is `(num_heads, num_key_value_heads)`, `sizes` `(key_dim, value_dim)`,
    `unfoldable` the settings that never fold, each None where unset (the soft cap, the
    score and mask mods, the window, the activity regularizer: the fold never calls the key
    and value projections, whose loss it is), and `projections` the query, key and value
    `EinsumDense` sublayers.
    """
    length = query.shape[1]
    if len(query.shape) != 3 or not isinstance(length, int):
        return False  # unknown, or a JAX symbolic size (shape inference), which cannot compare
    if length * 4 > min(sizes) or heads[0] != heads[1]:
        return False
    if any(setting is not None for setting in unfoldable):
        return False
    if use_causal_mask or (training and dropout > 0):
        return False
    return not any(
        dense.quantization_mode is not None or dense.lora_enabled for dense in projections
    )


def fold(q, key, value, w_k, b_k, scale, key_dim):
    """The core's inputs with `W_K` folded into the projected queries `q` `(B, T, N, H)`:
    `(B, T, N, E_k)` queries, `(B, S, 1, E_k)` keys (one key "head" that every head reads) and
    `(B, S, 1, E_v)` values, with a column of ones after them where there are biases (`b_k`,
    the key bias, is not None: the layer's biases are all there or none).

    `w_k` is the key kernel `(E_k, N, H)`, `scale` the layer's (None: `1 / sqrt(key_dim)`).
    """
    w_k = keras.ops.cast(w_k, q.dtype)  # (E_k, N, H)
    q_keys = keras.ops.einsum("btnh,enh->btne", q, w_k)  # (B, T, N, E_k): q k_s = q_keys x_s
    if scale is None:
        # The core's default scale follows the last axis, E_k here: keep 1 / sqrt(H).
        q_keys = q_keys * math.sqrt(w_k.shape[0] / key_dim)
    if b_k is not None:
        # The key bias adds `q b_K` to every logit of a row, which the softmax ignores: its
        # gradient is zero, given as zeros (not None, which optimizers warn about).
        q_keys = q_keys + 0.0 * keras.ops.sum(keras.ops.cast(b_k, q_keys.dtype))
        # sum_s p_s (x_s W_V + b_V) = (sum_s p_s x_s) W_V + (sum_s p_s) b_V: a column of
        # ones beside the values gives each row's total weight (0 where every key is
        # masked), whatever the masks' shapes.
        value = keras.ops.concatenate([value, keras.ops.ones_like(value[..., :1])], axis=-1)
    return q_keys, key[:, :, None, :], value[:, :, None, :]


def unfold(mixed, width, w_v, b_v):
    """`(B, T, N, Hv)` from the attention output in the inputs' space `mixed` `(B, T, N, E_v)`
    (each head's weighted sum of the `width` value inputs, and its total weight where `fold`
    added the ones): `W_V` `(E_v, N, Hv)` applied after the weighted sum, and the bias `b_v`
    (or None) times the total weight."""
    w_v = keras.ops.cast(w_v, mixed.dtype)  # (E_v, N, Hv)
    out = keras.ops.einsum("btne,enh->btnh", mixed[..., :width], w_v)  # (B, T, N, Hv)
    if b_v is not None:
        out = out + mixed[..., width:] * keras.ops.cast(b_v, out.dtype)
    return out


def mean_values(value, w_v, b_v):
    """`(B, 1, N, Hv)`: the mean of the projected values, `mean_s(x_s) W_V + b_V`, without
    calling the projection again (which would add its activity regularizer's loss twice)."""
    mean = keras.ops.mean(value, axis=1)  # (B, E_v)
    w_v = keras.ops.cast(w_v, mean.dtype)  # (E_v, N, Hv)
    out = keras.ops.einsum("be,enh->bnh", mean, w_v)[:, None]  # (B, 1, N, Hv)
    if b_v is not None:
        out = out + keras.ops.cast(b_v, out.dtype)
    return out
