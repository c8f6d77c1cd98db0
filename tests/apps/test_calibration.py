"""Temperature scaling and the calibration figures, against independent computations: Keras's
own binary cross-entropy and its gradient (TensorFlow's autodiff), and ECE, log loss and Brier
written again here bin by bin."""

import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from apps.classifier import model as model_lib
from apps.classifier import short_reviews
from apps.serving.compiled import compiled_classifier
from apps.training import calibration

ROOT = pathlib.Path(__file__).resolve().parents[2]


def keras_loss(log_odds, labels, temperature):
    """Keras's mean binary cross-entropy of `sigmoid(log_odds / temperature)`."""
    return keras.losses.binary_crossentropy(
        tf.constant(labels, tf.float64)[:, None],
        tf.constant(log_odds, tf.float64)[:, None] / temperature,
        from_logits=True,
    )


def slope_in_log_temperature(log_odds, labels, temperature):
    """d(mean loss) / d(log T) at `temperature`, by TensorFlow's autodiff."""
    log_t = tf.Variable(np.log(temperature), dtype=tf.float64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras_loss(log_odds, labels, tf.exp(log_t)))
    return float(tape.gradient(loss, log_t))


def overconfident(n=20000, seed=0, factor=3.0):
    """Labels drawn from sigmoid(z), and log-odds `factor` times too large."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 2.0, n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-z))).astype("int64")
    return factor * z, labels


def test_fitted_temperature_minimizes_keras_cross_entropy():
    log_odds, labels = overconfident()
    temperature = calibration.fit_temperature(log_odds, labels)
    assert 2.8 < temperature < 3.2  # the factor the log-odds were inflated by
    assert abs(slope_in_log_temperature(log_odds, labels, temperature)) < 1e-9
    at = float(np.mean(keras_loss(log_odds, labels, temperature)))
    for other in (temperature * 0.99, temperature * 1.01):
        assert np.mean(keras_loss(log_odds, labels, other)) > at
    # Underconfident log-odds are sharpened: a temperature below 1.
    assert calibration.fit_temperature(log_odds / 9, labels) == pytest.approx(temperature / 9)


def test_temperature_at_the_ends_of_its_range():
    z = np.array([-2.0, -1.0, 1.0, 2.0])
    assert calibration.fit_temperature(z, [0, 0, 1, 1]) == calibration.TEMPERATURE_RANGE[0]
    assert calibration.fit_temperature(z, [1, 0, 1, 0]) == calibration.TEMPERATURE_RANGE[1]


def reference_ece(probability, labels, bins):
    """Guo et al.'s ECE, bin by bin: bin m holds the confidences in ((m - 1) / M, m / M]."""
    confidence = np.maximum(probability, 1 - probability)
    correct = (probability >= 0.5) == (labels == 1)
    total = 0.0
    for m in range(1, bins + 1):
        inside = (confidence > (m - 1) / bins) & (confidence <= m / bins)
        if inside.any():
            total += inside.mean() * abs(correct[inside].mean() - confidence[inside].mean())
    return total


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_report_matches_independent_figures(temperature):
    log_odds, labels = overconfident(n=5000, seed=1)
    figures = calibration.report(log_odds, labels, temperature)
    probability = 1 / (1 + np.exp(-log_odds / temperature))
    assert figures["ece"] == pytest.approx(reference_ece(probability, labels, 15), abs=1e-12)
    assert figures["log_loss"] == pytest.approx(
        float(np.mean(keras_loss(log_odds, labels, temperature))), rel=1e-9
    )
    brier = keras.losses.MeanSquaredError()(labels[:, None].astype("float64"), probability[:, None])
    assert figures["brier"] == pytest.approx(float(brier), rel=1e-6)
    assert figures["accuracy"] == pytest.approx(np.mean((log_odds > 0) == (labels == 1)))
    assert sum(b["count"] for b in figures["bins"]) == len(labels)
    # Too confident by 3x: ECE large at T = 1, small at the true temperature.
    assert figures["ece"] > 0.1 if temperature == 1 else figures["ece"] < 0.02


def test_log_loss_counts_probabilities_that_round_to_certainty():
    figures = calibration.report([-40.0, 40.0], [1, 1])  # float32 rounds sigmoid(40) to 1
    assert figures["log_loss"] == pytest.approx(20.0)
    assert figures["ece"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "log_odds, labels, match",
    [
        ([0.5, 1.0], [1], "Received: 2 log-odds and 1 labels"),
        ([], [], "Received: 0 log-odds"),
        ([0.5, np.nan], [1, 0], "must be finite"),
        ([0.5, 1.0], [1, 2], r"must be 0 or 1. Received: \[1.0, 2.0\]"),
    ],
    ids=["lengths", "empty", "nan", "labels"],
)
def test_bad_inputs_are_refused(log_odds, labels, match):
    with pytest.raises(ValueError, match=match):
        calibration.fit_temperature(log_odds, labels)
    with pytest.raises(ValueError, match=match):
        calibration.report(log_odds, labels)


