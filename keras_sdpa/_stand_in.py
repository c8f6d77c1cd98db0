"""What the layer keeps of the class it stands in for (`replaces=`), so that a swap never
changes an answer: that class's call arguments, and its rule for a query row whose keys are
all masked.

`replace_attention` and `sdpa_scope` set `replaces` to the name of the class they replace;
`get_config` records it, so a `.keras` file loads back with the same behaviour.
"""

import inspect

# The call arguments of each class this layer stands in for (Keras 3.15, keras-hub 0.32;
# `tests/test_swap.py` compares them with the installed classes). Keras hands a layer the
# inputs' implicit masks only as the `*_mask` arguments its `call` names, so keras-hub's
# `CachedMultiHeadAttention`, which names none, never sees them.
_KERAS = (
    "query", "value", "key", "query_mask", "value_mask", "key_mask", "attention_mask",
    "return_attention_scores", "training", "use_causal_mask",
)  # fmt: skip
CALL_ARGUMENTS = {
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
    ),  # fmt: skip
}


def check(replaces):
    if replaces is not None and replaces not in CALL_ARGUMENTS:
        raise ValueError(
            f"`replaces` must be None or one of {sorted(CALL_ARGUMENTS)}. "
            f"Received: replaces={replaces!r}"
        )


def call_signature(call, replaces):
    """`call`'s signature cut to the arguments of the class `replaces` names: Keras binds
    each call to it, so an argument that class does not take is refused as it would refuse
    it, and no mask it never names is filled in."""
    signature = inspect.signature(call)
    kept = [p for name, p in signature.parameters.items() if name in CALL_ARGUMENTS[replaces]]
    return signature.replace(parameters=kept)


def uniform_rows(replaces, dropout, return_attention_scores, rank):
    """Whether a query row whose keys are all masked gets uniform weights, the mean of the
    values, as the replaced class computes it.

    Keras's attention layers (and keras-hub's cached one, which inherits their attention)
    run `keras.ops.dot_product_attention` when they have no dropout, return no scores and
    take rank-3 inputs: it masks with a large negative logit, so such a row's softmax is
    uniform. Otherwise they run their own masked softmax, which zeroes the row, as this
    layer always does on its own (`replaces=None`).
    """
    return replaces is not None and dropout == 0 and not return_attention_scores and rank == 3
