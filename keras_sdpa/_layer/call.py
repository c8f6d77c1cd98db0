"""The layer's call, by route: `ScaledDotProductAttention.call` checks its arguments into one
`Call`, `route` picks the function that attends, and the layer finishes (gate, `W_O`).

The routes are the layer's own call, kept apart from its construction: they read its
sublayers and settings, and reach attention through `layer._compute_attention`, the
override point of `keras.layers.MultiHeadAttention`, so that a subclass's override applies.
Each returns the heads' outputs `(B, *dims_q, N, Hv)`, the weights (or None) and the
updated key/value cache (or None).
"""

import functools
import typing

import keras

from keras_sdpa._core.plan import check_scores
from keras_sdpa._layer import arguments as _arguments
from keras_sdpa._layer import cache as _cache
from keras_sdpa._layer import folded as _folded
from keras_sdpa._layer import masks as _layer_masks
from keras_sdpa._layer import stand_in
from keras_sdpa._shared.types import MaskMod, Tensor


class Call(typing.NamedTuple):
    """One call of the layer, its arguments checked, as the routes read them."""

    query: Tensor  # (B, *dims_q, E_q)
    value: Tensor  # (B, *dims_v, E_v)
    key: Tensor  # (B, *dims_v, E_k): the value where no key was given
    # The padding masks of the query, value and key: (B, T|S) or None each.
    masks: tuple[Tensor | None, Tensor | None, Tensor | None]
    attention_mask: Tensor | None  # MultiHeadAttention's layout
    attention_bias: Tensor | None  # in its own precision (`_arguments.bias_past_autocast`)
    return_scores: bool
    training: bool | None
    causal: bool
    mask_mod: MaskMod | None  # the layer's, holding this call's segment ids
    cache: Tensor | None = None  # (B, 2, S, K, H)
    index: int | Tensor | None = None  # `cache_update_index`


def route(layer, call):
    """The function that attends for `call`: against a key/value cache, through a
    subclass's own `_compute_attention`, in the inputs' space (a short query, where
    `keras_sdpa._layer.folded` says it folds), or on the projected queries, keys and values."""
    if call.cache is not None or call.index is not None:
        return cached
    if not layer._own_core:
        return overridden
    if layer._folds_projections(call.query, call.training, call.causal):
        return folded
    return projected


def projected(layer, call):
    """The layer's own attention on the projections."""
    mask, rows = _own_masks(call)
    q = layer.query_dense(call.query)  # (B, *dims_q, N, H)
    k = layer.key_dense(call.key)  # (B, *dims_v, K, H)
    v = layer.value_dense(call.value)  # (B, *dims_v, K, Hv)
    out, weights = layer._compute_attention(
        q,
        k,
        v,
        mask,
        call.training,
        call.return_scores,
        use_causal_mask=call.causal,
        attention_bias=call.attention_bias,
        mask_mod=call.mask_mod,
    )
    mean_values = functools.partial(keras.ops.mean, v, axis=1, keepdims=True)
    return _own_rows(layer, call, out, weights, mask, rows, mean_values)


def folded(layer, call):
    """Attention with `W_K` folded into the query and `W_V` applied after the weighted sum
    (`keras_sdpa._layer.folded`): the keys and values are never projected."""
    mask, rows = _own_masks(call)
    q = layer.query_dense(call.query)  # (B, T, N, H)
    w_k, b_k = layer.key_dense.kernel, layer.key_dense.bias
    q_keys, keys, values = _folded.fold(
        q, call.key, call.value, w_k, b_k, layer.scale, layer._key_dim
    )  # (B, T, N, E_k), (B, S, 1, E_k), (B, S, 1, E_v) and the ones
    mixed, weights = layer._compute_attention(
        q_keys,
        keys,
        values,
        mask,
        call.training,
        call.return_scores,
        use_causal_mask=call.causal,
        attention_bias=call.attention_bias,
    )
    w_v, b_v = layer.value_dense.kernel, layer.value_dense.bias
    out = _folded.unfold(mixed, call.value.shape[-1], w_v, b_v)  # (B, T, N, Hv)
    mean_values = functools.partial(_folded.mean_values, call.value, w_v, b_v)
    return _own_rows(layer, call, out, weights, mask, rows, mean_values)


