"""A swap never changes an answer: the ten ways `replace_attention` and `sdpa_scope` once gave
other answers than the stock model, without an error (issue #54), each against the stock model
with the same weights.

Written on `keras.ops` and NumPy: `tests/backends/test_jax_backend.py` runs this file's default
cases on JAX too.
"""

import json
import os
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest
from keras_hub.src.layers.modeling import transformer_decoder
from keras_hub.src.layers.modeling.cached_multi_head_attention import CachedMultiHeadAttention
from keras_hub.src.layers.modeling.transformer_decoder import TransformerDecoder
from keras_hub.src.layers.modeling.transformer_encoder import TransformerEncoder
from test_swap import gpt2_lm

import keras_sdpa
from keras_sdpa import ScaledDotProductAttention
from keras_sdpa._layer import stand_in as _stand_in

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, T, E, VOCAB = 2, 7, 16, 53


def numpy(x):
    return keras.ops.convert_to_numpy(x)


def twins(build):
    """`build()` twice, the second seeded apart and given the first's weights."""
    keras.utils.set_random_seed(0)
    stock = build()
    keras.utils.set_random_seed(1)
    other = build()
    other.set_weights(stock.get_weights())
    return stock, other


def padded_ids():
    ids = np.random.default_rng(0).integers(1, VOCAB, (B, T)).astype("int32")
    ids[0, 4:] = 0  # padding, which Embedding(mask_zero=True) masks
    return ids


def sdpa_layers(model):
    return [x for x in model._flatten_layers() if isinstance(x, ScaledDotProductAttention)]


# 1. keras-hub's CachedMultiHeadAttention takes no padding masks: Keras must hand the swapped
# layer none either.


def masked_decoder():
    ids = keras.Input((T,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, E, mask_zero=True)(ids)
    x = TransformerDecoder(intermediate_dim=32, num_heads=2, dropout=0.0)(x)
    return keras.Model(ids, x)


def test_a_cached_attention_gets_no_implicit_mask_after_the_swap():
    stock, ours = twins(masked_decoder)
    assert [name for _, name in keras_sdpa.replace_attention(ours).swapped] == [
        "CachedMultiHeadAttention"
    ]
    ids = padded_ids()
    np.testing.assert_allclose(numpy(ours(ids)), numpy(stock(ids)), atol=1e-5)  # padded too

    stock_layer, ours_layer = stand_in(
        lambda: CachedMultiHeadAttention(num_heads=2, key_dim=4), (B, T, 8), (B, T, 8)
    )
    x = keras.ops.convert_to_tensor(np.random.default_rng(1).normal(size=(B, T, 8)), "float32")
    x._keras_mask = keras.ops.convert_to_tensor(padded_ids() > 0)  # as Embedding leaves it
    np.testing.assert_allclose(numpy(ours_layer(x, x)), numpy(stock_layer(x, x)), atol=1e-5)
    cache = np.zeros((B, 2, T, 2, 4), "float32")
    want = stock_layer(x, x, cache=cache, cache_update_index=0)
    got = ours_layer(x, x, cache=cache, cache_update_index=0)  # raised on the masks once
    for a, b in zip(got, want):
        np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-5)
    with pytest.raises(TypeError, match="query_mask"):  # refused as the stock layer refuses it
        ours_layer(x, x, query_mask=np.ones((B, T), bool))


def test_the_call_arguments_kept_are_the_replaced_classes():
    import inspect

    for cls in (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
        CachedMultiHeadAttention,
    ):
        names = [n for n in inspect.signature(cls.call).parameters if n != "self"]
        assert tuple(names) == _stand_in.CALL_ARGUMENTS[cls.__name__], cls


# 2 and 3. Scopes: thread-local, overlapping and nested.


