"""The key/value cache: keras-hub's `CachedMultiHeadAttention` contract, with per-row positions.

Cached decoding is checked token by token against the same layer recomputing full causal
attention over the whole sequence, which shares none of the cache's code paths. Written on
`keras.ops` and NumPy: it runs on TensorFlow and JAX.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from keras import ops
from on_backend import BACKEND, jit, numpy, tensor

from keras_sdpa import ScaledDotProductAttention, mods

B, L, E, H = 3, 12, 16, 4


def sequences(seed=0, length=L):
    return tensor(np.random.default_rng(seed).normal(size=(B, length, E)), "float32")


def layer_for(kind, **kwargs):
    heads = {"mha": (4, None), "gqa": (4, 2), "mqa": (4, 1)}[kind]
    layer = ScaledDotProductAttention(
        num_heads=heads[0], key_dim=H, num_key_value_heads=heads[1], **kwargs
    )
    layer(sequences(), sequences())  # build
    return layer


def empty_cache(layer, length=L):
    return ops.zeros((B, 2, length, layer._kv_heads, H))


PROMPT, STEPS = 6, 64


def even_keys_and_the_diagonal(b, h, q_idx, kv_idx):
    """A user mask_mod: a query sees the even positions and itself."""
    return ops.logical_or(kv_idx % 2 == 0, kv_idx == q_idx)


def distance_penalty(score, b, h, q_idx, kv_idx, slope):
    return score - slope * ops.cast(ops.abs(q_idx - kv_idx), score.dtype)


@pytest.mark.default_cases("gqa", "window", "mask_mod", "with_tensors", "bias", "chunked")
@pytest.mark.parametrize(
    "kind, kwargs, biased",
    [
        ("mha", {}, False),
        ("gqa", {}, False),
        ("mqa", {}, False),
        ("gqa", dict(sliding_window=3), False),
        ("mha", dict(score_mod=mods.alibi(4)), False),
        ("gqa", dict(mask_mod=even_keys_and_the_diagonal), False),
        ("mha", dict(score_mod=mods.with_tensors(distance_penalty, tensor(0.3, "float32"))), False),
        ("gqa", {}, True),
        ("mha", dict(implementation="chunked", chunk_size=16), False),
    ],
    ids=["mha", "gqa", "mqa", "window", "alibi", "mask_mod", "with_tensors", "bias", "chunked"],
)
def test_prefill_then_one_token_a_step_equals_full_recomputation(kind, kwargs, biased):
    """A prompt of 6 written at 0, then 64 tokens one at a time, each at its position: every
    step's output equals the full causal layer's at that position, to 1e-5. The mods, the
    window and the bias count positions from the cache's, as in training."""
    length = PROMPT + STEPS
    layer = layer_for(kind, **kwargs)
    x = sequences(length=length)
    bias = None
    if biased:
        bias = tensor(np.random.default_rng(9).normal(size=(B, 4, length, length)), "float32")

    def rows(start, stop):  # the bias of queries start..stop-1, over the whole cache
        return None if bias is None else bias[:, :, start:stop]

    full = layer(x, x, use_causal_mask=True, attention_bias=bias)  # (B, length, E)
    out, cache = layer(
        x[:, :PROMPT],
        x[:, :PROMPT],
        use_causal_mask=True,
        attention_bias=rows(0, PROMPT),
        cache=empty_cache(layer, length),
        cache_update_index=0,
    )
    np.testing.assert_allclose(numpy(out), numpy(full)[:, :PROMPT], atol=1e-5)
    for position in range(PROMPT, length):
        token = x[:, position : position + 1]
        out, cache = layer(
            token,
            token,
            use_causal_mask=True,
            attention_bias=rows(position, position + 1),
            cache=cache,
            cache_update_index=position,
        )
        np.testing.assert_allclose(
            numpy(out)[:, 0], numpy(full)[:, position], atol=1e-5, err_msg=str(position)
        )


def test_per_row_positions_decode_ragged_prompts():
    """Rows with prompts of 2, 5 and 7 tokens decode in one batch, each writing and reading at
    its own position (a (B,) cache_update_index); each row equals its full recomputation."""
    layer = layer_for("gqa")
    x = sequences(1)
    full = layer(x, x, use_causal_mask=True)
    prompts = np.array([2, 5, 7])
    _, cache = layer(
        x[:, :7], x[:, :7], use_causal_mask=True, cache=empty_cache(layer), cache_update_index=0
    )
    for step in range(L - 7):
        positions = prompts + step
        token = ops.take_along_axis(x, positions[:, None, None], axis=1)  # (B, 1, E)
        out, cache = layer(
            token, token, use_causal_mask=True, cache=cache, cache_update_index=tensor(positions)
        )
        want = ops.take_along_axis(full, positions[:, None, None], axis=1)
        np.testing.assert_allclose(numpy(out), numpy(want), atol=1e-5, err_msg=str(step))


