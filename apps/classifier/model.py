"""The sentiment classifier, built from `keras_sdpa.ScaledDotProductAttention`.

    token ids (B, L) -> Embedding(mask_zero=True) + positions  (B, L, E)
                        (+ word-pair and word-triple embeddings, optional)
                        (+ naive-Bayes log-count ratios, projected, optional)
                     -> num_layers x TransformerBlock           (B, L, E)  self-attention
                     -> AttentionPooling                        (B, E)     a learned query attends
                     -> Dense(1, sigmoid)                       (B, 1)     P(positive)

Both attentions are our layer: the blocks with T = S = L, the pooling with T = 1,
whose weights say directly which tokens the classifier looked at.
"""

import typing

import keras
from keras import ops

from keras_sdpa import ScaledDotProductAttention

from .embedding import TokenAndPositionEmbedding
from .optimizer import Adam  # noqa: F401 (registered with Keras, as `model.keras` names it)
from .pooling import AttentionPooling


@keras.saving.register_keras_serializable(package="apps")
class TransformerBlock(keras.layers.Layer):
    """Post-norm encoder block: `LN(x + SDPA(x))`, then `LN(x + FFN(x))`."""

    def __init__(self, num_heads, key_dim, ff_dim, dropout=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.ff_dim = ff_dim
        self.dropout = dropout
        self.seed = seed
        self.supports_masking = True  # the output keeps the input's padding mask
        # A single head of our layer has no W_O unless asked (the derivation's head); the
        # residual needs the block's width back, as MultiHeadAttention always gives it.
        projection = {"output_projection": True} if num_heads == 1 else {}
        self.attention = ScaledDotProductAttention(
            num_heads=num_heads,
            key_dim=key_dim,
            dropout=dropout,
            seed=seed,
            name="attention",
            **projection,
        )
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="attention_norm")
        self.ff_inner = keras.layers.Dense(ff_dim, activation="gelu", name="ff_inner")
        self.ff_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="ff_norm")
        self.dropout_layer = keras.layers.Dropout(dropout, seed=seed)

    def build(self, x_shape):
        width = x_shape[-1]
        self.attention.build(x_shape, x_shape)
        self.attention_norm.build(x_shape)
        self.ff_inner.build(x_shape)
        self.ff_outer = keras.layers.Dense(width, name="ff_outer")
        self.ff_outer.build((*x_shape[:-1], self.ff_dim))
        self.ff_norm.build(x_shape)

    def call(self, x, mask=None, training=None, return_attention_scores=False):
        # The (L, L) weights cost a pass over the matrix forward and one more backward:
        # only the inspector asks for them, never the training step.
        result = self.attention(
            x,
            x,
            query_mask=mask,
            value_mask=mask,
            return_attention_scores=return_attention_scores,
            training=training,
        )  # (B, L, E), and (B, N, L, L) if asked
        attended, scores = result if return_attention_scores else (result, None)
        x = self.attention_norm(x + self.dropout_layer(attended, training=training))
        inner = self.ff_inner(x)  # (B, L, ff_dim)
        x = self.ff_norm(x + self.dropout_layer(self.ff_outer(inner), training=training))
        return (x, scores) if return_attention_scores else x

    def compute_mask(self, x, mask=None):
        return mask

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "ff_dim": self.ff_dim,
            "dropout": self.dropout,
            "seed": self.seed,
        }


def build_classifier(
    vocab_size,
    sequence_length,
    embed_dim=64,
    num_heads=2,
    key_dim=32,
    ff_dim=128,
    num_layers=1,
    dropout=0.1,
    seed=0,
    bigram_vocab_size=0,
    trigram_vocab_size=0,
    naive_bayes=False,
    naive_bayes_folds=5,
    pooling_scale=None,
    pooling_values="block",
    ngram_dim=None,
    word_dropout=0.0,
    normalize_embeddings=False,
):
    """Returns `(model, inspector)`, two functional models over the same weights.

    `pooling_scale` multiplies the pooling attention's logits (None: `1 / sqrt(key_dim)`);
    a larger one makes the pooling sharper from the start. `pooling_values` is what the
    pooling sums: `"block"`, the last block's output, or `"embedding"`, each position's own
    embedding, weighed by the pooling weights the block's output gives (`AttentionPooling`).
    `ngram_dim` is the width of the pair and triple tables (None: `embed_dim`), projected to
    `embed_dim` (`TokenAndPositionEmbedding`). `word_dropout` zeroes whole positions of the
    embedding in training (its word, pair, triple and position at once; the kept ones times
    1 / (1 - p)), after Iyyer et al.'s (2015) word dropout, which removes the word instead: the
    position stays in the attention mask, an input of zeros (its key and value are the
    projections' biases); 0 adds no layer. `normalize_embeddings`: the word, pair and triple
    tables normalised by their rows' frequencies (`TokenAndPositionEmbedding.adapt_frequencies`).

    `model` maps token ids `(B, L)`, any `L <= sequence_length`, to `P(positive)` `(B, 1)`
    and is the one trained.
    `inspector` returns a dict: `probability` `(B, 1)`, `attention` (the blocks' weights,
    `(B, num_layers, N, L, L)`) and `pooling` (the pooling weights, `(B, N, L)`).
    With `bigram_vocab_size > 0`, call `model.get_layer("embedding").adapt_bigrams(ids)`
    on the training ids before training (`adapt_trigrams` likewise, then
    `adapt_naive_bayes(ids, labels)` with `naive_bayes=True`).
    """
    embedding = TokenAndPositionEmbedding(
        vocab_size,
        sequence_length,
        embed_dim,
        bigram_vocab_size,
        trigram_vocab_size,
        naive_bayes,
        naive_bayes_folds,
        ngram_dim=ngram_dim,
        normalize_embeddings=normalize_embeddings,
        name="embedding",
    )
    embedding_dropout = keras.layers.Dropout(dropout, seed=seed, name="embedding_dropout")
    word_dropout_layer = None
    if word_dropout:  # one draw per position, shared by its E features; a seed no block has
        word_dropout_layer = keras.layers.Dropout(
            word_dropout, noise_shape=(None, None, 1), seed=seed + num_layers, name="word_dropout"
        )
    blocks = [
        TransformerBlock(
            num_heads, key_dim, ff_dim, dropout=dropout, seed=seed + index, name=f"block_{index}"
        )
        for index in range(num_layers)
    ]
    pooling = AttentionPooling(
        num_heads, key_dim, scale=pooling_scale, values_from=pooling_values, name="pooling"
    )
    pooled_dropout = keras.layers.Dropout(dropout, seed=seed, name="pooled_dropout")
    # Under a mixed-precision policy the output layer stays float32, so the probability is
    # float32 (Keras's mixed-precision guide); otherwise it follows the policy (float64 too).
    mixed = keras.config.dtype_policy().name.startswith("mixed")
    classifier = keras.layers.Dense(
        1, activation="sigmoid", name="classifier", dtype="float32" if mixed else None
    )

    layers = _Layers(
        embedding,
        embedding_dropout,
        word_dropout_layer,
        blocks,
        pooling,
        pooled_dropout,
        classifier,
        pooling_values,
    )

    # The inspector's graph first: Keras (3.15) cannot connect the weights of a layer's
    # second symbolic call that asks for them when its first call did not.
    inspector = _inspector(layers)
    ids, probability, _, _ = _forward(layers, with_scores=False)
    model = keras.Model(ids, probability, name="sdpa_sentiment")
    return model, inspector


