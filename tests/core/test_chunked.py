"""The chunked (O(T) memory) core against the dense core, NumPy, and finite differences.

Written on `keras.ops`, NumPy and `on_backend`, so it runs on TensorFlow and on JAX.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops
from on_backend import (
    BACKEND,
    assert_gradients_match_finite_differences,
    gradient_to_variables,
    numpy,
    optimized_hlo,
    spy_on_paths,
    tensor,
)
from test_ops import MASKS, core_kwargs, make_mask, outputs_and_gradients, reference

from keras_sdpa import ScaledDotProductAttention
from keras_sdpa._core import chunk_sizes, program
from keras_sdpa._core import plan as _plan
from keras_sdpa.ops import scaled_dot_product_attention

B, N, H, HV = 2, 3, 6, 5
CHUNK = 4  # small, so every test crosses several blocks and a ragged last one

# (T, S): divisible by the chunk, ragged, T < S, T > S, a single partial block.
LENGTHS = [(8, 8), (11, 11), (7, 13), (13, 6), (3, 3)]


def inputs(t, s, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, t, N, H), (B, s, N, H), (B, s, N, HV)]
    return [tensor(rng.normal(size=shape), dtype) for shape in shapes]


def mask_for(kind, t, s):
    mask = make_mask(kind, t=t, s=s)
    if mask is not None and mask.ndim == 4 and mask.shape[1] not in (1, N):
        mask = mask[:, :1]  # test_ops builds masks for its own N
    return mask


def run(implementation, q, k, v, mask, is_causal, scale=None):
    """Output and the gradients of a loss that weighs every output element differently (as
    NumPy arrays)."""
    size = math.prod(q.shape[:3]) * HV
    weights = ops.cos(ops.reshape(ops.arange(size, dtype=q.dtype), (*q.shape[:3], HV)))

    def loss(q, k, v):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            is_causal=is_causal,
            scale=scale,
            implementation=implementation,
            chunk_size=CHUNK,
        )
        return ops.sum(out * weights), out

    out, grads = outputs_and_gradients(loss, q, k, v)
    return [out, *grads]


@pytest.mark.default_cases(
    "T7_S13-none-causal",
    "T7_S13-padding-full",
    "T7_S13-2d-causal",
    "T13_S6-full-causal",
    "T13_S6-fully_masked_rows-full",
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("t, s", LENGTHS, ids=[f"T{t}_S{s}" for t, s in LENGTHS])
def test_chunked_equals_dense_forward_and_gradients(t, s, mask_kind, is_causal):
    q, k, v = inputs(t, s)
    mask = mask_for(mask_kind, t, s)
    dense = run("dense", q, k, v, mask, is_causal)
    chunked = run("chunked", q, k, v, mask, is_causal)
    for name, a, b in zip(["out", "d_q", "d_k", "d_v"], dense, chunked):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", MASKS)
def test_chunked_matches_numpy_reference(mask_kind, is_causal):
    t, s = 11, 9
    q, k, v = inputs(t, s, "float64")
    mask = mask_for(mask_kind, t, s)
    out = scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, scale=0.7, implementation="chunked", chunk_size=CHUNK
    )
    want, _ = reference(q, k, v, mask, is_causal=is_causal, scale=0.7)
    np.testing.assert_allclose(numpy(out), want, atol=1e-12)


def test_chunked_bfloat16_equals_dense():
    q, k, v = inputs(13, 10, "bfloat16")
    mask = mask_for("padding", 13, 10)
    dense = run("dense", q, k, v, mask, True)
    chunked = run("chunked", q, k, v, mask, True)
    for a, b in zip(dense, chunked):
        np.testing.assert_allclose(
            np.asarray(b, np.float32), np.asarray(a, np.float32), atol=1e-2, rtol=1e-2
        )


def test_chunked_fully_masked_rows_are_zero_with_finite_gradients():
    t, s = 9, 10
    q, k, v = inputs(t, s)
    mask = np.ones((B, 1, t, s), bool)
    mask[0, 0, 2] = False  # one query row of example 0 sees nothing
    mask[1] = False  # example 1 sees nothing at all
    out, d_q, d_k, d_v = run("chunked", q, k, v, mask, False)
    np.testing.assert_array_equal(out[0, 2], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    for grad in (d_q, d_k, d_v):
        assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(d_k[1], 0.0)


@pytest.mark.default_cases("causal")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_chunked_gradients_match_finite_differences(is_causal):
    t, s = 7, 6
    q, k, v = inputs(t, s, "float64")
    mask = mask_for("fully_masked_rows", t, s)
    c = np.random.default_rng(3).normal(size=(B, t, N, HV))

    def loss(q, k, v):
        out = scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, implementation="chunked", chunk_size=CHUNK
        )
        return ops.sum(out * c)

    assert_gradients_match_finite_differences(loss, [q, k, v])


def test_chunked_path_is_one_xla_program_with_loops():
    q, k, v = inputs(11, 11)
    kwargs = core_kwargs(num_heads=N, num_kv_heads=N, is_causal=True, chunk_size=CHUNK)
    core = program.compiled
    chunked = dict(plan=kwargs["plan"].replace(path="chunked"))
    hlo = optimized_hlo(core, q, k, v, None, None, None, (), (), None, (), **chunked)
    assert "while" in hlo and " dot(" in hlo and "exponential(" in hlo
    dense = optimized_hlo(core, q, k, v, None, None, None, (), (), None, (), **kwargs)
    assert "while" not in dense


def test_auto_picks_chunked_only_for_large_scores_without_weights():
    small = ops.zeros((1, 128, 4, 8))
    large = ops.zeros((1, 8192, 4, 8))  # 1 * 4 * 8192^2 * 4 bytes = 1 GiB of scores
    wide = ops.zeros((1024, 512, 4, 8))  # 4 GiB of scores, in sequences shorter than a block
    unknown = keras.KerasTensor((None, None, 4, 8))  # lengths unknown while tracing
    block = 2048
    choose = _plan.choose_path
    assert choose("auto", small, small, False, block) == "dense"
    assert choose("auto", large, large, False, block) == "chunked"
    assert choose("auto", wide, wide, False, block) == "dense"
    assert choose("auto", large, large, True, block) == "dense"  # weights need (T, S)
    if BACKEND == "jax":
        # JAX traces every call with its shapes known, always as inside a compiled program
        # (`_inside_xla`): unknown lengths cannot wait for run time there, and stay dense.
        assert choose("auto", unknown, unknown, False, block) == "dense"
    else:
        assert choose("auto", unknown, unknown, False, block) == "auto"  # at run time
    assert choose("chunked", small, small, False, block) == "chunked"
    assert choose("dense", large, large, False, block) == "dense"


@pytest.mark.parametrize(
    "length, chunked, chunk_size", [(1024, False, None), (4096, True, 256)], ids=["T1024", "T4096"]
)
def test_a_mask_tensor_takes_small_blocks_only_past_one_default_block(length, chunked, chunk_size):
    """A `(T, S)` mask (B=16, N=8: 512 MiB of scores at T=1,024) keeps "auto"'s choice as
    without it up to one default block, dense at T=1,024 (blocks of 512 took 1.66x its time
    on an unstructured mask), and past it runs the chunked path in blocks sized to the batch
    and heads (16 MiB of scores a step, 256 at the least, as here), which skip what the mask
    empties."""
    q = ops.zeros((16, length, 8, 1))
    mask = np.tril(np.ones((length, length), bool))[None, None]
    plan, _ = _plan.make(q, q, q, mask)
    taken = bool(_plan.chunked_by_size(plan, q, q)) if plan.by_size else plan.path == "chunked"
    assert taken == chunked
    if chunked:
        assert (plan.query_chunk_size, plan.chunk_size) == (chunk_size, chunk_size)


def test_dropout_and_weights_fall_back_to_dense():
    q, k, v = inputs(9, 9)
    kwargs = dict(dropout_rate=0.3, training=True, seed=11, return_weights=True)
    dense = scaled_dot_product_attention(q, k, v, implementation="dense", **kwargs)
    chunked = scaled_dot_product_attention(q, k, v, implementation="chunked", **kwargs)
    for a, b in zip(dense, chunked):
        np.testing.assert_array_equal(numpy(a), numpy(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(implementation="flash"), r"`implementation` must be.*implementation='flash'"),
        (dict(chunk_size=0), r"`chunk_size` must be None or a positive int.*chunk_size=0"),
        (dict(chunk_size=2.5), r"chunk_size=2.5"),
    ],
    ids=["implementation", "chunk_zero", "chunk_float"],
)
def test_bad_implementation_arguments(kwargs, match):
    q, k, v = inputs(3, 3)
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_layer_results_do_not_depend_on_the_implementation():
    rng = np.random.default_rng(0)
    query = tensor(rng.normal(size=(B, 11, 16)), "float32")
    value = tensor(rng.normal(size=(B, 9, 12)), "float32")
    mask = tensor(rng.random((B, 11, 9)) > 0.3)
    layers = {
        name: ScaledDotProductAttention(num_heads=2, key_dim=4, implementation=name, chunk_size=4)
        for name in ("dense", "chunked")
    }
    layers["dense"](query, value)
    layers["chunked"](query, value)
    layers["chunked"].set_weights(layers["dense"].get_weights())
    results = {}
    for name, layer in layers.items():

        def loss(layer=layer):
            out = layer(query, value, attention_mask=mask, use_causal_mask=True)
            return ops.sum(out * ops.sin(out))

        # The output of the same call, outside the autodiff (no dropout: deterministic).
        out = numpy(layer(query, value, attention_mask=mask, use_causal_mask=True))
        results[name] = [out, *gradient_to_variables(loss, layer.trainable_weights)]
    for a, b in zip(results["dense"], results["chunked"]):
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_layer_config_round_trips_the_implementation():
    layer = ScaledDotProductAttention(
        num_heads=2, key_dim=4, implementation="chunked", chunk_size=64
    )
    config = layer.get_config()
    assert config["implementation"] == "chunked" and config["chunk_size"] == 64
    clone = ScaledDotProductAttention.from_config(config)
    assert clone.implementation == "chunked" and clone.chunk_size == 64
    with pytest.raises(ValueError, match="implementation='fast'"):
        ScaledDotProductAttention(implementation="fast")
    with pytest.raises(ValueError, match="chunk_size=-1"):
        ScaledDotProductAttention(chunk_size=-1)


def test_layer_in_a_keras_model_trains_with_chunked_attention():
    x = keras.Input((None, 8))
    y = ScaledDotProductAttention(num_heads=2, key_dim=4, implementation="chunked", chunk_size=4)(
        x, x
    )
    model = keras.Model(x, keras.layers.GlobalAveragePooling1D()(y))
    model.compile("adam", "mse")
    data = np.random.default_rng(0).normal(size=(8, 10, 8)).astype("float32")
    history = model.fit(data, data.mean(1), epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_default_blocks_are_evened_out_over_the_length(monkeypatch):
    """Without a `chunk_size`, the blocks cover the length evenly in multiples of 128 (4,097
    tokens in 3 blocks of 1408, not 2048 + 2048 + a block of padding); a given one is kept."""
    assert chunk_sizes.balanced_chunk_size(4097, 2048) == 1408
    assert chunk_sizes.balanced_chunk_size(8192, 2048) == 2048
    assert chunk_sizes.balanced_chunk_size(3000, 2048) == 1536
    assert chunk_sizes.balanced_chunk_size(129, 128) == 128
    seen = spy_on_paths(monkeypatch, "chunk_size")
    monkeypatch.setattr(chunk_sizes, "sized", lambda *args, **kwargs: 512)
    rng = np.random.default_rng(0)
    q, k, v = (tensor(rng.standard_normal((1, 520, 1, 8)), "float32") for _ in range(3))
    got = scaled_dot_product_attention(q, k, v, implementation="chunked")
    given = scaled_dot_product_attention(q, k, v, implementation="chunked", chunk_size=512)
    assert seen == [384, 512]  # 520 tokens: 2 blocks of 384, not 512 + 8; a given size kept
    want = scaled_dot_product_attention(q, k, v, implementation="dense")
    np.testing.assert_allclose(numpy(got), numpy(want), atol=1e-5)
    np.testing.assert_allclose(numpy(given), numpy(want), atol=1e-5)


def test_default_blocks_hold_16_mib_of_scores_a_step():
    """The default block `C` is the largest power of two (256 to 2048) with `B N C^2` scores
    of 16 MiB at most: blocks of 1024 at B=1, N=4, of 512 at N=8 (float64: 512 at N=4)."""
    assert chunk_sizes.sized(1, 4) == 1024
    assert chunk_sizes.sized(1, 8) == 512
    assert chunk_sizes.sized(None, 2) == 512  # a batch unknown while tracing counts as 8
    assert chunk_sizes.sized(1, 4, compute_bytes=8) == 512
    assert chunk_sizes.sized(16, 8) == 256 and chunk_sizes.sized(1, 1) == 2048


def test_short_queries_against_long_keys_take_short_query_blocks():
    """64 queries against 16,384 keys: query blocks of 64, not 64 padded to a key block."""
    q, k = ops.zeros((1, 64, 4, 8)), ops.zeros((1, 16384, 4, 8))
    plan, _ = _plan.make(q, k, k, request=_plan._request.Request(implementation="chunked"))
    assert (plan.query_chunk_size, plan.chunk_size) == (64, 1024)


def assert_chunked_is_dense(q, k, v, **kwargs):
    """The chunked path's output and gradients (of the output weighted by `cos(t)` per
    query) are the dense path's."""
    t = q.shape[1]

    def run(implementation):
        def loss(q, k, v):
            out = scaled_dot_product_attention(q, k, v, implementation=implementation, **kwargs)
            weights = ops.cos(ops.arange(t, dtype="float32"))[None, :, None, None]
            return ops.sum(out * weights), out

        out, grads = outputs_and_gradients(loss, q, k, v)
        return [out, *grads]

    for got, want in zip(run("chunked"), run("dense")):
        np.testing.assert_allclose(got, want, atol=2e-5)


