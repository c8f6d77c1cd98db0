"""The layer against keras.layers.MultiHeadAttention with the same weights, and Keras plumbing."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from keras import ops as kops
from keras.src.backend.common.masking import get_keras_mask  # no public name in Keras 3.15
from on_backend import BACKEND, gradient_to_variables, gradients, numpy, tensor

from keras_sdpa import ScaledDotProductAttention, _backend
from keras_sdpa._core import program

# Pairwise-distinct sizes: batch, query length, key length, heads, head size, widths.
B, T, S, N, H, HV = 2, 3, 5, 4, 6, 7
E_Q, E_K, E_V = 9, 10, 11


def inputs(seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    query = tensor(rng.normal(size=(B, T, E_Q)), dtype)
    value = tensor(rng.normal(size=(B, S, E_V)), dtype)
    key = tensor(rng.normal(size=(B, S, E_K)), dtype)
    return query, value, key


def keras_call(mha, *args, **kwargs):
    """`mha(*args, **kwargs)`, a Keras MultiHeadAttention's call, as the reference.

    On JAX, Keras 3.15's MultiHeadAttention fails when `value_dim` differs from `key_dim` and
    it returns no scores: its fused path, `jax.nn.dot_product_attention`, takes one head size
    ("cannot reshape array of shape (2, 3, 4, 1, 7) ... into shape (2, 3, 4, 6)"). Its
    einsum path, which it takes when it returns scores, computes the same output there."""
    if (
        BACKEND == "jax"
        and mha._value_dim != mha._key_dim
        and not kwargs.get("return_attention_scores")
    ):
        return mha(*args, return_attention_scores=True, **kwargs)[0]
    return mha(*args, **kwargs)


def twin_layers(**kwargs):
    """A Keras MultiHeadAttention and our layer holding the same weights."""
    query, value, key = inputs()
    mha = keras.layers.MultiHeadAttention(N, H, value_dim=HV, **kwargs)
    ours = ScaledDotProductAttention(N, H, value_dim=HV, **kwargs)
    keras_call(mha, query, value, key)
    ours(query, value, key)
    # Random biases too, so a missing bias cannot pass.
    ours.set_weights(
        [
            w + np.random.default_rng(i).normal(size=w.shape) * 0.1
            for i, w in enumerate(mha.get_weights())
        ]
    )
    mha.set_weights(ours.get_weights())
    return mha, ours


@pytest.mark.parametrize("use_causal_mask", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "attention_mask"])
def test_cross_attention_matches_keras(with_mask, use_causal_mask):
    mha, ours = twin_layers()
    query, value, key = inputs(1)
    mask = None
    if with_mask:
        mask = np.random.default_rng(2).random((B, T, S)) > 0.4
        mask[..., 0] = True  # no fully masked rows: Keras disagrees with itself there
    kwargs = dict(
        attention_mask=mask, use_causal_mask=use_causal_mask, return_attention_scores=True
    )
    want_out, want_scores = mha(query, value, key, **kwargs)
    out, scores = ours(query, value, key, **kwargs)
    assert out.shape == (B, T, E_Q) and scores.shape == (B, N, T, S)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_self_attention_matches_keras():
    query, _, _ = inputs(3)
    mha = keras.layers.MultiHeadAttention(N, H, value_dim=HV, output_shape=8)
    ours = ScaledDotProductAttention(N, H, value_dim=HV, output_shape=8)
    keras_call(mha, query, query)
    ours(query, query)
    ours.set_weights(mha.get_weights())
    want = keras_call(mha, query, query, use_causal_mask=True)
    got = ours(query, query, use_causal_mask=True)
    assert got.shape == (B, T, 8)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_activity_regularizer_applies_to_the_projections_as_in_keras():
    """MultiHeadAttention gives `activity_regularizer` to each projection; so does this layer
    (once it regularized the layer's output instead: other losses, with no error)."""
    query, value, _ = inputs(3)
    kwargs = dict(value_dim=HV, activity_regularizer=keras.regularizers.L2(0.01))
    mha = keras.layers.MultiHeadAttention(N, H, **kwargs)
    ours = ScaledDotProductAttention(N, H, **kwargs)
    keras_call(mha, query, value)
    ours(query, value)
    ours.set_weights(mha.get_weights())
    keras_call(mha, query, value)
    ours(query, value)
    want = [float(loss) for loss in mha.losses]
    assert len(want) == 4
    np.testing.assert_allclose([float(loss) for loss in ours.losses], want, rtol=1e-5)
    config = ScaledDotProductAttention.from_config(ours.get_config()).get_config()
    assert config["activity_regularizer"] == ours.get_config()["activity_regularizer"] is not None


@pytest.mark.parametrize("scale", [None, 1.0, 0.05], ids=["default", "unscaled", "scale_0.05"])
def test_single_head_is_the_derivation(scale):
    """num_heads=1 without W_O: softmax(X W_Q (X W_K)^T / sqrt(d_k)) X W_V, in NumPy."""
    query, value, key = inputs(4, "float64")
    layer = ScaledDotProductAttention(key_dim=H, value_dim=HV, scale=scale, dtype="float64")
    out = numpy(layer(query, value, key))
    w_q, b_q, w_k, b_k, w_v, b_v = (numpy(w) for w in layer.weights)
    q = np.einsum("bte,eh->bth", query, w_q[:, 0]) + b_q[0]
    k = np.einsum("bse,eh->bsh", key, w_k[:, 0]) + b_k[0]
    v = np.einsum("bse,eh->bsh", value, w_v[:, 0]) + b_v[0]
    scores = q @ k.transpose(0, 2, 1) * (1 / np.sqrt(H) if scale is None else scale)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert out.shape == (B, T, HV)
    np.testing.assert_allclose(out, weights @ v, atol=1e-12)


def test_implicit_masks_from_embedding():
    tokens = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 1]])  # first example padded
    embedding = keras.layers.Embedding(12, E_Q, mask_zero=True)
    mha = keras.layers.MultiHeadAttention(N, H)
    ours = ScaledDotProductAttention(N, H)
    x = embedding(tokens)
    mha(x, x)
    ours(x, x)
    ours.set_weights(mha.get_weights())
    # Keras's layer strips the mask from its inputs, so each call gets a fresh embedding.
    x = embedding(tokens)
    want, want_scores = mha(x, x, return_attention_scores=True)
    x = embedding(tokens)
    got, scores = ours(x, x, return_attention_scores=True)
    real = tokens != 0
    # Real query rows agree with Keras; padded keys get no weight.
    np.testing.assert_allclose(numpy(got)[real], numpy(want)[real], atol=1e-5)
    assert (numpy(scores)[0, :, :, 3:] == 0).all()
    # Padded query rows attend to nothing: zero weights, where Keras spreads them uniformly.
    assert (numpy(scores)[0, :, 3:, :] == 0).all()
    # The query's mask carries on to the output, for pooling downstream.
    np.testing.assert_array_equal(numpy(get_keras_mask(got)), real)


