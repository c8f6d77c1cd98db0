"""The XLA core against a NumPy reference, Keras, eager execution and finite differences.

Written on `keras.ops`, NumPy and `on_backend`, so it runs on TensorFlow and on JAX; the
checks of what only TensorFlow has (AutoGraph) are `tensorflow_only`.
"""

import inspect

import keras
import numpy as np
import pytest
from keras import ops
from on_backend import (
    BACKEND,
    assert_gradients_match_finite_differences,
    numpy,
    optimized_hlo,
    spy_on_paths,
    tensor,
)
from reference import attention as reference

from keras_sdpa import ops as ops_module
from keras_sdpa._core import plan as _plan
from keras_sdpa._core import program
from keras_sdpa._core import request as _request
from keras_sdpa.ops import scaled_dot_product_attention

if BACKEND == "jax":
    import jax

# Pairwise-distinct sizes, so a swapped axis cannot pass.
B, T, S, N, H, HV = 2, 3, 5, 4, 6, 7


def random_inputs(dtype="float32", t=T, s=S, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, N, H))
    k = rng.normal(size=(B, s, N, H))
    v = rng.normal(size=(B, s, N, HV))
    return [tensor(x, dtype) for x in (q, k, v)]


def make_mask(kind, t=T, s=S, seed=1):
    rng = np.random.default_rng(seed)
    if kind == "none":
        return None
    if kind == "padding":  # (B, 1, 1, S): the last keys of each example are padding
        lengths = np.array([s, 2])
        return np.arange(s)[None, None, None, :] < lengths[:, None, None, None]
    if kind == "full":  # (B, N, T, S), random but no row fully masked
        mask = rng.random((B, N, t, s)) > 0.4
        mask[..., 0] = True
        return mask
    if kind == "2d":  # (T, S)
        mask = rng.random((t, s)) > 0.3
        mask[:, -1] = True
        return mask
    if kind == "fully_masked_rows":  # query rows with no key at all
        mask = rng.random((B, 1, t, s)) > 0.3
        mask[0, 0, 1, :] = False
        mask[1, 0, 0, :] = False
        return mask
    raise ValueError(kind)


MASKS = ["none", "padding", "full", "2d", "fully_masked_rows"]


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default_scale", "scale_0.3"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", MASKS)
def test_matches_numpy_reference(mask_kind, is_causal, scale):
    q, k, v = random_inputs()
    mask = make_mask(mask_kind)
    out, weights = scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, scale=scale, return_weights=True
    )
    want_out, want_weights = reference(q, k, v, mask, is_causal=is_causal, scale=scale)
    assert out.shape == (B, T, N, HV) and weights.shape == (B, N, T, S)
    np.testing.assert_allclose(numpy(out), want_out, atol=1e-5)
    np.testing.assert_allclose(numpy(weights), want_weights, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, atol",
    [("float16", 1e-2), ("bfloat16", 3e-2), ("float32", 1e-5), ("float64", 1e-12)],
)
def test_dtypes(dtype, atol):
    q, k, v = random_inputs(dtype)
    mask = make_mask("fully_masked_rows")
    out, weights = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    standardize = keras.backend.standardize_dtype
    assert standardize(out.dtype) == dtype and standardize(weights.dtype) == dtype
    want_out, want_weights = reference(*(numpy(x, "float64") for x in (q, k, v)), mask)
    np.testing.assert_allclose(numpy(out, "float64"), want_out, atol=atol, rtol=atol)
    np.testing.assert_allclose(numpy(weights, "float64"), want_weights, atol=atol)


def test_half_precision_scores_do_not_overflow():
    # |q . k| reaches about 10^5 here, far beyond float16's 65504.
    q, k, v = random_inputs("float32")
    q, k = q * 100.0, k * 100.0
    out = scaled_dot_product_attention(
        ops.cast(q, "float16"), ops.cast(k, "float16"), ops.cast(v, "float16"), scale=1.0
    )
    want, _ = reference(q, k, v, scale=1.0)
    assert np.isfinite(numpy(out)).all()
    np.testing.assert_allclose(numpy(out, "float32"), want, atol=2e-2)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "full"])
def test_matches_keras_dot_product_attention(mask_kind, is_causal):
    # T == S, since Keras's causal mask is only defined for square scores.
    q, k, v = random_inputs(t=S)
    v = v[..., :H]  # keras.ops.dot_product_attention wants Hv == H
    mask = make_mask(mask_kind, t=S)
    ours = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    theirs = ops.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=1e-5)


