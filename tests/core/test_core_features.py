"""Bias, grouped heads, sliding window, soft cap, chunked dropout and edge sizes of the core.

Every feature is checked on both paths, forward and gradient, against references
that share no code with the core: a float64 NumPy forward pass, and the gradient
the backend's autodiff (a `tf.GradientTape` or `jax.grad`) derives from a plain float64
formula on `keras.ops` (the core's gradients are hand-written, so this compares two
independent derivations). Written on `keras.ops` and NumPy: it runs on TensorFlow and JAX.
"""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from keras import ops
from on_backend import (
    assert_gradients_match_finite_differences,
    gradients,
    jit,
    numpy,
    optimized_hlo,
    tanh,
    tensor,
)
from reference import attention as reference

from keras_sdpa._core import blocks
from keras_sdpa.ops import scaled_dot_product_attention

# Pairwise-distinct sizes: batch, query/key length, query heads, key heads, head sizes.
B, T, S, N, K, H, HV = 2, 7, 9, 6, 2, 5, 3
CHUNK = 3  # small, so every chunked test crosses several blocks and ragged last ones
PATHS = ["dense", "chunked"]


def autodiff_reference(q, k, v, mask=None, bias=None, is_causal=False, window=None, cap=None):
    """The same formula on plain float64 `keras.ops`, for the gradient autodiff derives."""
    groups = q.shape[2] // k.shape[2]
    k, v = ops.repeat(k, groups, axis=2), ops.repeat(v, groups, axis=2)
    logits = ops.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    if cap is not None:
        logits = cap * tanh(logits / cap)
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask, logits.shape)
    offset = np.arange(logits.shape[2])[:, None] - np.arange(logits.shape[3])[None, :]
    if is_causal:
        allowed &= offset >= 0
    if window is not None:
        allowed &= np.abs(offset) < window
    weights = ops.softmax(ops.where(allowed, logits, -1e30), axis=-1)
    weights = ops.where(allowed.any(-1, keepdims=True), weights, 0.0)  # fully masked rows
    return ops.einsum("bnts,bsnh->btnh", weights, v)


def inputs(seed=0, t=T, s=S, n=N, k=K, dtype="float64"):
    rng = np.random.default_rng(seed)
    shapes = [(B, t, n, H), (B, s, k, H), (B, s, k, HV)]
    return [tensor(rng.normal(size=shape), dtype) for shape in shapes]


def padding_and_holes(t=T, s=S, seed=1):
    """`(B, 1, T, S)`: random holes, and query 2 of example 0 sees no key at all."""
    mask = np.random.default_rng(seed).random((B, 1, t, s)) > 0.3
    mask[0, 0, 2] = False
    return mask


FEATURES = {
    "bias_per_head": dict(bias=(1, N, T, S)),
    "bias_per_key": dict(bias=(B, 1, 1, S)),
    "bias_2d": dict(bias=(T, S)),
    "bias_per_head_scalar": dict(bias=(N, 1, 1)),
    "window": dict(window=3),
    "causal_window": dict(window=2, is_causal=True),
    "cap": dict(cap=1.5),
    "mask_causal": dict(mask=True, is_causal=True),
    "everything": dict(bias=(1, N, T, S), mask=True, is_causal=True, window=4, cap=2.0),
}


def feature_args(spec, seed=3):
    spec = dict(spec)
    rng = np.random.default_rng(seed)
    if "bias" in spec:
        spec["bias"] = tensor(rng.normal(size=spec["bias"]) * 2.0)
    if spec.get("mask"):
        spec["mask"] = padding_and_holes()
    return spec


def core_call(q, k, v, path, spec):
    return scaled_dot_product_attention(
        q,
        k,
        v,
        spec.get("mask"),
        bias=spec.get("bias"),
        is_causal=spec.get("is_causal", False),
        sliding_window=spec.get("window"),
        attn_logits_soft_cap=spec.get("cap"),
        implementation=path,
        chunk_size=CHUNK,
    )


@pytest.mark.default_cases(
    "mha-dense-everything",
    "gqa-chunked-everything",
    "mqa-chunked-everything",
    "mha-chunked-bias_per_head_scalar",
    "gqa-dense-window",
    "mqa-chunked-bias_per_key",
    "gqa-dense-bias_2d",
)
@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_heads", [N, K, 1], ids=["mha", "gqa", "mqa"])
def test_forward_matches_numpy_reference(feature, path, kv_heads):
    q, k, v = inputs(k=kv_heads)
    spec = feature_args(FEATURES[feature])
    out = core_call(q, k, v, path, spec)
    want, _ = reference(q, k, v, **spec)
    np.testing.assert_allclose(numpy(out), want, atol=1e-10)