def test_a_compiled_generate_step_equals_eager():
    """One `jit_compile=True` step with a per-row index: the same output and cache as eager."""
    layer = layer_for("mha")
    x = sequences(2)
    cache = empty_cache(layer)
    _, cache = layer(x[:, :4], x[:, :4], use_causal_mask=True, cache=cache, cache_update_index=0)
    index = tensor([4, 4, 4], "int32")

    @jit
    def step(token, cache, index):
        return layer(token, token, use_causal_mask=True, cache=cache, cache_update_index=index)

    token = x[:, 4:5]
    compiled = step(token, cache, index)
    eager = layer(token, token, use_causal_mask=True, cache=cache, cache_update_index=index)
    for a, b in zip(compiled, eager):
        np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-5)


def test_a_static_cache_is_cross_attention_to_what_it_holds():
    """With `cache_update_index=None` the cache's keys and values are read as they are, and the
    inputs' ignored: the same as attending to the memory they were projected from."""
    layer = layer_for("gqa")
    query, memory = sequences(3)[:, :4], sequences(4)
    keys = layer._key_dense(memory)
    values = layer._value_dense(memory)
    cache = ops.stack([keys, values], axis=1)  # (B, 2, S, K, H)
    out, returned = layer(query, ops.zeros_like(query), cache=cache)
    np.testing.assert_allclose(numpy(out), numpy(layer(query, memory)), atol=1e-5)
    assert returned is cache or np.array_equal(returned, cache)


def test_scores_come_back_with_the_cache():
    layer = layer_for("mha")
    x = sequences()
    out, scores, cache = layer(
        x[:, :3],
        x[:, :3],
        use_causal_mask=True,
        cache=empty_cache(layer),
        cache_update_index=0,
        return_attention_scores=True,
    )
    assert scores.shape == (B, 4, 3, L) and cache.shape == (B, 2, L, 4, H)
    np.testing.assert_array_equal(numpy(scores)[:, :, :, 3:], 0.0)  # past each row's position
    np.testing.assert_allclose(numpy(ops.sum(scores, -1)), 1.0, atol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda layer, x: layer(x, x, cache_update_index=0),
            "`cache_update_index` needs a `cache`",
        ),
        (
            lambda layer, x: layer(x, x, cache=ops.zeros((B, 2, L, 2, H)), cache_update_index=0),
            r"`cache` must be \(B, 2, S, K, H\) with K = num_key_value_heads = 4",
        ),
        (
            lambda layer, x: layer(x, x, cache=ops.zeros((B, L, 4, H)), cache_update_index=0),
            r"Received: cache.shape=\(3, 12, 4, 4\)",
        ),
        (
            lambda layer, x: layer(x, x, cache=ops.zeros((B, 2, L, 4, H)), cache_update_index=11),
            r"must leave room for the 2 new positions in a cache of 12: each row's index in "
            r"\[0, 10\]. Received: cache_update_index=11\b",
        ),
    ],
    ids=["index_without_cache", "head_count", "cache_rank", "index_past_the_cache"],
)
def test_bad_cache_arguments(call, match):
    layer = layer_for("mha")
    with pytest.raises(ValueError, match=match):
        call(layer, sequences()[:, :2])


def test_a_score_mods_tensors_are_those_of_its_own_layer_in_decode():
    """Two layers with one score function and different tensors (`with_tensors`) decode each
    with its own: the tensors are arguments of the program, not baked into the first trace."""
    x = sequences(5)
    for slope in (0.3, 2.0):
        layer = layer_for(
            "mha", score_mod=mods.with_tensors(distance_penalty, tensor(slope, "float32"))
        )
        full = layer(x, x, use_causal_mask=True)
        _, cache = layer(
            x[:, :6], x[:, :6], use_causal_mask=True, cache=empty_cache(layer), cache_update_index=0
        )
        out, _ = layer(
            x[:, 6:7], x[:, 6:7], use_causal_mask=True, cache=cache, cache_update_index=6
        )
        np.testing.assert_allclose(
            numpy(out)[:, 0], numpy(full)[:, 6], atol=1e-5, err_msg=str(slope)
        )


def decoding_error(layer, x, prompt=4):
    """The largest gap between cached decoding (a prompt, then one token a step) and the
    layer's own full causal recomputation."""
    full = layer(x, x, use_causal_mask=True)
    out, cache = layer(
        x[:, :prompt],
        x[:, :prompt],
        use_causal_mask=True,
        cache=empty_cache(layer, x.shape[1]),
        cache_update_index=0,
    )
    gaps = [np.max(np.abs(out - full[:, :prompt]))]
    for position in range(prompt, x.shape[1]):
        token = x[:, position : position + 1]
        out, cache = layer(
            token, token, use_causal_mask=True, cache=cache, cache_update_index=position
        )
        gaps.append(np.max(np.abs(out[:, 0] - full[:, position])))
    return max(gaps)


