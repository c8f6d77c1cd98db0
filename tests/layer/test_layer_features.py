"""The layer's drop-in arguments against Keras's layers with the same weights, and its own.

Parity: `keras.layers.MultiHeadAttention` for `attention_axes` (ranks 4 and 5, with
masks), `sliding_window`, `use_gate`, `flash_attention`, every mask shape and a tuple
`output_shape`; `keras.layers.GroupQueryAttention` for `num_key_value_heads`. Outputs
and scores agree to 1e-5. Then what Keras's layers do not have: `attention_bias`
(checked against NumPy, and trained), the soft cap, round trips with every argument
set, empty batches, and the run-time choice of path under unknown lengths.
"""

import keras
import numpy as np
import pytest
from keras import ops as kops
from on_backend import BACKEND, gradient_to_variables, gradients, jit, numpy, spy_on_paths, tensor
from reference import attention as reference

from keras_sdpa import ScaledDotProductAttention, ops
from keras_sdpa._core import plan

B, E = 2, 8


def random(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def twins(peer_cls, query, value, peer_kwargs, our_kwargs):
    """A Keras layer and ours with the same (perturbed, so biases count) weights."""
    peer = peer_cls(**peer_kwargs)
    ours = ScaledDotProductAttention(**our_kwargs)
    peer(query, value)
    ours(query, value)
    weights = peer.get_weights()
    assert [w.shape for w in weights] == [w.shape for w in ours.get_weights()]
    rng = np.random.default_rng(0)
    weights = [w + rng.normal(size=w.shape).astype(w.dtype) * 0.1 for w in weights]
    peer.set_weights(weights)
    ours.set_weights(weights)
    return peer, ours


def assert_same(peer, ours, query, value, **call):
    want, want_scores = peer(query, value, return_attention_scores=True, **call)
    got, scores = ours(query, value, return_attention_scores=True, **call)
    assert got.shape == want.shape and scores.shape == want_scores.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    # Without scores the layer may take another path: the same output still.
    np.testing.assert_allclose(ours(query, value, **call), want, atol=1e-5)


MHA_CASES = {
    # name: (query shape, value shape, layer kwargs, mask shape or None)
    "rank4_axis2": ((B, 3, 4, E), (B, 3, 5, E), dict(attention_axes=(2,)), (B, 3, 4, 5)),
    "rank4_axes12": ((B, 3, 4, E), (B, 2, 5, E), dict(attention_axes=(1, 2)), (B, 3, 4, 2, 5)),
    "rank4_negative": ((B, 3, 4, E), (B, 3, 5, E), dict(attention_axes=-2), None),
    "rank5_axes23": ((B, 3, 4, 6, E), (B, 3, 2, 5, E), dict(attention_axes=(2, 3)), None),
    "rank5_axes23_mask": (
        (B, 3, 4, 6, E),
        (B, 3, 2, 5, E),
        dict(attention_axes=(2, 3)),
        (B, 3, 4, 6, 2, 5),
    ),
    "output_shape_tuple": ((B, 5, E), (B, 6, E), dict(output_shape=(3, 2)), None),
    "gate": ((B, 5, E), (B, 6, E), dict(use_gate=True), (B, 5, 6)),
    "gate_rank4": ((B, 3, 4, E), (B, 3, 5, E), dict(use_gate=True, attention_axes=2), None),
}


@pytest.mark.parametrize("case", list(MHA_CASES), ids=list(MHA_CASES))
def test_matches_multi_head_attention(case):
    query_shape, value_shape, kwargs, mask_shape = MHA_CASES[case]
    query, value = random(query_shape, 1), random(value_shape, 2)
    kwargs = dict(num_heads=2, key_dim=4, **kwargs)
    peer, ours = twins(keras.layers.MultiHeadAttention, query, value, kwargs, kwargs)
    mask = None
    if mask_shape is not None:
        mask = np.random.default_rng(3).random(mask_shape) > 0.3
        mask[..., 0] = True  # no fully masked rows: there Keras spreads weight uniformly
    assert_same(peer, ours, query, value, attention_mask=mask)


@pytest.mark.parametrize("causal", [False, True], ids=["band", "causal_band"])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_matches_multi_head_attention(window, causal):
    x = random((B, 7, E), 4)
    kwargs = dict(num_heads=2, key_dim=4, sliding_window=window)
    peer, ours = twins(keras.layers.MultiHeadAttention, x, x, kwargs, kwargs)
    assert_same(peer, ours, x, x, use_causal_mask=causal)


@pytest.mark.parametrize(
    "mask_shape", [(7, 9), (B, 7, 9), (B, 1, 7, 9), (B, 2, 7, 9)], ids=lambda s: f"{len(s)}d"
)
def test_every_mask_shape_matches_multi_head_attention(mask_shape):
    query, value = random((B, 7, E), 5), random((B, 9, E), 6)
    kwargs = dict(num_heads=2, key_dim=4)
    peer, ours = twins(keras.layers.MultiHeadAttention, query, value, kwargs, kwargs)
    mask = np.random.default_rng(7).random(mask_shape) > 0.4
    mask[..., 0] = True
    assert_same(peer, ours, query, value, attention_mask=mask, use_causal_mask=False)


def test_flash_attention_runs_the_chunked_path_and_matches(monkeypatch):
    x = random((B, 7, E), 8)
    kwargs = dict(num_heads=2, key_dim=4)
    peer, ours = twins(
        keras.layers.MultiHeadAttention, x, x, kwargs, dict(kwargs, flash_attention=True)
    )
    paths = spy_on_paths(monkeypatch)
    got = ours(x, x, use_causal_mask=True)
    np.testing.assert_allclose(got, peer(x, x, use_causal_mask=True), atol=1e-5)
    assert paths == ["chunked"]
    ours.flash_attention = False
    ours(x, x)
    assert paths == ["chunked", "dense"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_matches_group_query_attention(kv_heads, causal, path):
    query, value = random((B, 7, E), 9), random((B, 9, E), 10)  # cross-attention, T != S
    peer_kwargs = dict(head_dim=3, num_query_heads=4, num_key_value_heads=kv_heads)
    our_kwargs = dict(num_heads=4, key_dim=3, num_key_value_heads=kv_heads)
    peer, ours = twins(keras.layers.GroupQueryAttention, query, value, peer_kwargs, our_kwargs)
    ours.implementation = path
    want = peer(query, value, use_causal_mask=causal)
    np.testing.assert_allclose(ours(query, value, use_causal_mask=causal), want, atol=1e-5)
    _, want_scores = peer(query, value, use_causal_mask=causal, return_attention_scores=True)
    _, scores = ours(query, value, use_causal_mask=causal, return_attention_scores=True)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def single_head_numpy(layer, query, value, bias=None, cap=None):
    """The layer's own weights, the formula in float64 NumPy (one head, no W_O)."""
    w_q, b_q, w_k, b_k, w_v, b_v = (numpy(w).astype(np.float64) for w in layer.weights)
    q = np.einsum("bte,enh->btnh", query, w_q) + b_q
    k = np.einsum("bse,enh->bsnh", value, w_k) + b_k
    v = np.einsum("bse,enh->bsnh", value, w_v) + b_v
    out, _ = reference(q, k, v, bias=bias, cap=cap)
    return out.reshape(out.shape[0], out.shape[1], -1)


def test_attention_bias_and_soft_cap_follow_the_formula():
    query, value = random((B, 5, E), 11), random((B, 6, E), 12)
    bias = random((1, 1, 5, 6), 13) * 3.0
    layer = ScaledDotProductAttention(key_dim=4, attn_logits_soft_cap=2.0, dtype="float64")
    got = layer(query, value, attention_bias=bias)
    np.testing.assert_allclose(got, single_head_numpy(layer, query, value, bias, 2.0), atol=1e-10)


@keras.saving.register_keras_serializable(package="keras_sdpa_tests")
class RelativePositionAttention(keras.layers.Layer):
    """A T5-style learned bias: one trainable scalar per head and relative distance."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.attention = ScaledDotProductAttention(num_heads=2, key_dim=4)

    def build(self, shape):
        self.table = self.add_weight(shape=(2, 2 * self.length - 1), initializer="zeros")
        self.attention.build(shape, shape)

    def call(self, x):
        offsets = np.arange(self.length)[None, :] - np.arange(self.length)[:, None]
        bias = kops.take(self.table, offsets + self.length - 1, axis=1)  # (N, T, S)
        return self.attention(x, x, attention_bias=bias[None])


def test_learned_relative_position_bias_trains():
    """Gradients reach the bias through the core: the table moves under fit."""
    x = random((16, 6, E), 14)
    y = random((16, 6, E), 15)
    inputs = keras.Input((6, E))
    model = keras.Model(inputs, RelativePositionAttention(6)(inputs))
    model.compile(keras.optimizers.Adam(0.05), "mse")
    table = model.layers[1].table
    model.fit(x, y, epochs=3, verbose=0)
    assert np.abs(numpy(table)).max() > 1e-3


ALL_ARGUMENTS = dict(
    num_heads=4,
    key_dim=3,
    value_dim=5,
    dropout=0.1,
    use_bias=True,
    output_shape=(2, 3),
    attention_axes=(2,),
    sliding_window=3,
    flash_attention=False,
    kernel_regularizer="l2",
    use_gate=True,
    seed=7,
    num_key_value_heads=2,
    implementation="chunked",
    chunk_size=4,
    scale=0.3,
    attn_logits_soft_cap=5.0,
)


def test_config_round_trips_every_argument():
    layer = ScaledDotProductAttention(**ALL_ARGUMENTS)
    config = layer.get_config()
    for name, value in ALL_ARGUMENTS.items():
        if name != "kernel_regularizer":
            assert config[name] == value, name
    assert ScaledDotProductAttention.from_config(config).get_config() == config


def all_arguments_model():
    inputs = keras.Input((3, 4, E))
    x = ScaledDotProductAttention(**ALL_ARGUMENTS)(inputs, inputs, use_causal_mask=True)
    return keras.Model(inputs, x)


def test_keras_file_round_trips_every_argument(tmp_path):
    model = all_arguments_model()
    x = random((B, 3, 4, E), 16)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)
    assert loaded.layers[1].get_config() == model.layers[1].get_config()


@pytest.mark.tensorflow_only("a SavedModel: model.export and tf.saved_model.load")
def test_saved_model_round_trips_every_argument(tmp_path):
    import tensorflow as tf

    model = all_arguments_model()
    x = random((B, 3, 4, E), 17)
    model.export(str(tmp_path / "exported"), verbose=False)
    reloaded = tf.saved_model.load(str(tmp_path / "exported"))
    np.testing.assert_allclose(reloaded.serve(x), model(x), atol=1e-6)


@pytest.mark.parametrize("path", ["dense", "chunked", "auto"])
@pytest.mark.parametrize(
    "query_shape, value_shape",
    [((0, 5, E), (0, 6, E)), ((2, 5, E), (2, 0, E)), ((2, 0, E), (2, 6, E))],
    ids=["empty_batch", "no_keys", "no_queries"],
)
def test_empty_sizes_give_empty_or_zero_outputs(query_shape, value_shape, path):
    layer = ScaledDotProductAttention(num_heads=2, key_dim=4, implementation=path)
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    query, value = random(query_shape, 18), random(value_shape, 19)
    out = layer(query, value)
    assert out.shape == query_shape
    if value_shape[1] == 0:
        # No key to attend to: a zero attention output, then W_O's bias.
        bias = numpy(layer.output_dense.bias)
        np.testing.assert_allclose(out, np.broadcast_to(bias, query_shape), atol=1e-7)
    else:
        assert mha(query, value).shape == query_shape
    if BACKEND == "tensorflow":
        import tensorflow as tf

        # Inside a graph with unknown sizes too, as a serving signature runs it.
        spec = [tf.TensorSpec((None, None, E)), tf.TensorSpec((None, None, E))]
        graph_out = tf.function(lambda q, v: layer(q, v), input_signature=spec)(query, value)
    else:
        # JAX traces every size as known (it has no unknown dimensions): inside `jax.jit`.
        graph_out = jit(lambda q, v: layer(q, v))(query, value)
    np.testing.assert_allclose(graph_out, out, atol=1e-7)


@pytest.mark.tensorflow_only("lengths unknown while tracing: a tf.function input_signature")
def test_auto_decides_at_run_time_for_unknown_lengths(monkeypatch):
    """Traced with unknown lengths, `"auto"` still takes the chunked program for long inputs.

    Dropout shows which program ran: the dense and the chunked path draw their
    keep-masks differently, so with the same seed each path has its own output.
    """
    import tensorflow as tf

    monkeypatch.setattr(plan, "AUTO_CHUNKED_BYTES", 4 * B * 2 * 32 * 32)  # chunked past T=32
    spec = [tf.TensorSpec((B, None, 2, 4))] * 3

    def call(implementation, chunk_size=16):
        def f(q, k, v):
            return ops.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_rate=0.5,
                training=True,
                seed=3,
                implementation=implementation,
                chunk_size=chunk_size,
            )

        return tf.function(f, input_signature=spec)

    auto, dense, chunked = call("auto"), call("dense"), call("chunked")
    for length, expected in ((24, dense), (40, chunked)):
        q, k, v = (random((B, length, 2, 4), seed) for seed in (20, 21, 22))
        got = auto(q, k, v)
        np.testing.assert_array_equal(got, expected(q, k, v))
        other = chunked if expected is dense else dense
        assert not np.allclose(got, other(q, k, v))
    # Large scores, but no sequence longer than one block: dense (a block would be as big).
    auto, dense, chunked = call("auto", 64), call("dense", 64), call("chunked", 16)
    q, k, v = (random((B, 40, 2, 4), seed) for seed in (20, 21, 22))
    np.testing.assert_array_equal(auto(q, k, v), dense(q, k, v))
    assert not np.allclose(auto(q, k, v), chunked(q, k, v))


@pytest.mark.large  # a fit; the choice itself: test_auto_decides_at_run_time_for_unknown_lengths
@pytest.mark.tensorflow_only("lengths unknown while tracing: Keras's JAX trainer knows them")
def test_auto_under_fit_with_unknown_lengths(monkeypatch):
    """A functional model with `Input((None, E))` trains; "auto" is left to run time there.

    Inside a caller's XLA step (`jit_compile=True`) with unknown lengths the choice falls
    back to dense: neither a run-time choice nor the chunked path compiles there.
    """
    chosen = []
    choose = plan.choose_path
    monkeypatch.setattr(plan, "choose_path", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    monkeypatch.setattr(plan, "AUTO_CHUNKED_BYTES", 4 * 4 * 2 * 24 * 24)  # chunked past T=24

    for jit_compile, want in ((False, "auto"), (True, "dense")):
        chosen.clear()
        inputs = keras.Input((None, E))
        x = ScaledDotProductAttention(num_heads=2, key_dim=4, chunk_size=8)(inputs, inputs)
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(x))
        model.compile("adam", "mse", jit_compile=jit_compile)
        for length in (12, 40):  # one below the threshold, one above: the same trace
            x = random((4, length, E), length)
            history = model.fit(x, x.mean(1), batch_size=4, epochs=2, verbose=0)
            assert np.isfinite(history.history["loss"]).all()
        assert want in chosen, (jit_compile, chosen)


@pytest.mark.large  # a jit-compiled fit; the choice itself: test_auto_decides_at_run_time
@pytest.mark.tensorflow_only("a batch unknown while tracing: Keras's JAX trainer knows it")
def test_auto_goes_chunked_inside_a_jit_compiled_fit_with_a_fixed_length(monkeypatch):
    """`Input((T, E))` under `jit_compile=True`: Keras traces `fit` with an unknown batch, and
    "auto" chooses from one example's scores. Past the bar it trains on the chunked path,
    to the same weights as the dense path (one epoch, 1e-5)."""
    import tensorflow as tf

    chosen = []
    choose = plan.choose_path
    monkeypatch.setattr(plan, "choose_path", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    monkeypatch.setattr(plan, "AUTO_CHUNKED_BYTES_PER_EXAMPLE", 4 * 2 * 24 * 24)  # past T=24
    length = 40
    x = random((8, length, E), 41)
    weights = {}
    for implementation in ("auto", "dense"):
        chosen.clear()
        keras.utils.set_random_seed(0)
        inputs = keras.Input((length, E))
        attention = ScaledDotProductAttention(
            num_heads=2, key_dim=4, chunk_size=16, implementation=implementation
        )
        y = attention(inputs, inputs, use_causal_mask=True)
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(y))
        model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True)
        # Batches of 3, 3 and 2 from `tf.data`: the traced batch size is unknown.
        data = tf.data.Dataset.from_tensor_slices((x, x.mean(1))).batch(3)
        model.fit(data, epochs=1, verbose=0, shuffle=False)
        weights[implementation] = [w.numpy() for w in model.weights]
        assert chosen and set(chosen) == {"chunked" if implementation == "auto" else "dense"}
    for auto, dense in zip(weights["auto"], weights["dense"]):
        np.testing.assert_allclose(auto, dense, atol=1e-5)


def test_other_backends_are_refused_with_the_variable_to_set(monkeypatch):
    """On a Keras backend other than TensorFlow and JAX, the layer and the core say which
    backend they met and which they support."""
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    match = r"'tensorflow' or 'jax'.*Received: KERAS_BACKEND='torch'"
    with pytest.raises(ValueError, match=match):
        ScaledDotProductAttention(num_heads=2, key_dim=4)
    q = random((1, 3, 2, 4), 30)
    with pytest.raises(ValueError, match=match):
        ops.scaled_dot_product_attention(q, q, q)


class _Unfolded(ScaledDotProductAttention):
    """The same layer with every key and value projected, whatever the query's length."""

    def _folds_projections(self, *args):
        return False


@pytest.mark.default_cases("2-gate")
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(scale=0.3), dict(use_gate=True), dict(output_shape=5)],
    ids=["plain", "scale", "gate", "output_shape"],
)
@pytest.mark.parametrize("length", [1, 2])
def test_short_queries_fold_the_projections_and_match(kwargs, length):
    """A query of 1 or 2 positions (attention pooling) attends with `W_K` folded into it and
    `W_V` after the weighted sum: the outputs, weights and every gradient are those of
    `keras.layers.MultiHeadAttention` and of the layer projecting every key."""
    width, heads, key_dim = 24, 2, 8
    query, value = random((3, length, width), 1), random((3, 11, 20), 2)
    mask = np.ones((3, length, 11), bool)
    mask[1, :, 4:] = False  # padding
    mask[2] = False  # no key at all: zero weights, and the value bias not added
    layer_kwargs = dict(num_heads=heads, key_dim=key_dim, **kwargs)
    mha_kwargs = {k: v for k, v in layer_kwargs.items() if k != "scale"}  # Keras has no scale
    mha, ours = twins(keras.layers.MultiHeadAttention, query, value, mha_kwargs, layer_kwargs)
    unfolded = _Unfolded(**layer_kwargs)
    unfolded(query, value)
    unfolded.set_weights(ours.get_weights())
    assert ours._folds_projections(tensor(query), False, False)
    assert not ours._folds_projections(tensor(random((3, 3, width), 3)), False, False)

    def run(layer, rows=slice(None)):
        def outputs():
            out, scores = layer(
                query[rows], value[rows], attention_mask=mask[rows], return_attention_scores=True
            )
            plain = layer(query[rows], value[rows], attention_mask=mask[rows])
            return out, scores, plain

        def loss():
            out, scores, plain = outputs()
            return kops.sum(out * plain) + kops.sum(scores**2)

        grads = gradient_to_variables(loss, layer.trainable_variables)
        return [numpy(x) for x in outputs()] + grads

    def close(got, want):
        # float32 sums in two orders: the error grows with the tensor's scale (its gradients
        # reach 30 here, and one element of 0.85 differed by 3.7e-5 in one CI run), so the
        # absolute bar is 2e-5 of the largest entry. A lost term or a swapped axis is O(0.1).
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * max(1.0, np.abs(want).max()))

    if "scale" not in kwargs:
        # Keras gives a row without keys uniform weights; compare with it on the other rows.
        for got, want in zip(run(ours, slice(0, 2)), run(mha, slice(0, 2))):
            close(got, want)
    for got, want in zip(run(ours), run(unfolded)):
        close(got, want)


