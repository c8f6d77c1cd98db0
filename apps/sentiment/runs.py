"""A finished training run's folder, loaded back as Keras models; and re-exporting it.

Usage:
    python -m apps.runs --run saved_models/imdb_sdpa --data_dir ../shared/data/tensorflow_datasets

`load_run` rebuilds the classifier of a folder written by `apps.train_sentiment` from its
`model.keras`, or, where only the SavedModel was kept (the shipped run), from the
SavedModel's variables, matched by name. The CLI re-exports the folder's SavedModel with
this version's signatures (`apps.serving.export.export_saved_model`) and checks, on the whole test
split, that the new SavedModel's accuracy is the one in `metrics.json`; it replaces the old
one only then.
"""

import dataclasses
import json
import os
import re
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import cli  # noqa: E402
from ..inspection import explain  # noqa: E402
from ..serving import export  # noqa: E402
from . import data  # noqa: E402
from . import model as model_lib  # noqa: E402


@dataclasses.dataclass
class Run:
    model: keras.Model  # token ids -> P(positive)
    inspector: keras.Model  # token ids -> probability, attention, pooling
    vectorizer: keras.layers.TextVectorization
    metrics: dict  # the run's metrics.json
    weights_from: str  # the file the weights came from


# The first layer kept its projections as `query_kernel`, ..., `output_kernel` variables.
_LEGACY_NAME = re.compile(r"/attention/(query|key|value|output)_(kernel|bias)$")


def _current_name(name):
    def rename(match):
        sublayer = "attention_output" if match[1] == "output" else match[1]
        return f"/attention/{sublayer}/{match[2]}"

    return _LEGACY_NAME.sub(rename, name.split(":")[0])


def load_run(run):
    """The classifier of a training run's folder as Keras models (`Run`)."""
    metrics_path = os.path.join(run, "metrics.json")
    saved_model = os.path.join(run, "saved_model")
    if not os.path.isfile(metrics_path) or not os.path.isdir(saved_model):
        raise ValueError(
            "`--run` must be a folder written by `python -m apps.train_sentiment` (with "
            f"metrics.json and saved_model/). Received: run={run!r}"
        )
    with open(metrics_path) as f:
        metrics = json.load(f)
    config = metrics["config"]
    vectorizer = data.make_vectorizer(
        config["vocab_size"],
        config["sequence_length"],
        vocabulary=os.path.join(run, "vocabulary.txt"),
    )
    model, inspector = model_lib.build_classifier(
        vocab_size=vectorizer.vocabulary_size(),
        sequence_length=config["sequence_length"],
        embed_dim=config["embed_dim"],
        num_heads=config["num_heads"],
        key_dim=config["key_dim"],
        ff_dim=config["ff_dim"],
        num_layers=config["num_layers"],
        dropout=0.0,
        bigram_vocab_size=config["bigram_vocab_size"],
        trigram_vocab_size=config.get("trigram_vocab_size", 0),
        naive_bayes=config.get("naive_bayes_alpha", 0) > 0,
        naive_bayes_folds=config.get("naive_bayes_folds", 1),
        pooling_scale=config.get("pooling_scale"),
        pooling_values=config.get("pooling_values", "block"),
        ngram_dim=config.get("ngram_dim"),
    )
    if config["bigram_vocab_size"]:
        pairs = data.read_ngrams(vectorizer, os.path.join(run, "bigrams.txt"))
        model.get_layer("embedding").set_bigrams(pairs)
    if config.get("trigram_vocab_size"):
        triples = data.read_ngrams(vectorizer, os.path.join(run, "trigrams.txt"))
        model.get_layer("embedding").set_trigrams(triples)
    keras_path = os.path.join(run, "model.keras")
    if os.path.isfile(keras_path):
        trained = keras.saving.load_model(keras_path, compile=False)
        model.set_weights(trained.get_weights())
        weights_from = keras_path
    else:
        loaded = tf.saved_model.load(saved_model)  # keeps the variables alive
        stored = {_current_name(v.name): v for v in loaded.signatures["serving_default"].variables}
        missing = [w.path for w in model.weights if w.path not in stored]
        if missing:
            raise ValueError(
                f"the SavedModel in {saved_model} has no variable for {missing[:3]} (and "
                f"{max(0, len(missing) - 3)} more); it was not written by this app's classifier"
            )
        for weight in model.weights:
            weight.assign(stored[weight.path])
        weights_from = saved_model
    model(vectorizer(tf.constant(["a"])))  # builds every layer (export needs built layers)
    return Run(model, inspector, vectorizer, metrics, weights_from)


