"""The layer's `attention_bias`: broadcast by NumPy's rules, added in float32 under mixed precision.

Against a NumPy float64 reference of the whole layer (projections, heads, output projection)
with the layer's own weights. Sizes are pairwise distinct but for `B == N` in one case: a
`(N, T, S)` bias read as `(B, T, S)` must not pass by the two sizes being equal.
"""

import keras
import numpy as np
import pytest
from on_backend import gradient_to_variable, numpy, spy_on_paths, tensor

from keras_sdpa import ScaledDotProductAttention

B, T, S, E, N, H = 3, 4, 5, 8, 2, 4


def random(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype("float32")


def layer_numpy(layer, query, value, bias):
    """The layer's output in float64: `softmax(Q K^T / sqrt(H) + bias) V W_O`, per head."""
    wq, bq, wk, bk, wv, bv, wo, bo = (w.astype("float64") for w in layer.get_weights())
    q = np.einsum("bte,enh->bnth", query, wq) + bq[None, :, None]  # (B, N, T, H)
    k = np.einsum("bse,enh->bnsh", value, wk) + bk[None, :, None]  # (B, N, S, H)
    v = np.einsum("bse,enh->bnsh", value, wv) + bv[None, :, None]  # (B, N, S, H)
    logits = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(q.shape[-1])  # (B, N, T, S)
    logits = logits + np.broadcast_to(np.asarray(bias, "float64"), logits.shape)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bnts,bnsh->bnth", weights, v)  # (B, N, T, H)
    return np.einsum("bnth,nhe->bte", out, wo) + bo  # (B, T, E)


def built_layer(batch=B, **kwargs):
    layer = ScaledDotProductAttention(num_heads=N, key_dim=H, **kwargs)
    layer(np.zeros((batch, T, E), "float32"), np.zeros((batch, S, E), "float32"))
    rng = np.random.default_rng(0)
    layer.set_weights(
        [w + 0.3 * rng.normal(size=w.shape).astype(w.dtype) for w in layer.get_weights()]
    )
    return layer


BIAS_SHAPES = {
    "N_T_S_with_B_equal_N": (N, N, T, S),  # (batch, bias shape...): B == N
    "N_T_S": (B, N, T, S),
    "N_1_S": (B, N, 1, S),
    "T_S": (B, T, S),
    "S": (B, S),
    "B_1_T_S": (B, B, 1, T, S),
}


@pytest.mark.parametrize("case", list(BIAS_SHAPES), ids=list(BIAS_SHAPES))
def test_a_bias_broadcasts_as_numpy_broadcasts_it(case):
    batch, *shape = BIAS_SHAPES[case]
    layer = built_layer(batch)
    query, value = random((batch, T, E), 1), random((batch, S, E), 2)
    bias = random(shape, 3, scale=2.0)
    got = layer(query, value, attention_bias=tensor(bias))
    np.testing.assert_allclose(numpy(got), layer_numpy(layer, query, value, bias), atol=1e-5)


def test_a_bias_that_does_not_broadcast_is_refused_with_its_shape():
    layer = built_layer()
    with pytest.raises(ValueError, match=r"attention_bias.*\(2, 7, 5\)|bias.*\(1, 2, 7, 5\)"):
        layer(random((B, T, E), 1), random((B, S, E), 2), attention_bias=random((N, 7, S), 3))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_bias_is_added_in_float32_under_mixed_precision(policy):
    """A large bias keeps its float32 value: rounded to half precision first, a bias near 200
    moved the outputs by 0.39 (of 1.35), and a -1e9 mask under float16 became -inf: NaN."""
    layer = built_layer(dtype=policy)
    query, value = random((B, T, E), 1, 0.1), random((B, S, E), 2, 0.1)
    bias = 200.0 + random((N, T, S), 3, scale=1.0)  # half precision: steps of 0.125 or 1
    bias[:, 0] = -1e9  # the first query row of every head fully masked by the bias
    got = numpy(layer(query, value, attention_bias=tensor(bias)), "float32")
    want = layer_numpy(layer, query, value, bias)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_a_cached_call_adds_its_bias_in_float32():
    """The cached path (one new row a call) takes the same bias in float32: under
    `mixed_bfloat16`, a bias near 200 gives what the float64 reference gives."""
    layer = built_layer(dtype="mixed_bfloat16")
    x = random((B, S, E), 4, 0.1)
    bias = 200.0 + random((B, N, S, S), 5)
    cache = keras.ops.zeros((B, 2, S, N, H), "bfloat16")
    for position in range(S):
        row = x[:, position : position + 1]
        out, cache = layer(
            row,
            row,
            attention_bias=tensor(bias[:, :, position : position + 1]),
            cache=cache,
            cache_update_index=position,
            use_causal_mask=True,
        )
    # The last row attends to every key: the uncached reference over the whole sequence.
    want = layer_numpy(layer, x, x, bias)[:, -1]
    np.testing.assert_allclose(numpy(out, "float32")[:, 0], want, atol=2e-2 * np.abs(want).max())


def test_a_functional_model_with_a_constant_bias_runs_and_has_a_config():
    """A bias given as an array in a functional model stays an argument of the node: the model
    runs (in float32 under mixed precision) and its config serializes."""
    layer = built_layer(dtype="mixed_float16")
    bias = 200.0 + random((N, T, S), 3)
    query, value = keras.Input((T, E)), keras.Input((S, E))
    model = keras.Model([query, value], layer(query, value, attention_bias=bias))
    x, v = random((B, T, E), 1, 0.1), random((B, S, E), 2, 0.1)
    got = numpy(model([x, v]), "float32")
    want = layer_numpy(layer, x, v, bias)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
    assert keras.saving.serialize_keras_object(model)


class ScaledBias(ScaledDotProductAttention):
    """A subclass whose own `call` does arithmetic on the bias before the layer's."""

    def call(self, query, value, key=None, attention_bias=None, **kwargs):
        return super().call(query, value, key, attention_bias=attention_bias * 2.0, **kwargs)


def test_a_subclass_call_receives_the_bias_as_a_tensor():
    layer = ScaledBias(num_heads=N, key_dim=H)
    query, value = random((B, T, E), 1), random((B, S, E), 2)
    bias = random((N, T, S), 3)
    got = layer(query, value, attention_bias=tensor(bias))
    np.testing.assert_allclose(numpy(got), layer_numpy(layer, query, value, 2 * bias), atol=1e-5)


# A learned bias (ALiBi-like: a slope per head times the key position, on a large offset)
# that rounding to half precision destroys: bfloat16 steps by 16 near 3,000, float16 by 2.
def slope_bias(offset=3000.0):
    slopes = np.array([0.25, 0.5], "float32")[:N, None, None]  # (N, 1, 1)
    return (offset + slopes * np.arange(S, dtype="float32")).astype("float32")  # (N, 1, S)


def weights_numpy(layer, query, value, bias):
    """The float64 reference's attention weights `(B, N, T, S)` with `bias` added."""
    wq, bq, wk, bk = (w.astype("float64") for w in layer.get_weights()[:4])
    q = np.einsum("bte,enh->bnth", query, wq) + bq[None, :, None]  # (B, N, T, H)
    k = np.einsum("bse,enh->bnsh", value, wk) + bk[None, :, None]  # (B, N, S, H)
    logits = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(H)  # (B, N, T, S)
    logits = logits + np.asarray(bias, "float64")
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


def bias_gradient_numpy(weights, upstream):
    """d sum(weights * upstream) / d bias for a `(N, 1, S)` bias, from the softmax's
    derivative in float64: `P (R - sum(P R))`, summed over the axes the bias broadcasts."""
    weights, upstream = weights.astype("float64"), upstream.astype("float64")
    dlogits = weights * (upstream - (weights * upstream).sum(-1, keepdims=True))  # (B, N, T, S)
    return dlogits.sum(axis=(0, 2))[:, None, :]  # (N, 1, S)


def output_bias_gradient_numpy(layer, query, value, bias, upstream):
    """d sum(out * upstream) / d bias for a `(N, 1, S)` bias, in float64: the output's
    gradient back through `W_O` and `V` to the weights, then the softmax's."""
    wv, bv, wo = (w.astype("float64") for w in layer.get_weights()[4:7])
    v = np.einsum("bse,enh->bnsh", value, wv) + bv[None, :, None]  # (B, N, S, H)
    d_context = np.einsum("bte,nhe->bnth", upstream.astype("float64"), wo)  # (B, N, T, H)
    d_weights = np.einsum("bnth,bnsh->bnts", d_context, v)  # (B, N, T, S)
    return bias_gradient_numpy(weights_numpy(layer, query, value, bias), d_weights)


@pytest.fixture
def paths(monkeypatch):
    """The path of every call of the core (`Plan.path`), as it runs."""
    return spy_on_paths(monkeypatch)


class RelativeBias(keras.layers.Layer):
    """A wrapping layer that passes its own float32 weight as the attention bias (a learned
    position table, T5-style); `autocast=True` is the default of `add_weight`."""

    def __init__(self, implementation="auto", **kwargs):
        super().__init__(**kwargs)
        self.attention = ScaledDotProductAttention(
            num_heads=N, key_dim=H, implementation=implementation, dtype=self.dtype_policy
        )

    def build(self, query_shape, value_shape):
        self.attention.build(query_shape, value_shape)
        self.table = self.add_weight(shape=(N, 1, S), initializer="zeros", name="table")

    def call(self, query, value, weights=True):
        """The attention weights (the dense path's), or with `weights=False` the output."""
        if not weights:
            return self.attention(query, value, attention_bias=self.table)
        return self.attention(
            query, value, attention_bias=self.table, return_attention_scores=True
        )[1]


def carrier_inputs():
    return random((B, T, E), 1, 0.5), random((B, S, E), 2, 0.5)


def wrapped(policy, implementation="auto"):
    """A `RelativeBias` under `policy` with the slope bias in its table, and the layer's
    weights perturbed as `built_layer` does."""
    model = RelativeBias(implementation, dtype=policy)
    query, value = carrier_inputs()
    model(query, value)
    rng = np.random.default_rng(0)
    model.attention.set_weights(
        [w + 0.3 * rng.normal(size=w.shape).astype(w.dtype) for w in model.attention.get_weights()]
    )
    model.table.assign(slope_bias())
    return model


POLICIES = ["mixed_bfloat16", "mixed_float16"]


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_float32_variable_as_the_bias_is_not_rounded(policy, implementation, paths):
    """A `keras.Variable` at the top level: Keras reads a float variable in the compute dtype
    inside a layer's call (its autocast scope); rounded, this bias missed the float32 weights
    by 0.95. The output on the path asked for, and the weights (which the dense path gives)."""
    layer = built_layer(dtype=policy, implementation=implementation)
    variable = keras.Variable(slope_bias(), dtype="float32")
    query, value = carrier_inputs()
    del paths[:]
    got = layer(query, value, attention_bias=variable)
    assert set(paths) == {implementation}
    want = layer_numpy(layer, query, value, slope_bias())
    np.testing.assert_allclose(numpy(got, "float32"), want, atol=2e-2 * np.abs(want).max())
    _, got = layer(query, value, attention_bias=variable, return_attention_scores=True)
    want = weights_numpy(layer, query, value, slope_bias())
    np.testing.assert_allclose(numpy(got, "float32"), want, atol=1e-2)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_wrapping_layers_float32_weight_is_not_rounded_eager_or_in_predict(policy):
    """The table a wrapping layer owns, passed as it is: eager, and in a compiled model's
    `predict` (traced: `tf.function`, `jax.jit`)."""
    model = wrapped(policy)
    query, value = carrier_inputs()
    want = weights_numpy(model.attention, query, value, slope_bias())
    np.testing.assert_allclose(numpy(model(query, value), "float32"), want, atol=1e-2)
    q, v = keras.Input((T, E)), keras.Input((S, E))
    functional = keras.Model([q, v], model(q, v))
    functional.compile(jit_compile=True)
    got = functional.predict([query, value], verbose=0)
    np.testing.assert_allclose(np.asarray(got, "float32"), want, atol=1e-2)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_bias_variables_gradient_is_the_float32_biases(policy, implementation, paths):
    """The gradient of the output reaches the variable from the float32 bias, on the path
    asked for: rounded, it was 44-100% off."""
    model = wrapped(policy, implementation)
    query, value = carrier_inputs()
    upstream = random((B, T, E), 4)

    def loss():
        out = keras.ops.cast(model(query, value, weights=False), "float32")
        return keras.ops.sum(out * upstream)

    del paths[:]
    got = gradient_to_variable(loss, model.table)
    assert set(paths) == {implementation}
    want = output_bias_gradient_numpy(model.attention, query, value, slope_bias(), upstream)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_fit_updates_the_bias_from_its_float32_gradient():
    """One step of `fit` (plain SGD, rate 1) moves the table by the float32 bias's gradient."""
    model = wrapped("mixed_bfloat16")
    query, value = carrier_inputs()
    upstream = random((B, N, T, S), 4)
    weights = weights_numpy(model.attention, query, value, slope_bias())
    want = slope_bias() - bias_gradient_numpy(weights, upstream)
    model.attention.trainable = False  # the table alone learns
    q, v = keras.Input((T, E)), keras.Input((S, E))
    functional = keras.Model([q, v], model(q, v))
    functional.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=lambda target, weights: keras.ops.sum(keras.ops.cast(weights, "float32") * target),
        jit_compile=True,
    )
    functional.fit([query, value], upstream, batch_size=B, verbose=0)
    np.testing.assert_allclose(numpy(model.table), want, atol=2e-2)