@pytest.mark.default_cases(
    "dense-everything", "chunked-everything", "chunked-bias_2d", "dense-bias_per_key"
)
@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
@pytest.mark.parametrize("path", PATHS)
def test_gradients_match_autodiff_of_the_formula(feature, path):
    q, k, v = inputs(k=K)
    spec = feature_args(FEATURES[feature])
    c = tensor(np.random.default_rng(9).normal(size=(B, T, N, HV)))
    watched = [q, k, v] + ([spec["bias"]] if "bias" in spec else [])

    def with_bias(bias):  # the spec, its bias (if any) the differentiated one
        return {**spec, **dict(zip(["bias"], bias))}

    def ours(q, k, v, *bias):
        return ops.sum(core_call(q, k, v, path, with_bias(bias)) * c)

    def theirs(q, k, v, *bias):
        return ops.sum(autodiff_reference(q, k, v, **with_bias(bias)) * c)

    got = gradients(ours, *watched)
    want = gradients(theirs, *watched)
    for name, a, b in zip(["d_query", "d_key", "d_value", "d_bias"], got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, atol=1e-10, err_msg=name)


@pytest.mark.default_cases("per_key-chunked")  # dense: the autodiff comparison, above
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(1, N, T, S), (B, 1, 1, S)], ids=["per_head", "per_key"])
def test_bias_gradient_matches_finite_differences(path, shape):
    """`d bias` is summed over the axes the bias broadcasts on, on both paths."""
    q, k, v = inputs(4, k=K)
    bias = tensor(np.random.default_rng(5).normal(size=shape))
    mask = padding_and_holes()
    c = tensor(np.random.default_rng(6).normal(size=(B, T, N, HV)))

    def loss(bias):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            is_causal=True,
            sliding_window=5,
            attn_logits_soft_cap=3.0,
            implementation=path,
            chunk_size=CHUNK,
        )
        return ops.sum(out * c)

    assert_gradients_match_finite_differences(loss, [bias])


def test_alibi_bias_matches_reference_in_float32():
    """ALiBi (Press et al., 2022) as the README writes it: a per-head slope times distance."""
    q, k, v = inputs(8, t=T, s=T, dtype="float32")
    slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)  # (N,)
    distance = np.arange(T)[None, :] - np.arange(T)[:, None]  # (T, S): s - t
    alibi = tensor((slopes[:, None, None] * distance)[None], "float32")  # (1, N, T, S)
    for path in PATHS:
        out = scaled_dot_product_attention(
            q, k, v, bias=alibi, is_causal=True, implementation=path, chunk_size=CHUNK
        )
        want, _ = reference(q, k, v, bias=alibi, is_causal=True)
        np.testing.assert_allclose(numpy(out), want, atol=1e-5)


def test_soft_cap_bounds_the_logits():
    """With a cap, no logit passes it: scaling the queries up cannot sharpen past cap."""
    q, k, v = inputs(10, k=N)
    _, weights = scaled_dot_product_attention(
        q * 1000.0, k, v, attn_logits_soft_cap=1.0, return_weights=True
    )
    # Logits within [-1, 1] bound any weight ratio in a row by e^2.
    ratio = ops.max(weights, -1) / ops.min(weights, -1)
    assert float(ops.max(ratio)) <= np.exp(2.0) + 1e-9


@pytest.mark.default_cases("chunked")
@pytest.mark.parametrize("path", PATHS)
def test_grouped_keys_are_not_repeated_in_memory(path):
    """The compiled program never materializes N-head keys: no tensor has N * S * H keys."""
    q, k, v = inputs(k=1, t=64, s=80, dtype="float32")
    attention = jit(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, implementation=path, chunk_size=32)
    )
    hlo = optimized_hlo(attention, q, k, v)
    repeated = f"f32[{B},{N},80,{H}]"  # keys broadcast to N heads, in the core's layout
    assert repeated not in hlo
    assert f"f32[{B},1,80,{H}]" in hlo or f"f32[{B},80,1,{H}]" in hlo