def check_against_saved_model(run, saved_model, texts, tolerance=1e-4):
    """The largest |P(positive)| difference between the Keras model and the SavedModel on
    `texts`; a `ValueError` beyond `tolerance`."""
    loaded = tf.saved_model.load(saved_model)
    serve = loaded.signatures["serving_default"]
    served = np.concatenate(
        [serve(text=tf.constant(texts[i : i + 64]))["probability"].numpy()
         for i in range(0, len(texts), 64)]
    )  # fmt: skip
    ids = data.vectorize(run.vectorizer, texts)
    ours = explain.ModelProbe(run.model).probability(ids)
    difference = float(np.max(np.abs(served - ours))) if len(texts) else 0.0
    if difference > tolerance:
        raise ValueError(
            f"the Keras model rebuilt from {run.weights_from} differs from the SavedModel by "
            f"{difference:.2g} in P(positive) (tolerance {tolerance}); not measuring it"
        )
    return difference


@dataclasses.dataclass
class Config:
    run: str = "saved_models/imdb_sdpa"  # a training run's folder
    data_dir: str | None = None  # TFDS folder; else $TFDS_DATA_DIR; else TFDS's default
    batch_size: int = 256  # reviews per call when checking the accuracy


def reexport(config):
    """Re-exports `config.run`'s SavedModel; returns the accuracy the new one measured."""
    run = load_run(config.run)
    metrics = run.metrics
    target = os.path.join(config.run, "saved_model")
    staging = os.path.join(config.run, "saved_model.reexport")
    print(f"Weights from {run.weights_from}; exporting to {staging}")
    export.export_saved_model(run.model, run.inspector, run.vectorizer, staging)
    texts, labels, split = data.load_test_split(
        metrics["config"]["dataset"], data.resolve_data_dir(config.data_dir)
    )
    if split != metrics["test_split"] or len(texts) != metrics["test_examples"]:
        raise ValueError(
            f"the run reported on {metrics['test_examples']} reviews of `{metrics['test_split']}`,"
            f" but TFDS gives {len(texts)} of `{split}`; not replacing its SavedModel"
        )
    loaded = tf.saved_model.load(staging)
    serve = loaded.signatures["serving_default"]
    progress = keras.utils.Progbar(len(texts), unit_name="review")
    correct = 0
    for start in range(0, len(texts), config.batch_size):
        batch = texts[start : start + config.batch_size]
        label = serve(text=tf.constant(batch))["label"].numpy()
        correct += int(np.sum(label == labels[start : start + config.batch_size]))
        progress.add(len(batch))
    accuracy = correct / len(texts)
    # metrics.json holds Keras's float32 running mean: equal to within a count of one review.
    if abs(accuracy - metrics["test_accuracy"]) > 1.5 / len(texts):
        raise ValueError(
            f"the re-exported SavedModel reads {accuracy:.5f} on {split}, not the recorded "
            f"{metrics['test_accuracy']:.5f}; {target} is left as it was (new one: {staging})"
        )
    shutil.rmtree(target)
    os.replace(staging, target)
    serving = export.measure_serving(target, texts[:2048])
    serving_path = export.write_json_atomic(os.path.join(config.run, "serving.json"), serving)
    export.write_model_card(metrics, os.path.join(config.run, "README.md"))
    return accuracy, split, len(texts), target, serving_path


def main(argv=None):
    config = cli.parse_config(
        Config,
        argv,
        prog="python -m apps.runs",
        description="Re-export a training run's SavedModel with this version's signatures.",
    )
    try:
        accuracy, split, count, target, serving = reexport(config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{split} accuracy {accuracy:.5f} on {count} reviews, as recorded. Wrote:")
    print(f"  saved_model          {target}")
    print(f"  serving              {serving}")
    print(f"  model_card           {os.path.join(config.run, 'README.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
