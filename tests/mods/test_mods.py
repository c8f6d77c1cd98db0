"""Programmable attention: `score_mod`, `mask_mod`, the built-ins of `keras_sdpa.mods`, block
skipping, and the layer that holds them.

Every built-in is checked on both paths, forward and gradient, against references that
share no code with it: a float64 NumPy forward pass in which each mod is written again from
its definition, and the gradient the backend's autodiff (a `tf.GradientTape` on TensorFlow,
`jax.grad` on JAX) derives from a plain float64 formula on `keras.ops` (the core's gradient
goes through the mod by the backend's autodiff inside its own hand-written one). Written on
`keras.ops`, NumPy and `on_backend`: it runs on both backends.
"""

import math
import os
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import keras
import numpy as np
import pytest
from keras import ops
from on_backend import BACKEND, gradient_to_variable, gradients, jit, numpy, tanh, tensor
from reference import attention as reference

import keras_sdpa
from keras_sdpa import mods
from keras_sdpa._core import chunked as _chunked
from keras_sdpa._core import plan as _plan
from keras_sdpa._core import program
from keras_sdpa.ops import scaled_dot_product_attention

# Pairwise-distinct sizes; T and S are not multiples of the block.
B, T, S, N, K, H = 2, 7, 9, 6, 2, 5
CHUNK = 3
PATHS = ["dense", "chunked"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEGMENTS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 3, 3]])  # (B, S)
PREFIX = np.array([2, 5])


# ------------------------------------------ the mods again, in NumPy, from their definitions


def np_t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """T5's `_relative_position_bucket` (Raffel et al., 2020), one integer at a time."""
    bucket = 0
    n = relative
    if bidirectional:
        num_buckets //= 2
        if n > 0:
            bucket += num_buckets
        n = abs(n)
    else:
        n = max(-n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    ratio = math.log(n / exact) / math.log(max_distance / exact)
    large = exact + int(ratio * (num_buckets - exact))
    return bucket + min(large, num_buckets - 1)


# ALiBi's slopes from the paper's code for 8 heads (1/2 ... 1/256) and, for 6, the 4-head
# sequence then every other one of the 8-head sequence.
ALIBI_8 = [2.0**-i for i in range(1, 9)]
ALIBI_6 = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]

TABLE = np.random.default_rng(5).normal(size=(8, N))


def np_mask(name, b, h, q, kv):
    if name in ("causal", "causal_function"):
        return q >= kv
    if name == "sliding_window":
        return np.abs(q - kv) < 3
    if name == "prefix_lm_int":
        return (kv <= q) | (kv < 4)
    if name == "prefix_lm_rows":
        return (kv <= q) | (kv < PREFIX[b])
    if name == "document":
        return SEGMENTS[b, np.minimum(q, T - 1)] == SEGMENTS[b, kv]
    if name == "chunked_local":
        return q // 4 == kv // 4
    if name == "and_masks":
        return (q >= kv) & (np.abs(q - kv) < 3)
    if name == "or_masks":
        return (q // 4 == kv // 4) | (kv < 2)
    raise KeyError(name)


def np_score(name, score, b, h, q, kv):
    if name == "alibi":
        return score - np.array(ALIBI_6)[h] * np.abs(q - kv)
    if name == "soft_cap":
        return 2.0 * np.tanh(score / 2.0)
    if name in ("t5", "t5_causal"):
        bidirectional = name == "t5"
        buckets = np.vectorize(lambda d: np_t5_bucket(d, bidirectional, 8, 20))(kv - q)
        return score + TABLE[buckets, h]
    raise KeyError(name)


def make_mask(name):
    return {
        "causal": lambda: mods.causal(),
        "causal_function": lambda: lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        "sliding_window": lambda: mods.sliding_window(3),
        "prefix_lm_int": lambda: mods.prefix_lm(4),
        "prefix_lm_rows": lambda: mods.prefix_lm(tensor(PREFIX)),
        "document": lambda: mods.document(tensor(SEGMENTS[:, :T]), kv_segment_ids=tensor(SEGMENTS)),
        "chunked_local": lambda: mods.chunked_local(4),
        "and_masks": lambda: mods.and_masks(mods.causal(), mods.sliding_window(3)),
        "or_masks": lambda: mods.or_masks(mods.chunked_local(4), lambda b, h, q, kv: kv < 2),
    }[name]()


def make_score(name):
    if name == "alibi":
        return mods.alibi(N)
    if name == "soft_cap":
        return mods.soft_cap(2.0)
    table = mods.relative_position_bias(N, 8, 20, bidirectional=name == "t5")
    table.table.assign(TABLE)
    return table


MASKS = [
    "causal",
    "causal_function",
    "sliding_window",
    "prefix_lm_int",
    "prefix_lm_rows",
    "document",
    "chunked_local",
    "and_masks",
    "or_masks",
]
SCORES = ["alibi", "soft_cap", "t5", "t5_causal"]


def indices(t=T, s=S, n=N):
    return (
        np.arange(B)[:, None, None, None],
        np.arange(n)[None, :, None, None],
        np.arange(t)[None, None, :, None],
        np.arange(s)[None, None, None, :],
    )


def inputs(seed=0, kv_heads=K, dtype="float32"):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, S, kv_heads, H), (B, S, kv_heads, H)]
    return [tensor(rng.normal(size=shape), dtype) for shape in shapes]