def test_overlapping_scopes_of_two_threads_restore_the_names_and_keep_other_threads_out():
    real = keras.layers.MultiHeadAttention
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    made = {}

    outside_done = threading.Event()

    def thread_a():
        with keras_sdpa.sdpa_scope(attn_logits_soft_cap=5.0):
            a_in.set()
            b_in.wait(10)
            outside_done.wait(10)  # the outsider constructs while both scopes are open
            made["a"] = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with keras_sdpa.sdpa_scope():
            b_in.set()
            a_out.wait(10)  # A closes first: B's scope is still open
            made["b"] = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)

    def outsider():
        b_in.wait(10)  # both scopes are open, in other threads
        made["outside"] = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        made["is_mha"] = isinstance(made["outside"], keras.layers.MultiHeadAttention)
        outside_done.set()

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b, outsider)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert type(made["a"]) is ScaledDotProductAttention and made["a"].attn_logits_soft_cap == 5.0
    assert type(made["b"]) is ScaledDotProductAttention and made["b"].attn_logits_soft_cap is None
    assert type(made["outside"]) is real and made["is_mha"]
    assert keras.layers.MultiHeadAttention is real  # the last scope out restored it
    assert type(keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)) is real


def test_nested_scopes_merge_their_options_for_every_class_and_take_positional_arguments():
    stock = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    with keras_sdpa.sdpa_scope(attn_logits_soft_cap=0.5):
        with keras_sdpa.sdpa_scope(flash_attention=True):
            mha = keras.layers.MultiHeadAttention(2, 4)  # positional, as Keras allows
            cached = transformer_decoder.CachedMultiHeadAttention(2, 4)  # a patched name
            gqa = keras.layers.GroupQueryAttention(4, 2, 1)
            assert isinstance(stock, keras.layers.MultiHeadAttention)  # still the class
        with keras_sdpa.sdpa_scope(attn_logits_soft_cap=0.25):
            inner = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    for layer in (mha, cached, gqa):
        assert type(layer) is ScaledDotProductAttention
        assert (layer.attn_logits_soft_cap, layer.flash_attention) == (0.5, True)
    assert (mha.num_heads, mha.key_dim, gqa.num_key_value_heads) == (2, 4, 1)
    assert (mha.replaces, cached.replaces, gqa.replaces) == (
        "MultiHeadAttention",
        "CachedMultiHeadAttention",
        "GroupedQueryAttention",
    )
    assert inner.attn_logits_soft_cap == 0.25


def test_scopes_closed_out_of_order_keep_each_ones_options():
    import contextlib

    with contextlib.ExitStack() as outer:
        first = keras_sdpa.sdpa_scope(attn_logits_soft_cap=5.0)
        first.__enter__()
        outer.enter_context(keras_sdpa.sdpa_scope(chunk_size=64))
        first.__exit__(None, None, None)  # the first closes while the second is open
        layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        assert (layer.attn_logits_soft_cap, layer.chunk_size) == (None, 64)
    assert type(keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)) is not type(layer)


def test_scopes_of_two_asyncio_tasks_do_not_mix():
    import asyncio

    async def main():
        a_in, b_in, a_built = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first():
            with keras_sdpa.sdpa_scope(attn_logits_soft_cap=5.0):
                a_in.set()
                await b_in.wait()  # the second task's scope is open now, in the same thread
                layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
                a_built.set()
                return layer.attn_logits_soft_cap

        async def second():
            await a_in.wait()
            with keras_sdpa.sdpa_scope(attn_logits_soft_cap=7.0):
                b_in.set()
                await a_built.wait()
                return keras.layers.MultiHeadAttention(num_heads=2, key_dim=4).attn_logits_soft_cap

        return await asyncio.gather(first(), second())

    assert asyncio.run(main()) == [5.0, 7.0]


# 4. Attention in containers of any depth.


class Nested(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [
            [
                keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="deep"),
                keras.layers.Dense(E),
            ]
        ]
        self.pair = {"inner": (keras.layers.MultiHeadAttention(2, 4, name="in_tuple"),)}

    def call(self, x):
        attention, dense = self.blocks[0]
        x = dense(x + attention(x, x))
        return x + self.pair["inner"][0](x, x)


def spy_calls(monkeypatch):
    called = []
    call = ScaledDotProductAttention.call

    def spy(self, *args, **kwargs):
        called.append(self.name)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(ScaledDotProductAttention, "call", spy)
    return called


