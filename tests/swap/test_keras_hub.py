"""keras-hub interop: its GPT-2 generates the same tokens with this layer in every block.

keras-hub's decoders call `CachedMultiHeadAttention` with a cache (B, 2, S, N, H), a scalar
`cache_update_index` and their own (B, T, S) mask. Here a random GPT-2 (nothing downloaded)
is built twice, once as shipped and once with `ScaledDotProductAttention` in place of every
`CachedMultiHeadAttention`, with the same weights. Greedy generation runs through keras-hub's
own jit-compiled `generate`, prefill and cache loop included.

keras-hub's `cached_multi_head_attention_test.py` ships in neither its wheel nor its sdist, so
it cannot be imported here as `tests/layer/test_keras_suites.py` imports Keras's suites. Its five
tests are restated below against this layer, with keras-hub's own `TestCase.run_layer_test`
(which ships) for the first: serialization, build, training and precision checks.
"""

from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras_hub.src.layers.modeling import transformer_decoder
from keras_hub.src.layers.modeling.cached_multi_head_attention import CachedMultiHeadAttention
from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
from keras_hub.src.models.gpt2.gpt2_causal_lm import GPT2CausalLM
from keras_hub.src.tests.test_case import TestCase

from keras_sdpa import ScaledDotProductAttention

VOCAB, LAYERS, HEADS, WIDTH = 97, 2, 4, 32


def gpt2(attention=None):
    """A small random GPT-2 causal LM; `attention` replaces `CachedMultiHeadAttention`."""
    config = dict(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=WIDTH,
        intermediate_dim=2 * WIDTH,
        max_sequence_length=64,
    )
    with mock.patch.object(
        transformer_decoder, "CachedMultiHeadAttention", attention or CachedMultiHeadAttention
    ):
        backbone = GPT2Backbone(**config)
    lm = GPT2CausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


@pytest.fixture(scope="module")
def models():
    keras.utils.set_random_seed(0)
    stock = gpt2()
    ours = gpt2(ScaledDotProductAttention)
    ours.set_weights(stock.get_weights())
    return stock, ours


