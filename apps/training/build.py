"""Model building: the classifier compiled in the strategy's scope, under the run's dtype
policy, with its n-gram vocabularies and naive-Bayes ratios set."""

import contextlib
import dataclasses
import os

import keras

from .. import files
from ..classifier import data
from ..classifier import model as model_lib
from ..classifier.optimizer import Adam
from ..classifier.perturbation import Perturbation, PerturbedClassifier


@contextlib.contextmanager
def dtype_policy(name):
    """Keras's global dtype policy set to `name` for the layers built inside, then restored.

    Under `mixed_float16`, `model.compile` wraps the optimizer in Keras's
    `LossScaleOptimizer` itself (its `auto_scale_loss`)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build_model(config, run, vectorizer, train_ids, train_labels, counted_ids, steps_per_epoch):
    """The compiled classifier and its inspector, in the strategy's scope, with the word-pair
    and word-triple vocabularies, the naive-Bayes ratios and the embeddings' row frequencies
    set. With a perturbation loss (`--adversarial_weight` and the others), the classifier is a
    `PerturbedClassifier`, which trains on the mixed objective."""
    perturbation = Perturbation.from_flags(dataclasses.asdict(config))
    # Variables, the model, its attention layers and the optimizer all live in the scope.
    with run.strategy.scope():
        model, inspector = model_lib.build_classifier(
            vocab_size=vectorizer.vocabulary_size(),
            sequence_length=config.sequence_length,
            embed_dim=config.embed_dim,
            num_heads=config.num_heads,
            key_dim=config.key_dim,
            ff_dim=config.ff_dim,
            num_layers=config.num_layers,
            dropout=config.dropout,
            word_dropout=config.word_dropout,
            seed=config.seed,
            bigram_vocab_size=config.bigram_vocab_size,
            trigram_vocab_size=config.trigram_vocab_size,
            naive_bayes=config.naive_bayes_alpha > 0,
            naive_bayes_folds=config.naive_bayes_folds,
            pooling_scale=config.pooling_scale,
            pooling_values=config.pooling_values,
            ngram_dim=config.ngram_dim,
            normalize_embeddings=perturbation.normalizes_embeddings,
        )
        if perturbation.weighted:
            model = PerturbedClassifier.around(model, perturbation)
        # Cosine decay to zero over the planned steps: a function of the optimizer's own
        # step, so a resumed run follows the same schedule.
        schedule = keras.optimizers.schedules.CosineDecay(
            config.learning_rate, decay_steps=steps_per_epoch * config.epochs
        )
        # The attention core is XLA-compiled on its own; the rest of the step runs on TF's
        # kernels (XLA's CPU random numbers make Keras's Dropout far slower under jit).
        model.compile(
            optimizer=Adam(
                schedule,
                weight_decay=config.weight_decay or None,
                use_ema=config.ema_momentum is not None,
                ema_momentum=config.ema_momentum or 0.99,
            ),
            loss="binary_crossentropy",
            metrics=["accuracy"],
            jit_compile=False,
        )
        model.optimizer.build(model.trainable_variables)
    if config.bigram_vocab_size:
        embedding = model.get_layer("embedding")
        if run.resuming and os.path.exists(run.bigrams):
            pairs = data.read_ngrams(vectorizer, run.bigrams)
            embedding.set_bigrams(pairs)
        else:
            embedding.adapt_bigrams(counted_ids)
            pairs = embedding.get_bigrams()
            _write_ngrams(vectorizer, pairs, run.bigrams)
        print(f"{len(pairs)} word pairs have their own embedding")
    if config.trigram_vocab_size:
        embedding = model.get_layer("embedding")
        if run.resuming and os.path.exists(run.trigrams):
            triples = data.read_ngrams(vectorizer, run.trigrams)
            embedding.set_trigrams(triples)
        else:
            embedding.adapt_trigrams(counted_ids)
            triples = embedding.get_trigrams()
            _write_ngrams(vectorizer, triples, run.trigrams)
        print(f"{len(triples)} word triples have their own embedding")
    if config.naive_bayes_alpha:
        # From the training split's labels only; a resumed run counts the same again (and
        # its restored weights hold the same tables).
        model.get_layer("embedding").adapt_naive_bayes(
            train_ids, train_labels, config.naive_bayes_alpha
        )
        print(f"Naive-Bayes log-count ratios counted on {len(train_ids)} training reviews")
    if perturbation.normalizes_embeddings:
        # On the reviews the vocabularies are counted on; a resumed run counts the same again.
        model.get_layer("embedding").adapt_frequencies(counted_ids)
        print(f"Embeddings normalised by their rows' frequencies in {len(counted_ids)} reviews")
    if perturbation.weighted:
        losses = ", ".join(f"{weight} x {name}" for name, weight in perturbation.weighted.items())
        print(f"Training on the mixed objective: the likelihood + {losses}")
    return model, inspector


def _write_ngrams(vectorizer, ngrams, path):
    """One n-gram per line ("not good"), most frequent first: the lookup's own order."""
    words = vectorizer.get_vocabulary()
    files.write_text_atomic(path, (" ".join(words[i] for i in ngram) + "\n" for ngram in ngrams))