# ------------------------------------------------------------------------------ the core


@pytest.mark.default_cases(
    "dense-and_masks",
    "chunked-or_masks",
    "chunked-document",
    "dense-prefix_lm_rows",
    "chunked-causal_function",
    "dense-prefix_lm_int",
)
@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("path", PATHS)
def test_mask_mods_match_numpy_reference(name, path):
    q, k, v = inputs(kv_heads=K)
    out = scaled_dot_product_attention(
        q, k, v, mask_mod=make_mask(name), implementation=path, chunk_size=CHUNK
    )
    want, _ = reference(q, k, v, mask_mod=lambda *i: np_mask(name, *i))
    np.testing.assert_allclose(numpy(out), want, atol=1e-5)


@pytest.mark.default_cases(
    "gqa-chunked-t5_causal", "mqa-dense-alibi", "mha-chunked-soft_cap", "mha-dense-t5"
)
@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_heads", [N, K, 1], ids=["mha", "gqa", "mqa"])
def test_score_mods_match_numpy_reference(name, path, kv_heads):
    q, k, v = inputs(kv_heads=kv_heads)
    out = scaled_dot_product_attention(
        q, k, v, score_mod=make_score(name), implementation=path, chunk_size=CHUNK
    )
    want, _ = reference(q, k, v, score_mod=lambda *a: np_score(name, *a))
    np.testing.assert_allclose(numpy(out), want, atol=1e-5)


def test_alibi_slopes_are_the_papers():
    np.testing.assert_allclose(mods.alibi_slopes(8), ALIBI_8)
    np.testing.assert_allclose(mods.alibi_slopes(6), ALIBI_6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_the_definition(bidirectional):
    distances = np.arange(-300, 301)
    got = mods.relative_position_bucket(tensor(distances), bidirectional, 32, 128)
    want = [np_t5_bucket(int(d), bidirectional, 32, 128) for d in distances]
    np.testing.assert_array_equal(numpy(got), want)


def autodiff_reference(q, k, v, table, name):
    """float64 keras.ops: the formula with T5's bias looked up in `table` (NumPy buckets)."""
    groups = q.shape[2] // k.shape[2]
    k, v = ops.repeat(k, groups, axis=2), ops.repeat(v, groups, axis=2)
    logits = ops.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    b, h, qi, ki = indices()
    buckets = np.vectorize(lambda d: np_t5_bucket(d, name == "t5", 8, 20))(ki - qi)[0, 0]
    bias = ops.transpose(ops.take(table, buckets, axis=0), [2, 0, 1])[None]  # (1, N, T, S)
    logits = logits + bias
    allowed = np.broadcast_to(np_mask("and_masks", b, h, qi, ki), logits.shape)
    weights = ops.softmax(ops.where(allowed, logits, -1e30), axis=-1)
    return ops.einsum("bnts,bsnh->btnh", weights, v)


@pytest.mark.default_cases("t5-chunked", "t5_causal-dense")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["t5", "t5_causal"])
def test_gradients_reach_the_inputs_and_the_t5_table(path, name):
    q, k, v = inputs(kv_heads=K)
    mod = make_score(name)
    weights = np.random.default_rng(9).normal(size=(B, T, N, H)).astype("float32")

    def loss(q, k, v):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            score_mod=mod,
            mask_mod=make_mask("and_masks"),
            implementation=path,
            chunk_size=CHUNK,
        )
        return ops.sum(out * weights)

    # The inputs' gradients by `gradients`, the table's (a Keras variable) by
    # `gradient_to_variable`: the same loss, differentiated twice.
    got = gradients(loss, q, k, v) + [gradient_to_variable(lambda: loss(q, k, v), mod.table)]
    q64, k64, v64 = (numpy(x, "float64") for x in (q, k, v))

    def ref_loss(q, k, v, table):
        ref = autodiff_reference(q, k, v, table, name)
        return ops.sum(ref * weights.astype("float64"))

    want = gradients(ref_loss, q64, k64, v64, TABLE, x64=True)
    for name_, g, w in zip(["q", "k", "v", "table"], got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name_)
    assert float(np.max(np.abs(got[3]))) > 1e-3  # the table's gradient is not zero


class Slopes(mods.Mod):
    """A score mod with a float tensor of its own: ALiBi with slopes given per call."""

    def __init__(self, slopes):
        self.slopes = slopes

    def __call__(self, score, b, h, q_idx, kv_idx):
        distance = ops.cast(ops.abs(q_idx - kv_idx), score.dtype)
        return score - ops.take(self.slopes, h, axis=0) * distance

    def _tensors(self):
        return (self.slopes,)

    def _with_tensors(self, tensors):
        return Slopes(tensors[0])


