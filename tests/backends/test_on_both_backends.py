"""The core and the layer on whichever backend Keras runs: written on `keras.ops` and NumPy.

`tests/backends/test_jax_backend.py` runs this file in a process on JAX (`KERAS_BACKEND=jax`, the
default tier), and the large tier runs it on TensorFlow too, so every check here holds on
both backends. References are independent of the core: NumPy in float64 for values, and for
gradients the backend's own autodiff (`jax.grad` on JAX, a `tf.GradientTape` on TensorFlow)
of a plain float64 softmax attention written here on `keras.ops`.
"""

import os

import keras
import numpy as np
import pytest
from keras import ops
from on_backend import BACKEND, float64_context, gradient_to_variable, gradients
from reference import attention as reference

from keras_sdpa import (
    ScaledDotProductAttention,
    create_block_mask,
    mods,
    scaled_dot_product_attention,
)
from keras_sdpa._core import program

if BACKEND == "jax":
    import jax

# The default tier runs this file on JAX (tests/backends/test_jax_backend.py). On TensorFlow
# its checks repeat the library's own test files, which the default tier runs there, so this file's
# TensorFlow run is in the large tier.
if BACKEND == "tensorflow":
    pytestmark = pytest.mark.large

# Pairwise-distinct sizes, so that a swapped axis cannot pass.
B, T, S, N, K, H, HV = 2, 5, 7, 4, 2, 8, 6


def test_runs_on_the_backend_asked_for():
    """What `tests/backends/test_jax_backend.py` starts runs on JAX, the session on TensorFlow."""
    assert BACKEND == os.environ.get("KERAS_BACKEND", "tensorflow")


def random(shape, seed, dtype="float32"):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def plain_attention(q, k, v, mask, bias):
    """A float64 softmax attention on keras.ops, with no custom gradient: the gradient's
    reference (GQA by repeating the keys, as keras.layers.GroupQueryAttention does)."""
    groups = q.shape[2] // k.shape[2]
    k, v = ops.repeat(k, groups, axis=2), ops.repeat(v, groups, axis=2)
    logits = ops.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
    logits = ops.where(mask, logits, -1e30)
    weights = ops.softmax(logits, axis=-1)
    return ops.einsum("bnts,bsnh->btnh", weights, v)