@pytest.mark.parametrize("sizes", [(8, 8), (6, 10), (12, 5)], ids=["8x8", "6x10", "12x5"])
@pytest.mark.parametrize("window", [None, 1, 5, 8, 13], ids=lambda w: f"window_{w}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["both_sides", "causal"])
@pytest.mark.parametrize("t, s", [(64, 64), (40, 72), (72, 40)], ids=["square", "wide", "tall"])
def test_chunked_loops_visit_exactly_the_blocks_that_meet_the_band(t, s, is_causal, window, sizes):
    """The block ranges the chunked loops run over, against brute force over positions, for
    square blocks and for query blocks `C_q` and key blocks `C_k` of other sizes.

    A block pair is needed when some query of the one may see some key of the other.
    The loops must visit every needed pair (or results would be wrong) and no other
    (or a window would cost O(T * S), not O(T * W)).
    """
    cq, ck = sizes
    num_q, num_k = -(-t // cq), -(-s // ck)
    tq, sk = np.arange(t)[:, None], np.arange(s)[None, :]
    allowed = np.ones((t, s), bool)
    if is_causal:
        allowed &= sk <= tq
    if window is not None:
        allowed &= np.abs(tq - sk) < window

    def meets(i, j):
        return allowed[i * cq : (i + 1) * cq, j * ck : (j + 1) * ck].any()

    for i in range(num_q):
        lo, hi = (
            int(x) for x in blocks.key_block_range(i, num_k, sizes, is_causal, window, (t, s))
        )
        needed = [j for j in range(num_k) if meets(i, j)]
        assert list(range(lo, hi)) == needed, (i, lo, hi, needed)
    for j in range(num_k):
        lo, hi = (
            int(x) for x in blocks.query_block_range(j, num_q, sizes, is_causal, window, (t, s))
        )
        needed = [i for i in range(num_q) if meets(i, j)]
        assert list(range(lo, hi)) == needed, (j, lo, hi, needed)


def test_chunked_dropout_gradient_redraws_the_same_mask():
    """Finite differences through seeded chunked dropout: the gradient's mask is the forward's."""
    q, k, v = inputs(23, t=5, s=7, k=K)
    c = tensor(np.random.default_rng(24).normal(size=(B, 5, N, HV)))

    def loss(q, k, v):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_rate=0.4,
            training=True,
            seed=11,
            implementation="chunked",
            chunk_size=CHUNK,
        )
        return ops.sum(out * c)

    assert_gradients_match_finite_differences(loss, [q, k, v])


def dropout_keep_mask(seed, t=40, s=48, rate=0.3, path="chunked"):
    """The keep-mask, read off the output: uniform weights (q = 0) and one-hot values."""
    q = ops.zeros((1, t, 1, 4), "float64")
    k = ops.zeros((1, s, 1, 4), "float64")
    v = tensor(np.eye(s)[None, :, None, :])  # (1, S, 1, S): value s is e_s
    out = scaled_dot_product_attention(
        q, k, v, dropout_rate=rate, training=True, seed=seed, implementation=path, chunk_size=16
    )
    scaled = numpy(out)[0, :, 0, :] * (1.0 - rate) * s  # 1 where kept, 0 where dropped
    np.testing.assert_allclose(scaled, np.round(scaled), atol=1e-9)
    return np.round(scaled).astype(bool)  # (T, S)


def test_chunked_dropout_masks_are_seeded_and_independent_per_block():
    rate = 0.3
    keep = dropout_keep_mask(5, rate=rate)
    np.testing.assert_array_equal(keep, dropout_keep_mask(5, rate=rate))  # reproducible
    assert (keep != dropout_keep_mask(6, rate=rate)).mean() > 0.2  # another seed, another mask
    # The kept fraction is 1 - rate, within 4 standard errors over T * S = 1920 draws.
    assert abs(keep.mean() - (1 - rate)) < 4 * np.sqrt(rate * (1 - rate) / keep.size)
    # Blocks draw their own masks: no two 16 x 16 blocks are equal.
    blocks = [keep[i : i + 16, j : j + 16] for i in (0, 16) for j in (0, 16, 32)]
    for a in range(len(blocks)):
        for b in range(a + 1, len(blocks)):
            assert (blocks[a] != blocks[b]).mean() > 0.2


@pytest.mark.large  # hypothesis: 30 random combinations, each a new program
@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(
    sizes=st.tuples(
        st.integers(1, 2),  # B
        st.integers(1, 9),  # T
        st.integers(1, 9),  # S
        st.integers(1, 3),  # K
        st.integers(1, 3),  # G
        st.integers(1, 4),  # H
        st.integers(1, 3),  # Hv
    ),
    options=st.fixed_dictionaries(
        {
            "mask": st.booleans(),
            "bias": st.sampled_from([None, "full", "per_head", "per_key"]),
            "window": st.one_of(st.none(), st.integers(1, 6)),
            "cap": st.one_of(st.none(), st.floats(0.5, 5.0)),
            "is_causal": st.booleans(),
            "path": st.sampled_from(PATHS),
            "chunk_size": st.integers(1, 5),
        }
    ),
    seed=st.integers(0, 2**16),
)
def test_property_every_combination_matches_the_reference(sizes, options, seed):
    b, t, s, k_heads, groups, h, hv = sizes
    n = k_heads * groups
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h))
    k = rng.normal(size=(b, s, k_heads, h))
    v = rng.normal(size=(b, s, k_heads, hv))
    mask = None
    if options["mask"]:
        mask = rng.random((b, 1, t, s)) > 0.4  # fully masked rows included, by chance
    bias = {
        None: None,
        "full": (b, n, t, s),
        "per_head": (n, 1, 1),
        "per_key": (b, 1, 1, s),
    }[options["bias"]]
    if bias is not None:
        bias = rng.normal(size=bias) * 2.0
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        mask,
        bias=bias,
        is_causal=options["is_causal"],
        sliding_window=options["window"],
        attn_logits_soft_cap=options["cap"],
        implementation=options["path"],
        chunk_size=options["chunk_size"],
    )
    want, _ = reference(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        is_causal=options["is_causal"],
        window=options["window"],
        cap=options["cap"],
    )
    np.testing.assert_allclose(numpy(out), want, atol=1e-10)
