"""The app's naive-Bayes log-count ratio features, against a plain-Python count."""

import math

import keras
import numpy as np
import pytest

from apps.classifier import embedding as embedding_lib
from apps.classifier import model as model_lib

# Six short reviews over a vocabulary of 10 ids (0 = padding, 1 = out of vocabulary).
IDS = np.array(
    [
        [3, 4, 5, 3, 0, 0],
        [3, 4, 5, 0, 0, 0],
        [3, 4, 6, 7, 0, 0],
        [2, 8, 9, 8, 9, 0],
        [2, 8, 9, 0, 0, 0],
        [2, 3, 4, 1, 9, 0],
    ]
)
LABELS = np.array([1, 1, 1, 0, 0, 0])


def reference_ratios(features, labels, size, alpha):
    """Wang & Manning's r from sets of features per document, counted one by one."""
    positive = [alpha] * size
    negative = [alpha] * size
    for document, label in zip(features, labels):
        for feature in set(document) - {0}:
            (positive if label == 1 else negative)[feature] += 1
    p_total, q_total = sum(positive), sum(negative)
    ratios = [math.log(p / p_total) - math.log(q / q_total) for p, q in zip(positive, negative)]
    ratios[0] = 0.0
    return np.array(ratios)


@pytest.mark.parametrize("alpha", [1.0, 0.25])
def test_ratios_count_each_feature_once_per_document(alpha):
    ratios = embedding_lib.naive_bayes_ratios(IDS, LABELS, 10, alpha)
    np.testing.assert_allclose(ratios, reference_ratios(IDS, LABELS, 10, alpha), rtol=1e-6)
    # Word 3 is in three positive reviews and one negative (twice in the first: counted once);
    # the positive reviews hold 10 distinct (review, word) pairs, the negative 11.
    p, q = 3 + alpha, 1 + alpha
    assert ratios[3] == pytest.approx(
        math.log(p / (10 + 10 * alpha)) - math.log(q / (11 + 10 * alpha)), rel=1e-6
    )
    assert ratios[0] == 0.0


def _classifier(**kwargs):
    return model_lib.build_classifier(
        vocab_size=10, sequence_length=6, embed_dim=8, key_dim=4, ff_dim=8, seed=1, **kwargs
    )


@pytest.mark.parametrize("folds", [1, 2])
def test_embedding_adds_the_projected_ratios_of_words_pairs_and_triples(folds, tmp_path):
    model, _ = _classifier(
        bigram_vocab_size=3, trigram_vocab_size=2, naive_bayes=True, naive_bayes_folds=folds
    )
    embedding = model.get_layer("embedding")
    embedding.adapt_bigrams(IDS)
    embedding.adapt_trigrams(IDS)
    embedding.adapt_naive_bayes(IDS, LABELS, alpha=0.5)

    # A review's fold is its number of tokens modulo the folds: lengths 4 3 4 5 3 5.
    fold = np.array([4, 3, 4, 5, 3, 5]) % folds
    np.testing.assert_array_equal(embedding.naive_bayes_fold(IDS), fold)
    pairs = embedding.bigram_lookup(embedding_lib.bigram_keys(IDS, 10)).numpy()  # (n, L)
    triples = embedding.trigram_lookup(embedding_lib.trigram_keys(IDS, 10)).numpy()
    features = {
        "word_ratios": (IDS, 10),
        "bigram_ratios": (pairs, 5),
        "trigram_ratios": (triples, 4),
    }
    tables = {}
    for name, (indices, size) in features.items():
        # Fold k's table counts the reviews of the other folds (all of them, with one fold).
        counted = [fold != k if folds > 1 else np.ones(len(IDS), bool) for k in range(folds)]
        tables[name] = np.stack(
            [reference_ratios(indices[c], LABELS[c], size, 0.5) for c in counted]
        )  # (folds, size)
        np.testing.assert_allclose(getattr(embedding, name).numpy(), tables[name], rtol=1e-5)

    # The layer's output is the embeddings plus the projection of each position's ratios,
    # read from its review's fold's tables.
    ratios = np.stack(
        [tables[name][fold[:, None], indices] for name, (indices, _) in features.items()],
        axis=-1,
    )  # (n, L, 3)
    kernel = embedding.naive_bayes_projection.kernel.numpy()  # (3, E)
    positions = embedding.position_embedding.embeddings.numpy()
    expected = (
        embedding.token_embedding.embeddings.numpy()[IDS]
        + positions[None]
        + embedding.bigram_embedding.embeddings.numpy()[pairs]
        + embedding.trigram_embedding.embeddings.numpy()[triples]
        + ratios @ kernel
    )
    np.testing.assert_allclose(embedding(IDS).numpy(), expected, rtol=1e-5, atol=1e-6)
    # Padding changes no review's fold, so no review's result (the buckets cut it away).
    np.testing.assert_allclose(embedding(IDS[:, :5]).numpy(), expected[:, :5], rtol=1e-5, atol=1e-6)

    # The tables are weights: they survive the Keras save and load.
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for name in tables:
        np.testing.assert_array_equal(
            getattr(loaded.get_layer("embedding"), name).numpy(), getattr(embedding, name).numpy()
        )
    np.testing.assert_allclose(loaded.predict(IDS, verbose=0), model.predict(IDS, verbose=0))
    # The ratios reach the prediction: zeroing them changes it.
    embedding.word_ratios.assign(np.zeros((folds, 10), "float32"))
    assert np.abs(model.predict(IDS, verbose=0) - loaded.predict(IDS, verbose=0)).max() > 1e-4


def test_ratio_tables_are_not_trained():
    model, _ = _classifier(naive_bayes=True)
    model(IDS)
    trainable = {w.path for w in model.trainable_weights}
    assert "embedding/word_ratios" not in trainable
    assert "embedding/naive_bayes_projection/kernel" in trainable


def test_adapt_naive_bayes_refuses_a_layer_without_it_and_a_bad_alpha():
    model, _ = _classifier()
    with pytest.raises(ValueError, match="naive_bayes=False"):
        model.get_layer("embedding").adapt_naive_bayes(IDS, LABELS)
    model, _ = _classifier(naive_bayes=True)
    with pytest.raises(ValueError, match="alpha=0"):
        model.get_layer("embedding").adapt_naive_bayes(IDS, LABELS, alpha=0)
    with pytest.raises(ValueError, match="naive_bayes_folds=0"):
        _classifier(naive_bayes=True, naive_bayes_folds=0)