CASES = {
    "plain": {},
    "mask": {"mask": True},
    "causal-bias": {"causal": True, "bias": True},
    "window-cap-scale": {"window": 3, "cap": 2.0, "scale": 0.3},
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("kv_heads", [N, K], ids=["mha", "gqa"])
def test_matches_numpy(case, kv_heads):
    options = CASES[case]
    q, k = random((B, T, N, H), 1), random((B, S, kv_heads, H), 2)
    v = random((B, S, kv_heads, HV), 3)
    mask = random((B, 1, T, S), 4) > -0.5 if options.get("mask") else None
    if mask is not None:
        mask[0, 0, 2] = False  # a fully masked row: zeros
    bias = random((1, N, T, S), 5) if options.get("bias") else None
    out, weights = scaled_dot_product_attention(
        q,
        k,
        v,
        mask,
        bias=bias,
        is_causal=options.get("causal", False),
        sliding_window=options.get("window"),
        attn_logits_soft_cap=options.get("cap"),
        scale=options.get("scale"),
        return_weights=True,
    )
    want, want_weights = reference(
        q,
        k,
        v,
        mask,
        bias,
        is_causal=options.get("causal", False),
        window=options.get("window"),
        cap=options.get("cap"),
        scale=options.get("scale"),
    )
    np.testing.assert_allclose(ops.convert_to_numpy(out), want, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(weights), want_weights, atol=1e-5)
    if mask is not None:
        assert not np.asarray(ops.convert_to_numpy(out))[0, 2].any()


@pytest.mark.parametrize("kv_heads", [N, K], ids=["mha", "gqa"])
def test_gradients_match_autodiff_of_a_float64_reference(kv_heads):
    q, k = random((B, T, N, H), 6), random((B, S, kv_heads, H), 7)
    v = random((B, S, kv_heads, HV), 8)
    mask = random((B, 1, T, S), 9) > -0.5
    bias = random((1, N, T, S), 10)
    probe = random((B, T, N, HV), 11)

    def ours(q, k, v, bias):
        out = scaled_dot_product_attention(q, k, v, mask, bias=bias)
        return ops.sum(out * probe)

    def theirs(q, k, v, bias):
        return ops.sum(plain_attention(q, k, v, mask, bias) * probe)

    got = gradients(ours, q, k, v, bias)
    want = gradients(theirs, *(x.astype("float64") for x in (q, k, v, bias)), x64=True)
    for name, a, b in zip("qkvb", got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=name)


def test_bfloat16_is_near_the_float64_reference():
    q, k, v = random((B, T, N, H), 12), random((B, S, K, H), 13), random((B, S, K, HV), 14)
    half = [ops.cast(x, "bfloat16") for x in (q, k, v)]
    out = scaled_dot_product_attention(*half)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    # Against the float64 attention of the rounded inputs: the weights are rounded to
    # bfloat16 as the operand of P V, so the output may move by one bfloat16 ulp (2^-8) of
    # its terms, sum_s P |V| (measured: up to 0.56 of it), and its own rounding adds half an
    # ulp of itself.
    rounded = [ops.convert_to_numpy(ops.cast(x, "float32")) for x in half]
    want, _ = reference(*rounded)
    terms, _ = reference(rounded[0], rounded[1], np.abs(rounded[2]))  # sum_s P |V|
    got = ops.convert_to_numpy(ops.cast(out, "float32"))
    assert np.all(np.abs(got - want) <= 2**-8 * terms + 2**-9 * np.abs(want) + 1e-6)


def test_score_and_mask_mods_match_their_masks():
    """ALiBi and a document mask against the same bias and mask given directly."""
    q, k, v = random((B, T, N, H), 15), random((B, T, N, H), 16), random((B, T, N, HV), 17)
    ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], "int32")
    out = scaled_dot_product_attention(
        q, k, v, score_mod=mods.alibi(N), mask_mod=mods.document(ids), is_causal=True
    )
    slopes = np.asarray(mods.alibi_slopes(N))[None, :, None, None]
    distance = np.abs(np.arange(T)[:, None] - np.arange(T)[None])
    same = ids[:, None, :, None] == ids[:, None, None, :]
    want, _ = reference(q, k, v, same, -slopes * distance, is_causal=True)
    np.testing.assert_allclose(ops.convert_to_numpy(out), want, atol=1e-5)


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_a_plain_mask_mod_and_one_with_tensors_combine(path):
    """`and_masks` of a plain function and a mod that holds tensors: the combined mod's
    template holds placeholders for the tensors, which are counted, never read (JAX refused
    to convert the placeholder)."""
    q, k, v = random((B, T, N, H), 15), random((B, T, N, H), 16), random((B, T, N, HV), 17)
    ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], "int32")
    near = lambda b, h, q_idx, kv_idx: kv_idx < q_idx + 2  # noqa: E731
    mask_mod = mods.and_masks(near, mods.document(ids))
    out = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, implementation=path)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    near = np.arange(T)[None, :] < np.arange(T)[:, None] + 2
    want, _ = reference(q, k, v, same & near)
    np.testing.assert_allclose(ops.convert_to_numpy(out), want, atol=1e-5)