def test_attention_in_nested_containers_is_swapped_called_and_trained(monkeypatch):
    def build():
        model = keras.Sequential([keras.Input((T, E)), Nested(), keras.layers.Dense(1)])
        return model

    stock, ours = twins(build)
    report = keras_sdpa.replace_attention(ours)
    assert sorted(path.split("/")[-1] for path, _ in report.swapped) == ["deep", "in_tuple"]
    nested = ours.layers[0]
    assert type(nested.blocks[0][0]) is type(nested.pair["inner"][0]) is ScaledDotProductAttention
    called = spy_calls(monkeypatch)
    x = np.random.default_rng(0).normal(size=(B, T, E)).astype("float32")
    np.testing.assert_allclose(numpy(ours(x)), numpy(stock(x)), atol=1e-5)
    # The report counts the layers the model's call runs, no more and no fewer.
    assert sorted(called) == sorted(path.split("/")[-1] for path, _ in report.swapped)
    y = np.ones((B, T, 1), "float32")
    for model in (stock, ours):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, epochs=2, verbose=0)
    w_q = [numpy(w) for w in ours.weights if "query" in w.path and "kernel" in w.path]
    assert len(w_q) == 2 and all(np.abs(w).sum() > 0 for w in w_q)
    for a, b in zip(stock.weights, ours.weights):  # trained as the stock model trains
        np.testing.assert_allclose(numpy(b), numpy(a), atol=1e-5)


def test_a_shared_holder_that_cannot_take_the_new_layer_stops_the_swap_before_any_change():
    model = keras.layers.Layer(name="model")
    model.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    other = keras.layers.Layer(name="other")
    object.__setattr__(other, "group", {model.attention})  # held outside the model, in a set
    object.__setattr__(other, "keep", [model.attention])
    old = model.attention
    with pytest.raises(ValueError, match=r"other\.group \(a set\)"):
        keras_sdpa.replace_attention(model)
    assert model.attention is old and other.keep[0] is old  # nothing changed


def test_a_tuple_met_twice_is_replaced_in_both_places():
    holder = keras.layers.Layer(name="holder")
    holder.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    pair = (holder.attention, 1)
    object.__setattr__(holder, "pairs", [pair, pair])  # untracked: Keras leaves it as it is
    keras_sdpa.replace_attention(holder)
    assert holder.pairs[0][0] is holder.pairs[1][0] is holder.attention
    assert type(holder.attention) is ScaledDotProductAttention


def test_a_layer_held_in_a_set_is_refused_with_its_place():
    holder = keras.layers.Layer(name="holder")
    holder.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    object.__setattr__(holder, "group", {holder.attention})
    with pytest.raises(ValueError, match=r"holder\.group \(a set\)"):
        keras_sdpa.replace_attention(holder)


# 5. Frozen projections stay frozen.


def test_frozen_projections_stay_frozen_and_untrained():
    def build():
        x = keras.Input((T, E))
        mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")
        model = keras.Model(x, keras.layers.Dense(1)(mha(x, x)))
        mha.query_dense.trainable = False
        mha.output_dense.bias.trainable = False
        return model

    stock, ours = twins(build)
    trainable = [w.path for w in ours.trainable_weights]
    keras_sdpa.replace_attention(ours)
    assert [w.path for w in ours.trainable_weights] == trainable
    assert len(trainable) == len(stock.trainable_weights) == 7
    w_q = numpy(ours.layers[1].query_dense.kernel).copy()
    x = np.random.default_rng(0).normal(size=(B, T, E)).astype("float32")
    y = np.ones((B, T, 1), "float32")
    for model in (stock, ours):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, epochs=2, verbose=0)
    np.testing.assert_array_equal(numpy(ours.layers[1].query_dense.kernel), w_q)
    for a, b in zip(stock.weights, ours.weights):
        np.testing.assert_allclose(numpy(b), numpy(a), atol=1e-5)


# 6. A layer shared by two models stays shared.


