"""A short query attends in the inputs' space: `W_K` folded into the query, `W_V` after
the weighted sum, so that the keys and values are never projected (attention pooling, `T = 1`).

The functions read the layer's projections and settings; the layer decides when they run.
"""

import math

import keras


def folds(layer, query, training, use_causal_mask):
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
    """
    length = query.shape[1]
    if len(query.shape) != 3 or not isinstance(length, int):
        return False  # unknown, or a JAX symbolic size (shape inference), which cannot compare
    if length * 4 > min(layer._key_dim, layer._value_dim):
        return False
    if layer._kv_heads != layer.num_heads or layer.attn_logits_soft_cap is not None:
        return False
    if layer.score_mod is not None or layer.mask_mod is not None:
        return False
    if use_causal_mask or layer.sliding_window is not None:
        return False
    if training and layer.dropout > 0:
        return False
    if layer._activity_regularizer is not None:
        return False  # the fold never calls the key and value projections, whose loss it is
    return not any(
        dense.quantization_mode is not None or dense.lora_enabled
        for dense in (layer._query_dense, layer._key_dense, layer._value_dense)
    )


def attend(
    layer, query, value, key, mask, training, return_attention_scores, use_causal_mask,
    attention_bias,
):  # fmt: skip
    """Attention with `W_K` folded into the query and `W_V` applied after the weighted
    sum (`folds`). Returns `(B, T, N, Hv)` and the weights or None."""
    q = layer._query_dense(query)  # (B, T, N, H)
    w_k = keras.ops.cast(layer._key_dense.kernel, q.dtype)  # (E_k, N, H)
    q_keys = keras.ops.einsum("btnh,enh->btne", q, w_k)  # (B, T, N, E_k): q k_s = q_keys x_s
    if layer.scale is None:
        # The core's default scale follows the last axis, E_k here: keep 1 / sqrt(H).
        q_keys = q_keys * math.sqrt(w_k.shape[0] / layer._key_dim)
    if layer.use_bias:
        # The key bias adds `q b_K` to every logit of a row, which the softmax ignores: its
        # gradient is zero, given as zeros (not None, which optimizers warn about).
        q_keys = q_keys + 0.0 * keras.ops.sum(keras.ops.cast(layer._key_dense.bias, q_keys.dtype))
    width = value.shape[-1]
    if layer.use_bias:
        # sum_s p_s (x_s W_V + b_V) = (sum_s p_s x_s) W_V + (sum_s p_s) b_V: a column of
        # ones beside the values gives each row's total weight (0 where every key is
        # masked), whatever the masks' shapes.
        value = keras.ops.concatenate([value, keras.ops.ones_like(value[..., :1])], axis=-1)
    mixed, weights = layer._compute_attention(
        q_keys,
        key[:, :, None, :],  # (B, S, 1, E_k): one key "head" that every head reads
        value[:, :, None, :],  # (B, S, 1, E_v), and the ones
        mask,
        training,
        return_attention_scores,
        use_causal_mask=use_causal_mask,
        attention_bias=attention_bias,
    )  # (B, T, N, E_v): each head's weighted sum of the value inputs, and its total
    w_v = keras.ops.cast(layer._value_dense.kernel, mixed.dtype)  # (E_v, N, Hv)
    out = keras.ops.einsum("btne,enh->btnh", mixed[..., :width], w_v)  # (B, T, N, Hv)
    if layer.use_bias:
        out = out + mixed[..., width:] * keras.ops.cast(layer._value_dense.bias, out.dtype)
    return out, weights


def mean_values(layer, value):
    """`(B, 1, N, Hv)`: the mean of the projected values, `mean_s(x_s) W_V + b_V`, without
    calling the projection again (which would add its activity regularizer's loss twice)."""
    mean = keras.ops.mean(value, axis=1)  # (B, E_v)
    w_v = keras.ops.cast(layer._value_dense.kernel, mean.dtype)  # (E_v, N, Hv)
    out = keras.ops.einsum("be,enh->bnh", mean, w_v)[:, None]  # (B, 1, N, Hv)
    if layer.use_bias:
        out = out + keras.ops.cast(layer._value_dense.bias, out.dtype)
    return out
