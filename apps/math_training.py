"""The math app's claim 5: training with and without the scaling, on a bag-of-words task.

`python -m apps.math_verified` (`apps/math_verified.py`) runs `measure_training` beside its
other claims and judges it with `check_training`.
"""

import time

import keras
import numpy as np

from keras_sdpa import ScaledDotProductAttention


def majority_task(examples, sequence_length, vocab_size, seed):
    """Token sequences labelled 1 when most of their tokens come from the lower half of
    the vocabulary: a bag-of-words sentiment task that attention pooling solves by
    averaging over every token, which a saturated softmax cannot do."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, (examples, sequence_length)).astype(np.int32)
    labels = ((tokens < vocab_size // 2).sum(1) > sequence_length // 2).astype(np.float32)
    return tokens, labels


def pooling_classifier(key_dim, scale, sequence_length, vocab_size, embed_dim, seed):
    """Embedding -> LayerNormalization -> attention pooling (a learned query, our layer
    with T = 1) -> Dense(1, sigmoid).

    The normalized inputs and the `fan_in` initializer give the projected queries
    and keys components of variance 1, the derivation's premise, at every `key_dim`.
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((sequence_length,), dtype="int32")
    x = keras.layers.Embedding(vocab_size, embed_dim, embeddings_initializer="normal")(tokens)
    x = keras.layers.LayerNormalization()(x)  # (B, S, E), unit variance per token
    first = keras.ops.zeros_like(tokens[:, :1])  # (B, 1): one learned query per example
    query = keras.layers.Embedding(1, embed_dim, embeddings_initializer="normal")(first)
    pooled = ScaledDotProductAttention(
        key_dim=key_dim,
        value_dim=embed_dim,
        scale=scale,
        kernel_initializer="lecun_normal",  # variance 1 / fan_in: Var(q_i) = Var(k_i) = 1
        name="pooling",
    )(query, x)  # (B, 1, E)
    probability = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(pooled))
    return keras.Model(tokens, probability)


class _Evaluate(keras.callbacks.Callback):
    """Validation loss and accuracy every `every` training steps, and the training loss."""

    def __init__(self, data, every):
        super().__init__()
        self.data, self.every = data, every
        self.steps, self.val_loss, self.val_accuracy, self.loss = [], [], [], []
        self.step = 0

    def evaluate(self):
        loss, accuracy = self.model.evaluate(*self.data, batch_size=1000, verbose=0)
        self.steps.append(self.step)
        self.val_loss.append(float(loss))
        self.val_accuracy.append(float(accuracy))

    def on_train_begin(self, logs=None):
        self.evaluate()

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        self.loss.append(float(logs["loss"]))
        if self.step % self.every == 0:
            self.evaluate()


def measure_training(config, progress):
    sequence_length, vocab_size, embed_dim = 33, 64, 64
    train = majority_task(config.train_examples, sequence_length, vocab_size, config.seed)
    validation = majority_task(2000, sequence_length, vocab_size, config.seed + 1)
    runs = {}
    for name, scale in (("scaled", None), ("unscaled", 1.0)):
        progress(f"claim 5: training with {name} scores (d_k = {config.train_key_dim})")
        model = pooling_classifier(
            config.train_key_dim, scale, sequence_length, vocab_size, embed_dim, config.seed
        )
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
        evaluate = _Evaluate(validation, config.eval_every)
        start = time.perf_counter()
        model.fit(
            *train,
            batch_size=config.train_batch_size,
            epochs=config.train_epochs,
            shuffle=True,
            callbacks=[evaluate],
            verbose=0,
        )
        evaluate.evaluate()  # the final point
        runs[name] = {
            "steps": evaluate.steps,
            "val_loss": evaluate.val_loss,
            "val_accuracy": evaluate.val_accuracy,
            "train_loss": evaluate.loss,
            "seconds": time.perf_counter() - start,
            "steps_to_95": _first_step(evaluate.steps, evaluate.val_accuracy, 0.95),
            "final_val_accuracy": evaluate.val_accuracy[-1],
            "final_val_loss": evaluate.val_loss[-1],
        }
    return {
        "task": "majority vote of 33 tokens from a vocabulary of 64 (lower half = positive)",
        "key_dim": config.train_key_dim,
        "examples": config.train_examples,
        "validation_examples": 2000,
        "epochs": config.train_epochs,
        **runs,
    }


def _first_step(steps, accuracies, bar):
    return next((s for s, a in zip(steps, accuracies) if a >= bar), None)


def check_training(result):
    """Claim 5: scaled reaches 95% validation accuracy, at least twice as fast as
    unscaled (or unscaled never does), and ends with the lower validation loss.

    The validation set has 2,000 examples: the standard error of an accuracy near
    0.95 is 0.005, far inside the gaps this checks.
    """
    scaled, unscaled = result["scaled"], result["unscaled"]
    if scaled["steps_to_95"] is None:
        return False
    faster = unscaled["steps_to_95"] is None or unscaled["steps_to_95"] >= 2 * scaled["steps_to_95"]
    return faster and scaled["final_val_loss"] < unscaled["final_val_loss"]