def test_layers_shared_by_another_model_are_swapped_there_too(tmp_path):
    x = keras.Input((T, E))
    first = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="first")
    second = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="second")
    hidden = second(first(x, x), x)
    model_a = keras.Model(x, keras.layers.Dense(1)(hidden), name="model_a")
    model_b = keras.Model(x, keras.layers.Dense(2)(hidden), name="model_b")
    report = keras_sdpa.replace_attention(model_a)
    assert sorted(report.shared) == [("model_b", "model_a/first"), ("model_b", "model_a/second")]
    assert sdpa_layers(model_b) == sdpa_layers(model_a) and len(sdpa_layers(model_a)) == 2
    shared = {id(w) for w in model_a.weights} & {id(w) for w in model_b.weights}
    assert len(shared) == 16  # both attention layers' variables, and no stale copy of them
    data = np.random.default_rng(0).normal(size=(B, T, E)).astype("float32")
    before = numpy(model_b(data))
    model_a.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    model_a.fit(data, np.ones((B, T, 1), "float32"), epochs=1, verbose=0)
    assert np.abs(numpy(model_b(data)) - before).max() > 1e-4  # trained through model_a
    path = str(tmp_path / "b.keras")
    model_b.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(numpy(loaded(data)), numpy(model_b(data)), atol=1e-5)


FROZEN_HOLDER = """
import gc, json, keras, keras_sdpa
x = keras.Input((5, 8))
shared = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="shared")
hidden = shared(x, x)
model_a = keras.Model(x, keras.layers.Dense(1)(hidden), name="model_a")
model_b = keras.Model(x, keras.layers.Dense(2)(hidden), name="model_b")
if {freeze}:
    gc.freeze()
report = keras_sdpa.replace_attention(model_a)
kinds = lambda model: [type(layer).__name__ for layer in model.layers if "shared" in layer.name]
print(json.dumps([report.shared, kinds(model_a), kinds(model_b)]))
"""


@pytest.mark.large  # two processes of their own
def test_a_model_frozen_out_of_the_collectors_view_is_not_found_as_the_docs_say():
    """What `replace_attention`'s docstring and docs/keras-hub.md say of `gc.freeze()`: the
    scan for other holders (`gc.get_referrers`) does not see frozen objects, so a model that
    shares the layers, frozen before the swap, keeps the old one. (In processes of their own:
    this session freezes what its collection imported.)"""
    results = []
    for freeze in (False, True):
        script = FROZEN_HOLDER.format(freeze=freeze)
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    sdpa, mha = ["ScaledDotProductAttention"], ["MultiHeadAttention"]
    assert results[0] == [[["model_b", "model_a/shared"]], sdpa, sdpa]
    assert results[1] == [[], sdpa, mha]


# 7. Functions traced before the swap are traced again, also around a swapped backbone.


def test_generate_traced_before_the_backbone_is_swapped_runs_the_new_layers():
    stock, ours = twins(gpt2_lm)
    prompt = {
        "token_ids": np.pad([[5, 6, 7]], [[0, 0], [0, 5]]),
        "padding_mask": np.arange(8)[None] < 3,
    }
    want = stock.generate(prompt, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(ours.generate(prompt, stop_token_ids=None)["token_ids"], want)
    report = keras_sdpa.replace_attention(ours.backbone)  # not the task around it
    assert ours.name in report.reset
    # New weights for the attention of both: a function traced with the old layers would
    # still read the old ones.
    for model in (stock, ours):
        for variable in model.backbone.weights:
            if "attention" in variable.path:
                variable.assign(variable * 1.5)
    want = stock.generate(prompt, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(ours.generate(prompt, stop_token_ids=None)["token_ids"], want)


# 8. A cross-attention cache filled with more keys than the queries.


def test_a_cross_attention_cache_fills_with_the_encoders_keys():
    stock, ours = stand_in(
        lambda: CachedMultiHeadAttention(num_heads=2, key_dim=4), (B, 4, 8), (B, 3, 8)
    )
    rng = np.random.default_rng(0)
    decoder = rng.normal(size=(B, 4, 8)).astype("float32")  # longer than the encoder
    encoder = rng.normal(size=(B, 3, 8)).astype("float32")
    cache = np.zeros((B, 2, 3, 2, 4), "float32")
    want = stock(decoder, encoder, cache=cache, cache_update_index=0)
    got = ours(decoder, encoder, cache=cache, cache_update_index=0)
    for a, b in zip(got, want):
        np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-5)
    with pytest.raises(ValueError, match="room for the 3 new positions in a cache of 3"):
        ours(decoder, encoder, cache=cache, cache_update_index=1)


# 9. A query whose keys are all masked gets what the replaced class gives it.


def masked_encoder(dropout):
    def build():
        ids = keras.Input((T,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, E, mask_zero=True)(ids)
        x = TransformerEncoder(intermediate_dim=32, num_heads=2, dropout=dropout)(x)
        return keras.Model(ids, x)

    return build


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["fused-uniform", "softmax-zeros"])
def test_fully_masked_rows_get_what_the_replaced_class_gives(dropout):
    stock, ours = twins(masked_encoder(dropout))
    keras_sdpa.replace_attention(ours)
    ids = padded_ids()
    got, want = numpy(ours(ids)), numpy(stock(ids))
    np.testing.assert_allclose(got, want, atol=1e-5)  # the padded rows too

    stock, ours = stand_in(
        lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=dropout),
        (B, T, 8),
        (B, 5, 8),
    )
    rng = np.random.default_rng(2)
    q, v = rng.normal(size=(B, T, 8)).astype("float32"), rng.normal(size=(B, 5, 8))
    v = v.astype("float32")
    mask = rng.random((B, T, 5)) < 0.5
    mask[0, 2], mask[1, 5] = False, False  # rows with no key
    for causal in (False, True):
        for scores in (False, True):
            kwargs = dict(
                attention_mask=mask, use_causal_mask=causal, return_attention_scores=scores
            )
            got, want = ours(q, v, **kwargs), stock(q, v, **kwargs)
            for a, b in zip(*(x if scores else (x,) for x in (got, want))):
                np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-5)