@pytest.mark.default_cases("chunked")
@pytest.mark.parametrize("path", PATHS)
def test_gradients_reach_a_mods_tensor_and_a_captured_variable(path):
    """The float tensor a `Mod` carries, a Keras variable a plain function reads and a plain
    tensor a closure captures all get the gradient autodiff gives the same formula."""
    q, k, v = inputs(kv_heads=N)
    slopes = tensor(ALIBI_6, "float32")
    scale = keras.Variable(0.7)

    def plain(score, b, h, q_idx, kv_idx):
        return score * scale

    def ours(mod):
        out = scaled_dot_product_attention(
            q, k, v, score_mod=mod, implementation=path, chunk_size=CHUNK
        )
        return ops.sum(out * out)

    def formula(mod):
        b, h, qi, ki = (tensor(x) for x in indices())
        logits = ops.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        logits = mod(logits, b, h, qi, ki)
        ref = ops.einsum("bnts,bsnh->btnh", ops.softmax(logits, -1), v)
        return ops.sum(ref * ref)

    def gradient(loss, mod):
        """The gradient to the Mod's slopes (an argument of the loss) or to `scale`."""
        if mod == "slopes":
            return gradients(lambda slopes: loss(Slopes(slopes)), slopes)[0]
        return gradient_to_variable(lambda: loss(plain), scale, nonzero=False)  # JAX: zero

    for mod in ("slopes", "scale"):
        if BACKEND == "jax" and mod == "scale":
            # On JAX the core sees only the variables a mod holds: a plain function's
            # outside variable is a constant of the trace and gets no gradient (as
            # docs/backends.md says; there, `mods.with_tensors` or a layer's weight). It
            # warns, naming the variable.
            with pytest.warns(UserWarning, match="read the variable .* which it does not hold"):
                got = gradient(ours, mod)
            want = gradient(formula, mod)
            assert np.abs(want) > 1e-3
            np.testing.assert_array_equal(got, 0.0)
            continue
        got, want = gradient(ours, mod), gradient(formula, mod)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def trace(fn):
    """`fn` traced as `fit` traces a step: a `tf.function` (graph, no XLA of its own) on
    TensorFlow; on JAX, where every trace is compiled, `jax.jit`."""
    if BACKEND == "jax":
        return jit(fn)
    import tensorflow as tf

    return tf.function(fn)


@pytest.mark.default_cases("dense")
@pytest.mark.parametrize("path", PATHS)
def test_gradients_reach_the_tensors_of_with_tensors(path):
    """`mods.with_tensors(fn, slopes)`, eagerly and inside a traced function (as in `fit`):
    `slopes` gets the gradient autodiff gives the same formula."""
    q, k, v = inputs(kv_heads=N)
    slopes = tensor(ALIBI_6, "float32")

    def alibi(score, b, h, q_idx, kv_idx, slopes):
        return score - ops.take(slopes, h, axis=0) * ops.cast(ops.abs(q_idx - kv_idx), score.dtype)

    def with_closure(slopes, attend):
        out = attend(mods.with_tensors(alibi, slopes))
        return ops.sum(out * out)

    def ours(mod):
        return scaled_dot_product_attention(
            q, k, v, score_mod=mod, implementation=path, chunk_size=CHUNK
        )

    def formula(mod):
        logits = ops.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        logits = mod(logits, *(tensor(x) for x in indices()))
        return ops.einsum("bnts,bsnh->btnh", ops.softmax(logits, -1), v)

    grads = []
    for attend in (ours, formula, ours):
        traced = lambda slopes, attend=attend: with_closure(slopes, attend)  # noqa: E731
        if len(grads) == 2:  # ours again, inside a traced function
            traced = trace(traced)
        grads.append(gradients(traced, slopes)[0])
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[2], grads[1], rtol=1e-4, atol=1e-5)
    assert float(np.max(np.abs(grads[0]))) > 1e-3


def test_captured_table_gradient_is_deterministic():
    """Two runs give bit-identical gradients for the T5 table, on the chunked path."""
    q, k, v = inputs(kv_heads=K)
    mod = make_score("t5")

    def table_gradient():
        def loss():
            out = scaled_dot_product_attention(
                q,
                k,
                v,
                score_mod=mod,
                mask_mod=mods.causal(),
                implementation="chunked",
                chunk_size=CHUNK,
            )
            return ops.sum(out * out)

        return gradient_to_variable(loss, mod.table)

    first, second = table_gradient(), table_gradient()
    assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("path", PATHS)
def test_mods_combine_with_the_built_in_arguments_in_the_documented_order(path):
    """logits * scale -> score_mod -> bias -> soft cap -> masks (mask_mod and the rest)."""
    q, k, v = inputs(kv_heads=K)
    rng = np.random.default_rng(2)
    bias = rng.normal(size=(1, N, T, S))
    mask = rng.random((B, 1, T, S)) > 0.2
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        mask,
        bias=tensor(bias, "float32"),
        is_causal=True,
        attn_logits_soft_cap=1.5,
        score_mod=make_score("alibi"),
        mask_mod=make_mask("document"),
        implementation=path,
        chunk_size=CHUNK,
    )

    def score(logits, b, h, qi, ki):
        logits = np_score("alibi", logits, b, h, qi, ki) + bias
        return 1.5 * np.tanh(logits / 1.5)

    def allowed(b, h, qi, ki):
        return np_mask("document", b, h, qi, ki) & mask & (qi >= ki)

    want, _ = reference(q, k, v, score_mod=score, mask_mod=allowed)
    np.testing.assert_allclose(numpy(out), want, atol=1e-5)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v = inputs(kv_heads=K)
    never = lambda b, h, q_idx, kv_idx: ops.logical_and(q_idx != 3, kv_idx >= 0)  # noqa: E731
    for path in PATHS:

        def attend(q, k, v, path=path):
            return scaled_dot_product_attention(
                q, k, v, mask_mod=never, implementation=path, chunk_size=CHUNK
            )

        np.testing.assert_array_equal(numpy(attend(q, k, v))[:, 3], 0.0)
        # The gradient of the sum of the outputs (what a tape gives for a tensor).
        for grad in gradients(lambda q, k, v: ops.sum(attend(q, k, v)), q, k, v):
            assert np.isfinite(grad).all()