def test_functional_model_declares_cross_attention_score_shape():
    query = keras.Input((T, E_Q))
    value = keras.Input((S, E_V))
    out, scores = ScaledDotProductAttention(N, H)(query, value, return_attention_scores=True)
    assert tuple(out.shape) == (None, T, E_Q)
    assert tuple(scores.shape) == (None, N, T, S)
    model = keras.Model([query, value], [out, scores])
    q, v, _ = inputs()
    got_out, got_scores = model([q, v])
    assert got_scores.shape == (B, N, T, S)


def small_model():
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = ScaledDotProductAttention(2, 4, dropout=0.1, seed=1, kernel_regularizer="l2")(x, x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(1, activation="sigmoid")(x))


TOKENS = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [2, 2, 0, 0]], np.int32)
LABELS = np.array([1.0, 0.0, 1.0, 0.0], np.float32)


def test_fit_step_with_jit_compile(monkeypatch):
    # Whether the layer was traced inside an XLA program: the step Keras compiled.
    contexts = []
    if BACKEND == "jax":
        # JAX knows every shape while tracing, so the layer never asks `inside_compiled` (always
        # True on JAX): each call into the compiled core records whether it is traced under
        # a `jax.jit`, the step Keras compiled.
        from jax._src import core as jax_core  # `unsafe_am_i_under_a_jit` has no public name

        compiled = program.compiled

        def spy(*args, **kwargs):
            contexts.append(jax_core.unsafe_am_i_under_a_jit())
            return compiled(*args, **kwargs)

        monkeypatch.setattr(program, "compiled", spy)
    else:
        shim = _backend.get()
        inside_xla = shim.inside_compiled
        monkeypatch.setattr(
            shim, "inside_compiled", lambda: contexts.append(inside_xla()) or contexts[-1]
        )
    model = small_model()
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy", jit_compile=True)
    before = [numpy(w) for w in model.trainable_weights]
    first = model.evaluate(TOKENS, LABELS, verbose=0)
    contexts.clear()
    model.fit(TOKENS, LABELS, epochs=5, verbose=0)
    assert contexts and all(contexts), "the training step was not compiled by XLA"
    after = [numpy(w) for w in model.trainable_weights]
    names = [w.path for w in model.trainable_weights]
    for name, b, a in zip(names, before, after):
        if "scaled_dot_product_attention" in name:
            assert not np.allclose(a, b), f"{name} did not train"
    assert model.evaluate(TOKENS, LABELS, verbose=0) < first


