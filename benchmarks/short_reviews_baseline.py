"""How well a review's single sentence can be read at all: linear baselines on the app's
short-review buckets.

The app's card reports accuracy by span length (`apps.classifier.short_reviews`): one sentence
of a test review, labelled with the whole review's label, reads far below the whole review.
Part of that gap is the label: a sentence of plot summary or a "the acting was fine" in a
negative review carries the review's label without its sentiment. This script measures what a
model trained *for* sentences gets on the same spans, so the gap can be split into what the
classifier misses and what the labels allow.

Three linear classifiers (logistic regression on which words and word pairs a text holds,
100,000 features, with the app's standardization; `keras.layers.TextVectorization` into one
`keras.layers.Dense`), each trained with the app's validation carve-out and early stopping on
it (the model of the epoch with the lowest validation loss), are read on the spans of the same
2,000 test reviews (`short_reviews.spans`, seed 0, as `metrics.json` records them):

- `reviews`: trained on the whole training reviews, as the app is;
- `sentences`: trained on every sentence of the training reviews, each with its review's label;
- `both`: trained on both.

Writes `saved_models/experiments/short_reviews_baseline.json` and prints a Markdown table.

Usage:
    python benchmarks/short_reviews_baseline.py --data_dir ../shared/data/tensorflow_datasets
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "saved_models", "experiments", "short_reviews_baseline.json")
FEATURES = 100_000
EPOCHS = 8
BATCH_SIZE = 256


def every_sentence(texts, labels):
    """`(sentences, labels)`: each sentence of each text, with its text's label."""
    import numpy as np

    from apps.classifier import short_reviews

    out_texts, out_labels = [], []
    for text, label in zip(texts, labels):
        for sentence in short_reviews.sentences(text):
            out_texts.append(sentence)
            out_labels.append(int(label))
    return np.array(out_texts, dtype=object), np.array(out_labels, np.int64)


def fit_linear(train, validation, seed):
    """A logistic regression on which words and pairs a text holds, fitted on
    `train = (texts, labels)`, the epoch with the lowest loss on `validation` kept.
    Returns `texts -> log-odds`."""
    import keras
    import numpy as np
    import tensorflow as tf

    from apps.classifier import data

    keras.utils.set_random_seed(seed)
    vectorizer = keras.layers.TextVectorization(
        max_tokens=FEATURES,
        ngrams=2,
        output_mode="multi_hot",
        standardize=data.standardize,
        sparse=True,
    )
    vectorizer.adapt(tf.data.Dataset.from_tensor_slices(train[0]).batch(1024))

    def dataset(texts, labels, shuffle):
        ds = tf.data.Dataset.from_tensor_slices((texts, labels.astype("float32")))
        if shuffle:
            ds = ds.shuffle(len(texts), seed=seed)
        return ds.batch(BATCH_SIZE).map(lambda x, y: (vectorizer(x), y)).prefetch(2)

    model = keras.Sequential(
        [
            keras.Input((vectorizer.vocabulary_size(),), sparse=True),
            keras.layers.Dense(
                1, kernel_initializer="zeros", kernel_regularizer=keras.regularizers.L2(1e-6)
            ),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    stop = keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True)
    model.fit(
        dataset(*train, shuffle=True),
        validation_data=dataset(*validation, shuffle=False),
        epochs=EPOCHS,
        callbacks=[stop],
        verbose=2,
    )

    def log_odds(texts):
        ds = tf.data.Dataset.from_tensor_slices(texts).batch(1024).map(vectorizer)
        return np.concatenate([model.predict_on_batch(x)[:, 0] for x in ds])

    return log_odds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.environ.get("TFDS_DATA_DIR"))
    parser.add_argument("--reviews", type=int, default=2000, help="test reviews cut into spans")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    if args.reviews < 1:
        parser.error(f"--reviews must be at least 1. Received: {args.reviews}")
    sys.path.insert(0, ROOT)
    import numpy as np
    from common import cpu_name

    from apps.classifier import data, short_reviews

    start = time.perf_counter()
    splits = data.load_splits(seed=args.seed, data_dir=data.resolve_data_dir(args.data_dir))
    sentences = every_sentence(splits.train_text, splits.train_label)
    val_sentences = every_sentence(splits.validation_text, splits.validation_label)
    reviews = (splits.train_text, splits.train_label)
    val_reviews = (splits.validation_text, splits.validation_label)
    print(
        f"{len(reviews[0])} training reviews, {len(sentences[0])} of their sentences",
        file=sys.stderr,
    )
    trainings = {
        "reviews": (reviews, val_reviews),
        "sentences": (sentences, val_sentences),
        "both": (
            tuple(np.concatenate(pair) for pair in zip(reviews, sentences)),
            tuple(np.concatenate(pair) for pair in zip(val_reviews, val_sentences)),
        ),
    }
    spans = short_reviews.spans(splits.test_text, splits.test_label, args.reviews, args.seed)
    results = {}
    for name, (train, validation) in trainings.items():
        print(f"fitting on {name} ({len(train[0])} texts)", file=sys.stderr)
        log_odds = fit_linear(train, validation, args.seed)
        results[name] = {
            bucket: float(np.mean((log_odds(texts) >= 0) == (labels == 1)))
            for bucket, (texts, labels) in spans.items()
        }
        results[name]["test split"] = float(
            np.mean((log_odds(splits.test_text) >= 0) == (splits.test_label == 1))
        )
        print(f"  {results[name]}", file=sys.stderr)
    report = {
        "command": "python benchmarks/short_reviews_baseline.py",
        "machine": cpu_name(),
        "seconds": round(time.perf_counter() - start, 1),
        "features": FEATURES,
        "split": splits.test_split,
        "reviews": args.reviews,
        "seed": args.seed,
        "examples": {bucket: int(len(labels)) for bucket, (_, labels) in spans.items()},
        "training_texts": {name: int(len(train[0])) for name, (train, _) in trainings.items()},
        "accuracy": results,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    buckets = list(spans)
    print("| trained on | " + " | ".join(buckets) + " | test split |")
    print("|---" * (len(buckets) + 2) + "|")
    for name, row in results.items():
        cells = " | ".join(f"{100 * row[b]:.2f}%" for b in buckets + ["test split"])
        print(f"| {name} | {cells} |")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
