"""The classifier's input: token and position embeddings, with word pairs, triples and
naive-Bayes ratios (`TokenAndPositionEmbedding`)."""

import keras
import numpy as np
import tensorflow as tf
from keras import ops


def bigram_keys(ids, vocab_size):
    """Each position's word pair `(previous word, word)` as one int64 key.

    The key is `previous * vocab_size + word`; it is 0 at the first position and wherever
    either word is padding, so pairs never cross into the padding.

    Args:
        ids: token ids `(B, L)`, 0 = padding.
        vocab_size: the number of word ids (the vectorizer's vocabulary size).

    Returns:
        int64 keys `(B, L)`.
    """
    ids = ops.cast(ids, "int64")
    previous = ops.pad(ids[:, :-1], [[0, 0], [1, 0]])  # (B, L), shifted right by one
    keys = previous * vocab_size + ids
    return ops.where(ops.logical_and(previous > 0, ids > 0), keys, ops.zeros_like(keys))


def trigram_keys(ids, vocab_size):
    """Each position's word triple `(word two back, previous word, word)` as one int64 key.

    The key is `(second * vocab_size + previous) * vocab_size + word`; it is 0 at the first two
    positions and wherever any of the three words is padding. (`vocab_size ** 3` fits int64 for
    vocabularies up to 2 million words.)

    Args:
        ids: token ids `(B, L)`, 0 = padding.
        vocab_size: the number of word ids (the vectorizer's vocabulary size).

    Returns:
        int64 keys `(B, L)`.
    """
    ids = ops.cast(ids, "int64")
    previous = ops.pad(ids[:, :-1], [[0, 0], [1, 0]])  # (B, L), shifted right by one
    second = ops.pad(ids[:, :-2], [[0, 0], [2, 0]])  # (B, L), shifted right by two
    keys = (second * vocab_size + previous) * vocab_size + ids
    present = ops.logical_and(ops.logical_and(second > 0, previous > 0), ids > 0)
    return ops.where(present, keys, ops.zeros_like(keys))


def naive_bayes_ratios(indices, labels, size, alpha=1.0):
    """Naive-Bayes log-count ratios `(size,)` of feature indices, from labelled documents.

    Wang & Manning (2012), "Baselines and bigrams": with `p` (`q`) the number of positive
    (negative) documents that contain a feature, plus `alpha`,
    `r = log(p / ||p||_1) - log(q / ||q||_1)`. A feature counts once per document, however
    often it occurs there. Index 0 (padding, no n-gram) gets 0.

    Args:
        indices: int feature indices `(n, L)` in `[0, size)`, 0 = nothing there.
        labels: 0/1 labels `(n,)`.
        size: the number of feature indices.
        alpha: additive smoothing, > 0.

    Returns:
        float32 ratios `(size,)`.
    """
    indices = np.asarray(indices, dtype=np.int64)
    labels = np.asarray(labels)
    document = np.repeat(np.arange(len(indices), dtype=np.int64), indices.shape[1])  # (n*L,)
    flat = indices.reshape(-1)
    present = flat > 0
    # One (document, feature) pair per feature a document contains.
    pairs = np.unique(document[present] * size + flat[present])
    document, feature = np.divmod(pairs, size)
    positive = np.bincount(feature, weights=labels[document] == 1, minlength=size) + alpha
    negative = np.bincount(feature, weights=labels[document] == 0, minlength=size) + alpha
    ratios = np.log(positive / positive.sum()) - np.log(negative / negative.sum())
    ratios[0] = 0.0
    return ratios.astype("float32")


