"""Context parallelism: the ring on 8 simulated CPU devices (issue #79).

Not collected by the TensorFlow session (its name is not `test_*.py`):
`tests/backends/test_jax_backend.py` runs it in a JAX process with
`--xla_force_host_platform_device_count=8` and `JAX_ENABLE_X64=1` (so that float64 inputs
stay float64; every other input here is float32). Every check is against the one-device core in
the same process, with the same inputs.
"""

import os
import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_sdpa
from keras_sdpa import mods
from keras_sdpa._core import ring

B, T, N, K, H = 2, 64, 4, 2, 8
DEVICES = 8


@pytest.fixture(autouse=True)
def sequence_mesh():
    """A distribution whose mesh has the "seq" axis, for each test; none after it."""
    assert len(jax.devices()) == DEVICES
    mesh = keras.distribution.DeviceMesh((DEVICES,), ["seq"], keras.distribution.list_devices())
    keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))
    yield
    keras.distribution.set_distribution(None)


def inputs(seed=0, t=T, n=N, k=K, hv=H, dtype="float32"):
    rng = np.random.default_rng(seed)
    shapes = [(B, t, n, H), (B, t, k, H), (B, t, k, hv)]
    return [rng.normal(size=shape).astype(dtype) for shape in shapes]


def segments(t=T):
    return np.repeat(np.arange(4), t // 4)[None].repeat(B, 0)  # (B, T): 4 packed documents


def key_mask(t=T):
    return np.random.default_rng(7).random((B, 1, 1, t)) > 0.3  # (B, 1, 1, S)


def left_padded(t=T):
    """Batch row 0 padded on the left for 20 keys; row 1 with every key masked (its rows
    attend to nothing: zeros, and zero gradients)."""
    mask = np.ones((B, 1, 1, t), bool)
    mask[0, ..., :20] = False
    mask[1] = False
    return mask


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal window": dict(is_causal=True, sliding_window=9),
    "window": dict(sliding_window=12),
    "padded": dict(mask=key_mask()),
    "causal, left padded, a row with no keys": dict(is_causal=True, mask=left_padded()),
    "causal segments": dict(is_causal=True, mask_mod=mods.document(segments())),
    "window, padded, segments": dict(
        sliding_window=12, mask=key_mask(), mask_mod=mods.document(segments())
    ),
    "causal and window mods": dict(mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(5))),
    "scale": dict(is_causal=True, scale=0.3),
}


def test_other_value_sizes_and_float64():
    """Hv = 12 against H = 8, causal; and float64 inputs computed in float64 (the one-device
    core's float64 to 1e-12)."""
    q, k, v = inputs(hv=12)
    c = np.random.default_rng(1).normal(size=(B, T, N, 12)).astype("float32")
    want, want_grads = outputs_and_gradients(dict(is_causal=True), q, k, v, c)
    got, grads = outputs_and_gradients(dict(is_causal=True, context_parallel="seq"), q, k, v, c)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for grad, expected in zip(grads, want_grads):
        np.testing.assert_allclose(grad, expected, atol=1e-5)
    q, k, v = inputs(dtype="float64")
    got = keras_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, context_parallel="seq")
    want = keras_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == "float64"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-12)