# -------------------------------------------------------------------------- block skipping


def brute_force_kinds(mask, t, s, c):
    """Each block's kind from the whole `(B, N, T, S)` mask (0 empty, 1 partial, 2 full)."""
    nq, nk = -(-t // c), -(-s // c)
    kinds = np.zeros((nq, nk), int)
    for i in range(nq):
        for j in range(nk):
            block = mask[:, :, i * c : (i + 1) * c, j * c : (j + 1) * c]
            full = block.all() and (j + 1) * c <= s
            kinds[i, j] = 2 if full else (1 if block.any() else 0)
    return kinds


@pytest.mark.parametrize("name", MASKS)
def test_block_kinds_match_brute_force(name):
    """At T=7, S=9 in blocks of 3 (and 2): ragged last blocks on both axes."""
    b, h, qi, ki = indices()
    mask = np.broadcast_to(np_mask(name, b, h, qi, ki), (B, N, T, S))
    for c in (CHUNK, 2):
        got = keras_sdpa.create_block_mask(make_mask(name), B, N, T, S, block_size=c).kinds
        np.testing.assert_array_equal(
            numpy(got), brute_force_kinds(mask, T, S, c), err_msg=f"C={c}"
        )


def visits(mask_mod, t, s, c, block_kinds=None):
    """How many blocks the chunked forward computes, and in how many of them it calls the
    mask_mod (the loop's own counters)."""
    rng = np.random.default_rng(t)
    q = tensor(rng.normal(size=(1, 1, 1, t, 4)), "float32")  # (B, K, G, T, H)
    k = tensor(rng.normal(size=(1, 1, s, 4)), "float32")

    @jit
    def run(q, k):
        plan = _plan.Plan(
            path="chunked",
            num_heads=1,
            num_kv_heads=1,
            dtype="float32",
            scale=1.0,
            chunk_size=c,
        )
        tensors = program.Tensors(mask_mod=mask_mod, block_kinds=block_kinds)
        return _chunked.attend(q, k, k, plan, tensors, count_visits=True)

    return tuple(int(x) for x in run(q, k)[1])


def _unaligned_documents():
    return tensor(np.repeat(np.arange(11), 12)[None, :128])  # (1, 128): ragged


@pytest.mark.default_cases("document", "causal")
@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: mods.document(tensor(np.repeat(np.arange(8), 16)[None])), (8, 0)),
        (mods.causal, (36, 8)),
        (lambda: None, (64, 64)),
        (lambda: mods.sliding_window(16), (8 + 2 * 7, 2 * 7)),  # the diagonal: full
        (lambda: mods.document(_unaligned_documents()), None),  # from create_block_mask
    ],
    ids=["document", "causal", "none", "window", "unaligned_documents"],
)
def test_the_chunked_loop_visits_only_non_empty_blocks(make, expected):
    """A spy on the forward loop, at T=S=128 in blocks of 16: with 8 equal segments only the
    8 diagonal blocks of 8 x 8 are computed, all full, so the mod is never called in them;
    causal computes 36 of 64 and calls the mod on the 8 diagonal ones; without a mask_mod
    all 64; ragged segments visit what `create_block_mask` marks non-empty."""
    mask_mod = make()
    count, with_mod = visits(mask_mod, 128, 128, 16)
    if expected is None:
        kinds = numpy(keras_sdpa.create_block_mask(mask_mod, 1, 1, 128, 128, 16).kinds)
        expected = (int(np.sum(kinds > 0)), int(np.sum(kinds == 1)))
    assert (count, with_mod) == expected


@pytest.mark.parametrize(
    "mask_mod, lowered",
    [
        (mods.causal(), (True, None, False)),
        (mods.sliding_window(4), (False, 4, False)),
        (mods.and_masks(mods.causal(), mods.sliding_window(4)), (True, 4, False)),
        (mods.and_masks(mods.sliding_window(5), mods.chunked_local(4)), (False, 5, True)),
        (mods.or_masks(mods.causal(), mods.chunked_local(4)), (False, None, True)),
    ],
    ids=["causal", "window", "causal_window", "window_and_other", "or"],
)
def test_causal_and_window_mods_run_as_the_built_in_arguments(monkeypatch, mask_mod, lowered):
    """What the compiled core receives: `is_causal`, `sliding_window`, and a mask_mod only
    for what is left (an `or` is never split)."""
    seen = []
    compiled = program.compiled

    def spy(*args, **kwargs):
        plan = kwargs["plan"]
        seen.append((plan.is_causal, plan.window, plan.mask_mod is not None))
        return compiled(*args, **kwargs)

    monkeypatch.setattr(program, "compiled", spy)
    q, k, v = inputs(kv_heads=K)
    scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, implementation="chunked")
    assert seen == [lowered]