def test_a_cached_call_takes_a_variable_bias_in_float32():
    """The cached path (one new row a call) reads a variable bias in float32 too."""
    layer = built_layer(dtype="mixed_bfloat16")
    x = random((B, S, E), 4, 0.5)
    bias = np.broadcast_to(slope_bias(), (N, S, S))  # the same slope bias for every row
    cache = keras.ops.zeros((B, 2, S, N, H), "bfloat16")
    variable = keras.Variable(bias[:, -1:], dtype="float32")  # (N, 1, S)
    for position in range(S):
        row = x[:, position : position + 1]
        _, weights, cache = layer(
            row,
            row,
            attention_bias=variable,
            cache=cache,
            cache_update_index=position,
            use_causal_mask=True,
            return_attention_scores=True,
        )
    want = weights_numpy(layer, x, x, bias)[:, :, -1:]  # the last row attends to every key
    np.testing.assert_allclose(numpy(weights, "float32"), want, atol=1e-2)


@pytest.mark.tensorflow_only("a TensorFlow variable, and TensorFlow's SavedModel")
def test_a_tf_variable_and_a_saved_model_keep_the_bias_in_float32(tmp_path):
    """A `tf.Variable` as the bias, and the wrapping layer exported as a SavedModel and
    loaded back with plain TensorFlow."""
    import tensorflow as tf

    model = wrapped("mixed_bfloat16")
    query, value = carrier_inputs()
    want = weights_numpy(model.attention, query, value, slope_bias())
    _, got = model.attention(
        query, value, attention_bias=tf.Variable(slope_bias()), return_attention_scores=True
    )
    np.testing.assert_allclose(numpy(got, "float32"), want, atol=1e-2)
    export = keras.export.ExportArchive()
    export.track(model)
    export.add_endpoint(
        "weights",
        lambda q, v: model(q, v),
        input_signature=[tf.TensorSpec((B, T, E), "float32"), tf.TensorSpec((B, S, E), "float32")],
    )
    export.write_out(str(tmp_path / "bias"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "bias"))
    np.testing.assert_allclose(numpy(loaded.weights(query, value), "float32"), want, atol=1e-2)