def outputs_and_gradients(options, q, k, v, c):
    attend = keras_sdpa.scaled_dot_product_attention

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, **options) * c)

    out = attend(q, k, v, **options)
    return np.asarray(out), [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_the_ring_is_the_one_device_core(name, heads):
    """Forward and the gradients to q, k and v within 1e-5 of the one-device core."""
    q, k, v = inputs(n=heads[0], k=heads[1])
    c = np.random.default_rng(1).normal(size=q.shape).astype("float32")
    want, want_grads = outputs_and_gradients(CASES[name], q, k, v, c)
    got, grads = outputs_and_gradients({**CASES[name], "context_parallel": "seq"}, q, k, v, c)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for grad, expected in zip(grads, want_grads):
        np.testing.assert_allclose(grad, expected, atol=1e-5)


@pytest.mark.parametrize("name", ["causal", "padded", "window, padded, segments"])
def test_chunk_pairs_in_key_blocks_are_the_one_device_core(name, monkeypatch):
    """Blocks of 2 keys inside each chunk pair (T=64 on 8 devices: chunks of 4 or 8), so the
    pair's loop over key blocks runs several times, forward and backward."""
    monkeypatch.setattr(ring, "MAX_KEY_BLOCK", 2)
    test_the_ring_is_the_one_device_core(name, (4, 2))


def visits(is_causal, per_device, window=None):
    """Each device's number of computed chunk pairs, on a ring balanced or not."""
    chunks = DEVICES * per_device
    rings = ring.Ring("seq", DEVICES, per_device, T // chunks, T // chunks, is_causal, window)
    q, k, v = inputs()
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    run = ring.compiled(q, k, v, None, None, ring=rings.counting(), mesh=mesh, scale=1.0)
    return np.asarray(run)


def test_the_causal_ring_is_balanced_and_skips_the_empty_pairs():
    """Zig-zag: 16 chunks, 136 causal pairs of 256, 17 on every device; without the zig-zag
    (one chunk a device) device d computes d + 1 pairs, and the balance check sees it."""
    balanced = visits(is_causal=True, per_device=2)
    assert balanced.tolist() == [17] * DEVICES
    assert balanced.sum() == 16 * 17 // 2
    unbalanced = visits(is_causal=True, per_device=1)
    assert unbalanced.tolist() == list(range(1, DEVICES + 1))
    for counts, fair in ((balanced, True), (unbalanced, False)):
        assert (np.abs(counts - counts.mean()) <= 0.1 * counts.mean()).all() == fair
    assert visits(is_causal=False, per_device=1).tolist() == [DEVICES] * DEVICES


def largest_array(hlo):
    """The most elements of any array in an HLO module's text."""
    sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        for dims in re.findall(r"\b(?:f32|f64|bf16|f16|pred|s32)\[([\d,]*)\]", hlo)
    ]
    return max(sizes)


def test_no_device_holds_a_t_by_s_over_p_buffer():
    """The compiled forward and gradient of T=S=256 on 8 devices, the inputs sharded over the
    sequence: no array larger than one chunk pair's `(c, c)` scores, far below a device's
    `(T, S / P)` (the one-device dense program holds all `(T, S)`)."""
    t, b, n = 256, 1, 2
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
    q, k, v = (jax.device_put(x[:b, :, :n], shard) for x in inputs(t=t, n=n, k=n))

    def step(q, k, v, **options):
        f = keras_sdpa.scaled_dot_product_attention
        loss = lambda q, k, v: jnp.sum(f(q, k, v, is_causal=True, **options))  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    ringed = jax.jit(lambda q, k, v: step(q, k, v, context_parallel="seq"))
    dense = jax.jit(lambda q, k, v: step(q, k, v, implementation="dense"))
    t_by_s_over_p = b * n * t * (t // DEVICES)
    chunk = t // (2 * DEVICES)
    pair_scores = b * n * chunk * chunk  # one chunk pair's (c, c): the most a device holds
    assert pair_scores <= t_by_s_over_p // 8
    assert largest_array(ringed.lower(q, k, v).compile().as_text()) <= pair_scores
    local = [np.asarray(x) for x in (q, k, v)]
    held = largest_array(dense.lower(*local).compile().as_text())
    assert held >= b * n * t * t  # the check sees the scores


def test_the_layer_takes_the_ring(monkeypatch):
    """`ScaledDotProductAttention(context_parallel="seq")` against the same layer without it:
    outputs and the gradients to its weights; a spy sees the ring run for the first only."""
    calls = []
    run = ring.run
    monkeypatch.setattr(ring, "run", lambda *a: calls.append(a[-1].context_parallel) or run(*a))
    x = np.random.default_rng(3).normal(size=(B, T, 16)).astype("float32")
    ringed = keras_sdpa.ScaledDotProductAttention(
        4, 8, num_key_value_heads=2, context_parallel="seq"
    )
    plain = keras_sdpa.ScaledDotProductAttention(4, 8, num_key_value_heads=2)
    ringed(x, x), plain(x, x)
    plain.set_weights(ringed.get_weights())

    def loss(weights, layer):
        out, _ = layer.stateless_call(weights, [], x, x, use_causal_mask=True)
        return jnp.sum(out * out)

    for layer in (ringed, plain):
        assert layer.get_config()["context_parallel"] == ("seq" if layer is ringed else None)
    weights = [w.value for w in ringed.trainable_variables]
    np.testing.assert_allclose(loss(weights, ringed), loss(weights, plain), rtol=1e-5)
    got = jax.grad(loss)(weights, ringed)
    want = jax.grad(loss)(weights, plain)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert calls and set(calls) == {"seq"}


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(mask=np.ones((B, 1, T, T), bool)), "a mask along the heads or the queries"),
        (dict(bias=np.zeros((B, N, T, T), "float32")), "cannot travel round the ring"),
        (dict(return_weights=True), "return_weights"),
        (dict(score_mod=mods.alibi(N)), "score_mod"),
        (dict(is_causal=True, context_parallel="model"), "must name an axis"),
        (dict(implementation="decode"), "decoding from a cache runs on one device"),
        (dict(implementation="chunked"), "the ring is the path"),
        (dict(chunk_size=8), "the ring is the path"),
        (dict(mask=np.ones((N, 1, T), bool)), "a mask along the heads or the queries"),
        (dict(mask_mod=mods.document(segments(), segments())), "with kv_segment_ids"),
        (dict(mask_mod=mods.document(segments()[:, :32])), "must be `\\(B, T\\)`"),
    ],
)
def test_what_the_ring_does_not_take_is_refused_by_name(options, message):
    q, k, v = inputs()
    with pytest.raises(ValueError, match=message):
        keras_sdpa.scaled_dot_product_attention(q, k, v, **{"context_parallel": "seq", **options})


def test_integer_inputs_are_refused_as_on_one_device():
    q, k, v = (x.astype("int32") for x in inputs())
    with pytest.raises(ValueError, match="`query` must be a floating tensor"):
        keras_sdpa.scaled_dot_product_attention(q, k, v, context_parallel="seq")


def test_lengths_and_a_missing_distribution_are_refused():
    q, k, v = inputs(t=40)  # 40 is not a multiple of 16 chunks
    with pytest.raises(ValueError, match="multiples of 16. Received: T=40, S=40"):
        keras_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, context_parallel="seq")
    keras.distribution.set_distribution(None)
    with pytest.raises(ValueError, match="no distribution is set"):
        keras_sdpa.scaled_dot_product_attention(*inputs(), context_parallel="seq")


def test_the_documentation_example_runs():
    """docs/context-parallel.md's example (a `py` block: the TensorFlow session's check of
    the documentation's `python` blocks leaves it to this JAX one)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    page = open(os.path.join(root, "docs", "context-parallel.md"), encoding="utf-8").read()
    (code,) = re.findall(r"```py\n(.*?)```", page, flags=re.S)
    scope = {}
    exec(compile(code, "docs/context-parallel.md", "exec"), scope)
    assert tuple(scope["y"].shape) == (2, 64, 16)
