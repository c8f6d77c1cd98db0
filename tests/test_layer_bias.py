"""The layer's `attention_bias`: broadcast by NumPy's rules, added in float32 under mixed precision.

Against a NumPy float64 reference of the whole layer (projections, heads, output projection)
with the layer's own weights. Sizes are pairwise distinct but for `B == N` in one case: a
`(N, T, S)` bias read as `(B, T, S)` must not pass by the two sizes being equal.
"""

import keras
import numpy as np
import pytest
from on_backend import numpy, tensor

from keras_sdpa import ScaledDotProductAttention

B, T, S, E, N, H = 3, 4, 5, 8, 2, 4


def random(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype("float32")


def layer_numpy(layer, query, value, bias):
    """The layer's output in float64: `softmax(Q K^T / sqrt(H) + bias) V W_O`, per head."""
    wq, bq, wk, bk, wv, bv, wo, bo = (w.astype("float64") for w in layer.get_weights())
    q = np.einsum("bte,enh->bnth", query, wq) + bq[None, :, None]  # (B, N, T, H)
    k = np.einsum("bse,enh->bnsh", value, wk) + bk[None, :, None]  # (B, N, S, H)
    v = np.einsum("bse,enh->bnsh", value, wv) + bv[None, :, None]  # (B, N, S, H)
    logits = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(q.shape[-1])  # (B, N, T, S)
    logits = logits + np.broadcast_to(np.asarray(bias, "float64"), logits.shape)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bnts,bnsh->bnth", weights, v)  # (B, N, T, H)
    return np.einsum("bnth,nhe->bte", out, wo) + bo  # (B, T, E)


def built_layer(batch=B, **kwargs):
    layer = ScaledDotProductAttention(num_heads=N, key_dim=H, **kwargs)
    layer(np.zeros((batch, T, E), "float32"), np.zeros((batch, S, E), "float32"))
    rng = np.random.default_rng(0)
    layer.set_weights(
        [w + 0.3 * rng.normal(size=w.shape).astype(w.dtype) for w in layer.get_weights()]
    )
    return layer


BIAS_SHAPES = {
    "N_T_S_with_B_equal_N": (N, N, T, S),  # (batch, bias shape...): B == N
    "N_T_S": (B, N, T, S),
    "N_1_S": (B, N, 1, S),
    "T_S": (B, T, S),
    "S": (B, S),
    "B_1_T_S": (B, B, 1, T, S),
}


@pytest.mark.parametrize("case", list(BIAS_SHAPES), ids=list(BIAS_SHAPES))
def test_a_bias_broadcasts_as_numpy_broadcasts_it(case):
    batch, *shape = BIAS_SHAPES[case]
    layer = built_layer(batch)
    query, value = random((batch, T, E), 1), random((batch, S, E), 2)
    bias = random(shape, 3, scale=2.0)
    got = layer(query, value, attention_bias=tensor(bias))
    np.testing.assert_allclose(numpy(got), layer_numpy(layer, query, value, bias), atol=1e-5)


def test_a_bias_that_does_not_broadcast_is_refused_with_its_shape():
    layer = built_layer()
    with pytest.raises(ValueError, match=r"attention_bias.*\(2, 7, 5\)|bias.*\(1, 2, 7, 5\)"):
        layer(random((B, T, E), 1), random((B, S, E), 2), attention_bias=random((N, 7, S), 3))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_bias_is_added_in_float32_under_mixed_precision(policy):
    """A large bias keeps its float32 value: rounded to half precision first, a bias near 200
    moved the outputs by 0.39 (of 1.35), and a -1e9 mask under float16 became -inf: NaN."""
    layer = built_layer(dtype=policy)
    query, value = random((B, T, E), 1, 0.1), random((B, S, E), 2, 0.1)
    bias = 200.0 + random((N, T, S), 3, scale=1.0)  # half precision: steps of 0.125 or 1
    bias[:, 0] = -1e9  # the first query row of every head fully masked by the bias
    got = numpy(layer(query, value, attention_bias=tensor(bias)), "float32")
    want = layer_numpy(layer, query, value, bias)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_a_cached_call_adds_its_bias_in_float32():
    """The cached path (one new row a call) takes the same bias in float32: under
    `mixed_bfloat16`, a bias near 200 gives what the float64 reference gives."""
    layer = built_layer(dtype="mixed_bfloat16")
    x = random((B, S, E), 4, 0.1)
    bias = 200.0 + random((B, N, S, S), 5)
    cache = keras.ops.zeros((B, 2, S, N, H), "bfloat16")
    for position in range(S):
        row = x[:, position : position + 1]
        out, cache = layer(
            row,
            row,
            attention_bias=tensor(bias[:, :, position : position + 1]),
            cache=cache,
            cache_update_index=position,
            use_causal_mask=True,
        )
    # The last row attends to every key: the uncached reference over the whole sequence.
    want = layer_numpy(layer, x, x, bias)[:, -1]
    np.testing.assert_allclose(numpy(out, "float32")[:, 0], want, atol=2e-2 * np.abs(want).max())


def test_a_functional_model_with_a_constant_bias_runs_and_has_a_config():
    """A bias given as an array in a functional model stays an argument of the node: the model
    runs (in float32 under mixed precision) and its config serializes."""
    layer = built_layer(dtype="mixed_float16")
    bias = 200.0 + random((N, T, S), 3)
    query, value = keras.Input((T, E)), keras.Input((S, E))
    model = keras.Model([query, value], layer(query, value, attention_bias=bias))
    x, v = random((B, T, E), 1, 0.1), random((B, S, E), 2, 0.1)
    got = numpy(model([x, v]), "float32")
    want = layer_numpy(layer, x, v, bias)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
    assert keras.saving.serialize_keras_object(model)


class ScaledBias(ScaledDotProductAttention):
    """A subclass whose own `call` does arithmetic on the bias before the layer's."""

    def call(self, query, value, key=None, attention_bias=None, **kwargs):
        return super().call(query, value, key, attention_bias=attention_bias * 2.0, **kwargs)


def test_a_subclass_call_receives_the_bias_as_a_tensor():
    layer = ScaledBias(num_heads=N, key_dim=H)
    query, value = random((B, T, E), 1), random((B, S, E), 2)
    bias = random((N, T, S), 3)
    got = layer(query, value, attention_bias=tensor(bias))
    np.testing.assert_allclose(numpy(got), layer_numpy(layer, query, value, 2 * bias), atol=1e-5)
