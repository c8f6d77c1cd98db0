"""The layer's shapes: its projections (`EinsumDense` sublayers and their equations), and its
outputs' shapes for Keras's shape inference (`compute_output_shape`, `compute_output_spec`)."""

import string

import keras

from keras_sdpa._layer.rank_n import normalize_axes


def projection_equation(free_dims, bound_dims, output_dims):
    """An EinsumDense equation `(free…, bound…) x (bound…, out…) -> (free…, out…)`.

    Returns the equation and the bias axes (the output axes).
    """
    letters = iter(string.ascii_lowercase)
    free = "".join(next(letters) for _ in range(free_dims))
    bound = "".join(next(letters) for _ in range(bound_dims))
    out = "".join(next(letters) for _ in range(output_dims))
    return f"{free}{bound},{bound}{out}->{free}{out}", out


def einsum_dense(name, input_shape, output_shape, bound_dims, use_bias, **options):
    """A built `EinsumDense` from `input_shape`, whose last `bound_dims` axes it contracts,
    to `(*free axes, *output_shape)`, with a bias on the output axes if `use_bias`; `options`
    are the sublayer's other arguments (initializers, regularizers, dtype policy, ...)."""
    free = len(input_shape) - bound_dims
    equation, bias_axes = projection_equation(free, bound_dims, len(output_shape))
    dense = keras.layers.EinsumDense(
        equation,
        output_shape=(None,) * (free - 1) + tuple(output_shape),
        bias_axes=bias_axes if use_bias else None,
        name=name,
        **options,
    )
    dense.build(input_shape)
    return dense


def output_shape(
    query_shape, value_shape, key_shape, projected, out_shape, heads, key_dim, value_dim
):
    """The output's shape `(B, *dims_q, *output_shape)`: with `W_O` (`projected`) the layer's
    `out_shape` (None: the query's width), else the heads concatenated, `N * Hv`."""
    query_shape = tuple(query_shape)
    value_shape = tuple(value_shape)
    key_shape = value_shape if key_shape is None else tuple(key_shape)
    if value_shape[1:-1] != key_shape[1:-1]:
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, must be equal. "
            f"Received: value_shape={value_shape}, key_shape={key_shape}"
        )
    if projected:
        return query_shape[:-1] + (out_shape or (query_shape[-1],))
    key_dim = key_dim or query_shape[-1] // heads
    return query_shape[:-1] + (heads * (value_dim or key_dim),)


def scores_shape(query_shape, value_shape, attention_axes, heads):
    """The weights' shape in MultiHeadAttention's layout:
    `(B, *batch dims, N, *query attention dims, *key attention dims)`."""
    rank = len(query_shape)
    axes = normalize_axes(attention_axes, rank)
    batch = [query_shape[a] for a in range(1, rank - 1) if a not in axes]
    return (
        (query_shape[0], *batch, heads)
        + tuple(query_shape[a] for a in axes)
        + tuple(value_shape[a] for a in axes)
    )