def t5_layer(seed):
    """A layer with a T5 bias of its own random table; every such mod has the same name."""
    bias = mods.RelativePositionBias(4, 8, 16, bidirectional=False, name="t5")
    bias.table.assign(np.random.default_rng(seed).normal(size=(8, 4)) * 3)
    return layer_for("mha", score_mod=bias)


def test_two_models_whose_t5_mods_share_a_name_decode_each_with_its_own_table():
    """Trace keys name a mod held by the cache's positions by its identity, not its `repr`
    (which holds only the name): with the name in the key, the second layer decoded with
    the first one's table, up to 2.3 away from its own recomputation."""
    x = sequences(6)[:, :10]
    for seed in (0, 1):
        assert decoding_error(t5_layer(seed), x) < 1e-5, seed


def test_two_loads_of_one_saved_model_decode_each_with_its_own_weights(tmp_path):
    """One `.keras` file loaded twice, the second load's table changed after loading: both
    loads decode as their own full recomputation."""
    path = str(tmp_path / "t5.keras")
    inputs = keras.Input((10, E))
    model = keras.Model(inputs, t5_layer(0)(inputs, inputs))
    model.save(path)
    x = sequences(7)[:, :10]
    first, second = (keras.saving.load_model(path) for _ in range(2))
    table = second.layers[-1].score_mod.table
    table.assign(table + np.random.default_rng(3).normal(size=(8, 4)) * 3)
    for model in (first, second):
        assert decoding_error(model.layers[-1], x) < 1e-5


def test_a_tensor_cache_index_past_the_end_is_refused():
    """Only Python ints were checked: a tensor index past `S - t` made XLA drop the write.
    Eager tensors are checked as ints are; a graph checks when it runs."""
    layer = layer_for("mha")
    x = sequences()[:, :2]
    cache = empty_cache(layer)
    message = r"index in \[0, 10\]. Received: cache_update_index=\[11, 0, 0\]"
    with pytest.raises(ValueError, match=message):
        layer(x, x, cache=cache, cache_update_index=tensor([11, 0, 0], "int32"))
    with pytest.raises(ValueError, match=r"Received: cache_update_index=-1\b"):
        layer(x, x, cache=cache, cache_update_index=tensor(-1, "int32"))
    if BACKEND == "tensorflow":  # JAX has no run-time check to raise: it has no graph mode
        import tensorflow as tf

        step = tf.function(
            lambda x, cache, index: layer(x, x, cache=cache, cache_update_index=index)
        )
        with pytest.raises(tf.errors.InvalidArgumentError, match="must leave room for the 2 new"):
            step(x, cache, tensor([3, 11, 0], "int32"))
        step(x, cache, tensor([3, 10, 0], "int32"))
    # A constant of the graph is refused while tracing, inside an XLA program too (where the
    # run-time asserts are dropped and the write past the end was lost). Inside `jax.jit` an
    # array made in the program is a tracer with no value while tracing (JAX 0.10): there the
    # constant a program knows while tracing is a Python int.
    eleven = (lambda: ops.convert_to_tensor(11)) if BACKEND == "tensorflow" else (lambda: 11)
    compiled = jit(lambda x, cache: layer(x, x, cache=cache, cache_update_index=eleven()))
    with pytest.raises(ValueError, match=r"index in \[0, 10\]. Received: cache_update_index=11\b"):
        compiled(x, cache)
    # A list of ints is known while tracing on both backends, as an int is.
    listed = jit(lambda x, cache: layer(x, x, cache=cache, cache_update_index=[3, 11, 0]))
    with pytest.raises(ValueError, match=r"Received: cache_update_index=\[3, 11, 0\]"):
        listed(x, cache)


@pytest.mark.parametrize(
    "index, match",
    [
        (2**32 + 3, r"Received: cache_update_index=4294967299\b"),  # int32 would wrap it to 3
        (
            tensor([1, 2], "int32"),
            r"one position per row of the batch \(3\). Received: "
            r"cache_update_index with shape \(2,\)",
        ),
        (tensor([1], "int32"), r"Received: cache_update_index with shape \(1,\)"),
    ],
    ids=["past_int32", "two_rows_of_three", "one_row_of_three"],
)
def test_cache_indexes_that_would_write_elsewhere_are_refused(index, match):
    layer = layer_for("mha")
    x = sequences()[:, :2]
    with pytest.raises(ValueError, match=match):
        layer(x, x, cache=empty_cache(layer), cache_update_index=index)