def core_kwargs(**overrides):
    """The static argument of the private compiled core, `keras_sdpa._core.program.compiled`:
    its plan."""
    fields = dict(
        num_heads=N,
        num_kv_heads=N,
        dtype="float32",
        mask_pattern=None,
        bias_pattern=None,
        is_causal=False,
        window=None,
        cap=None,
        scale=0.5,
        dropout_rate=0.0,
        return_weights=False,
        path="dense",
        chunk_size=2048,
        score_mod=None,
        mask_mod=None,
    )
    fields.update(overrides)
    return dict(plan=_plan.Plan(**fields))


@pytest.mark.parametrize("mask_kind", MASKS)
def test_xla_matches_eager(mask_kind):
    q, k, v = random_inputs()
    mask = make_mask(mask_kind)
    mask = None if mask is None else tensor(mask)
    mask_pattern = None if mask is None else (True,) * 4
    kwargs = core_kwargs(is_causal=True, scale=0.5, return_weights=True, mask_pattern=mask_pattern)
    mask = None if mask is None else ops.broadcast_to(mask, (B, N, T, S))
    eager = program.attention(q, k, v, mask, None, None, **kwargs)
    xla = program.compiled(q, k, v, mask, None, None, **kwargs)
    for a, b in zip(eager, xla):
        np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-6)


def test_core_is_compiled_by_xla():
    q, k, v = random_inputs()
    core, kwargs = program.compiled, core_kwargs(path="dense")
    hlo = optimized_hlo(core, q, k, v, None, None, None, (), (), None, (), **kwargs)
    # The whole computation is one XLA module: the two matmuls, the exp of the softmax.
    assert "HloModule" in hlo
    assert hlo.count(" dot(") >= 2
    assert "exponential(" in hlo


def test_rows_sum_to_one_and_masked_weights_are_zero():
    q, k, v = random_inputs()
    mask = make_mask("fully_masked_rows")
    _, weights = scaled_dot_product_attention(q, k, v, mask, is_causal=True, return_weights=True)
    weights = numpy(weights)
    allowed = np.broadcast_to(mask, weights.shape) & (
        np.arange(T)[:, None] >= np.arange(S)[None, :]
    )
    assert (weights[~allowed] == 0).all()
    has_key = allowed.any(-1)
    np.testing.assert_allclose(weights.sum(-1)[has_key], 1.0, atol=1e-6)
    assert (weights.sum(-1)[~has_key] == 0).all()


@pytest.mark.default_cases("True-dropout", "False-no_dropout")
@pytest.mark.parametrize("dropout_rate", [0.0, 0.5], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("return_weights", [False, True])
def test_fully_masked_rows_give_zeros_not_nan(return_weights, dropout_rate):
    q, k, v = random_inputs()
    mask = np.zeros((B, 1, T, S), bool)
    mask[:, :, 1:, :2] = True  # query 0 sees nothing

    def loss(q, k, v):
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            return_weights=return_weights,
            dropout_rate=dropout_rate,
            training=True,
            seed=3,
        )
        out = result[0] if return_weights else result
        return ops.sum(out**2), result

    result, grads = outputs_and_gradients(loss, q, k, v)
    out = result[0] if return_weights else result
    assert (out[:, 0] == 0).all()
    assert np.isfinite(out).all()
    for g in grads:
        assert np.isfinite(g).all()
    if return_weights:
        assert (result[1][:, :, 0] == 0).all()


def outputs_and_gradients(fn, *args):
    """For `fn(*args) -> (loss, outputs)`: the outputs and the gradient of the scalar loss to
    every arg, from one call under the backend's autodiff (a `tf.GradientTape`, or
    `jax.value_and_grad` with `has_aux`), as NumPy."""
    if BACKEND == "jax":
        args = [jax.numpy.asarray(a) for a in args]
        grad_fn = jax.value_and_grad(fn, argnums=tuple(range(len(args))), has_aux=True)
        (_, outputs), grads = grad_fn(*args)
    else:
        import tensorflow as tf

        args = [tf.convert_to_tensor(a) for a in args]
        with tf.GradientTape() as tape:
            tape.watch(args)
            loss, outputs = fn(*args)
        grads = tape.gradient(loss, args)
    return keras.tree.map_structure(np.asarray, outputs), [np.asarray(g) for g in grads]