def test_decode_path_matches_numpy():
    q, k, v = random((B, 1, N, H), 18), random((B, S, K, H), 19), random((B, S, K, HV), 20)
    out = scaled_dot_product_attention(q, k, v, implementation="decode")
    np.testing.assert_allclose(ops.convert_to_numpy(out), reference(q, k, v)[0], atol=1e-5)


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_dropout_keeps_the_seeds_mask_and_scales_the_rest(path):
    """With V the identity, each output row is the row of kept weights times 1 / (1 - rate):
    its entries are 0 or the weight scaled, about a `rate` of them 0, and the same seed
    gives the same mask."""
    t, rate = 64, 0.25
    q, k = random((1, t, 1, H), 21), random((1, t, 1, H), 22)
    v = np.eye(t, dtype="float32")[None, :, None, :]  # (1, S, 1, S): out == weights

    def run(seed, training=True):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_rate=rate,
            training=training,
            seed=seed,
            implementation=path,
            chunk_size=16,
        )
        return ops.convert_to_numpy(out)[0, :, 0]  # (T, S)

    weights = reference(q, k, v)[1][0, 0]  # (T, S)
    first = run(7)
    dropped = first == 0
    np.testing.assert_allclose(first[~dropped], weights[~dropped] / (1 - rate), rtol=1e-4)
    assert abs(dropped.mean() - rate) < 0.03, dropped.mean()
    np.testing.assert_array_equal(run(7), first)
    assert (run(8) != first).any()
    np.testing.assert_allclose(run(7, training=False), weights, atol=1e-6)


def test_layer_matches_keras_multi_head_attention():
    """Same weights, same output. (`value_dim` stays `key_dim`: Keras 3.15's own layer fails
    on JAX with another value size, reshaping its output to the key size.)"""
    query, value = random((B, T, 16), 24), random((B, S, 12), 25)
    theirs = keras.layers.MultiHeadAttention(num_heads=N, key_dim=H)
    ours = ScaledDotProductAttention(num_heads=N, key_dim=H)
    theirs(query, value)
    ours(query, value)
    ours.set_weights(theirs.get_weights())
    mask = random((B, T, S), 26) > -0.5
    mask[:, :, 0] = True  # no fully masked row: Keras averages those, this layer gives zeros
    a = ops.convert_to_numpy(ours(query, value, attention_mask=mask, use_causal_mask=True))
    b = ops.convert_to_numpy(theirs(query, value, attention_mask=mask, use_causal_mask=True))
    np.testing.assert_allclose(a, b, atol=1e-5)