class _Pooling(keras.layers.Layer):
    """A learned query attending over a sequence, as `apps.classifier.pooling.AttentionPooling`."""

    def __init__(self, query, **attention_kwargs):
        super().__init__(name="pooling")
        self.query = query  # (1, 1, E)
        self.attention = ScaledDotProductAttention(**attention_kwargs)

    def build(self, x_shape):
        self.attention.build((x_shape[0], 1, x_shape[-1]), x_shape)

    def call(self, x, mask=None):
        query = keras.ops.broadcast_to(self.query, (keras.ops.shape(x)[0], 1, x.shape[-1]))
        return self.attention(query, x, value_mask=mask)


@pytest.mark.default_cases("folded")
@pytest.mark.parametrize("kv_heads", [None, 1], ids=["folded", "mqa"])
def test_pooling_query_with_lengths_unknown_until_run_time(kv_heads):
    """A functional model with `Input((None, E))` traces "auto"'s run-time choice, chunked
    branch included, for a 1-position query over a padded sequence (attention pooling): with
    the projections folded it reads the inputs as one key head, and with
    `num_key_value_heads=1` it has one. The chunked loops once lost that head's static size:
    the model failed to build, and its gradient to trace."""
    query, value = random((1, 1, 64), 1), random((2, 7, 64), 2)
    mask = np.arange(7)[None, :] < np.array([[7], [3]])  # (B, S)
    pooling = _Pooling(query, num_heads=2, key_dim=32, num_key_value_heads=kv_heads)
    v_in, m_in = keras.Input((None, 64)), keras.Input((None,), dtype="bool")
    model = keras.Model([v_in, m_in], pooling(v_in, mask=m_in))
    want = pooling.attention(np.repeat(query, 2, axis=0), value, value_mask=mask)
    np.testing.assert_allclose(model.predict([value, mask], verbose=0), want, atol=1e-6)

    def loss(v, m):
        return kops.sum(pooling(v, mask=m) ** 2)

    (want,) = gradients(lambda v: loss(v, tensor(mask)), tensor(value))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def gradient(v, m):
            with tf.GradientTape() as tape:
                tape.watch(v)
                value_ = loss(v, m)
            return tape.gradient(value_, v)

        unknown = tf.function(
            gradient,
            input_signature=[tf.TensorSpec((None, None, 64)), tf.TensorSpec((None, None), tf.bool)],
        )
        got = unknown(value, mask)
    else:
        import jax

        # JAX traces every length as known (it has no unknown dimensions): the gradient
        # inside `jax.jit`.
        got = jit(jax.grad(loss))(value, mask)
    # On TensorFlow both run the projections and the core as compiled programs; on JAX the
    # eager reference runs the projections op by op, and XLA's fused sums round differently
    # in float32 (2.3e-6 apart on values near 0.4, the folded case).
    np.testing.assert_allclose(got, want, atol=1e-6 if BACKEND == "tensorflow" else 1e-5)