def test_a_shared_block_mask_gives_the_same_result_and_must_match_its_mod():
    q, k, v = inputs(kv_heads=K)
    mod = make_mask("document")
    block_mask = keras_sdpa.create_block_mask(mod, B, N, T, S, block_size=CHUNK)
    shared = scaled_dot_product_attention(
        q, k, v, mask_mod=mod, block_mask=block_mask, implementation="chunked"
    )
    own = scaled_dot_product_attention(
        q, k, v, mask_mod=mod, implementation="chunked", chunk_size=CHUNK
    )
    np.testing.assert_array_equal(numpy(shared), numpy(own))
    with pytest.raises(ValueError, match="same `mask_mod`"):
        scaled_dot_product_attention(q, k, v, mask_mod=mods.causal(), block_mask=block_mask)
    # Made for other sizes, its map would skip blocks of another batch or length.
    for sizes, match in (
        ((B + 1, N, T, S), "made for B=3 and this call has B=2"),
        ((B, N, T, S + 3), "made for S=12 and this call has S=9"),
    ):
        other = keras_sdpa.create_block_mask(mod, *sizes, block_size=CHUNK)
        with pytest.raises(ValueError, match=match):
            scaled_dot_product_attention(q, k, v, mask_mod=mod, block_mask=other)
    # Made for one example and one head, a mask that reads neither holds for all of them.
    upper = make_mask("causal_function")
    shared = keras_sdpa.create_block_mask(upper, 1, 1, T, S, block_size=CHUNK)
    np.testing.assert_array_equal(
        numpy(
            scaled_dot_product_attention(
                q, k, v, mask_mod=upper, block_mask=shared, implementation="chunked"
            )
        ),
        numpy(
            scaled_dot_product_attention(
                q, k, v, mask_mod=upper, implementation="chunked", chunk_size=CHUNK
            )
        ),
    )
    with pytest.raises(ValueError, match="chunk_size=4, block_mask.block_size=3"):
        scaled_dot_product_attention(q, k, v, mask_mod=mod, block_mask=block_mask, chunk_size=4)


BAND = st.tuples(st.integers(-12, 12), st.integers(0, 12))


@pytest.mark.large  # hypothesis: 25 random masks on both paths
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    bands=st.lists(BAND, min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, S - 1), max_size=3),
    combine=st.sampled_from(["and", "or"]),
    t=st.integers(1, 11),
)
def test_random_band_and_segment_masks_match_on_both_paths(bands, cuts, combine, t):
    """Random mask_mods made of bands `lo <= q - kv < lo + width` and random segments."""
    segments = np.zeros((B, max(S, t)), int)
    for cut in cuts:
        segments[:, cut:] += 1

    def band(lo, width):
        return lambda b, h, q, kv: ops.logical_and(q - kv >= lo, q - kv < lo + width)

    parts = [band(lo, width) for lo, width in bands]
    np_parts = [
        lambda b, h, q, kv, lo=lo, w=w: (q - kv >= lo) & (q - kv < lo + w) for lo, w in bands
    ]
    if cuts:
        parts.append(mods.document(tensor(segments[:, :t]), tensor(segments[:, :S])))
        np_parts.append(lambda b, h, q, kv: segments[b, q] == segments[b, kv])
    mask_mod = (mods.and_masks if combine == "and" else mods.or_masks)(*parts)
    op = np.logical_and if combine == "and" else np.logical_or

    def np_mask_mod(b, h, q, kv):
        result = np_parts[0](b, h, q, kv)
        for part in np_parts[1:]:
            result = op(result, part(b, h, q, kv))
        return result

    rng = np.random.default_rng(t)
    q = tensor(rng.normal(size=(B, t, N, H)), "float32")
    _, k, v = inputs(kv_heads=K)
    want, _ = reference(q, k, v, mask_mod=np_mask_mod)
    for path in PATHS:
        out = scaled_dot_product_attention(
            q, k, v, mask_mod=mask_mod, implementation=path, chunk_size=CHUNK
        )
        np.testing.assert_allclose(numpy(out), want, atol=1e-5, err_msg=path)


def tracing_count(compiled):
    """How many programs a compiled function has traced: TensorFlow's count, or on JAX the
    size of `jax.jit`'s cache (one entry per trace; no public count)."""
    if BACKEND == "jax":
        return compiled._cache_size()
    return compiled.experimental_get_tracing_count()


