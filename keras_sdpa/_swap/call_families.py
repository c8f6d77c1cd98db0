"""Kernel swaps for the classes that write their kernel inside `call`: Bloom's and Falcon's
(with ALiBi) and T5's (with its relative-position bias).

There is no `_compute_attention` to replace, so `call` is replaced on the instance
(`keras_sdpa._swap.families.swap`) by a function with the class's own signature. It calls the
class's own sublayers (the projections, Bloom's ALiBi layer, T5's `compute_bias`, the dropout) and
repeats only its cache bookkeeping; the kernel, `softmax(scale * Q K^T + bias) V` under the mask,
runs on `keras_sdpa.scaled_dot_product_attention`, with the family's position bias as the core's
`bias`.
"""

import dataclasses
import types
from collections.abc import Callable

import keras
from keras import ops

from keras_sdpa import ops as core
from keras_sdpa._shared.types import Tensor

_MODELS = "keras_hub.src.models"


@dataclasses.dataclass(frozen=True)
class CallFamily:
    """A class whose kernel is written inside `call`: `call` is replaced.

    The projections, the cache's update and the output projection are the class's own
    sublayers and code path (`_projected`); what differs is a row here.

    Attributes:
        call: the replacement, with the class's `call` signature.
        projections: the attribute names of the query, key, value and output projections.
        bias: `(layer, extra, key_length)` -> the logits' bias (ALiBi), broadcastable to
            `(B, N, T, S)`, with `extra` the call's other arguments.
        dropout: the `keras.layers.Dropout` of the weights (also of the output, with
            `output_dropout`).
    """

    call: Callable[..., Tensor | tuple[Tensor, ...]]  # T5's: (out, position bias, cache)
    projections: tuple[str, str, str, str]
    bias: Callable[[keras.layers.Layer, dict[str, Tensor], int | Tensor], Tensor] | None
    dropout: Callable[[keras.layers.Layer], keras.layers.Dropout | None]
    output_dropout: bool = False