def stand_in(make, *shapes):
    """A Keras layer built on `shapes` and the stand-in put in its place, same weights."""

    def build():
        layer = make()
        layer(*(np.zeros(shape, "float32") for shape in shapes))
        return layer

    stock, ours = twins(build)
    holder = keras.layers.Layer()
    holder.attention = ours
    keras_sdpa.replace_attention(holder)
    return stock, holder.attention


def close(got, want):
    for a, b in zip(keras.tree.flatten(got), keras.tree.flatten(want)):
        np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-5)


@pytest.mark.parametrize(
    "case",
    ["gqa", "window", "window-causal", "value_mask-causal", "folded", "2d-mask", "window-beyond"],
)
def test_fully_masked_rows_of_every_mask_form_are_the_stock_ones(case):
    rng = np.random.default_rng(3)
    t = 1 if case == "folded" else T
    q = rng.normal(size=(B, t, 8)).astype("float32")
    v = rng.normal(size=(B, 5, 8)).astype("float32")
    if case == "gqa":
        stock, ours = stand_in(
            lambda: keras.layers.GroupQueryAttention(4, 4, 2), (B, T, 8), (B, 5, 8)
        )
    else:
        window = {"window": 2, "window-causal": 2, "window-beyond": 1}.get(case)  # T > S + W
        stock, ours = stand_in(
            lambda: keras.layers.MultiHeadAttention(
                2, 16 if case == "folded" else 4, sliding_window=window
            ),
            (B, t, 8),
            (B, 5, 8),
        )
    keys = np.ones((B, 5), bool)
    keys[0, :3], keys[1] = False, False  # row 0's first keys and all of row 1's
    mask = rng.random((B, t, 5)) < 0.6
    mask[0, 0] = False
    kwargs = {
        "gqa": dict(attention_mask=mask, use_causal_mask=True),
        "window": dict(value_mask=keys),
        "window-causal": dict(value_mask=keys, use_causal_mask=True),
        "value_mask-causal": dict(value_mask=keys, use_causal_mask=True),
        "folded": dict(attention_mask=mask),
        "2d-mask": dict(attention_mask=mask[0]),  # (T, S)
        "window-beyond": {},  # the last query rows see no key: |t - s| < 1 past S
    }[case]
    close(ours(q, v, **kwargs), stock(q, v, **kwargs))