def overridden(layer, call):
    """A subclass's own `_compute_attention`, with MultiHeadAttention's contract: the causal
    mask folded into `attention_mask`; neither mods nor a bias reach it."""
    check_scores(layer.flash_attention, call.return_scores)
    name = type(layer).__name__
    _arguments.check_overridden_core(name, layer.score_mod, layer.mask_mod, call.attention_bias)
    rank = len(call.query.shape)
    mask = _layer_masks.combine_masks(*call.masks, call.attention_mask, rank)
    if call.causal:
        mask = _layer_masks.with_causal(mask, call.query, call.value)
    q = layer.query_dense(call.query)  # (B, *dims_q, N, H)
    k = layer.key_dense(call.key)  # (B, *dims_v, K, H)
    v = layer.value_dense(call.value)  # (B, *dims_v, K, Hv)
    out, weights = layer._compute_attention(q, k, v, mask, call.training, call.return_scores)
    return out, weights, None


def cached(layer, call):
    """keras-hub's `CachedMultiHeadAttention` contract, with per-row positions: the layer's
    projections make the queries (and the new keys and values, which `keras_sdpa._layer.cache`
    writes), and `_cache.attend_from_offsets` runs the core from each row's position."""
    if not layer._own_core:
        raise ValueError(
            f"A `cache` reaches only this layer's own attention; {type(layer).__name__} "
            "overrides `_compute_attention`."
        )
    query_mask, value_mask, key_mask = call.masks
    sizes = (layer._kv_heads, layer._key_dim, layer._value_dim)
    cache = _cache.check(call.cache, call.index, call.query, value_mask, key_mask, *sizes)
    q = layer.query_dense(call.query)  # (B, T, N, H)
    keys, values, offset, cache = _cache.update(  # (B, S, K, H) twice, (B,), the cache
        cache,
        call.index,
        call.key,
        lambda: (layer.key_dense(call.key), layer.value_dense(call.value)),
    )
    request = layer._core_request(call.training, call.return_scores, mask_mod=call.mask_mod)
    out, weights, mask = _cache.attend_from_offsets(
        q, keys, values, offset, call.attention_mask, call.attention_bias, call.causal, request
    )
    out, weights = _layer_masks.zero_rows(out, weights, query_mask)
    out = stand_in.cached_rows(layer, out, values, mask, call.return_scores)
    return out, weights, cache


def _own_masks(call):
    """The mask the layer's own core takes, in MultiHeadAttention's layout, and the query's
    padding `rows` `(B, T)` set apart (rank 3): the core gets the key-side masks only, and
    those rows are zeroed after it (the same numbers; a (B, S) mask costs the core 0.88x the
    time of a (B, T, S) one, forward plus backward, at the app's B=64, T=512)."""
    query_mask, value_mask, key_mask = call.masks
    rank = len(call.query.shape)
    rows = query_mask if rank == 3 else None
    query_side = None if rows is not None else query_mask
    mask = _layer_masks.combine_masks(query_side, value_mask, key_mask, call.attention_mask, rank)
    return mask, rows


def _own_rows(layer, call, out, weights, mask, rows, mean_values):
    """The rows `_own_masks` set apart zeroed, and the rows whose keys are all masked as the
    replaced class gives them (`stand_in.rows`; `mean_values()` the mean of the projected
    values)."""
    out, weights = _layer_masks.zero_rows(out, weights, rows)
    out = stand_in.rows(
        layer, out, call.value, mean_values, mask, rows, call.return_scores, call.causal
    )
    return out, weights, None


def folds(layer, query, training, causal):
    """Whether a short query attends in the inputs' space (`keras_sdpa._layer.folded.folds`)."""
    projections = (layer.query_dense, layer.key_dense, layer.value_dense)
    return _folded.folds(
        query,
        training,
        causal,
        heads=(layer.num_heads, layer._kv_heads),
        sizes=(layer._key_dim, layer._value_dim),
        dropout=layer.dropout,
        unfoldable=(
            layer.attn_logits_soft_cap,
            layer.score_mod,
            layer.mask_mod,
            layer.sliding_window,
            layer._activity_regularizer,
        ),
        projections=projections,
    )
