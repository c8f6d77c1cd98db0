"""The decode path: a few query rows against the keys in their `(B, S, K, H)` layout.

The layer takes it (`implementation="decode"`) for a cached call with one new token, a
generating decoder's step; "auto" never does, since its autodiff gradient is slower than the
dense path's in training. It is checked against the float64 NumPy reference of
`test_core_features.py`, against the backend's autodiff of the formula for the gradients, and
against the dense path for the mods. Written on `keras.ops` and NumPy: it runs on TensorFlow
and JAX.
"""

import keras
import numpy as np
import pytest
from keras import ops
from on_backend import BACKEND, gradients, jit, numpy, tensor
from test_core_features import HV, B, K, N, S, autodiff_reference, inputs, reference

from keras_sdpa import ScaledDotProductAttention, mods
from keras_sdpa._core import decode as _decode
from keras_sdpa._core import program
from keras_sdpa.ops import scaled_dot_product_attention


def mask_with_an_empty_row(seed=1):
    """`(B, 1, 1, S)`: random holes, and example 0 sees no key at all."""
    mask = np.random.default_rng(seed).random((B, 1, 1, S)) > 0.3
    mask[0] = False
    return mask


def bias(shape, seed=3):
    return tensor(np.random.default_rng(seed).normal(size=shape) * 2.0)


FEATURES = {
    "plain": {},
    "mask": dict(mask=mask_with_an_empty_row()),
    "bias_per_head": dict(bias=bias((1, N, 1, S))),
    "bias_per_key": dict(bias=bias((B, 1, 1, S))),
    "window": dict(window=3),
    "causal": dict(is_causal=True),
    "cap": dict(cap=1.5),
    "everything": dict(mask=mask_with_an_empty_row(), bias=bias((1, N, 1, S)), window=4, cap=2.0),
}


def rows(spec):
    """One query row; for the causal mask, as many rows as keys (its top-left alignment
    reads key 0 alone for a single row, which the core refuses on this path)."""
    return S if spec.get("is_causal") else 1


def decode_call(q, k, v, spec):
    return scaled_dot_product_attention(
        q,
        k,
        v,
        spec.get("mask"),
        bias=spec.get("bias"),
        is_causal=spec.get("is_causal", False),
        sliding_window=spec.get("window"),
        attn_logits_soft_cap=spec.get("cap"),
        implementation="decode",
    )


@pytest.fixture
def decode_spy(monkeypatch):
    """Counts the decode path's traces (a new shape each test, so each traces anew)."""
    calls = []
    attend = _decode.attend

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return attend(*args, **kwargs)

    monkeypatch.setattr(_decode, "attend", spy)
    return calls


def test_the_layer_decodes_one_cached_token_and_nothing_else(decode_spy):
    """A cached call with one new token takes the decode path; "auto" elsewhere, a cached call
    of several tokens, and a layer asked for "dense" do not."""
    x = tensor(np.random.default_rng(0).normal(size=(2, 5, 16)), "float32")
    layer = ScaledDotProductAttention(num_heads=4, key_dim=4, num_key_value_heads=2)
    dense = ScaledDotProductAttention(num_heads=4, key_dim=4, implementation="dense")
    for each in (layer, dense):
        each(x, x)
    cache = ops.zeros((2, 2, 13, 2, 4))
    _, cache = layer(x, x, use_causal_mask=True, cache=cache, cache_update_index=0)
    layer(x[:, :1], x[:, :1], cache=cache, cache_update_index=5)
    assert len(decode_spy) == 1
    layer(x[:, :1], x)  # one query row, no cache
    q, k, v = inputs(t=1, s=S + 4, k=K, dtype="float32")
    scaled_dot_product_attention(q, k, v)  # "auto"
    dense(x[:, :1], x[:, :1], cache=ops.zeros((2, 2, 13, 4, 4)), cache_update_index=5)
    assert len(decode_spy) == 1


def test_a_cached_token_takes_the_path_flash_attention_names(monkeypatch, decode_spy):
    """`flash_attention` chooses for a cached call too: False runs dense and True chunked,
    never decode, all to the same numbers; with True the scores a cached call returns come
    from the dense path (an uncached call refuses them)."""

    paths, compiled = [], program.compiled

    def spy(*args, **kwargs):
        paths.append(kwargs["plan"].path)
        return compiled(*args, **kwargs)

    monkeypatch.setattr(program, "compiled", spy)
    x = tensor(np.random.default_rng(1).normal(size=(2, 5, 16)), "float32")
    cache = ops.zeros((2, 2, 13, 4, 4))
    weights, outputs = None, {}
    for flash in (None, False, True):
        layer = ScaledDotProductAttention(num_heads=4, key_dim=4, flash_attention=flash)
        layer(x, x)
        weights = weights or layer.get_weights()
        layer.set_weights(weights)
        paths.clear()
        out, _ = layer(x[:, :1], x[:, :1], cache=cache, cache_update_index=5)
        outputs[flash] = numpy(out)
        assert paths == [{None: "decode", False: "dense", True: "chunked"}[flash]], flash
        np.testing.assert_allclose(outputs[flash], outputs[None], atol=1e-6)
    paths.clear()
    _, scores, _ = layer(
        x[:, :1], x[:, :1], cache=cache, cache_update_index=5, return_attention_scores=True
    )
    assert paths == ["dense"] and tuple(scores.shape) == (2, 4, 1, 13)
    assert len(decode_spy) == 1
    with pytest.raises(ValueError, match="`flash_attention=True` never forms"):
        layer(x, x, return_attention_scores=True)