class GatheredBias(keras.layers.Layer):
    """A T5-style table gathered inside this layer's own call: Keras has read the weight
    before the attention layer sees the gathered bias, so only the weight's own
    `autocast=False` keeps it in float32 (docs/layer.md's recipe)."""

    def __init__(self, autocast_table, **kwargs):
        super().__init__(**kwargs)
        self.autocast_table = autocast_table
        self.attention = ScaledDotProductAttention(num_heads=N, key_dim=H, dtype=self.dtype_policy)

    def build(self, query_shape, value_shape):
        self.attention.build(query_shape, value_shape)
        self.table = self.add_weight(
            shape=(S, N), initializer="zeros", autocast=self.autocast_table, name="table"
        )

    def call(self, query, value):
        bias = keras.ops.take(self.table, np.arange(S), axis=0)  # (S, N): one row per key
        bias = keras.ops.transpose(bias)[:, None, :]  # (N, 1, S)
        return self.attention(query, value, attention_bias=bias, return_attention_scores=True)[1]


@pytest.mark.parametrize("autocast_table", [False, True], ids=["recipe", "autocast"])
def test_a_table_gathered_in_another_layer_keeps_float32_only_by_the_recipe(autocast_table):
    layer = GatheredBias(autocast_table, dtype="mixed_bfloat16")
    query, value = carrier_inputs()
    layer(query, value)
    layer.table.assign(np.transpose(slope_bias()[:, 0]))  # (S, N)
    want = weights_numpy(layer.attention, query, value, slope_bias())
    error = np.abs(numpy(layer(query, value), "float32") - want).max()
    if autocast_table:  # rounded by Keras in this layer's call: the layer cannot know
        assert error > 0.1
    else:
        assert error < 1e-2