@pytest.mark.default_cases("fully_masked_rows-True-seeded_dropout")
@pytest.mark.parametrize("dropout_rate", [0.0, 0.3], ids=["no_dropout", "seeded_dropout"])
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "fully_masked_rows"])
def test_gradients_match_finite_differences(mask_kind, return_weights, dropout_rate):
    q, k, v = random_inputs("float64")
    mask = make_mask(mask_kind)
    rng = np.random.default_rng(7)
    c_out = rng.normal(size=(B, T, N, HV))
    c_weights = rng.normal(size=(B, N, T, S))

    def loss(q, k, v):
        # A fixed int seed makes the dropout a fixed function of the inputs.
        result = scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            is_causal=True,
            return_weights=return_weights,
            dropout_rate=dropout_rate,
            training=True,
            seed=5,
        )
        if return_weights:
            return ops.sum(result[0] * c_out) + ops.sum(result[1] * c_weights)
        return ops.sum(result * c_out)

    assert_gradients_match_finite_differences(loss, [q, k, v])


def test_dropout_drops_weights_and_rescales_the_rest():
    rate = 0.4
    q, k, _ = random_inputs(s=64)
    # With V = identity over keys, the output row is the applied weight row itself.
    v = ops.tile(ops.eye(64, dtype="float32")[None, :, None, :], [B, 1, N, 1])  # (B, S, N, S)
    out, weights = scaled_dot_product_attention(
        q, k, v, dropout_rate=rate, training=True, seed=11, return_weights=True
    )
    applied = np.transpose(numpy(out), (0, 2, 1, 3))  # (B, N, T, S)
    dropped = applied == 0
    assert abs(dropped.mean() - rate) < 0.05  # 3072 draws: 4 standard deviations
    np.testing.assert_allclose(applied[~dropped], numpy(weights)[~dropped] / (1 - rate), rtol=1e-5)


