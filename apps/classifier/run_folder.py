"""A finished training run's folder, loaded back as Keras models.

`load_run` rebuilds the classifier of a folder written by `apps.train_sentiment` from its
`model.keras`, or, where only the SavedModel was kept (the shipped run), from the
SavedModel's variables, matched by name.
"""

import dataclasses
import json
import os
import re

import keras
import tensorflow as tf

from . import data
from . import model as model_lib
from .perturbation import Perturbation  # registers PerturbedClassifier, which model.keras may name


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
        normalize_embeddings=Perturbation.from_flags(config).normalizes_embeddings,
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