@pytest.mark.default_cases("T_S")
@pytest.mark.parametrize("mask_shape", [(1, 11), (3, 2, 1, 11)], ids=["T_S", "per_head"])
def test_short_queries_fold_with_every_mask_shape(mask_shape):
    """The folded path takes every `attention_mask` shape the layer takes, `(T, S)` and per
    head `(B, N, T, S)` too, with a head whose keys are all masked: the same outputs,
    weights and gradients as the layer projecting every key."""
    query, value = random((3, 1, 24), 1), random((3, 11, 20), 2)
    mask = np.ones(mask_shape, bool)
    mask[..., 6:] = False
    if len(mask_shape) == 4:
        mask[1, 0] = False  # no key for head 0 of review 1
    layer_kwargs = dict(num_heads=2, key_dim=8, bias_initializer="random_normal")
    ours, unfolded = ScaledDotProductAttention(**layer_kwargs), _Unfolded(**layer_kwargs)
    ours(query, value)
    unfolded(query, value)
    unfolded.set_weights(ours.get_weights())
    assert ours._folds_projections(tensor(query), False, False)

    def run(layer):
        def outputs():
            return layer(query, value, attention_mask=mask, return_attention_scores=True)

        def loss():
            out, scores = outputs()
            return kops.sum(out**2) + kops.sum(scores**2)

        grads = gradient_to_variables(loss, layer.trainable_variables)
        return [numpy(x) for x in outputs()] + grads

    for got, want in zip(run(ours), run(unfolded)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
