"""The classifier's attention pooling: a learned query attends over the tokens."""

import keras
from keras import ops

from keras_sdpa import ScaledDotProductAttention

POOLING_VALUES = ("block", "embedding")  # what the attention pooling sums


@keras.saving.register_keras_serializable(package="apps")
class AttentionPooling(keras.layers.Layer):
    """Pools `(B, L, E)` to `(B, E)`: a learned query attends over the unmasked tokens.

    This is `ScaledDotProductAttention` with `T = 1`; its weights `(B, N, 1, L)` are
    the classifier's own account of which tokens it used.

    `values_from` says what the caller pools: `"block"`, the keys themselves (the blocks'
    output, each position mixed with its context), or `"embedding"`, the positions' own
    embeddings passed as `values` (the keys, and so the weights, still come from the blocks).
    With embeddings the pooled vector is a weighted sum of each token's own features, so a
    token the weights rank high carries what it adds.
    """

    def __init__(self, num_heads, key_dim, scale=None, values_from="block", **kwargs):
        super().__init__(**kwargs)
        if values_from not in POOLING_VALUES:
            raise ValueError(
                f"`values_from` must be one of {', '.join(POOLING_VALUES)}. "
                f"Received: values_from={values_from!r}"
            )
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.scale = scale  # of the logits; None = 1 / sqrt(key_dim)
        self.values_from = values_from
        self.attention = ScaledDotProductAttention(
            num_heads=num_heads, key_dim=key_dim, scale=scale, name="attention"
        )

    def build(self, x_shape):
        width = x_shape[-1]
        self.query = self.add_weight(
            shape=(1, 1, width), initializer="glorot_uniform", name="query"
        )
        self.attention.build((x_shape[0], 1, width), x_shape)

    def call(self, x, mask=None, values=None, return_attention_scores=False):
        """`x` `(B, L, E)` the keys; `values` `(B, L, E)`, only with `values_from="embedding"`."""
        if (values is None) != (self.values_from == "block"):
            given = "None" if values is None else "a tensor"
            raise ValueError(
                "`values` must be given exactly when `values_from` is 'embedding'. "
                f"Received: values_from={self.values_from!r}, values={given}"
            )
        batch = ops.shape(x)[0]
        query = ops.broadcast_to(self.query, (batch, 1, ops.shape(x)[-1]))  # (B, 1, E)
        result = self.attention(
            query,
            x if values is None else values,
            key=x,
            value_mask=mask,
            return_attention_scores=return_attention_scores,
        )  # (B, 1, E), and (B, N, 1, L) if asked
        pooled, scores = result if return_attention_scores else (result, None)
        pooled = ops.squeeze(pooled, 1)  # (B, E)
        return (pooled, scores) if return_attention_scores else pooled

    def compute_mask(self, x, mask=None):
        return None

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "scale": self.scale,
            "values_from": self.values_from,
        }