def test_new_segment_ids_do_not_trace_a_new_program():
    q, k, v = inputs(kv_heads=K)
    mod = mods.document(tensor(SEGMENTS[:, :T]), tensor(SEGMENTS))
    scaled_dot_product_attention(q, k, v, mask_mod=mod, implementation="chunked", chunk_size=3)
    before = tracing_count(program.compiled)
    for shift in range(3):
        ids = (SEGMENTS + shift) % 4
        mod = mods.document(tensor(ids[:, :T]), tensor(ids))
        scaled_dot_product_attention(q, k, v, mask_mod=mod, implementation="chunked", chunk_size=3)
    assert tracing_count(program.compiled) == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(score_mod=3), "`score_mod` must be None or a callable"),
        (dict(mask_mod="causal"), "`mask_mod` must be None or a callable"),
        (dict(mask_mod=lambda b, h, q, kv: ops.cast(q - kv, "float32")), "must return booleans"),
        (dict(block_mask="blocks"), "`block_mask` must be a BlockMask"),
    ],
    ids=["score_mod", "mask_mod", "non_boolean", "block_mask"],
)
def test_bad_mod_arguments(kwargs, match):
    q, k, v = inputs(kv_heads=K)
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: mods.sliding_window(0), r"`window` must be a positive int. Received: window=0"),
        (lambda: mods.chunked_local(2.5), r"`chunk` must be a positive int"),
        (lambda: mods.prefix_lm(-1), r"prefix_length=-1"),
        (lambda: mods.document(tensor([1, 2], "int32")), r"`segment_ids` must be a \(B, length\)"),
        (lambda: mods.soft_cap(0), r"`cap` must be a positive number. Received: cap=0"),
        (lambda: mods.alibi(0), r"num_heads=0"),
        (lambda: mods.relative_position_bias(4, num_buckets=2), r"num_buckets=2"),
        (lambda: mods.and_masks(), r"needs at least one mask mod"),
        # At max_distance == max_exact T5's log-bucket formula divides by log(1) = 0.
        (lambda: mods.relative_position_bias(4, 8, 2), r"above the 2 distances .* max_distance=2"),
        (
            lambda: mods.relative_position_bias(4, 8, 3, bidirectional=False),
            r"above the 4 distances .* max_distance=3",
        ),
    ],
    ids=[
        "window",
        "chunk",
        "prefix",
        "segments",
        "cap",
        "alibi",
        "buckets",
        "and_masks",
        "max_distance",
        "max_distance_causal",
    ],
)
def test_bad_mod_constructor_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------------ the layer


@keras.saving.register_keras_serializable(package="test_mods")
def every_other_key(b, h, q_idx, kv_idx):
    return kv_idx % 2 == 0


def test_layer_config_round_trips_built_ins_and_registered_functions():
    layer = keras_sdpa.ScaledDotProductAttention(
        num_heads=N,
        key_dim=H,
        score_mod=mods.relative_position_bias(N, 8, 20),
        mask_mod=mods.and_masks(mods.causal(), mods.document(), every_other_key),
    )
    clone = keras_sdpa.ScaledDotProductAttention.from_config(layer.get_config())
    assert isinstance(clone.score_mod, mods.RelativePositionBias)
    assert clone.score_mod.get_config()["num_buckets"] == 8
    assert clone.mask_mod == layer.mask_mod
    assert clone.mask_mod.mask_mods[2] is every_other_key
    for mod in (mods.alibi(N), mods.soft_cap(3.0), mods.prefix_lm(2), mods.sliding_window(4)):
        config = keras_sdpa.ScaledDotProductAttention(num_heads=N, score_mod=mod).get_config()
        assert keras_sdpa.ScaledDotProductAttention.from_config(config).score_mod == mod


def test_an_unregistered_function_is_refused_at_save_time(tmp_path):
    layer = keras_sdpa.ScaledDotProductAttention(mask_mod=lambda b, h, q, kv: q >= kv)
    refused = "`mask_mod` must be a keras_sdpa.mods built-in or a function registered"
    with pytest.raises(ValueError, match=refused):
        layer.get_config()
    with pytest.raises(ValueError, match="per-row prefix lengths"):
        per_row = mods.prefix_lm(tensor([1, 2], "int32"))
        keras_sdpa.ScaledDotProductAttention(mask_mod=per_row).get_config()


def random_normal(shape, seed=0):
    """A float32 tensor of standard normal draws (what `tf.random.normal` gave)."""
    return tensor(np.random.default_rng(seed).normal(size=shape), "float32")


def test_segment_ids_need_a_document_mask():
    layer = keras_sdpa.ScaledDotProductAttention(num_heads=2, key_dim=4, mask_mod=mods.causal())
    x = random_normal((B, T, 8))
    with pytest.raises(ValueError, match="`segment_ids` are read by a `keras_sdpa.mods.document"):
        layer(x, x, segment_ids=ops.zeros((B, T), "int32"))
    layer = keras_sdpa.ScaledDotProductAttention(num_heads=2, key_dim=4, mask_mod=mods.document())
    with pytest.raises(ValueError, match=r"`segment_ids` must be a \(B, T\) integer tensor"):
        layer(x, x, segment_ids=ops.zeros((B, T)))