class _Wrapper(keras.layers.Layer):
    """A custom layer that calls the attention inside: on JAX, Keras infers its output shape
    in a functional model by tracing `call` with a symbolic batch size."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = ScaledDotProductAttention(num_heads=2, key_dim=4)

    def call(self, x):
        return self.attention(x, x)


def test_a_custom_layer_around_the_attention_builds_in_a_functional_model():
    """ "auto" once compared a symbolic batch size with its threshold on JAX and raised
    `InconclusiveDimensionOperation` while the model was built."""
    wrapper = _Wrapper()
    inputs = keras.Input((T, 8))
    model = keras.Model(inputs, wrapper(inputs))
    x = random((B, T, 8), 30)
    out = np.asarray(model(x))
    q, k, v = (
        np.einsum("bte,enh->btnh", x, np.asarray(dense.kernel)) + np.asarray(dense.bias)
        for dense in (
            wrapper.attention.query_dense,
            wrapper.attention.key_dense,
            wrapper.attention.value_dense,
        )
    )
    heads, _ = reference(q, k, v)
    output = wrapper.attention.output_dense
    want = np.einsum("btnh,nhe->bte", heads, np.asarray(output.kernel)) + np.asarray(output.bias)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_keras_file_round_trip(tmp_path):
    model = _small_model()
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = random((B, T, 16), 27)
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded(x)), ops.convert_to_numpy(model(x)), atol=1e-6
    )


def _small_model():
    inputs = keras.Input((T, 16))
    x = ScaledDotProductAttention(num_heads=N, key_dim=H, num_key_value_heads=K)(
        inputs, inputs, use_causal_mask=True
    )
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x)))


def test_fit_lowers_the_loss():
    keras.utils.set_random_seed(0)
    model = _small_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    x, y = random((16, T, 16), 28), random((16, 1), 29)
    history = model.fit(x, y, epochs=5, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


CHUNKED_CASES = {
    "causal-gqa": dict(is_causal=True),
    "window-bias": dict(sliding_window=6, bias=True),
    "mask-cap": dict(mask=True, attn_logits_soft_cap=3.0),
    "alibi-document": dict(score_mod="alibi", mask_mod="document"),
    "block-mask": dict(mask_mod="document", block_mask=True),
    "float64": dict(is_causal=True, float64=True),
}


@pytest.mark.parametrize("case", list(CHUNKED_CASES), ids=list(CHUNKED_CASES))
def test_chunked_path_matches_dense_outputs_and_gradients(case, monkeypatch):
    """T=37 and S=45 in blocks of 8 (neither a multiple), 4 query heads over 2: the chunked
    program (seen by a spy on the compiled core) against the dense one."""
    options = dict(CHUNKED_CASES[case])
    t, s, chunk = 37, 45, 8
    dtype = "float64" if options.pop("float64", False) else "float32"
    q, k = random((B, t, N, H), 30, dtype), random((B, s, K, H), 31, dtype)
    v = random((B, s, K, HV), 32, dtype)
    if options.pop("mask", False):
        mask = random((B, 1, t, s), 33) > -0.3
        mask[1, 0, 5] = False  # a fully masked row: zeros on both paths
        options["mask"] = mask
    bias = random((1, N, t, s), 34, dtype) if options.pop("bias", False) else None
    if options.get("score_mod") == "alibi":
        options["score_mod"] = mods.alibi(N)
    if options.get("mask_mod") == "document":
        ids = np.sort(np.random.default_rng(35).integers(0, 4, (B, max(t, s))), axis=1)
        options["mask_mod"] = mods.document(ids[:, :t].astype("int32"), ids[:, :s].astype("int32"))
    if options.pop("block_mask", False):
        options["block_mask"] = create_block_mask(options["mask_mod"], B, N, t, s, block_size=chunk)
    probe = random((B, t, N, HV), 36, dtype)
    paths = []
    compiled = program.compiled

    def spy(*args, **kwargs):
        paths.append(kwargs["plan"].path)
        return compiled(*args, **kwargs)

    monkeypatch.setattr(program, "compiled", spy)

    def run(implementation):
        def loss(q, k, v, bias):
            out = scaled_dot_product_attention(
                q,
                k,
                v,
                bias=bias,
                implementation=implementation,
                chunk_size=None if "block_mask" in options else chunk,
                **options,
            )
            return ops.sum(out * probe), out

        args = [x for x in (q, k, v, bias) if x is not None]

        def value(*args):
            return loss(*args[:3], args[3] if len(args) > 3 else None)[0]

        with float64_context():
            out = loss(q, k, v, bias)[1]
            grads = gradients(value, *args, x64=dtype == "float64")
        return ops.convert_to_numpy(out), grads

    chunked, dense = run("chunked"), run("dense")
    assert "chunked" in paths and "dense" in paths
    tolerance = 1e-10 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(chunked[0], dense[0], atol=tolerance)
    for a, b in zip(chunked[1], dense[1]):
        np.testing.assert_allclose(a, b, atol=tolerance)
    if "mask" in options:
        assert not chunked[0][1, 5].any()


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_a_learned_bias_table_reads_its_new_weights_and_gets_its_gradient(path):
    """T5's relative-position table (a Keras layer mod): the outputs follow `assign` (on JAX
    the table enters each call as an input, not as a constant of the first trace), and the
    gradient to the table is autodiff's of a float64 attention with that bias added."""
    t = 9
    q, k, v = random((B, t, N, H), 40), random((B, t, K, H), 41), random((B, t, K, HV), 42)
    probe = random((B, t, N, HV), 43)
    table = mods.relative_position_bias(N, num_buckets=8, max_distance=16)
    buckets = ops.convert_to_numpy(
        mods.relative_position_bucket(np.arange(t)[None] - np.arange(t)[:, None], True, 8, 16)
    )  # (T, S)

    def bias_of(values):
        return np.transpose(np.asarray(values)[buckets], (2, 0, 1))[None]  # (1, N, T, S)

    def ours():
        out = scaled_dot_product_attention(
            q, k, v, score_mod=table, implementation=path, chunk_size=4
        )
        return ops.sum(out * probe), out

    for seed in (44, 45):
        table.table.assign(random((8, N), seed))
        want, _ = reference(q, k, v, bias=bias_of(ops.convert_to_numpy(table.table)))
        np.testing.assert_allclose(ops.convert_to_numpy(ours()[1]), want, atol=1e-5)
    got = gradient_to_variable(lambda: ours()[0], table.table)

    def theirs(values):
        bias = ops.transpose(ops.take(values, buckets, axis=0), (2, 0, 1))[None]
        return ops.sum(plain_attention(q64, k64, v64, np.ones((1, 1, t, t), bool), bias) * probe)

    q64, k64, v64 = (x.astype("float64") for x in (q, k, v))
    (want,) = gradients(theirs, ops.convert_to_numpy(table.table).astype("float64"), x64=True)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_a_with_tensors_mod_gets_its_tensors_gradient(path):
    t = 9
    q, k, v = random((B, t, N, H), 46), random((B, t, N, H), 47), random((B, t, N, HV), 48)
    slopes, probe = random((N,), 49), random((B, t, N, HV), 50)
    distance = np.abs(np.arange(t)[:, None] - np.arange(t)[None]).astype("float32")

    def alibi(score, b, h, q_idx, kv_idx, slopes):
        return score - ops.take(slopes, h, axis=0) * ops.cast(ops.abs(q_idx - kv_idx), "float32")

    def ours(slopes):
        mod = mods.with_tensors(alibi, slopes)
        out = scaled_dot_product_attention(
            q, k, v, score_mod=mod, implementation=path, chunk_size=4
        )
        return ops.sum(out * probe)

    def theirs(slopes):
        bias = -ops.reshape(slopes, (1, N, 1, 1)) * distance
        return ops.sum(plain_attention(q64, k64, v64, np.ones((1, 1, t, t), bool), bias) * probe)

    q64, k64, v64 = (x.astype("float64") for x in (q, k, v))
    (got,) = gradients(ours, slopes)
    (want,) = gradients(theirs, slopes.astype("float64"), x64=True)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_cache_write_outside_the_cache_is_dropped():
    """Inside a compiled program the index is known only when it runs: a row written at -1
    or past the end changes nothing (JAX's scatter alone would wrap -1 to the last slot)."""
    from keras_sdpa import _backend
    from keras_sdpa._layer import cache as _cache

    write = _backend.get().compile(_cache.write_rows)  # tf.function(jit_compile=True), jax.jit
    cache = np.zeros((3, 2, 6, 2, 4), "float32")
    update = np.ones((3, 2, 1, 2, 4), "float32")
    offset = np.array([-1, 2, 6], "int32")
    written = ops.convert_to_numpy(write(cache, update, offset))
    want = cache.copy()
    want[1, :, 2] = 1.0
    np.testing.assert_array_equal(written, want)