def _inspector(layers):
    """The inspector over the classifier's `layers` (`build_classifier`)."""
    ids, probability, block_scores, pool_scores = _forward(layers, with_scores=True)
    return keras.Model(
        ids,
        {
            "probability": probability,
            "attention": ops.stack(block_scores, axis=1),  # (B, layers, N, L, L)
            "pooling": ops.squeeze(pool_scores, 2),  # (B, N, L)
        },
        name="sdpa_sentiment_inspector",
    )


class _Layers(typing.NamedTuple):
    """The classifier's layers, shared by the trained model and the inspector."""

    embedding: keras.layers.Layer
    embedding_dropout: keras.layers.Layer
    word_dropout: keras.layers.Layer | None
    blocks: list
    pooling: keras.layers.Layer
    pooled_dropout: keras.layers.Layer
    classifier: keras.layers.Layer
    pooling_values: str


def _forward(layers, with_scores):
    """The classifier over shared `layers`; with the attention weights for the inspector."""
    # Any length up to `sequence_length`: the positions are sliced to it, and the SavedModel
    # serves each review at the shortest of a few lengths that holds it.
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = ops.not_equal(ids, 0)  # (B, L), the Embedding's mask_zero mask
    x = embedded = layers.embedding_dropout(layers.embedding(ids))
    if layers.word_dropout is not None:
        x = embedded = layers.word_dropout(x)
    block_scores = []
    for block in layers.blocks:
        x = block(x, mask=mask, return_attention_scores=with_scores)
        if with_scores:
            x, scores = x  # (B, L, E), (B, N, L, L)
            block_scores.append(scores)
    values = embedded if layers.pooling_values == "embedding" else None
    pooled = layers.pooling(x, mask=mask, values=values, return_attention_scores=with_scores)
    pool_scores = None
    if with_scores:
        pooled, pool_scores = pooled  # (B, E), (B, N, 1, L)
    probability = layers.classifier(layers.pooled_dropout(pooled))
    return ids, probability, block_scores, pool_scores


def dropped_embeddings(model, x):
    """The embedding's output `x` `(B, L, E)` through its training dropouts (the embedding's,
    and the word dropout where the model has one), as `model(ids, training=True)` drops it."""
    x = model.get_layer("embedding_dropout")(x, training=True)
    if any(layer.name == "word_dropout" for layer in model.layers):
        x = model.get_layer("word_dropout")(x, training=True)
    return x


def log_odds_from_embeddings(model, x, mask, training=False, dropped=False):
    """The classifier's log-odds `(B,)` from its embedding layer's output `x` `(B, L, E)`.

    `model` is `build_classifier`'s; its layers after the embedding are called directly. At
    inference (`training=False`) the dropouts are left out; in training they drop as in
    `model(ids, training=True)`, which this then computes (the perturbation losses of
    `apps.classifier.perturbation` start the classifier from perturbed embeddings). `dropped`:
    `x` has been through `dropped_embeddings` already (the adversarial pass perturbs the
    likelihood pass's dropped embeddings, as Miyato et al. do)."""
    if training and not dropped:
        x = dropped_embeddings(model, x)
    embedded = x
    for layer in model.layers:
        if layer.name.startswith("block_"):
            x = layer(x, mask=mask, training=training)  # (B, L, E)
    pooling = model.get_layer("pooling")
    values = embedded if pooling.values_from == "embedding" else None
    pooled = pooling(x, mask=mask, values=values)  # (B, E)
    if training:
        pooled = model.get_layer("pooled_dropout")(pooled, training=True)
    classifier = model.get_layer("classifier")
    return (ops.matmul(pooled, classifier.kernel) + classifier.bias)[:, 0]  # (B,)