def test_the_stand_in_takes_its_classs_arguments_as_that_class_does():
    rng = np.random.default_rng(4)
    q = rng.normal(size=(B, T, 8)).astype("float32")
    mask = rng.random((B, T, T)) < 0.5
    stock, ours = stand_in(lambda: CachedMultiHeadAttention(2, 4), (B, T, 8), (B, T, 8))
    close(ours(q, q, q, mask), stock(q, q, q, mask))  # the fourth is `attention_mask`
    cache = rng.normal(size=(B, 2, T, 2, 4)).astype("float32")
    kwargs = dict(cache_update_index=0)  # Keras takes only tensors by position
    close(ours(q, q, None, mask, cache, **kwargs), stock(q, q, None, mask, cache, **kwargs))
    stock, ours = stand_in(lambda: keras.layers.MultiHeadAttention(2, 4), (B, T, 8), (B, T, 8))
    rows = np.ones((B, T), bool)
    rows[0, 3:] = False
    # MultiHeadAttention reads the query's padding from its Keras mask, not this argument.
    close(ours(q, q, query_mask=rows), stock(q, q, query_mask=rows))
    with pytest.raises(TypeError, match="attention_bias"):  # Keras's refuses it too
        ours(q, q, attention_bias=np.zeros((B, 2, T, T), "float32"))


@pytest.mark.parametrize("t", [T, 1], ids=["projected", "short-query"])
def test_the_stand_in_adds_the_losses_of_the_replaced_class(t):
    def make():  # a short query against wide heads would attend in the inputs' space
        return keras.layers.MultiHeadAttention(2, 16, activity_regularizer="l2")

    stock, ours = stand_in(make, (B, t, 8), (B, T, 8))
    rng = np.random.default_rng(5)
    q, v = rng.normal(size=(B, t, 8)).astype("float32"), rng.normal(size=(B, T, 8))
    v = v.astype("float32")
    mask = rng.random((B, t, T)) < 0.5
    mask[0, 0] = False
    close(ours(q, v, attention_mask=mask), stock(q, v, attention_mask=mask))
    assert len(ours.losses) == len(stock.losses) == 4
    close(ours.losses, stock.losses)


def test_bad_replaces_is_refused_with_what_was_received():
    with pytest.raises(ValueError, match=r"replaces=\['MultiHeadAttention'\]"):
        ScaledDotProductAttention(num_heads=2, replaces=["MultiHeadAttention"])
    with pytest.raises(ValueError, match="ignores `use_gate`.*use_gate=True"):
        ScaledDotProductAttention(num_heads=2, use_gate=True, replaces="CachedMultiHeadAttention")
    layer = ScaledDotProductAttention(num_heads=2, replaces="MultiHeadAttention")
    with pytest.raises(AttributeError):
        layer.replaces = None  # fixed at construction, with the call arguments it decides
    with pytest.raises(ValueError, match="`replaces` is the swap's to set"):
        keras_sdpa.replace_attention(keras.layers.Layer(), replaces="MultiHeadAttention")


# 10. Saving: a functional graph loads back swapped; a model whose code builds Keras's
# attention warns when its config is taken, and loads swapped inside the scope.


def test_a_swapped_keras_hub_model_warns_on_saving_and_loads_swapped_in_the_scope(tmp_path):
    stock, ours = twins(gpt2_lm)
    keras_sdpa.replace_attention(ours.backbone)
    path = str(tmp_path / "gpt2.keras")
    with pytest.warns(UserWarning, match="does not record the attention"):
        ours.backbone.save(path)
    plain = keras.saving.load_model(path)
    assert sdpa_layers(plain) == []  # what the warning says
    with keras_sdpa.sdpa_scope():
        loaded = keras.saving.load_model(path)
    assert [x.replaces for x in sdpa_layers(loaded)] == ["CachedMultiHeadAttention"] * 2
    inputs = {"token_ids": padded_ids()[:, :6], "padding_mask": padded_ids()[:, :6] > 0}
    np.testing.assert_allclose(numpy(loaded(inputs)), numpy(stock.backbone(inputs)), atol=1e-5)


def test_a_swapped_functional_model_loads_back_swapped_without_a_warning(tmp_path, recwarn):
    x = keras.Input((T, E))
    functional = keras.Model(x, keras.layers.MultiHeadAttention(2, 4)(x, x))
    keras_sdpa.replace_attention(functional)
    path = str(tmp_path / "functional.keras")
    functional.save(path)
    assert not [w for w in recwarn if "does not record" in str(w.message)]
    loaded = keras.saving.load_model(path)
    assert [layer.replaces for layer in sdpa_layers(loaded)] == ["MultiHeadAttention"]
    data = np.random.default_rng(0).normal(size=(B, T, E)).astype("float32")
    np.testing.assert_allclose(numpy(loaded(data)), numpy(functional(data)), atol=1e-5)