def test_dropout_runs_dense_with_the_same_keep_mask(decode_spy):
    q, k, v = inputs(t=1, s=S + 5, k=K, dtype="float32")
    args = dict(dropout_rate=0.5, training=True, seed=7)
    auto = scaled_dot_product_attention(q, k, v, implementation="decode", **args)
    dense = scaled_dot_product_attention(q, k, v, implementation="dense", **args)
    np.testing.assert_array_equal(numpy(auto), numpy(dense))
    assert not decode_spy


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("kv_heads", [N, K, 1], ids=["mha", "gqa", "mqa"])
def test_forward_matches_numpy_reference(feature, kv_heads):
    spec = FEATURES[feature]
    q, k, v = inputs(t=rows(spec), k=kv_heads)
    want, _ = reference(q, k, v, **spec)
    np.testing.assert_allclose(numpy(decode_call(q, k, v, spec)), want, atol=1e-10)


@pytest.mark.default_cases("everything", "mask")
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gradients_match_autodiff_of_the_formula(feature):
    spec = FEATURES[feature]
    q, k, v = inputs(t=rows(spec), k=K)
    c = tensor(np.random.default_rng(9).normal(size=(B, rows(spec), N, HV)))
    watched = [q, k, v] + ([spec["bias"]] if "bias" in spec else [])
    grads = []
    for attention in (decode_call, lambda q, k, v, spec: autodiff_reference(q, k, v, **spec)):

        def loss(q, k, v, *bias, attention=attention):  # the bias, if any, differentiated
            return ops.sum(attention(q, k, v, {**spec, **dict(zip(["bias"], bias))}) * c)

        grads.append(gradients(loss, *watched))
    for name, a, b in zip(["d_query", "d_key", "d_value", "d_bias"], *grads):
        np.testing.assert_allclose(a, b, atol=1e-10, err_msg=name)


def skip_every_third_key(b, h, q_idx, kv_idx):
    return kv_idx % 3 != 0


@pytest.mark.default_cases("both", "alibi")
@pytest.mark.parametrize(
    "mod",
    [
        dict(score_mod=mods.alibi(N)),
        dict(score_mod=mods.soft_cap(1.0)),
        dict(mask_mod=skip_every_third_key),
        dict(mask_mod=mods.document(tensor([[0] * 4 + [1] * (S - 4)] * B, "int32"))),
        dict(score_mod=mods.alibi(N), mask_mod=skip_every_third_key),
    ],
    ids=["alibi", "soft_cap", "mask_fn", "document", "both"],
)
def test_mods_match_the_dense_path_forward_and_gradient(mod):
    q, k, v = inputs(t=1, k=K)
    results = []
    for implementation in ("decode", "dense"):

        def attention(q, k, v, implementation=implementation):
            return scaled_dot_product_attention(q, k, v, implementation=implementation, **mod)

        def loss(q, k, v, attention=attention):
            out = attention(q, k, v)
            return ops.sum(out * ops.arange(HV, dtype=out.dtype))

        results.append([numpy(attention(q, k, v)), *gradients(loss, q, k, v)])
    for name, a, b in zip(["out", "d_query", "d_key", "d_value"], *results):
        np.testing.assert_allclose(a, b, atol=1e-10, err_msg=name)


def test_a_causal_decode_row_is_refused_not_aligned_to_key_0():
    """`is_causal` is top-left aligned, as Keras's: on the decode path a single new row would
    read key 0 alone, silently. It is refused, naming the cache's own positions instead."""
    q, k, v = inputs(t=1, k=K)
    with pytest.raises(ValueError, match=r"is_causal=True, implementation='decode', T=1, S=9"):
        scaled_dot_product_attention(q, k, v, is_causal=True, implementation="decode")
    with pytest.raises(ValueError, match=r"mask_mod=Causal\(\), implementation='decode'"):
        scaled_dot_product_attention(q, k, v, mask_mod=mods.causal(), implementation="decode")


def test_a_bfloat16_cache_is_read_as_it_is_and_multiplied_in_float32():
    q, k, v = inputs(t=1, s=64, k=K)
    want, _ = reference(q, k, v)
    half = [ops.cast(x, "bfloat16") for x in (q, k, v)]
    out = scaled_dot_product_attention(*half, implementation="decode")
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    rounded, _ = reference(*[numpy(x, "float64") for x in half])  # the inputs' rounding
    np.testing.assert_allclose(numpy(out, "float64"), rounded, atol=1e-2)
    np.testing.assert_allclose(numpy(out, "float64"), want, atol=5e-2)


def test_inside_a_compiled_step_with_an_unknown_batch(decode_spy):
    """The decode path compiles inside a caller's XLA program with the batch unknown (on
    TensorFlow; JAX traces every shape known, so there it compiles inside `jax.jit`)."""
    q, k, v = inputs(t=1, k=K, dtype="float32")

    def attention(q, k, v):
        return scaled_dot_product_attention(q, k, v, implementation="decode")

    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(
            attention,
            jit_compile=True,
            input_signature=[
                tf.TensorSpec((None,) + tuple(x.shape[1:]), x.dtype) for x in (q, k, v)
            ],
        )
    else:  # a batch unknown while tracing does not exist on JAX
        step = jit(attention)
    want, _ = reference(q, k, v)
    np.testing.assert_allclose(numpy(step(q, k, v)), want, atol=1e-5)
    assert len(decode_spy) == 1