def prompts(lengths=(3, 5, 7), total=24):
    """Ragged prompts, padded to `total`: keras-hub starts at the shortest and keeps each
    row's own prompt tokens until the row passes them."""
    rng = np.random.default_rng(0)
    ids = np.zeros((len(lengths), total), "int32")
    mask = np.zeros((len(lengths), total), bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(1, VOCAB, length)
        mask[row, :length] = True
    return {"token_ids": ids, "padding_mask": mask}


def test_the_swap_replaces_every_cached_attention(models):
    stock, ours = models
    kinds = [type(block._self_attention_layer) for block in ours.backbone.transformer_layers]
    assert kinds == [ScaledDotProductAttention] * LAYERS
    assert [type(b._self_attention_layer) for b in stock.backbone.transformer_layers] == [
        CachedMultiHeadAttention
    ] * LAYERS


def test_gpt2_generates_the_same_greedy_tokens(models):
    """keras-hub's `generate` (jit-compiled prefill and cache loop) gives the same tokens."""
    stock, ours = models
    want = stock.generate(prompts(), stop_token_ids=None)["token_ids"]
    got = ours.generate(prompts(), stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(got, want)
    assert len(set(map(tuple, np.asarray(want)[:, 7:]))) > 1  # rows generated, not copied


def test_gpt2_logits_match_without_and_with_the_cache(models):
    """The full forward pass, and the prefill plus every cached step, to 1e-5."""
    stock, ours = models
    x = prompts()
    np.testing.assert_allclose(
        ours.predict(x, verbose=0), stock.predict(x, verbose=0), atol=1e-5, rtol=1e-5
    )
    ids = tf.constant(x["token_ids"])
    (_, stock_cache), (_, our_cache) = stock._build_cache(ids), ours._build_cache(ids)
    np.testing.assert_allclose(our_cache, stock_cache, atol=1e-5)
    for index in range(7, 12):
        token = ids[:, index : index + 1]
        want, _, stock_cache = stock.call_with_cache(token, stock_cache, index)
        got, _, our_cache = ours.call_with_cache(token, our_cache, index)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=str(index))


class TestKerasHubCachedAttentionChecks(TestCase):
    """The checks of keras-hub's `cached_multi_head_attention_test.py`, on this layer."""

    batch_size, seq_len, num_heads, key_dim = 2, 5, 2, 4
    hidden_dim = num_heads * key_dim

    def layer(self, **kwargs):
        return ScaledDotProductAttention(num_heads=self.num_heads, key_dim=self.key_dim, **kwargs)

    def inputs(self):
        return keras.random.uniform((self.batch_size, self.seq_len, self.hidden_dim), seed=1)

    def empty_cache(self):
        shape = (self.batch_size, 2, self.seq_len, self.num_heads, self.key_dim)
        return keras.ops.zeros(shape)

    def test_layer_behaviors(self):
        self.run_layer_test(
            cls=ScaledDotProductAttention,
            init_kwargs={"num_heads": 2, "key_dim": 4, "dropout": 0.1},
            input_data={
                "query": keras.random.uniform(shape=(2, 4, 6)),
                "value": keras.random.uniform(shape=(2, 4, 6)),
            },
            expected_output_shape=(2, 4, 6),
            expected_num_trainable_weights=8,
            expected_num_non_trainable_variables=1,
        )

    def test_cache_call_is_correct(self):
        """A while_loop of one-token steps equals one call over the whole sequence, output and
        cache, with keras-hub's (T, S) causal mask."""
        x, layer = self.inputs(), self.layer()
        mask = keras.ops.tril(keras.ops.ones((self.seq_len, self.seq_len)))
        whole, whole_cache = layer(
            x, x, cache=self.empty_cache(), cache_update_index=0, attention_mask=mask
        )

        def step(i, outputs, cache):
            token = keras.ops.slice(x, (0, i, 0), (self.batch_size, 1, self.hidden_dim))
            row = keras.ops.slice(mask, (i, 0), (1, self.seq_len))
            out, cache = layer(
                query=token, value=token, cache=cache, cache_update_index=i, attention_mask=row
            )
            return i + 1, keras.ops.slice_update(outputs, [0, i, 0], out), cache

        _, looped, looped_cache = keras.ops.while_loop(
            lambda i, outputs, cache: i < self.seq_len,
            step,
            [0, keras.ops.zeros_like(x), self.empty_cache()],
        )
        self.assertAllClose(looped, whole, atol=1e-5, rtol=1e-5)
        self.assertAllClose(looped_cache, whole_cache, atol=1e-5, rtol=1e-5)

    def test_return_attention_scores(self):
        out, scores = self.layer()(self.inputs(), self.inputs(), return_attention_scores=True)
        self.assertAllEqual(out.shape, [self.batch_size, self.seq_len, self.hidden_dim])
        self.assertAllEqual(
            scores.shape, [self.batch_size, self.num_heads, self.seq_len, self.seq_len]
        )
        sums = keras.ops.sum(scores, axis=-1)
        self.assertAllClose(sums, keras.ops.ones_like(sums), atol=1e-5)

    def test_return_attention_scores_with_cache(self):
        x = self.inputs()
        mask = keras.ops.tril(keras.ops.ones((self.seq_len, self.seq_len)))
        out, scores, cache = self.layer()(
            x,
            x,
            cache=self.empty_cache(),
            cache_update_index=0,
            attention_mask=mask,
            return_attention_scores=True,
        )
        self.assertAllEqual(out.shape, [self.batch_size, self.seq_len, self.hidden_dim])
        self.assertAllEqual(
            scores.shape, [self.batch_size, self.num_heads, self.seq_len, self.seq_len]
        )
        self.assertAllEqual(cache.shape, self.empty_cache().shape)

    def test_training_propagation(self):
        """Dropout of about 1 zeroes the weights: the output is `W_O` applied to zeros."""
        x = self.inputs()
        layer = self.layer(dropout=0.99999)
        out = layer(x, x, training=True)
        heads = keras.ops.zeros((self.batch_size, self.seq_len, self.num_heads, self.key_dim))
        self.assertAllClose(out, layer._output_dense(heads), atol=1e-5)