def test_get_config_round_trip():
    layer = ScaledDotProductAttention(
        3,
        5,
        value_dim=2,
        dropout=0.25,
        use_bias=False,
        output_shape=6,
        kernel_initializer="he_normal",
        kernel_regularizer="l2",
        bias_constraint="non_neg",
        seed=4,
        scale=0.5,
        name="attn",
    )
    config = layer.get_config()
    clone = ScaledDotProductAttention.from_config(config)
    assert clone.get_config() == config
    assert config["num_heads"] == 3 and config["value_dim"] == 2 and config["output_shape"] == (6,)
    assert config["scale"] == 0.5
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert isinstance(restored, ScaledDotProductAttention)


def test_numpy_scalars_are_taken_as_keras_takes_them_and_kept_as_python_numbers():
    """Sizes computed from arrays (`hidden // heads`), as Keras's layers take them: the
    layer computes as with Python numbers, and its config is JSON."""
    query, value, key = inputs()
    plain = ScaledDotProductAttention(3, 5, value_dim=2, dropout=0.0, use_bias=True, scale=0.5)
    sized = ScaledDotProductAttention(
        np.int64(3),
        np.int32(5),
        value_dim=np.int64(2),
        dropout=np.float32(0.0),
        use_bias=np.True_,
        scale=np.float32(0.5),
        attention_axes=(np.int64(1),),
    )
    want = plain(query, value, key)
    sized(query, value, key)
    sized.set_weights(plain.get_weights())
    np.testing.assert_allclose(numpy(sized(query, value, key)), numpy(want), atol=1e-6)
    config = sized.get_config()
    assert json.loads(json.dumps(config))["num_heads"] == 3
    for name in ("num_heads", "key_dim", "value_dim", "dropout", "use_bias", "scale"):
        assert type(config[name]) is type(plain.get_config()[name]), name
    assert config["attention_axes"] == (1,) and type(config["attention_axes"][0]) is int


def test_keras_file_round_trip(tmp_path):
    model = small_model()
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        loaded.predict(TOKENS, verbose=0), model.predict(TOKENS, verbose=0), atol=1e-6
    )