def test_dropout_without_a_seed_differs_per_call_and_is_refused_inside_a_transformation():
    q = random((1, 8, 2, H), 51)
    first, second = (
        ops.convert_to_numpy(scaled_dot_product_attention(q, q, q, dropout_rate=0.5, training=True))
        for _ in range(2)
    )
    assert (first != second).any()
    if BACKEND == "jax":  # a seed drawn in Python would be one constant of the trace

        def dropped(q):
            return scaled_dot_product_attention(q, q, q, dropout_rate=0.5, training=True).sum()

        for transform in (jax.jit, jax.grad, jax.vmap):
            with pytest.raises(ValueError, match=r"needs a seed.*Received: seed=None"):
                transform(dropped)(q[None] if transform is jax.vmap else q)
    else:  # TensorFlow draws the seed in the program
        import tensorflow as tf

        step = tf.function(
            lambda q: scaled_dot_product_attention(q, q, q, dropout_rate=0.5, training=True)
        )
        assert (ops.convert_to_numpy(step(q)) != ops.convert_to_numpy(step(q))).any()


@pytest.mark.parametrize("kv_heads", [N, K], ids=["mha", "gqa"])
def test_a_cached_step_at_per_row_positions_matches_the_full_causal_call(kv_heads):
    """keras-hub's cache contract, `(B, 2, S, K, H)` with `cache_update_index` per row: one
    new token at position 3 in row 0 and 5 in row 1 (the decode path) gives the outputs of
    the whole sequence's causal call at those positions."""
    length, width = 8, 16
    x = random((B, length, width), 52)
    layer = ScaledDotProductAttention(num_heads=N, key_dim=H, num_key_value_heads=kv_heads)
    full = ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    cache = np.zeros((B, 2, length, kv_heads, H), "float32")
    _, cache = layer(x[:, :6], x[:, :6], cache=cache, cache_update_index=0, use_causal_mask=True)
    positions = np.array([3, 5], "int32")
    cache = ops.convert_to_numpy(cache).copy()
    cache[np.arange(B), :, positions] = 0.0  # the step itself must write its key and value
    token = x[np.arange(B), positions][:, None]  # (B, 1, E)
    out, cache = layer(
        token, token, cache=cache, cache_update_index=positions, use_causal_mask=True
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(out)[:, 0], full[np.arange(B), positions], atol=1e-5
    )


