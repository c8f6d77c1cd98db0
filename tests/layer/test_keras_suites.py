"""Keras's own MultiHeadAttention and GroupQueryAttention test suites, run on this layer.

"Drop-in" means what Keras's tests say it means. This file imports the suites that
ship with the installed Keras (`keras/src/layers/attention/*_test.py`), points their
`layers.MultiHeadAttention` and `layers.GroupedQueryAttention` at
`ScaledDotProductAttention`, and runs every test that exercises the layer's public
behaviour. The few that test Keras's private internals (or a limit of GroupQueryAttention
that this layer does not share) are listed in `EXCLUDED_MHA` and `EXCLUDED_GQA` with
the reason, and `tests/layer/test_layer.py` covers the behaviour they guard.
"""

import keras
from keras.src import layers as keras_layers
from keras.src.layers.attention import grouped_query_attention_test as gqa_suite
from keras.src.layers.attention import multi_head_attention_test as mha_suite

from keras_sdpa import ScaledDotProductAttention


class _Layers:
    """`keras.layers`, with the attention layers replaced by ours."""

    def __init__(self, **overrides):
        self._overrides = overrides

    def __getattr__(self, name):
        if name in self._overrides:
            return self._overrides[name]
        return getattr(keras_layers, name)


@keras.saving.register_keras_serializable(package="keras_sdpa_tests")
class _GroupedQueryAttention(ScaledDotProductAttention):
    """This layer under `GroupedQueryAttention`'s argument names.

    `head_dim` is `key_dim` and `num_query_heads` is `num_heads`; everything else,
    `num_key_value_heads` included, is already the same.
    """

    def __init__(self, head_dim=None, num_query_heads=None, **kwargs):
        if head_dim is not None:
            kwargs["key_dim"] = head_dim
        if num_query_heads is not None:
            kwargs["num_heads"] = num_query_heads
        super().__init__(**kwargs)


mha_suite.layers = _Layers(MultiHeadAttention=ScaledDotProductAttention)
gqa_suite.layers = _Layers(GroupedQueryAttention=_GroupedQueryAttention)


# Tests of Keras's private internals or of a limit this layer does not share, with why.
# What each guards is tested in tests/layer/test_layer.py through the public API.
# Runs on JAX only (skipped by Keras on TensorFlow): Keras's flash attention refuses dropout,
# and this layer's chunked path has it (test_layer_features.py's dropout tests); that it
# refuses `return_attention_scores` with `flash_attention=True` is test_layer.py's.
_FLASH_ERRORS = (
    "expects `flash_attention=True` with `dropout=0.1` to raise; this layer's O(T) path "
    "applies dropout"
)
EXCLUDED_MHA = {
    "test_sliding_window_serialization": (
        "reads MHA's private `_sliding_window`; the config round trip of `sliding_window` "
        "is test_layer.py::test_get_config_round_trip"
    ),
    "test_flash_attention_with_errors": _FLASH_ERRORS,
}
EXCLUDED_GQA = {
    "test_causal_only_skipped_for_subclass": (
        "GroupedQueryAttention's private `_compute_attention` signature (no "
        "`return_attention_scores`); this layer keeps MultiHeadAttention's override "
        "contract, which the MHA suite's test of the same name checks"
    ),
    "test_shape_mismatch_error_query_value_dim_mismatch": (
        "GroupedQueryAttention refuses query and value of different widths; this layer, "
        "like MultiHeadAttention, takes them (MHA suite: different_qv_last_dims)"
    ),
    "test_flash_attention_with_errors": _FLASH_ERRORS,
}


def _without(cls, excluded):
    for name in excluded:
        assert callable(getattr(cls, name)), f"{name} is not in the installed Keras suite"
        setattr(cls, name, None)  # a non-callable attribute is not collected
    return cls


class TestKerasMultiHeadAttentionSuite(mha_suite.MultiHeadAttentionTest):
    pass


class TestKerasGroupedQueryAttentionSuite(gqa_suite.GroupedQueryAttentionTest):
    pass


_without(TestKerasMultiHeadAttentionSuite, EXCLUDED_MHA)
_without(TestKerasGroupedQueryAttentionSuite, EXCLUDED_GQA)


def test_the_suites_ran_on_this_layer():
    """The substitution took: the suites' `layers` build this package's layer."""
    assert mha_suite.layers.MultiHeadAttention is ScaledDotProductAttention
    layer = gqa_suite.layers.GroupedQueryAttention(
        head_dim=2, num_query_heads=4, num_key_value_heads=2
    )
    assert isinstance(layer, ScaledDotProductAttention)
    assert (layer.num_heads, layer.key_dim, layer.num_key_value_heads) == (4, 2, 2)
