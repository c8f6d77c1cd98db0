"""Data preparation: the TFDS splits, the vocabulary, the token ids, and the short spans that
train beside the whole reviews."""

import os

import keras
import numpy as np
import tensorflow as tf

from .. import files
from ..classifier import data, short_reviews


def prepare_data(config, run):
    """The TFDS splits, the vectorizer (adapted on `--vocabulary_source`, or the interrupted
    run's), the train and validation token ids, and the token ids the pair and triple
    vocabularies are counted on (train's, with the unlabelled reviews' after them)."""
    keras.utils.set_random_seed(config.seed)
    data_dir = data.resolve_data_dir(config.data_dir)
    print(f"Loading {config.dataset} with tensorflow-datasets (data_dir={data_dir or 'default'})")
    splits = data.load_splits(config.dataset, data_dir, config.validation_fraction, config.seed)
    if splits.num_classes != 2:
        raise ValueError(
            "`--dataset` must have two classes (this app has a sigmoid head). "
            f"Received: dataset={config.dataset!r} with {splits.num_classes} classes"
        )
    print(
        f"train {len(splits.train_text)}, validation {len(splits.validation_text)} (from train, "
        f"seed {config.seed}), test {len(splits.test_text)} "
        f"({splits.test_split} split, for the final report only)"
    )
    counted_text = splits.train_text
    # Read again on `--resume` too: pretraining reads them.
    if config.vocabulary_source == "train+unsupervised":
        unlabeled = data.load_unlabeled(config.dataset, data_dir)
        # IMDB's unlabelled split repeats some labelled reviews word for word (270 of the test
        # split's, 27 of validation's): those stay out, so no held-out text is counted.
        held_out = {*splits.validation_text, *splits.test_text}
        unlabeled = np.array([text for text in unlabeled if text not in held_out], dtype=object)
        print(f"Reading train and {len(unlabeled)} unlabelled reviews for the vocabularies")
        counted_text = np.concatenate([splits.train_text, unlabeled])
        splits.unlabeled_text = unlabeled
    if run.resuming and os.path.exists(run.vocabulary):
        vectorizer = data.make_vectorizer(
            config.vocab_size, config.sequence_length, vocabulary=run.vocabulary
        )
    else:
        vectorizer = data.make_vectorizer(config.vocab_size, config.sequence_length)
        vectorizer.adapt(tf.data.Dataset.from_tensor_slices(counted_text).batch(1024))
        _write_vocabulary(vectorizer, run.vocabulary)
    train_ids = data.vectorize(vectorizer, splits.train_text)  # (n, L)
    validation_ids = data.vectorize(vectorizer, splits.validation_text)
    counted_ids = train_ids
    if len(counted_text) > len(splits.train_text):
        extra = data.vectorize(vectorizer, counted_text[len(splits.train_text) :])
        counted_ids = np.concatenate([train_ids, extra])  # (n + unlabelled, L)
    return splits, vectorizer, train_ids, validation_ids, counted_ids


def _write_vocabulary(vectorizer, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Index 0 (padding) and 1 (OOV) are the layer's own; it adds them back on load.
    files.write_text_atomic(path, (f"{token}\n" for token in vectorizer.get_vocabulary()[2:]))


def training_examples(config, splits, vectorizer, train_ids):
    """The token ids and labels the run fits on: the training reviews, and with
    `--short_spans`, spans of 1 to 3 of their sentences after them."""
    fit_ids, train_labels = train_ids, splits.train_label
    if config.short_spans:
        texts, labels = short_reviews.training_spans(
            splits.train_text, splits.train_label, config.short_spans, config.seed
        )
        print(f"{len(texts)} spans of 1 to 3 sentences train beside the whole reviews")
        if len(texts):
            fit_ids = np.concatenate([train_ids, data.vectorize(vectorizer, texts)])
            train_labels = np.concatenate([train_labels, labels])
    return fit_ids, train_labels