def test_fold_divides_the_log_odds_and_keeps_every_label():
    model, _ = model_lib.build_classifier(
        vocab_size=50, sequence_length=16, embed_dim=8, key_dim=4, ff_dim=8, seed=2
    )
    model.get_layer("classifier").bias.assign([0.7])  # zero as initialized: folded too
    ids = np.random.default_rng(0).integers(0, 50, (32, 16)).astype("int32")
    log_odds = compiled_classifier(model, log_odds=True)(tf.constant(ids)).numpy()
    before = model.predict(ids, verbose=0)[:, 0]
    np.testing.assert_allclose(before, 1 / (1 + np.exp(-log_odds)), atol=1e-6)
    calibration.fold_temperature(model, 2.5)
    after = model.predict(ids, verbose=0)[:, 0]
    np.testing.assert_allclose(after, 1 / (1 + np.exp(-log_odds / 2.5)), atol=1e-6)
    np.testing.assert_array_equal(after >= 0.5, before >= 0.5)
    with pytest.raises(ValueError, match="temperature=0"):
        calibration.fold_temperature(model, 0)


def test_spans_hold_what_their_bucket_names():
    review = (
        b"A great film.<br /><br />The cast is strong! Was the plot thin? Yes. "
        b"The ending works. The music soars. I laughed a lot. I cried too. Go see it."
    )
    sentences = short_reviews.sentences(review)
    assert sentences[:3] == [b"A great film.", b"The cast is strong!", b"Was the plot thin?"]
    assert b"Yes." not in sentences  # one word: not a sentence
    texts = [review, b"Too short to split.", b"Two sentences here. And one more."]
    spans = short_reviews.spans(texts, [1, 0, 1], count=3, seed=0)
    assert set(spans) == {name for name, _, _ in short_reviews.BUCKETS}
    for name, fewest, most in short_reviews.BUCKETS:
        got, labels = spans[name]
        for span, label in zip(got, labels):
            if fewest is None:
                assert span in texts
                continue
            parts = short_reviews.sentences(span)
            assert fewest <= len(parts) <= most, (name, span)
            # Consecutive sentences of one review, with its label.
            owner = [t for t in texts if span in b" ".join(short_reviews.sentences(t))]
            assert owner and label == [1, 0, 1][texts.index(owner[0])], span
    assert len(spans["a paragraph (4-8 sentences)"][0]) == 1  # only the long review has 4
    again = short_reviews.spans(texts, [1, 0, 1], count=3, seed=0)
    assert all(list(again[k][0]) == list(spans[k][0]) for k in spans)
    with pytest.raises(ValueError, match="count=0"):
        short_reviews.spans(texts, [1, 0, 1], count=0, seed=0)


def test_training_spans_are_one_to_three_sentences_of_the_chosen_reviews():
    texts = [f"Review {i} starts. It {i} goes. Then {i} more. End {i}.".encode() for i in range(40)]
    labels = np.arange(40) % 2
    got, got_labels = short_reviews.training_spans(texts, labels, 0.5, seed=3)
    assert len(got) == 20
    for span, label in zip(got, got_labels):
        owner = [i for i, t in enumerate(texts) if span in t]
        assert len(owner) == 1 and label == labels[owner[0]]
        assert 1 <= len(short_reviews.sentences(span)) <= 3
    assert len(set(got)) > 5  # drawn at random, not the first sentence each time
    assert len(short_reviews.training_spans(texts, labels, 0.0, seed=3)[0]) == 0
    with pytest.raises(ValueError, match="fraction=1.5"):
        short_reviews.training_spans(texts, labels, 1.5, seed=3)


@pytest.mark.large  # the shipped model on all 25,000 test reviews
def test_committed_saved_model_reproduces_its_recorded_accuracy_and_calibration():
    """The committed SavedModel, not the metrics file, measured anew on IMDB's test split.

    Every test review served through `serving_default` with plain TensorFlow: the accuracy is
    the one `metrics.json` records (to one review), and the expected calibration error,
    computed here from the served probabilities (`reference_ece` above, bin by bin), is at
    most 0.015 and the recorded one.
    """
    from apps.classifier import data

    metrics = json.loads((ROOT / "saved_models/imdb_sdpa/metrics.json").read_text())
    texts, labels, _ = data.load_test_split("imdb_reviews")
    serve = tf.saved_model.load(str(ROOT / "saved_models/imdb_sdpa/saved_model"))
    serve = serve.signatures["serving_default"]
    probability = np.concatenate(
        [
            serve(text=tf.constant(texts[i : i + 256]))["probability"].numpy()
            for i in range(0, len(texts), 256)
        ]
    ).astype("float64")
    accuracy = np.mean((probability >= 0.5) == (labels == 1))
    assert abs(accuracy - metrics["test_accuracy"]) <= 1 / len(labels), accuracy
    ece = reference_ece(probability, labels, 15)
    assert ece <= 0.015, ece
    assert abs(ece - metrics["calibration"]["test"]["after"]["ece"]) < 1e-4, ece