# A process without this package (export and reload in this one: test_layer_features).
@pytest.mark.large
@pytest.mark.tensorflow_only("a SavedModel, TFSMLayer and tf.saved_model.load")
def test_saved_model_export_loads_without_keras_sdpa(tmp_path):
    model = small_model()
    path = str(tmp_path / "exported")
    model.export(path, verbose=False)
    want = model.predict(TOKENS, verbose=0)
    # keras.layers.TFSMLayer, in this process.
    reloaded = keras.layers.TFSMLayer(path, call_endpoint="serve")
    np.testing.assert_allclose(reloaded(TOKENS), want, atol=1e-6)
    # tf.saved_model.load, in a process that never imports keras_sdpa.
    script = textwrap.dedent(f"""
        import sys, numpy as np, tensorflow as tf
        model = tf.saved_model.load({path!r})
        out = model.serve(tf.constant({TOKENS.tolist()}, tf.int32))
        assert "keras_sdpa" not in sys.modules
        print(repr(out.numpy().ravel().tolist()))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    got = np.array(eval(result.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(got, want.ravel(), atol=1e-6)


@pytest.mark.large  # tf.distribute with two logical CPUs
@pytest.mark.tensorflow_only("tf.distribute.MirroredStrategy")
def test_mirrored_replicas_draw_their_own_dropout_masks():
    """Two replicas on two logical CPUs, the same input: different masks in training,
    the same output in inference, and the mirrored weights identical on both."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        two = [tf.config.LogicalDeviceConfiguration()] * 2
        tf.config.set_logical_device_configuration(cpu, two)
        from keras_sdpa import ScaledDotProductAttention, ops
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        x = tf.random.stateless_normal((2, 5, 8), seed=[1, 2])
        with strategy.scope():
            layer = ScaledDotProductAttention(2, 4, dropout=0.5, seed=3)
            layer(x, x)

        def outputs(training):
            per_replica = strategy.run(lambda: layer(x, x, training=training))
            return [t.numpy() for t in strategy.experimental_local_results(per_replica)]

        a, b = outputs(True)
        assert a.shape == (2, 5, 8) and not np.allclose(a, b), "replicas drew the same masks"
        c, d = outputs(False)
        np.testing.assert_allclose(c, d, atol=1e-6)
        kernels = strategy.experimental_local_results(layer.query_kernel.value)
        np.testing.assert_array_equal(kernels[0].numpy(), kernels[1].numpy())
        print("ok", strategy.num_replicas_in_sync)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["ok", "2"]


@pytest.mark.large  # the core's gradients: tests/core/test_ops.py and tests/core/test_chunked.py
def test_gradients_match_finite_differences():
    """d loss / d (inputs, W_Q, W_K, W_V), against central differences in float64."""
    query, value, key = inputs(5, "float64")
    layer = ScaledDotProductAttention(2, 3, value_dim=2, dtype="float64")
    mask = np.random.default_rng(6).random((B, T, S)) > 0.3
    c = np.random.default_rng(7).normal(size=(B, T, E_Q))

    def loss_of(query, value, key):
        out = layer(query, value, key, attention_mask=mask, use_causal_mask=True)
        return kops.sum(out * c)

    def loss():
        return loss_of(query, value, key)

    loss()  # builds the layer
    inputs_ = {"query": query, "value": value, "key": key}
    kernels = {"W_Q": layer.query_kernel, "W_K": layer.key_kernel, "W_V": layer.value_kernel}
    targets = {**inputs_, **kernels}
    # The backend's autodiff: to the inputs, and to the kernels (Keras variables).
    grads = dict(zip(inputs_, gradients(loss_of, query, value, key)))
    grads.update(zip(kernels, gradient_to_variables(loss, kernels.values())))
    eps = 1e-6
    for name, target in targets.items():
        base = numpy(target)
        numeric = np.zeros_like(base)
        for i in np.ndindex(base.shape):
            for sign in (1, -1):
                bumped = base.copy()
                bumped[i] += sign * eps
                if name in inputs_:
                    kwargs = dict(inputs_)
                    kwargs[name] = tensor(bumped)
                    out = layer(
                        kwargs["query"],
                        kwargs["value"],
                        kwargs["key"],
                        attention_mask=mask,
                        use_causal_mask=True,
                    )
                    f = float(kops.sum(out * c))
                else:
                    target.assign(bumped)
                    f = float(loss())
                    target.assign(base)
                numeric[i] += sign * f / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, atol=1e-7, rtol=1e-6, err_msg=name)