def test_dropout_is_seedable_and_only_in_training():
    q, k, v = random_inputs()

    def run(**kwargs):
        return numpy(scaled_dot_product_attention(q, k, v, dropout_rate=0.5, **kwargs))

    np.testing.assert_array_equal(run(training=True, seed=1), run(training=True, seed=1))
    assert not np.allclose(run(training=True, seed=1), run(training=True, seed=2))
    np.testing.assert_allclose(run(training=False), reference(q, k, v)[0], atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(query=np.zeros((B, T, H))), r"`query` must have rank 4.*\(2, 3, 6\)"),
        (dict(key=np.zeros((B, S, N, H + 1))), r"same head size H.*key.shape=\(2, 5, 4, 7\)"),
        (dict(value=np.zeros((B, S + 1, N, HV))), r"same length S.*value.shape=\(2, 6, 4, 7\)"),
        (dict(mask=np.ones((B, N, T + 1, S), bool)), r"`mask` must broadcast.*\(2, 4, 4, 5\)"),
        (dict(dropout_rate=1.0), r"`dropout_rate` must be in \[0, 1\).*dropout_rate=1.0"),
        (dict(dropout_rate=-0.1), r"dropout_rate=-0.1"),
        (dict(query=np.zeros((B, T, N, H), np.int32)), r"`query` must be a floating.*int32"),
        (dict(value=np.zeros((B, S, N + 1, HV))), r"same number of heads K.*\(2, 5, 5, 7\)"),
        (
            dict(key=np.zeros((B, S, 3, H)), value=np.zeros((B, S, 3, HV))),
            r"key/value heads K .* must divide the query heads N.*key.shape=\(2, 5, 3, 6\)",
        ),
        (dict(scale=-1.0), r"`scale` must be a positive finite number.*scale=-1.0"),
        (dict(scale=float("inf")), r"scale=inf"),
        (
            dict(bias=np.zeros((B, N, T, S + 1))),
            r"`bias` must broadcast to the logits' shape \(B, N, T, S\) = \(2, 4, 3, 5\)\. "
            r"Received: bias.shape=\(2, 4, 3, 6\)",
        ),
        (dict(bias=np.zeros((T, S), bool)), r"`bias` must be a floating tensor.*bool"),
        (dict(sliding_window=0), r"`sliding_window` must be None or a positive int.*=0"),
        (dict(sliding_window=2.5), r"sliding_window=2.5"),
        (dict(attn_logits_soft_cap=0.0), r"`attn_logits_soft_cap` must be .*positive.*=0.0"),
        (dict(attn_logits_soft_cap=-1), r"attn_logits_soft_cap=-1"),
    ],
    ids=[
        "rank",
        "head_size",
        "length",
        "mask",
        "dropout_1",
        "dropout_neg",
        "int",
        "heads",
        "kv_heads_divide",
        "scale_neg",
        "scale_inf",
        "bias_shape",
        "bias_dtype",
        "window_zero",
        "window_float",
        "cap_zero",
        "cap_negative",
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    q, k, v = random_inputs()
    args = dict(query=q, key=k, value=v)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(**args)


def test_bad_seed_raises_value_error():
    q, k, v = random_inputs()
    with pytest.raises(ValueError, match=r"`seed` must be an int, None, or a \(2,\) integer"):
        scaled_dot_product_attention(q, k, v, dropout_rate=0.5, training=True, seed=[1, 2, 3])


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_bfloat16_keeps_float32_scores_and_softmax(path):
    """The promise: float32 scores and softmax for half inputs, so the output is within
    one bfloat16 ulp of the float64 reference rounded to bfloat16, even with large logits.

    Logits of a few hundred make a bfloat16 softmax drift by many ulps: `exp` of a
    logit rounded to 8 bits of mantissa is off by up to `exp(1)`.
    """
    rng = np.random.default_rng(21)
    q = tensor(rng.normal(size=(B, 16, N, H)) * 12.0, "bfloat16")
    k = tensor(rng.normal(size=(B, 24, N, H)) * 12.0, "bfloat16")
    v = tensor(rng.normal(size=(B, 24, N, HV)), "bfloat16")
    out = scaled_dot_product_attention(q, k, v, implementation=path, chunk_size=8)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    want, _ = reference(*(numpy(x, "float64") for x in (q, k, v)))
    want_bf16 = numpy(ops.cast(tensor(want), "bfloat16"), "float64")
    magnitude = np.maximum(np.abs(want_bf16), 2.0**-20)
    ulp = 2.0 ** (np.floor(np.log2(magnitude)) - 7)  # bfloat16 keeps 8 significant bits
    error = np.abs(numpy(out, "float64") - want_bf16)
    assert (error <= ulp).all(), f"{(error / ulp).max():.1f} ulps"


def test_dropout_applies_one_mask_to_the_weights_before_the_values():
    """out == (weights * keep / (1 - rate)) @ V for a random V, with the same seed.

    The keep-mask is read from a second call with V = identity (same seed, same mask),
    so dropping outputs instead of weights, or rescaling wrongly, cannot pass.
    """
    rate = 0.4
    q, k, v = random_inputs(s=32, seed=5)
    kwargs = dict(dropout_rate=rate, training=True, seed=11, implementation="dense")
    out = scaled_dot_product_attention(q, k, v, **kwargs)
    eye = ops.tile(ops.eye(32, dtype="float32")[None, :, None, :], [B, 1, N, 1])  # (B, S, N, S)
    applied = np.transpose(numpy(scaled_dot_product_attention(q, k, eye, **kwargs)), (0, 2, 1, 3))
    keep = applied != 0  # (B, N, T, S)
    want, _ = reference(q, k, v, keep=keep, dropout_rate=rate)
    np.testing.assert_allclose(numpy(out), want, atol=1e-5)
    assert 0.3 < 1 - keep.mean() < 0.5


def test_public_call_runs_the_xla_compiled_program(monkeypatch):
    """The public function reaches `program.compiled`, a `tf.function(jit_compile=True)` on
    TensorFlow (traced inline inside a caller's XLA program) and a `jax.jit` on JAX.

    That this function is one XLA program is `test_core_is_compiled_by_xla`.
    """
    compiled = program.compiled
    if BACKEND == "jax":
        assert isinstance(compiled, jax.stages.Wrapped)  # what jax.jit returns
    else:
        import tensorflow as tf

        # (Inside a caller's XLA program the core is traced into it instead: `.compiled` is
        # the program it runs everywhere else.)
        assert isinstance(compiled.compiled, tf.types.experimental.PolymorphicFunction)
        assert compiled.compiled._jit_compile is True
    paths = spy_on_paths(monkeypatch)
    q, k, v = random_inputs()
    scaled_dot_product_attention(q, k, v)
    assert paths == ["dense"]


@pytest.mark.tensorflow_only("AutoGraph and a caller's tf.function exist only on TensorFlow")
def test_a_callers_tf_function_runs_this_package_as_written():
    """A caller's `tf.function` converts what it calls with AutoGraph; the two entry points are
    `do_not_convert` (their branches are on static values), so the first trace does not pay
    for converting the package (benchmarks/tracing.py measures it).

    Seen from the mods, which run inside both: of the functions above them, only the caller's
    own is AutoGraph's code."""
    import inspect

    import tensorflow as tf

    stacks = []

    def converted():
        return [f.function for f in inspect.stack() if "__autograph_generated" in f.filename]

    def score(s, b, h, q_idx, kv_idx):
        stacks.append(converted())
        return s * 2.0

    def causal(b, h, q_idx, kv_idx):
        stacks.append(converted())
        return q_idx >= kv_idx

    @tf.function
    def attend(q, k, v):
        block_mask = ops_module.create_block_mask(causal, B, N, T, S, block_size=2)
        return scaled_dot_product_attention(
            q,
            k,
            v,
            score_mod=score,
            mask_mod=causal,
            block_mask=block_mask,
            implementation="chunked",
        )

    q, k, v = random_inputs()
    got = attend(q, k, v)
    np.testing.assert_allclose(
        numpy(got), reference(q, k, v, is_causal=True, scale=2 / H**0.5)[0], atol=1e-5
    )
    assert len(stacks) >= 2
    for stack in stacks:
        assert stack and set(stack) == {"tf__attend"}, stack


@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(implementation="chunked"), "chunked"),
        (dict(implementation="chunked", dropout_rate=0.2, training=True), "chunked"),
        (dict(implementation="chunked", return_weights=True), "dense"),
        (dict(implementation="auto"), "dense"),
        (dict(implementation="dense"), "dense"),
    ],
    ids=["chunked", "chunked_dropout", "weights_force_dense", "auto_small", "dense"],
)
def test_which_path_the_public_call_takes(kwargs, want, monkeypatch):
    paths = spy_on_paths(monkeypatch)
    q, k, v = random_inputs()
    scaled_dot_product_attention(q, k, v, **kwargs)
    assert paths == [want]