def test_segment_ids_of_another_size_are_refused():
    """XLA clamps an id gathered past the end: ids of the wrong length used to mask by the
    last id silently. With a cache they are one per cached position."""
    layer = keras_sdpa.ScaledDotProductAttention(num_heads=2, key_dim=4, mask_mod=mods.document())
    x = random_normal((B, T, 8))
    for shape, match in (((B, T - 2), f"the query's length {T}"), ((B + 1, T), f"batch size {B}")):
        with pytest.raises(ValueError, match=match):
            layer(x, x, segment_ids=ops.zeros(shape, "int32"))
    cache = ops.zeros((B, 2, 12, 2, 4))
    with pytest.raises(ValueError, match=r"the cache's length 12.*shape \(2, 7\)"):
        layer(x, x, segment_ids=ops.zeros((B, T), "int32"), cache=cache, cache_update_index=0)
    layer(x, x, segment_ids=ops.zeros((B, 12), "int32"), cache=cache, cache_update_index=0)


@pytest.mark.parametrize(
    "make",
    [lambda: mods.alibi(4), lambda: mods.relative_position_bias(8, 8, 16)],
    ids=["alibi", "t5"],
)
def test_a_mod_made_for_other_heads_is_refused(make):
    """A per-head gather past the mod's heads is clamped inside XLA (the last head's slope or
    column, silently): the layer and the core refuse it."""
    mod = make()
    with pytest.raises(
        ValueError,
        match=r"made for \d heads and meets 6 query heads. "
        r"Received: score_mod=\w+\(num_heads=\d\), num_heads=6",
    ):
        keras_sdpa.ScaledDotProductAttention(num_heads=6, key_dim=4, score_mod=mod)
    q, k, v = inputs(kv_heads=K)  # N = 6
    with pytest.raises(ValueError, match="meets 6 query heads"):
        scaled_dot_product_attention(q, k, v, score_mod=mod)


def test_layer_with_mods_matches_keras_mha_with_the_same_weights_and_mask():
    """A document mask as mask_mod gives MultiHeadAttention's output with the same mask."""
    x = random_normal((B, T, 12))
    ids = tensor(SEGMENTS[:, :T])
    ours = keras_sdpa.ScaledDotProductAttention(num_heads=3, key_dim=4, mask_mod=mods.document())
    mha = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4)
    mha(x, x)
    ours(x, x, segment_ids=ids)
    ours.set_weights(mha.get_weights())
    mask = ops.equal(ids[:, :, None], ids[:, None, :])  # (B, T, T)
    for path in ("dense", "chunked"):
        ours.implementation = path
        np.testing.assert_allclose(
            numpy(ours(x, x, segment_ids=ids)), numpy(mha(x, x, attention_mask=mask)), atol=1e-5
        )


@pytest.fixture(scope="module")
def t5_document_model(tmp_path_factory):
    """A small model with a T5 bias and a document mask, trained by `fit` and saved to
    `.keras`."""
    length, width = 16, 16
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    segments = keras.Input((length,), dtype="int32", name="segments")
    x = keras.layers.Embedding(40, width)(tokens)
    attention = keras_sdpa.ScaledDotProductAttention(
        num_heads=4,
        key_dim=4,
        score_mod=mods.relative_position_bias(4, 8, 16),
        mask_mod=mods.and_masks(mods.causal(), mods.document()),
        chunk_size=8,
        implementation="chunked",
    )
    x = attention(x, x, segment_ids=segments)
    out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model([tokens, segments], out)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 40, (64, length)), np.sort(rng.integers(0, 3, (64, length)), axis=1)]
    target = (data[0][:, :1] > 20).astype("float32")
    before = numpy(attention.score_mod.table).copy()
    history = model.fit(data, target, epochs=3, batch_size=16, verbose=0)
    folder = tmp_path_factory.mktemp("t5_document")
    model.save(folder / "model.keras")
    return model, attention, before, history, data, folder


def test_a_t5_document_model_trains_under_fit(t5_document_model):
    model, attention, before, history, _, _ = t5_document_model
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    assert np.abs(numpy(attention.score_mod.table) - before).max() > 1e-3
    assert attention.weights[-1] is attention.score_mod.table  # after the projections


def test_a_t5_document_model_reloads_from_keras_file(t5_document_model):
    model, _, _, _, data, folder = t5_document_model
    reloaded = keras.saving.load_model(folder / "model.keras")
    np.testing.assert_allclose(
        reloaded.predict(data, verbose=0), model.predict(data, verbose=0), atol=1e-6
    )