RECTANGLES = {
    "causal": dict(is_causal=True),
    "mask": {},
    "window": dict(sliding_window=70),
    "causal_window_gqa": dict(is_causal=True, sliding_window=50),
    "mask_bias": {},
}


@pytest.mark.parametrize("case", list(RECTANGLES), ids=list(RECTANGLES))
def test_rectangular_blocks_give_the_dense_result_and_gradients(case, monkeypatch):
    """Query blocks of 96 against key blocks of 160 (neither divides the other, nor the
    lengths): the blocks a causal mask or a window empties are found and skipped on both
    axes, and outputs and gradients are the dense path's."""
    monkeypatch.setattr(chunk_sizes, "fitted", lambda *args, **kwargs: (96, 160))
    rng = np.random.default_rng(2)
    t, s, kv_heads = 350, 500 if "mask" in case else 350, 1 if "gqa" in case else 2
    q = tensor(rng.standard_normal((1, t, 2, 8)), "float32")
    k, v = (tensor(rng.standard_normal((1, s, kv_heads, 8)), "float32") for _ in range(2))
    kwargs = dict(RECTANGLES[case])
    if "mask" in case:  # T != S: with a bias, the two-pass gradient; without, the one pass
        kwargs.update(mask=tensor(rng.random((1, 1, t, s)) > 0.3))
    if "bias" in case:
        kwargs.update(bias=tensor(rng.standard_normal((1, 2, 1, s)), "float32"))

    assert_chunked_is_dense(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "case", ["causal", "mask", "gqa_cross"], ids=["causal", "mask", "gqa_cross"]
)
def test_evened_default_blocks_give_the_dense_result_and_gradients(case, monkeypatch):
    """The evened-out default blocks (T=520 in blocks of 512: 2 of 384) with a causal mask, a
    boolean mask, and grouped heads over keys of another length: outputs and gradients are
    the dense path's."""
    monkeypatch.setattr(chunk_sizes, "sized", lambda *args, **kwargs: 512)
    query_blocks = spy_on_paths(monkeypatch, "query_chunk_size")
    key_blocks = spy_on_paths(monkeypatch, "chunk_size")
    rng = np.random.default_rng(1)
    t, s, heads, kv_heads = (520, 700, 2, 1) if case == "gqa_cross" else (520, 520, 2, 2)
    q = tensor(rng.standard_normal((1, t, heads, 8)), "float32")
    k, v = (tensor(rng.standard_normal((1, s, kv_heads, 8)), "float32") for _ in range(2))
    kwargs = {
        "causal": dict(is_causal=True),
        "mask": dict(mask=tensor(rng.random((1, 1, t, s)) > 0.3)),
        "gqa_cross": {},
    }[case]

    assert_chunked_is_dense(q, k, v, **kwargs)
    assert (query_blocks[0], key_blocks[0]) == (384, 384)


