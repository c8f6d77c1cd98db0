"""Self-training (`--self_training_from`): which unlabelled reviews the teacher labels and
keeps, checked against the teacher's own Keras model and against NumPy."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from conftest import TINY_RUN, keras_model_of_run

from apps.classifier import data
from apps.training import config as train_config
from apps.training import self_training
from apps.training import train as train_sentiment

TEXTS = [
    b"A wonderful, moving film with a brilliant cast and a great story.",
    b"Dull, predictable and far too long. I want my two hours back.",
    b"The best film of the year: funny, warm and beautifully made.",
    b"Awful acting, a boring plot and terrible dialogue throughout.",
    b"Not bad.",
    b"I loved every minute of it, a great film with a wonderful ending that I will remember.",
    b"A waste of time and money; the worst film I have seen in years.",
    b"It was fine, nothing special, some good scenes and some bad ones.",
    b"Brilliant.",
    b"Terrible, boring, awful, the plot makes no sense and the cast is bad.",
]


def _surest_by_hand(log_odds, per_class):
    """The reviews `surest` must keep, by the definition: per class, every kept one at least
    as sure as every one left, as many of each class."""
    positive = [i for i in range(len(log_odds)) if log_odds[i] > 0]
    negative = [i for i in range(len(log_odds)) if log_odds[i] < 0]
    count = min(per_class, len(positive), len(negative))
    top = sorted(positive, key=lambda i: (-log_odds[i], i))[:count]
    bottom = sorted(negative, key=lambda i: (log_odds[i], i))[:count]
    return sorted(top + bottom)


@pytest.mark.parametrize("per_class", [1, 3, 50])
def test_surest_keeps_the_most_confident_of_each_class_and_balances_them(per_class):
    rng = np.random.default_rng(per_class)
    log_odds = rng.normal(0.5, 2.0, 40)  # more positives than negatives
    log_odds[:3] = 0.0  # undecided: neither class
    chosen, labels = self_training.surest(log_odds, per_class)
    assert list(chosen) == _surest_by_hand(log_odds, per_class)
    np.testing.assert_array_equal(labels, (log_odds[chosen] > 0).astype(int))
    assert 2 * np.sum(labels) == len(labels)  # as many of each class
    kept_positive = log_odds[chosen][labels == 1]
    left = np.setdiff1d(np.flatnonzero(log_odds > 0), chosen)
    assert not len(left) or kept_positive.min() >= log_odds[left].max()


def test_teacher_log_odds_come_back_in_the_rows_order(tiny_run):
    """The rows go through in order of length; each log-odds goes back to its own row (the
    teacher's Keras model on each row alone is the reference)."""
    model, vectorizer = keras_model_of_run(*tiny_run)
    ids = data.vectorize(vectorizer, np.array(TEXTS, dtype=object))
    log_odds = self_training.teacher_log_odds(model, ids, batch_size=3)
    for row, value in zip(ids, log_odds):
        p = float(model.predict(row[None], verbose=0)[0, 0])
        np.testing.assert_allclose(value, np.log(p / (1 - p)), atol=1e-4)


def _teacher_of_both_classes(tiny_run, folder, texts):
    """A copy of the tiny run whose output bias puts the median of `texts` at log-odds 0: it
    predicts both classes (the tiny run, 12 steps, predicts mostly one)."""
    output, metrics = tiny_run
    shutil.copytree(output, folder)
    model, words = keras_model_of_run(str(folder), metrics)
    p = model.predict(data.vectorize(words, np.array(texts, dtype=object)), verbose=0)[:, 0]
    classifier = model.get_layer("classifier")
    classifier.bias.assign(classifier.bias - np.median(np.log(p / (1 - p))))
    model.save(os.path.join(folder, "model.keras"))
    return str(folder), model, words


def _config(tiny_run_folder, **changes):
    config = train_config.Config(
        self_training_from=tiny_run_folder, self_training_reviews=4, **changes
    )
    train_config.check_config(config)
    return config


@pytest.mark.parametrize("words", ["own", "teacher's", "teacher's, shorter"])
def test_the_teacher_labels_unlabelled_reviews_never_held_out_ones(words, tiny_run, tmp_path):
    """The teacher reads the reviews through its own vocabulary (this run's `own` differs; with
    the `teacher's` words and length it reads this run's ids), a review whose token ids are a
    held-out one's stays out, and the kept ones carry the teacher's label, the surest of each
    class first."""
    output, teacher, teacher_words = _teacher_of_both_classes(tiny_run, tmp_path / "teacher", TEXTS)
    texts = np.array(TEXTS, dtype=object)
    vectorizer, length = teacher_words, tiny_run[1]["config"]["sequence_length"]
    if words == "own":
        vectorizer, length = data.make_vectorizer(50, 24), 24  # a smaller vocabulary
        vectorizer.adapt(texts)
    elif words == "teacher's, shorter":  # the teacher's ids would be cut: it reads the texts
        vocabulary = os.path.join(tiny_run[0], "vocabulary.txt")
        vectorizer, length = data.make_vectorizer(3000, 8, vocabulary=vocabulary), 8
    ids = data.vectorize(vectorizer, texts)
    p = teacher.predict(data.vectorize(teacher_words, texts), verbose=0)[:, 0]
    log_odds = np.log(p / (1 - p))
    hold = _surest_by_hand(log_odds, 2)[0]  # a validation review the teacher is sure of
    splits = dataclasses.replace(_empty_splits(), unlabeled_text=texts)
    chosen_ids, labels, record = self_training.pseudo_labelled(
        _config(output, sequence_length=length), splits, vectorizer, ids, ids[[hold]], 4
    )
    log_odds[hold] = 0.0  # held out: neither class
    expected = _surest_by_hand(log_odds, 2)
    np.testing.assert_array_equal(chosen_ids, ids[expected])
    np.testing.assert_array_equal(labels, (log_odds[expected] > 0).astype(int))
    assert record["labelled_by_teacher"] == 9 and record["reviews"] == len(expected)
    assert record["same_vocabulary"] is (words == "teacher's")
    assert record["teacher_test_accuracy"] == tiny_run[1]["test_accuracy"]


def _empty_splits():
    empty = np.array([], dtype=object)
    label = np.array([], dtype="int64")
    return data.Splits(empty, label, empty, label, empty, label, "test", 2)


def test_a_teacher_with_another_validation_set_is_refused(tiny_run):
    output, _ = tiny_run
    with pytest.raises(
        ValueError, match=r"`--self_training_from`.*--seed \(teacher 0, this run 1\)"
    ):
        self_training.pseudo_labelled(
            _config(output, seed=1), _empty_splits(), None, np.zeros((0, 4)), np.zeros((0, 4)), 4
        )


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--self_training_reviews", "1"], "self_training_reviews=1"),
        (["--self_training_reviews", "3"], "self_training_reviews=3"),
        (["--self_training_from", "/nonexistent"], "self_training_from='/nonexistent'"),
        (
            ["--self_training_from", ".", "--vocabulary_source", "train"],
            "vocabulary_source='train'",
        ),
    ],
)
def test_self_training_flags_are_checked(flags, match, capsys):
    with pytest.raises(SystemExit):
        train_sentiment.parse_args(flags)
    assert match in capsys.readouterr().err