def test_auto_takes_the_chunked_path_for_large_scores(monkeypatch):
    paths = spy_on_paths(monkeypatch)
    monkeypatch.setattr(_plan, "AUTO_CHUNKED_BYTES", B * N * T * S * 4 - 1)
    q, k, v = random_inputs()
    scaled_dot_product_attention(q, k, v, chunk_size=2)
    assert paths == ["chunked"]
    # Sequences no longer than one block stay dense, however large the batch: the chunked
    # path would hold a whole (T, S) block per head too.
    scaled_dot_product_attention(q, k, v, chunk_size=max(T, S))
    assert paths == ["chunked", "dense"]


def test_chunked_blocks_are_never_longer_than_the_sequences(monkeypatch):
    """A block of 2048 for T = S = 512 padded a serving batch of 256 to 24 GiB of scores."""
    sizes = spy_on_paths(monkeypatch, "chunk_size")
    q, k, v = random_inputs()
    expected = scaled_dot_product_attention(q, k, v, implementation="dense")
    got = scaled_dot_product_attention(q, k, v, implementation="chunked")
    scaled_dot_product_attention(q, k, v, implementation="chunked", chunk_size=2)
    assert sizes == [2048, max(T, S), 2]
    np.testing.assert_allclose(numpy(got), numpy(expected), atol=1e-5)


def test_the_request_holds_every_keyword_of_the_public_function_with_its_default():
    """`scaled_dot_product_attention` passes its keyword arguments on by name, as one
    `_request.Request`: an option missing from the request would be dropped, and a default
    written twice could drift."""
    parameters = inspect.signature(scaled_dot_product_attention).parameters
    keywords = {
        name: parameter.default
        for name, parameter in parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY and name != "bias"
    }
    assert list(_request.CORE_OPTIONS) == list(keywords)
    request = _request.Request()
    assert {name: getattr(request, name) for name in _request.CORE_OPTIONS} == keywords


@pytest.mark.tensorflow_only("the refusal of the TensorFlow backend")
def test_context_parallel_names_the_jax_backend_on_tensorflow():
    """The ring is JAX's (`tests/core/ring_on_8_devices.py` runs it on 8 devices)."""
    q, k, v = random_inputs()
    with pytest.raises(ValueError, match="runs on Keras's JAX backend.*context_parallel='seq'"):
        scaled_dot_product_attention(q, k, v, context_parallel="seq")
    with pytest.raises(ValueError, match="name of a device mesh axis. Received: context_para"):
        scaled_dot_product_attention(q, k, v, context_parallel=3)