@pytest.mark.large  # a process without this package; the layer's own: tests/layer/test_layer.py
@pytest.mark.tensorflow_only("a SavedModel served by TensorFlow's loader")
def test_a_t5_document_model_serves_without_this_package(t5_document_model):
    import tensorflow as tf

    model, _, _, _, data, folder = t5_document_model
    export = keras.export.ExportArchive()
    export.track(model)
    spec = tf.TensorSpec((None, data[0].shape[1]), tf.int32)
    export.add_endpoint(
        "serve", lambda t, s: model([t, s], training=False), input_signature=[spec, spec]
    )
    export.write_out(str(folder / "saved_model"))
    np.save(folder / "tokens.npy", data[0][:8])
    np.save(folder / "segments.npy", data[1][:8])
    script = (
        "import sys, numpy as np, tensorflow as tf\n"
        "folder = sys.argv[1]\n"
        "served = tf.saved_model.load(folder + '/saved_model')\n"
        "out = served.serve(tf.constant(np.load(folder + '/tokens.npy'), tf.int32),\n"
        "                   tf.constant(np.load(folder + '/segments.npy'), tf.int32))\n"
        "assert 'keras_sdpa' not in sys.modules\n"
        "np.save(folder + '/served.npy', out.numpy())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        timeout=300,
        cwd=str(folder),
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    served = np.load(folder / "served.npy")
    np.testing.assert_allclose(served, model.predict([d[:8] for d in data], verbose=0), atol=1e-5)


@pytest.mark.default_cases("graph")
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_t5_table_trains_under_fit_with_the_automatic_path(jit_compile):
    """`implementation="auto"` with a batch unknown while tracing: the choice is made then
    (a run-time choice between two programs loses the gradient of the mod's variables)."""
    tokens = keras.Input((12,), dtype="int32")
    x = keras.layers.Embedding(30, 16)(tokens)
    bias = mods.relative_position_bias(4, 8, 16)
    x = keras_sdpa.ScaledDotProductAttention(num_heads=4, key_dim=4, score_mod=bias)(x, x)
    model = keras.Model(tokens, keras.layers.Dense(1)(x[:, -1]))
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    model.fit(rng.integers(0, 30, (16, 12)), rng.normal(size=(16, 1)), epochs=2, verbose=0)
    assert np.abs(numpy(bias.table)).max() > 1e-3  # the table starts at zeros


@pytest.mark.default_cases("dense")
@pytest.mark.parametrize("path", PATHS)
def test_dropout_with_a_score_mod_and_a_mask_mod_matches_finite_differences(path):
    """float64 central differences through seeded dropout, ALiBi and a document mask: the
    gradient redraws the forward's keep-mask and goes through the mod (on the chunked path
    in the queries' layout, where the key-side products read the blocks transposed)."""
    from on_backend import assert_gradients_match_finite_differences

    rng = np.random.default_rng(31)
    q, k, v = (tensor(rng.normal(size=(B, t, n, 3))) for t, n in ((5, N), (7, K), (7, K)))
    c = tensor(rng.normal(size=(B, 5, N, 3)))
    ids = tensor(SEGMENTS[:, :7])

    def loss(q, k, v):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_rate=0.4,
            training=True,
            seed=11,
            score_mod=mods.alibi(N),
            mask_mod=mods.document(ids[:, :5], ids),
            implementation=path,
            chunk_size=CHUNK,
        )
        return ops.sum(out * c)

    assert_gradients_match_finite_differences(loss, [q, k, v])


def ops_score(name, score, b, h, q, kv):
    """The score mods again, in float64 keras.ops, for autodiff."""
    dtype = keras.backend.standardize_dtype(score.dtype)
    distance = ops.cast(ops.abs(q - kv), dtype)
    if name == "alibi":
        return score - ops.take(tensor(ALIBI_6, dtype), h, axis=0) * distance
    if name == "soft_cap":
        return 2.0 * tanh(score / 2.0)  # float64 on JAX too
    buckets = np.vectorize(lambda d: np_t5_bucket(d, name == "t5", 8, 20))(kv - q)[0, 0]
    table = ops.take(tensor(TABLE, dtype), buckets, axis=0)  # (T, S, N)
    return score + ops.transpose(table, [2, 0, 1])[None]


@pytest.mark.default_cases("dense-t5", "chunked-and_masks", "chunked-alibi")
@pytest.mark.parametrize(
    "score, mask",
    [(None, name) for name in MASKS] + [(name, None) for name in SCORES],
    ids=MASKS + SCORES,
)
@pytest.mark.parametrize("path", PATHS)
def test_every_built_in_has_the_gradient_autodiff_gives(score, mask, path):
    """d q, d k, d v of every built-in, against the backend's autodiff of the float64 formula
    with the mod written again (NumPy masks, keras.ops scores)."""
    q, k, v = inputs(kv_heads=K)
    c = np.random.default_rng(8).normal(size=(B, T, N, H)).astype("float32")

    def loss(q, k, v):
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            score_mod=make_score(score) if score else None,
            mask_mod=make_mask(mask) if mask else None,
            implementation=path,
            chunk_size=CHUNK,
        )
        return ops.sum(out * c)

    got = gradients(loss, q, k, v)
    q64, k64, v64 = (numpy(x, "float64") for x in (q, k, v))

    def ref_loss(q64, k64, v64):
        kk, vv = ops.repeat(k64, N // K, axis=2), ops.repeat(v64, N // K, axis=2)
        logits = ops.einsum("btnh,bsnh->bnts", q64, kk) / np.sqrt(H)
        b, h, qi, ki = indices()
        if score:
            logits = ops_score(score, logits, b, h, qi, ki)
        allowed = np.ones(logits.shape, bool)
        if mask:
            allowed = np.broadcast_to(np_mask(mask, b, h, qi, ki), logits.shape)
        weights = ops.softmax(ops.where(allowed, logits, -1e30), axis=-1)
        weights = ops.where(allowed.any(-1, keepdims=True), weights, 0.0)
        ref = ops.einsum("bnts,bsnh->btnh", weights, vv)
        return ops.sum(ref * c.astype("float64"))

    want = gradients(ref_loss, q64, k64, v64, x64=True)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)