@pytest.mark.large  # a whole run with its teacher: the labels join the training set
def test_a_self_training_run_trains_on_its_teachers_labels(tiny_run, tmp_path):
    texts = data.load_unlabeled("imdb_reviews")[: 6 * 32]
    teacher, _, _ = _teacher_of_both_classes(tiny_run, tmp_path / "teacher", texts)
    flags = list(TINY_RUN)
    flags[flags.index("--vocabulary_source") + 1] = "train+unsupervised"
    output = tmp_path / "student"
    code = train_sentiment.main(
        [*flags, "--self_training_from", teacher, "--self_training_reviews", "40"]
        + ["--output", str(output)]
    )
    assert code == 0
    metrics = json.loads((output / "metrics.json").read_text())
    record = metrics["self_training"]
    # Smoke runs label the first `max_steps` batches' worth of unlabelled reviews.
    assert record["labelled_by_teacher"] <= 6 * 32 and record["reviews"] == 40
    assert record["positive"] == 20 and record["teacher"] == teacher
    assert metrics["stage_seconds"]["self_training_labels"] == record["seconds"]
    card = (output / "README.md").read_text()
    assert "## Self-training" in card and "the 40 it was surest of" in " ".join(card.split())
    assert record["fit_examples"] == metrics["train_examples"] + 40