@keras.saving.register_keras_serializable(package="apps")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding (`mask_zero=True`, id 0 is padding) plus a learned position embedding.

    With `bigram_vocab_size > 0`, each position also adds the embedding of its word pair
    (previous word, word), looked up by `keras.layers.IntegerLookup` among the
    `bigram_vocab_size` most frequent pairs of the training set (`adapt_bigrams`);
    rarer pairs share one out-of-vocabulary vector. `trigram_vocab_size > 0` does the same
    for the word triple that ends at each position (`adapt_trigrams`). The sequence stays one
    vector per word, so the attention weights are still over words. With `ngram_dim`, the pair
    and triple tables are `ngram_dim` wide and their sum is projected to `embed_dim` by one
    learned matrix (`ngram_projection`): tables of 200,000 n-grams at width 16 take a quarter
    of the memory (and of the SavedModel) that width 64 does.

    With `naive_bayes=True`, each position also adds a learned projection of its features'
    naive-Bayes log-count ratios (`naive_bayes_ratios`): the word's, and the pair's and the
    triple's where those are embedded. The ratios are fixed tables, set from the training
    labels by `adapt_naive_bayes` and saved with the weights; the projection is trained. They
    enter each position like the embeddings do, so the pooling attention still decides how
    much each position's evidence counts.

    With `normalize_embeddings=True`, the word, pair and triple tables are each looked up
    normalised as Miyato, Dai & Goodfellow (ICLR 2017) do for adversarial training:
    `(v_k - mean) / sqrt(var + 1e-6)`, with `mean = sum_j f_j v_j` and
    `var = sum_j f_j (v_j - mean)^2` per feature, `f_j` the row's frequency in the reviews
    `adapt_frequencies` counts (padding and "no n-gram" count 0). A perturbation of a given
    norm then means the same whatever scale the tables have grown to. The tables are
    normalised at every call, on all their rows: each step's gradient reaches every row.

    The ratios are cross-fitted over `naive_bayes_folds` folds, so that no review reads ratios
    counted on its own label. A review's fold is its number of tokens modulo the folds
    (`naive_bayes_fold`: a function of the review alone, so training and serving agree, and
    padding does not change it), and it reads the tables counted on the other folds' reviews.
    Tables counted on every review, the review's own included, let the model learn the
    training labels from the ratios of the n-grams only that review has: measured, 98.5%
    training accuracy and 89.56% validation after one epoch, against 82.9% and 91.00% without
    the ratios. `naive_bayes_folds=1` counts every review for the one table.
    """

    def __init__(
        self,
        vocab_size,
        sequence_length,
        embed_dim,
        bigram_vocab_size=0,
        trigram_vocab_size=0,
        naive_bayes=False,
        naive_bayes_folds=5,
        ngram_dim=None,
        normalize_embeddings=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.normalize_embeddings = normalize_embeddings
        if ngram_dim is not None and ngram_dim <= 0:
            raise ValueError(f"`ngram_dim` must be positive. Received: ngram_dim={ngram_dim}")
        self.ngram_dim = ngram_dim
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.embed_dim = embed_dim
        self.bigram_vocab_size = bigram_vocab_size
        self.trigram_vocab_size = trigram_vocab_size
        self.naive_bayes = naive_bayes
        if naive_bayes_folds < 1:
            raise ValueError(
                f"`naive_bayes_folds` must be >= 1. Received: naive_bayes_folds={naive_bayes_folds}"
            )
        self.naive_bayes_folds = naive_bayes_folds
        self.token_embedding = keras.layers.Embedding(
            vocab_size, embed_dim, mask_zero=True, name="token_embedding"
        )
        self.position_embedding = keras.layers.Embedding(
            sequence_length, embed_dim, name="position_embedding"
        )
        if bigram_vocab_size:
            # Index 0: no pair (key 0); index 1: a pair outside the vocabulary.
            self.bigram_lookup = keras.layers.IntegerLookup(
                max_tokens=bigram_vocab_size + 2,
                mask_token=0,
                vocabulary_dtype="int64",
                name="bigram_lookup",
            )
            self.bigram_embedding = keras.layers.Embedding(
                bigram_vocab_size + 2, ngram_dim or embed_dim, name="bigram_embedding"
            )
        if trigram_vocab_size:
            self.trigram_lookup = keras.layers.IntegerLookup(
                max_tokens=trigram_vocab_size + 2,
                mask_token=0,
                vocabulary_dtype="int64",
                name="trigram_lookup",
            )
            self.trigram_embedding = keras.layers.Embedding(
                trigram_vocab_size + 2, ngram_dim or embed_dim, name="trigram_embedding"
            )
        if ngram_dim is not None and (bigram_vocab_size or trigram_vocab_size):
            self.ngram_projection = keras.layers.Dense(
                embed_dim, use_bias=False, name="ngram_projection"
            )
        if naive_bayes:
            self.naive_bayes_projection = keras.layers.Dense(
                embed_dim, use_bias=False, name="naive_bayes_projection"
            )

    def _naive_bayes_tables(self):
        """`(name, size)` of each ratio table: words, then pairs and triples if embedded."""
        tables = [("word_ratios", self.vocab_size)]
        if self.bigram_vocab_size:
            tables.append(("bigram_ratios", self.bigram_vocab_size + 2))
        if self.trigram_vocab_size:
            tables.append(("trigram_ratios", self.trigram_vocab_size + 2))
        return tables

    def _embedded_tables(self):
        """`(embedding, frequency table name)` of each table a position adds, in the order of
        `_feature_indices`: the words, then the pairs and the triples if embedded."""
        lookups = [(self.token_embedding, "word_frequencies")]
        if self.bigram_vocab_size:
            lookups.append((self.bigram_embedding, "bigram_frequencies"))
        if self.trigram_vocab_size:
            lookups.append((self.trigram_embedding, "trigram_frequencies"))
        return lookups

    def adapt_frequencies(self, ids, batch_size=1024):
        """Sets each table's row frequencies (`normalize_embeddings`) from token ids `(n, L)`:
        how often each word, pair and triple index occurs, over all occurrences. Call it after
        the pair and triple vocabularies are set: the counts are per looked-up index."""
        if not self.normalize_embeddings:
            raise ValueError(
                "`adapt_frequencies` needs a layer built with normalize_embeddings=True. "
                f"Received: normalize_embeddings={self.normalize_embeddings}"
            )
        counts = [
            np.zeros(embedding.input_dim, "float64") for embedding, _ in self._embedded_tables()
        ]
        for start in range(0, len(ids), batch_size):
            batch = tf.constant(ids[start : start + batch_size])
            for count, indices in zip(counts, self._feature_indices(batch)):
                count += np.bincount(np.asarray(indices).reshape(-1), minlength=len(count))
        for count, (_, name) in zip(counts, self._embedded_tables()):
            count[0] = 0.0  # padding, or no pair or triple there
            getattr(self, name).assign((count / max(count.sum(), 1.0)).astype("float32"))

    def _lookup(self, embedding, frequencies, indices):
        """`embedding`'s rows at `indices` `(B, L)`, normalised by the row frequencies in the
        weight `frequencies` with `normalize_embeddings`: `(B, L, width)`.

        Normalised in float32 at least (float64 under a float64 policy); under a mixed policy
        the table is read in the compute dtype, as the lookup's output is."""
        if not self.normalize_embeddings:
            return embedding(indices)
        dtype = keras.backend.result_type(self.compute_dtype, "float32")
        table = ops.cast(embedding.embeddings, dtype)  # (rows, width)
        weights = ops.cast(getattr(self, frequencies), dtype)[:, None]  # (rows, 1)
        weights = weights / ops.maximum(ops.sum(weights), 1e-12)
        mean = ops.sum(weights * table, axis=0)  # (width,)
        variance = ops.sum(weights * ops.square(table - mean), axis=0)
        table = (table - mean) / ops.sqrt(variance + 1e-6)
        return ops.cast(ops.take(table, indices, axis=0), self.compute_dtype)

    def _feature_indices(self, ids):
        """Each position's index into each ratio table, `[(B, L), ...]` as `_naive_bayes_tables`."""
        indices = [ids]
        if self.bigram_vocab_size:
            indices.append(self.bigram_lookup(bigram_keys(ids, self.vocab_size)))
        if self.trigram_vocab_size:
            indices.append(self.trigram_lookup(trigram_keys(ids, self.vocab_size)))
        return indices

    def naive_bayes_fold(self, ids):
        """Each review's fold `(B,)` int32: its number of tokens modulo `naive_bayes_folds`."""
        return ops.mod(
            ops.sum(ops.cast(ops.not_equal(ids, 0), "int32"), axis=-1), self.naive_bayes_folds
        )

    def adapt_naive_bayes(self, ids, labels, alpha=1.0, batch_size=1024):
        """Sets the ratio tables from training token ids `(n, L)` and their 0/1 labels `(n,)`:
        for each fold, the ratios counted on the reviews of the other folds (of all, with one
        fold).

        Call it after the pair and triple vocabularies are set: the ratios are per looked-up
        index."""
        if not self.naive_bayes:
            raise ValueError(
                "`adapt_naive_bayes` needs a layer built with naive_bayes=True. "
                f"Received: naive_bayes={self.naive_bayes}"
            )
        if alpha <= 0:
            raise ValueError(f"`alpha` must be > 0. Received: alpha={alpha}")
        columns = [[] for _ in self._naive_bayes_tables()]
        for start in range(0, len(ids), batch_size):
            batch = tf.constant(ids[start : start + batch_size])
            for column, indices in zip(columns, self._feature_indices(batch)):
                column.append(np.asarray(indices))
        labels = np.asarray(labels)
        folds = np.asarray(self.naive_bayes_fold(ids))  # (n,)
        for (name, size), column in zip(self._naive_bayes_tables(), columns):
            indices = np.concatenate(column)  # (n, L)
            tables = []
            for fold in range(self.naive_bayes_folds):
                counted = folds != fold if self.naive_bayes_folds > 1 else slice(None)
                tables.append(naive_bayes_ratios(indices[counted], labels[counted], size, alpha))
            getattr(self, name).assign(np.stack(tables))  # (folds, size)

    def adapt_bigrams(self, ids, batch_size=1024):
        """Sets the pair vocabulary: the most frequent pairs in token ids `(n, L)`."""
        keys = tf.data.Dataset.from_tensor_slices(ids).batch(batch_size)
        self.bigram_lookup.adapt(keys.map(lambda batch: bigram_keys(batch, self.vocab_size)))

    def get_bigrams(self):
        """The pair vocabulary as `(previous, word)` id pairs, most frequent first.

        A method, as `StringLookup.get_vocabulary` is: Keras's saving reads every attribute
        of a layer and walks the lists it finds, so a property would be rebuilt and walked at
        every save and load."""
        keys = self.bigram_lookup.get_vocabulary(include_special_tokens=False)
        return [divmod(int(key), self.vocab_size) for key in keys]

    def set_bigrams(self, pairs):
        """Sets the pair vocabulary from `(previous, word)` id pairs (as `get_bigrams` gives)."""
        self.bigram_lookup.set_vocabulary(
            [previous * self.vocab_size + word for previous, word in pairs]
        )

    def adapt_trigrams(self, ids, batch_size=1024):
        """Sets the triple vocabulary: the most frequent triples in token ids `(n, L)`."""
        keys = tf.data.Dataset.from_tensor_slices(ids).batch(batch_size)
        self.trigram_lookup.adapt(keys.map(lambda batch: trigram_keys(batch, self.vocab_size)))

    def get_trigrams(self):
        """The triple vocabulary as `(second, previous, word)` id triples, most frequent first
        (a method, as `get_bigrams` is)."""
        keys = self.trigram_lookup.get_vocabulary(include_special_tokens=False)
        triples = []
        for key in keys:
            rest, word = divmod(int(key), self.vocab_size)
            triples.append((*divmod(rest, self.vocab_size), word))
        return triples

    def set_trigrams(self, triples):
        """Sets the triple vocabulary from `(second, previous, word)` id triples."""
        v = self.vocab_size
        self.trigram_lookup.set_vocabulary([(a * v + b) * v + c for a, b, c in triples])

    def build(self, ids_shape):
        self.token_embedding.build(ids_shape)
        self.position_embedding.build((self.sequence_length,))
        if self.bigram_vocab_size:
            self.bigram_embedding.build(ids_shape)
        if self.trigram_vocab_size:
            self.trigram_embedding.build(ids_shape)
        if hasattr(self, "ngram_projection"):
            self.ngram_projection.build((*ids_shape, self.ngram_dim))
        if self.normalize_embeddings:
            for embedding, name in self._embedded_tables():
                # Uniform until `adapt_frequencies` counts them; float32 under a mixed policy.
                table = self.add_weight(
                    shape=(embedding.input_dim,),
                    initializer="ones",
                    trainable=False,
                    autocast=False,
                    name=name,
                )
                setattr(self, name, table)
        if self.naive_bayes:
            for name, size in self._naive_bayes_tables():
                table = self.add_weight(
                    shape=(self.naive_bayes_folds, size),
                    initializer="zeros",
                    trainable=False,
                    name=name,
                )
                setattr(self, name, table)
            self.naive_bayes_projection.build((*ids_shape, len(self._naive_bayes_tables())))

    def call(self, ids):
        positions = ops.arange(ops.shape(ids)[-1])  # (L,)
        indices = self._feature_indices(ids)  # words, then pairs and triples: [(B, L), ...]
        lookups = self._embedded_tables()
        x = self._lookup(*lookups[0], ids) + self.position_embedding(positions)  # (B, L, E)
        ngrams = [self._lookup(*lookup, i) for lookup, i in zip(lookups[1:], indices[1:])]
        if hasattr(self, "ngram_projection"):
            x = x + self.ngram_projection(ops.sum(ops.stack(ngrams), axis=0))  # (B, L, E)
        else:
            for embedded in ngrams:
                x = x + embedded
        if self.naive_bayes:
            fold = ops.cast(self.naive_bayes_fold(ids), "int64")[:, None]  # (B, 1)
            ratios = ops.stack(
                [
                    # Row `fold` of the (folds, size) table, as one flat lookup.
                    ops.take(
                        ops.reshape(getattr(self, name), (-1,)),
                        fold * size + ops.cast(index, "int64"),
                    )  # (B, L)
                    for (name, size), index in zip(self._naive_bayes_tables(), indices)
                ],
                axis=-1,
            )  # (B, L, tables)
            x = x + self.naive_bayes_projection(ratios)
        return x

    def compute_mask(self, ids, mask=None):
        return self.token_embedding.compute_mask(ids)

    def compute_output_shape(self, ids_shape):
        return (*ids_shape, self.embed_dim)

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "sequence_length": self.sequence_length,
            "embed_dim": self.embed_dim,
            "bigram_vocab_size": self.bigram_vocab_size,
            "trigram_vocab_size": self.trigram_vocab_size,
            "naive_bayes": self.naive_bayes,
            "naive_bayes_folds": self.naive_bayes_folds,
            "ngram_dim": self.ngram_dim,
            "normalize_embeddings": self.normalize_embeddings,
        }