def _banded_mask(t, s, window=None, padding=0):
    """Causal (or a window) and key padding, as a `(1, 1, T, S)` boolean tensor: keras-hub's
    decoders give their kernels this mask, not `is_causal`."""
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= rows - cols < window
    mask &= cols < s - padding
    return mask[None, None]


def _visits_with_mask(mask, c):
    """How many blocks the chunked forward computes with `mask` as a tensor (the loop's own
    counter), at T=S=128."""
    t, s = mask.shape[-2:]
    rng = np.random.default_rng(0)
    q = tensor(rng.normal(size=(1, 1, 1, t, 4)), "float32")  # (B, K, G, T, H)
    k = tensor(rng.normal(size=(1, 1, s, 4)), "float32")
    plan = _plan.Plan(
        path="chunked",
        num_heads=1,
        num_kv_heads=1,
        dtype="float32",
        scale=1.0,
        chunk_size=c,
        mask_pattern=(False, False, True, True),
    )
    tensors = program.Tensors(mask=tensor(mask[:, :, None]))  # (1, 1, 1, T, S)
    from keras_sdpa._core import chunked as _chunked

    return int(_chunked.attend(q, k, k, plan, tensors, count_visits=True)[1][0])


@pytest.mark.parametrize(
    "mask_args, expected",
    [
        ({}, 36),  # causal: the 8 diagonal blocks and the 28 below
        ({"padding": 32}, 33),  # and the last 2 key blocks padding: 3 of those 36 empty
        ({"window": 16}, 8 + 7),  # the diagonal and the one below it
    ],
    ids=["causal", "causal_and_padding", "window"],
)
def test_a_mask_tensor_skips_the_blocks_it_empties(mask_args, expected):
    """keras-hub's decoders pass causal-and-padding (and windowed) masks as `(B, T, S)`
    tensors: the chunked loop computes only the blocks where the tensor allows a key, as many
    as `is_causal` or `sliding_window` would visit (T=S=128 in blocks of 16: 64 blocks)."""
    assert _visits_with_mask(_banded_mask(128, 128, **mask_args), 16) == expected


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window"])
def test_a_mask_tensor_that_empties_blocks_gives_the_dense_result(window):
    """Causal or windowed masks as tensors, padded keys in one example only and a fully
    masked query row, in blocks of 4: the blocks skipped change nothing, forward or
    gradients."""
    t = s = 13
    q, k, v = inputs(t, s)
    mask = np.concatenate(  # example 0 has 5 padded keys, example 1 none
        [_banded_mask(t, s, window=window, padding=5), _banded_mask(t, s, window=window)]
    )
    mask[0, 0, 6] = False  # a query row that sees nothing
    dense = run("dense", q, k, v, mask, False)
    chunked = run("chunked", q, k, v, mask, False)
    for name, a, b in zip(["out", "d_q", "d_k", "d_v"], dense, chunked):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)
    want, _ = reference(*map(numpy, (q, k, v)), mask)
    np.testing.assert_allclose(chunked[0], want, atol=1e-5)
