"""Masked-word pretraining of the classifier's encoder: its embedding and its blocks.

    token ids (B, L), 15% of the words hidden -> the classifier's embedding and blocks (B, L, E)
                                              -> the hidden positions                   (B, P, E)
                                              -> Dense + LayerNorm, then the word table (B, P, V)

BERT's objective (Devlin et al. 2019) on the classifier's own encoder: the words it
predicts are scored against the first `predicted_words` rows of the encoder's word table
(tied output weights), so what the prediction learns lands in the embedding the classifier
fine-tunes. A hidden word is shown as the vectorizer's out-of-vocabulary id: the word pairs
and triples that hold it are then those of an unknown word, so no n-gram gives it away.
"""

import keras
import numpy as np
from keras import ops

MASK_ID = 1  # TextVectorization's out-of-vocabulary id (0 is padding)


def hide_words(ids, rng, predicted_words, rate=0.15):
    """BERT's corruption of a batch of token ids, as NumPy arrays.

    In each row, `rate` of its words (at least one) are chosen; of those, 80% are replaced by
    `MASK_ID`, 10% by a random word and 10% are left as they are. Words outside the first
    `predicted_words` ids (and unknown words) may be chosen but are not predicted.

    Args:
        ids: int token ids `(B, L)`, 0 = padding.
        rng: a `numpy.random.Generator`.
        predicted_words: the size of the prediction's vocabulary (ids `2 .. predicted_words-1`).
        rate: the fraction of each row's words chosen.

    Returns:
        `(corrupted ids (B, L), positions (B, P), targets (B, P), weights (B, P))`, with
        `P = ceil(rate * L)`; `weights` is 1.0 where a chosen word is predicted, else 0.0
        (and `targets` is 0 there).
    """
    ids = np.asarray(ids)
    batch, length = ids.shape
    slots = max(1, int(np.ceil(rate * length)))
    present = ids != 0
    draw = np.where(present, rng.random(ids.shape), 2.0)  # padding sorts last
    positions = np.argsort(draw, axis=1, kind="stable")[:, :slots].astype("int32")  # (B, P)
    count = np.clip(np.round(rate * present.sum(axis=1)), 1, slots)  # (B,)
    chosen = np.arange(slots)[None, :] < count[:, None]  # (B, P)
    chosen &= np.take_along_axis(present, positions, axis=1)
    targets = np.take_along_axis(ids, positions, axis=1)  # (B, P)
    action = rng.random(positions.shape)
    replacement = np.where(
        action < 0.8,
        MASK_ID,
        np.where(action < 0.9, rng.integers(2, predicted_words, positions.shape), targets),
    )
    corrupted = ids.copy()
    rows = np.broadcast_to(np.arange(batch)[:, None], positions.shape)
    corrupted[rows[chosen], positions[chosen]] = replacement[chosen]
    weights = chosen & (targets > MASK_ID) & (targets < predicted_words)
    targets = np.where(weights, targets, 0)  # in range for the loss, weighed 0
    return corrupted, positions, targets.astype("int32"), weights.astype("float32")


@keras.saving.register_keras_serializable(package="apps")
class MaskedWordModel(keras.Model):
    """The classifier's embedding and blocks, with a head that predicts hidden words.

    Called on `(corrupted ids (B, L), positions (B, P))`, it returns the logits `(B, P, V)`
    of the words at `positions`, `V = predicted_words`. The encoder runs without dropout:
    the hidden words are the noise it learns against. The layers are the classifier's own,
    so pretraining this model trains them in place.
    """

    def __init__(self, classifier, predicted_words, **kwargs):
        super().__init__(**kwargs)
        self.embedding = classifier.get_layer("embedding")
        self.blocks = [layer for layer in classifier.layers if layer.name.startswith("block_")]
        self.predicted_words = min(predicted_words, self.embedding.vocab_size)
        width = self.embedding.embed_dim
        self.transform = keras.layers.Dense(width, activation="gelu", name="mlm_transform")
        self.transform_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="mlm_norm")
        self.transform.build((None, None, width))
        self.transform_norm.build((None, None, width))
        self.word_bias = self.add_weight(
            shape=(self.predicted_words,), initializer="zeros", name="mlm_word_bias"
        )

    def call(self, inputs, training=None):
        ids, positions = inputs
        mask = ops.not_equal(ids, 0)  # (B, L)
        x = self.embedding(ids)  # (B, L, E)
        for block in self.blocks:
            x = block(x, mask=mask, training=False)
        index = ops.expand_dims(positions, -1)  # (B, P, 1)
        index = ops.broadcast_to(index, (*ops.shape(positions), ops.shape(x)[-1]))
        x = ops.take_along_axis(x, index, axis=1)  # (B, P, E)
        x = self.transform_norm(self.transform(x))
        table = self.embedding.token_embedding.embeddings[: self.predicted_words]  # (V, E)
        logits = ops.matmul(x, ops.cast(ops.transpose(table), x.dtype)) + self.word_bias
        return ops.cast(logits, "float32")  # (B, P, V)


def encoder_layers(classifier):
    """The classifier's layers that pretraining trains: the embedding, then the blocks."""
    return [classifier.get_layer("embedding")] + [
        layer for layer in classifier.layers if layer.name.startswith("block_")
    ]


def encoder_weights(classifier):
    """`{"layer/index": array}` of `encoder_layers`' weights, for `np.savez`."""
    return {
        f"{layer.name}/{index}": np.asarray(weight)
        for layer in encoder_layers(classifier)
        for index, weight in enumerate(layer.get_weights())
    }


def set_encoder_weights(classifier, saved):
    """Sets `encoder_layers`' weights from `encoder_weights`' mapping (or an `np.load`)."""
    for layer in encoder_layers(classifier):
        count = len(layer.get_weights())
        layer.set_weights([saved[f"{layer.name}/{index}"] for index in range(count)])