def _path(layer):
    cls = type(layer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _bloom_call(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None):
    return _projected(self, hidden_states, attention_mask, cache, cache_update_index, {})


def _falcon_call(self, inputs, alibi, attention_mask=None, cache=None, cache_update_index=None):
    extra = {"alibi": alibi}
    return _projected(self, inputs, attention_mask, cache, cache_update_index, extra)


def _projected(self, x, attention_mask, cache, cache_update_index, extra):
    """What Bloom's and Falcon's `call` compute, their kernel on the core: the projections,
    the cache's update (a `(B, 2, S, N, H)` tensor, returned updated), `softmax(scale * Q K^T
    + ALiBi)` under the mask (a fully masked row gives zeros, as their masked softmax), the
    weights' dropout, and the output projection."""
    family = CALL_FAMILIES[_path(self)]
    query_dense, key_dense, value_dense, output_dense = (
        getattr(self, name) for name in family.projections
    )
    query = query_dense(x)  # (B, T, N, H)
    key, value, cache = with_cache(
        cache, cache_update_index, lambda: (key_dense(x), value_dense(x))
    )
    mask = None
    if attention_mask is not None:
        mask = attention_mask
        if keras.backend.standardize_dtype(mask.dtype) != "bool":
            mask = ops.greater(mask, 0.5)  # as `keras.layers.Softmax` reads a mask
        mask = mask[:, None]  # (B, 1, T, S)
    dropout = family.dropout(self)
    out = core.scaled_dot_product_attention(
        query,
        key,
        value,
        mask,
        bias=family.bias(self, extra, ops.shape(key)[1]),
        scale=self.inv_norm_factor,
        **core_options(self, dropout, _call_training(self)),
    )  # (B, T, N, H)
    batch, length = ops.shape(x)[0], ops.shape(x)[1]
    out = output_dense(ops.reshape(out, (batch, length, self.num_heads * self.head_dim)))
    if family.output_dropout:
        out = dropout(out)
    return out if cache is None else (out, cache)


def with_cache(cache, cache_update_index, project):
    """The keys and values a call attends to, and the cache it returns: keras-hub's contract,
    a `(B, 2, S, N, H)` cache read whole when `cache_update_index` is None, else updated at
    that index with `project()`'s `(key, value)`; without a cache, `project()`'s."""
    if cache is not None and cache_update_index is None:
        return cache[:, 0, ...], cache[:, 1, ...], cache
    key, value = project()
    if cache is not None:
        start = [0, cache_update_index, 0, 0]
        key = ops.slice_update(cache[:, 0, ...], start, key)
        value = ops.slice_update(cache[:, 1, ...], start, value)
        return key, value, ops.stack((key, value), axis=1)
    if cache_update_index is not None:
        raise ValueError(
            "`cache_update_index` should not be set if `cache` is `None`. Received: "
            f"cache={cache}, cache_update_index={cache_update_index}"
        )
    return key, value, cache


def core_options(layer, dropout, training):
    """The core's dropout and path arguments for a swapped kernel: the stock kernel's
    `dropout` (a `keras.layers.Dropout`, or None), drawn from only while training, and the
    swap's `implementation` and `chunk_size`."""
    active = dropout is not None and dropout.rate > 0
    active = active and training is not None and training is not False
    implementation, chunk_size = layer._sdpa_core_options
    return {
        "dropout_rate": dropout.rate if active else 0.0,
        "training": training if active else False,
        "seed": dropout.seed_generator.next() if active else None,
        "implementation": implementation,
        "chunk_size": chunk_size,
    }


def _call_training(layer):
    """The `training` of the call in progress (Keras's call context, read without making
    one): these classes' `call` takes none, and their dropout layers read it from there."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.training


def _bloom_alibi(layer, extra, key_length):
    """Bloom's own ALiBi (`AlibiBias`), `(1, N, 1, S)`, added to the scaled logits."""
    return layer._alibi_layer._get_alibi_bias(layer.num_heads, key_length)


def _falcon_alibi(layer, extra, key_length):
    """Falcon's `alibi` argument, `(B, N, 1, S)`: it scales the sum of logits and ALiBi."""
    return extra["alibi"] * ops.cast(layer.inv_norm_factor, extra["alibi"].dtype)


def _t5_call(
    self,
    hidden_states,
    mask=None,
    key_value_states=None,
    position_bias=None,
    cache=None,
    cache_update_index=None,
    training=False,
):
    """T5's `call`, its kernel on the core: `softmax(Q K^T + position_bias) V`, unscaled, where
    the first layer's relative-position bias (with `-1e9` where the mask is False, as T5 adds
    it) is made here and handed on, as T5 hands it, to the layers after it."""
    batch = ops.shape(hidden_states)[0]

    def heads(states):  # (B, L, N * H) -> (B, L, N, H)
        return ops.reshape(states, (batch, -1, self.num_heads, self.key_value_dim))

    query = heads(self.query_projector(hidden_states))
    source = hidden_states if key_value_states is None else key_value_states
    key, value, cache = with_cache(
        cache,
        cache_update_index,
        lambda: (heads(self.key_projector(source)), heads(self.value_projector(source))),
    )
    if position_bias is None:
        position_bias = _t5_position_bias(self, query, key, mask, cache_update_index)
    out = core.scaled_dot_product_attention(
        query,
        key,
        value,
        bias=position_bias,
        scale=1.0,
        **core_options(self, self.dropout_layer, training),
    )  # (B, T, N, H)
    out = self.output_projector(ops.reshape(out, (batch, -1, self.inner_dim)))
    return out, position_bias, cache


def _t5_position_bias(layer, query, key, mask, cache_update_index):
    """T5's own relative-position bias (`compute_bias`; zeros in the layers without one),
    `(1, N, T, S)`, plus `-1e9` where `mask` (`(B, T, S)`) is False."""
    length, key_length = ops.shape(query)[1], ops.shape(key)[1]
    if layer.use_relative_attention_bias:
        start = 0 if cache_update_index is None else cache_update_index
        bias = layer.compute_bias(length, key_length, query_start_index=start)
    else:
        bias = ops.zeros((1, layer.num_heads, length, key_length), layer.compute_dtype)
    if mask is not None:
        bias = bias + (1.0 - ops.cast(mask[:, None], bias.dtype)) * -1e9
    return bias


CALL_FAMILIES = types.MappingProxyType(
    {
        f"{_MODELS}.bloom.bloom_attention.BloomAttention": CallFamily(
            call=_bloom_call,
            projections=("_query_dense", "_key_dense", "_value_dense", "_output_dense"),
            bias=_bloom_alibi,
            dropout=lambda layer: layer._dropout_layer,
            output_dropout=True,
        ),
        f"{_MODELS}.falcon.falcon_attention.FalconAttention": CallFamily(
            call=_falcon_call,
            projections=("query_dense", "key_dense", "value_dense", "output_dense"),
            bias=_falcon_alibi,
            dropout=lambda layer: layer.attention_dropout,
        ),
        f"{_MODELS}.t5.t5_multi_head_attention.T5MultiHeadAttention": CallFamily(
            call=_t5_call,
            projections=("query_projector", "key_projector", "value_projector", "output_projector"),
            bias=None,  # made by `_t5_call`, and handed to the next layer
            dropout=lambda layer: layer.dropout_layer,
        ),
    }
)