@pytest.mark.tensorflow_only("a query length unknown while tracing (tf.function signature)")
def test_a_static_cache_index_is_checked_when_the_query_length_is_unknown():
    """With the new positions' count unknown while tracing, a static index is still refused
    when it is negative or past the cache, and a graph checks the rest when it runs."""
    import tensorflow as tf

    layer = layer_for("mha")
    cache = empty_cache(layer)
    spec = tf.TensorSpec((B, None, E), tf.float32)
    for index, match in (
        (-1, r"a position in \[0, 12\]. Received: cache_update_index=-1\b"),
        (13, r"a position in \[0, 12\]. Received: cache_update_index=13\b"),
    ):
        step = tf.function(
            lambda x, index=index: layer(x, x, cache=cache, cache_update_index=index),
            input_signature=[spec],
        )
        with pytest.raises(ValueError, match=match):
            step.get_concrete_function()
    step = tf.function(
        lambda x: layer(x, x, cache=cache, cache_update_index=11), input_signature=[spec]
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="room for the new positions"):
        step(sequences()[:, :2])  # 11 + 2 > 12
    step(sequences()[:, :1])


def test_a_score_mod_set_after_the_layer_was_made_is_checked_in_cached_calls():
    """The cached call hands the core the score mod inside a wrapper: an ALiBi for 2 heads on
    a 4-head layer would have its heads 2 and 3 read head 1's slopes."""
    layer = layer_for("mha")
    layer.score_mod = mods.alibi(2)
    x = sequences()[:, :2]
    with pytest.raises(ValueError, match=r"Received: score_mod=Alibi\(num_heads=2\), num_heads=4"):
        layer(x, x, cache=empty_cache(layer), cache_update_index=0)


def test_the_cached_call_drops_weights_in_training():
    """With `dropout` and `training=True` the cached call drops attention weights as the
    uncached call does (it ignored both): each draw differs, their mean is the inference
    output (inverted dropout is unbiased), and the returned scores are the undropped ones."""
    layer = layer_for("mha", dropout=0.5)
    x = sequences(8)[:, :4]
    kwargs = dict(use_causal_mask=True, cache=empty_cache(layer), cache_update_index=0)
    want, scores, _ = (numpy(t) for t in layer(x, x, return_attention_scores=True, **kwargs))
    draws = np.stack([numpy(layer(x, x, training=True, **kwargs)[0]) for _ in range(100)])
    assert np.abs(draws[0] - want).max() > 0.1 and np.abs(draws[0] - draws[1]).max() > 0.1
    error = 5 * draws.std(0) / np.sqrt(len(draws))  # five standard errors of the mean
    assert np.all(np.abs(draws.mean(0) - want) <= error + 1e-6)
    _, dropped_scores, _ = layer(x, x, training=True, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(numpy(dropped_scores), numpy(scores), atol=1e-6)


JAX_CACHE_CHECK = """
import os
os.environ["KERAS_BACKEND"] = "jax"
import jax, jax.numpy as jnp, numpy as np
from keras_sdpa._layer import cache as _cache
B, S, K, H, t = 2, 7, 3, 5, 2
cache = np.zeros((B, 2, S, K, H), "float32")
update = np.random.default_rng(0).normal(size=(B, 2, t, K, H)).astype("float32")
query = jnp.zeros((B, t, 4))
write = jax.jit(lambda c, u, i: _cache.write_rows(c, u, _cache.check_index(i, query, S)))
got = np.asarray(write(cache, update, np.array([1, 5], "int32")))
want = cache.copy()
want[0, :, 1:3], want[1, :, 5:7] = update[0], update[1]
np.testing.assert_array_equal(got, want)
try:
    _cache.check_index(np.array([0, 6]), query, S)  # concrete: checked while tracing
    raise AssertionError("no error")
except ValueError as error:
    assert "each row's index in [0, 5]" in str(error), error
mask = _cache.Positioned(jnp.array([1, 4]), True, 3, None, None).mask_mod()
b, q, k = jnp.arange(B)[:, None, None, None], jnp.arange(t)[:, None], jnp.arange(S)
position = np.array([1, 4])[:, None, None, None] + np.arange(t)[:, None]
want = (k <= position) & (np.abs(position - k) < 3)  # (B, 1, t, S)
np.testing.assert_array_equal(np.asarray(mask(b, 0, q, k)), want)
print("ok")
"""


@pytest.mark.large  # the default tier's JAX run of test_on_both_backends caches per row too
def test_the_cache_writes_and_positions_on_jax():
    """On Keras's JAX backend, inside `jax.jit`: each row's new keys and values land at its own
    index (JAX's scatter reads `(M, 3)` indices), a concrete index past the end is refused, and
    the positioned causal window counts from each row's offset."""
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    run = subprocess.run(
        [sys.executable, "-c", JAX_CACHE_CHECK], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
