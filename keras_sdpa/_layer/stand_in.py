"""What the layer keeps of the class it stands in for (`replaces=`), so that a swap never
changes an answer: that class's call arguments, and its rule for a query row whose keys are
all masked.

`replace_attention` and `sdpa_scope` set `replaces` to the name of the class they replace;
`get_config` records it, so a `.keras` file loads back with the same behaviour.
"""

import inspect
import types

import keras
from keras.src import backend as keras_backend  # the mask accessors have no public name

from keras_sdpa._layer import masks as _layer_masks

# The call arguments of each class this layer stands in for (Keras 3.15, keras-hub 0.32;
# `tests/swap/test_swap.py` compares them with the installed classes). Keras hands a layer the
# inputs' implicit masks only as the `*_mask` arguments its `call` names, so keras-hub's
# `CachedMultiHeadAttention`, which names none, never sees them.
_KERAS = (
    "query",
    "value",
    "key",
    "query_mask",
    "value_mask",
    "key_mask",
    "attention_mask",
    "return_attention_scores",
    "training",
    "use_causal_mask",
)
CALL_ARGUMENTS = types.MappingProxyType(
    {
        "MultiHeadAttention": _KERAS,
        "GroupedQueryAttention": _KERAS,
        "CachedMultiHeadAttention": (
            "query",
            "value",
            "key",
            "attention_mask",
            "cache",
            "cache_update_index",
            "return_attention_scores",
            "training",
        ),
    }
)


def check(replaces, use_gate, sliding_window):
    if replaces is not None and (not isinstance(replaces, str) or replaces not in CALL_ARGUMENTS):
        raise ValueError(
            f"`replaces` must be None or one of {sorted(CALL_ARGUMENTS)}. "
            f"Received: replaces={replaces!r}"
        )
    if replaces == "CachedMultiHeadAttention" and (use_gate or sliding_window is not None):
        raise ValueError(
            "keras-hub's CachedMultiHeadAttention ignores `use_gate` and `sliding_window` in "
            "its call, so a layer that stands in for it cannot apply them. Received: "
            f"replaces={replaces!r}, use_gate={use_gate!r}, sliding_window={sliding_window!r}"
        )


def call_signature(call, replaces):
    """`call`'s signature cut to the arguments of the class `replaces` names: Keras binds
    each call to it, so an argument that class does not take is refused as it would refuse
    it, and no mask it never names is filled in."""
    signature = inspect.signature(call)
    kept = [signature.parameters[name] for name in CALL_ARGUMENTS[replaces]]  # in its order
    return signature.replace(parameters=kept)


def by_name(signature, args, kwargs):
    """`(args, kwargs)` of a call bound by the replaced class's `signature`: every argument
    but the first by its name, so that a positional one reaches the parameter that class
    gives it (its fourth is `attention_mask` where this layer's is `query_mask`)."""
    bound = signature.bind(*args, **kwargs).arguments  # TypeError as that class raises it
    if not args:
        return (), bound
    first = next(iter(bound))
    return (bound.pop(first),), bound


def query_mask(replaces, query, given):
    """The query's padding mask: MultiHeadAttention reads it from the query's Keras mask
    alone (its `query_mask` argument is not read); this layer otherwise takes the argument."""
    if replaces == "MultiHeadAttention":
        return keras_backend.get_keras_mask(query)
    return given


def gives_uniform_rows(replaces, dropout, return_attention_scores, rank):
    """Whether a query row whose keys are all masked gets uniform weights, the mean of the
    values, as the replaced class computes it.

    Keras's attention layers (and keras-hub's cached one, which inherits their attention)
    run `keras.ops.dot_product_attention` when they have no dropout, return no scores and
    take rank-3 inputs: it masks with a large negative logit, so such a row's softmax is
    uniform. Otherwise they run their own masked softmax, which zeroes the row, as this
    layer always does on its own (`replaces=None`).
    """
    return replaces is not None and dropout == 0 and not return_attention_scores and rank == 3


def rows(layer, out, value, mean_values, mask, query_mask, return_scores, causal):
    """The attention output `out` `(B, T, N, Hv)` of an uncached call, with the rows whose
    keys are all masked given what the class `layer` replaces gives them: `mean_values()`
    `(B, 1, K, Hv)`, the mean of the projected values, where that is uniform weights. `mask`
    is the keys' side, `query_mask` `(B, T)` the rows left out."""
    rank = len(value.shape)
    if not gives_uniform_rows(layer.replaces, layer.dropout, return_scores, rank):
        return out
    t, s = keras.ops.shape(out)[1], keras.ops.shape(value)[1]
    empty = _layer_masks.empty_rows(mask, query_mask, t, s, causal, layer.sliding_window)
    if empty is None:
        return out
    return _layer_masks.uniform_rows(out, empty, mean_values())  # (B, T, N, Hv)


def cached_rows(layer, out, values, mask, return_scores):
    """The same for a cached call, against the cached `values` `(B, S, K, H)` (keras-hub's
    cached attention takes no causal flag, window or padding mask: `mask` says it all)."""
    if mask is None or not gives_uniform_rows(layer.replaces, layer.dropout, return_scores, 3):
        return out
    empty = _layer_masks.empty_rows(mask, None, None, None)  # (B|1, N|1, T)
    return _layer_masks.uniform_rows(out, empty, keras.ops.mean(values, axis=1, keepdims=True))