def test_dropout_only_in_training_and_seeded():
    query, value, key = inputs()
    layer = ScaledDotProductAttention(N, H, dropout=0.5, seed=3)
    inference = numpy(layer(query, value, key))
    np.testing.assert_array_equal(layer(query, value, key, training=False), inference)
    first = numpy(layer(query, value, key, training=True))
    second = numpy(layer(query, value, key, training=True))
    assert not np.allclose(first, inference) and not np.allclose(first, second)
    # Two new layers with the same seed and weights drop the same weights.
    twins = [ScaledDotProductAttention(N, H, dropout=0.5, seed=3) for _ in range(2)]
    for twin in twins:
        twin(query, value, key)
        twin.set_weights(layer.get_weights())
    a, b = (twin(query, value, key, training=True) for twin in twins)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    query, value, key = inputs()
    reference = ScaledDotProductAttention(N, H)
    want = reference(query, value, key)
    keras.config.set_dtype_policy(policy)
    try:
        layer = ScaledDotProductAttention(N, H)
        layer(query, value, key)
    finally:
        keras.config.set_dtype_policy("float32")
    layer.set_weights(reference.get_weights())
    out, scores = layer(query, value, key, return_attention_scores=True)
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
    assert layer.query_kernel.dtype == "float32"
    np.testing.assert_allclose(numpy(out, "float32"), want, atol=5e-2, rtol=5e-2)
    np.testing.assert_allclose(numpy(scores, "float32").sum(-1), 1.0, atol=2e-2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(num_heads=0),
            r"argument `num_heads`, expected a positive integer. Received: num_heads=0",
        ),
        (dict(num_heads=-2), r"num_heads=-2"),
        (dict(dropout=1.0), r"`dropout` must be in \[0, 1\). Received: dropout=1.0"),
        (dict(dropout=-0.5), r"dropout=-0.5"),
        (dict(key_dim=0), r"argument `key_dim`, expected a positive integer or None.*key_dim=0"),
        (dict(output_shape=(2, 0)), r"Invalid `output_shape`.*output_shape=\(2, 0\)"),
        (dict(output_shape=0), r"Invalid `output_shape`.*output_shape=0"),
        (dict(output_shape=8.0), r"output_shape=8.0"),
        (dict(num_heads=4, num_key_value_heads=3), r"`num_key_value_heads` must divide.*=3"),
        (dict(num_key_value_heads=0), r"num_key_value_heads=0"),
        (dict(sliding_window=0), r"`sliding_window` must be None or a positive int.*=0"),
        (dict(attn_logits_soft_cap=-2.0), r"`attn_logits_soft_cap` must be.*=-2.0"),
        (dict(flash_attention="yes"), r"`flash_attention` must be None, True or False.*'yes'"),
        (dict(attention_axes="1"), r"`attention_axes` must be None, an int.*'1'"),
        (
            dict(implementation="flash"),
            r'`implementation` must be "auto", "dense" or "chunked"\. .*=\'flash\'',
        ),
        (dict(implementation="decode"), r'must be "auto", "dense" or "chunked".*=\'decode\''),
        (dict(chunk_size=0), r"`chunk_size` must be None or a positive int.*chunk_size=0"),
        (dict(scale=0.0), r"`scale` must be a positive finite number or None. Received: scale=0.0"),
        (dict(scale=float("nan")), r"scale=nan"),
        (dict(scale="1"), r"scale='1'"),
        # NumPy scalars are taken as Python numbers, and refused with the same messages.
        (dict(num_heads=np.int64(0)), r"expected a positive integer. Received: num_heads=0"),
        (dict(dropout=np.float32(1.5)), r"`dropout` must be in \[0, 1\). Received: dropout=1.5"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScaledDotProductAttention(**kwargs)


def test_key_dim_default_needs_divisible_width():
    query, value, key = inputs()  # query width 9
    with pytest.raises(ValueError, match=r"query width=9, num_heads=4"):
        ScaledDotProductAttention(num_heads=4)(query, value, key)


def test_bad_call_inputs():
    query, value, key = inputs()
    layer = ScaledDotProductAttention(N, H)
    layer(query, value, key)
    with pytest.raises(ValueError, match=r"`query` and `value` must have the same rank"):
        layer(query[..., None, :], value, key)
    with pytest.raises(ValueError, match=r"last axis of `query` must be 9.*\(2, 3, 4\)"):
        layer(query[..., :4], value, key)
    with pytest.raises(ValueError, match=r"`value` and `key`, except the last.*\(2, 4, 10\)"):
        layer(query, value, key[:, :4])
    with pytest.raises(ValueError, match=r"`query` must be a floating tensor.*int32"):
        layer(kops.cast(query, "int32"), value, key)
    with pytest.raises(ValueError, match=r"`mask` must broadcast.*\(2, 1, 3, 4\)"):
        layer(query, value, key, attention_mask=np.ones((B, T, S - 1), bool))
    with pytest.raises(ValueError, match=r"`attention_mask` must have rank 4 or less.*\(1, 2,"):
        layer(query, value, key, attention_mask=np.ones((1, B, N, T, S), bool))
    with pytest.raises(ValueError, match=r"`attention_axes` must name position axes.*\(2,\)"):
        ScaledDotProductAttention(N, H, attention_axes=2)(query, value, key)
    with pytest.raises(ValueError, match=r"flash_attention=True, return_attention_scores=True"):
        ScaledDotProductAttention(N, H, flash_attention=True)(
            query, value, key, return_attention_scores=True
        )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_query_padding_zeroes_rows_as_a_full_mask_does(causal):
    """The core sees only the key-side padding; the query's padding zeroes its rows after.
    Outputs, weights and gradients equal those of the same masks given as one (B, T, S)
    `attention_mask`, which the core applies whole: padded query rows have zero weights and
    a zero attention output (so `W_O`'s bias alone)."""
    query, value = inputs()[:2]
    query_mask = np.arange(T)[None, :] < np.array([[T], [2]])  # (B, T)
    value_mask = np.arange(S)[None, :] < np.array([[3], [S]])  # (B, S)
    layer = ScaledDotProductAttention(N, H, bias_initializer="random_normal")
    layer(query, value)

    def run(**masks):
        def call():
            return layer(
                query, value, return_attention_scores=True, use_causal_mask=causal, **masks
            )

        def loss():
            out, scores = call()
            return kops.sum(out**2) + kops.sum(scores**2)

        out, scores = call()
        return [numpy(out), numpy(scores)] + gradient_to_variables(loss, layer.trainable_variables)

    whole = query_mask[:, :, None] & value_mask[:, None, :]  # (B, T, S)
    for got, want in zip(
        run(query_mask=query_mask, value_mask=value_mask), run(attention_mask=whole)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    out, scores = run(query_mask=query_mask, value_mask=value_mask)[:2]
    assert (scores[1, :, 2:, :] == 0).all()
    np.testing.assert_allclose(
        out[1, 2:], np.broadcast_to(numpy(layer.output_dense.bias), (T - 2, E_Q))
    )