def test_a_learned_table_frozen_at_the_first_trace_gets_its_gradient_once_trainable():
    """Whether a variable trains is not part of what keys a trace: a table traced while
    frozen (fine-tuning unfreezes later) must still get its gradient."""
    t = 9
    q, k, v = random((B, t, N, H), 53), random((B, t, N, H), 54), random((B, t, N, HV), 55)
    table = mods.relative_position_bias(N, num_buckets=8, max_distance=16)
    table.table.assign(random((8, N), 56))

    def loss():
        return ops.sum(scaled_dot_product_attention(q, k, v, score_mod=table) ** 2)

    table.trainable = False
    loss()  # traced with the table frozen
    table.trainable = True
    got = gradient_to_variable(loss, table.table)
    buckets = ops.convert_to_numpy(
        mods.relative_position_bucket(np.arange(t)[None] - np.arange(t)[:, None], True, 8, 16)
    )

    def theirs(values):
        bias = ops.transpose(ops.take(values, buckets, axis=0), (2, 0, 1))[None]
        out = plain_attention(
            *(x.astype("float64") for x in (q, k, v)), np.ones((1, 1, t, t), bool), bias
        )
        return ops.sum(out**2)

    (want,) = gradients(theirs, ops.convert_to_numpy(table.table).astype("float64"), x64=True)
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_cached_step_reads_a_learned_tables_new_weights():
    """The layer's cached calls wrap its score_mod for the cache's positions; the table
    inside still enters each call: after `assign`, the step matches the full causal call."""
    length, width = 8, 16
    x = random((B, length, width), 57)
    table = mods.relative_position_bias(N, num_buckets=8, max_distance=16)
    layer = ScaledDotProductAttention(num_heads=N, key_dim=H, score_mod=table)
    cache = np.zeros((B, 2, length, N, H), "float32")
    positions = np.array([5, 5], "int32")
    for seed in (58, 59):
        table.table.assign(random((8, N), seed))
        full = ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
        _, filled = layer(
            x[:, :5], x[:, :5], cache=cache, cache_update_index=0, use_causal_mask=True
        )
        out, _ = layer(
            x[:, 5:6], x[:, 5:6], cache=filled, cache_update_index=positions, use_causal_mask=True
        )
        np.testing.assert_allclose(ops.convert_to_numpy(out)[:, 0], full[:, 5], atol=1e-5)


def test_a_mask_mod_reading_a_variable_it_does_not_hold_warns_on_jax():
    """On JAX such a variable is a constant of the trace: `create_block_mask` and the core
    warn, naming it; on TensorFlow it is read by reference, and nothing warns."""
    import warnings

    limit = keras.Variable(3, dtype="int32", name="limit")
    near = lambda b, h, q_idx, kv_idx: kv_idx < limit  # noqa: E731
    q = random((B, T, N, H), 31)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_block_mask(near, B, N, T, T, block_size=4)
        scaled_dot_product_attention(q, q, q, mask_mod=near)
    named = [w for w in caught if "read the variable 'limit'" in str(w.message)]
    assert len(named) >= (2 if BACKEND == "jax" else 0)
    assert BACKEND == "jax" or not named
