"""The pretraining stage: masked-word prediction on the training and unlabelled reviews,
which trains the classifier's embedding and blocks before it learns the labels.

The encoder it makes is saved in `<output>/pretrained/` with the configuration that made it;
a later run into the same folder whose configuration matches loads it and skips the stage.
An interrupted stage saves its state in `<output>/checkpoints/pretrain/`, and `--resume`
continues it on the same batches and the same hidden words."""

import hashlib
import json
import os
import sys
import time
from contextlib import nullcontext

import keras
import numpy as np

from .. import files
from ..classifier import masked_lm
from ..classifier.optimizer import Adam
from . import distribute
from .batches import training_stream
from .fit import TrainingState, interrupts_raised, optimizer_step

# The flags that decide what the pretrained encoder is: a saved one is reused only if these,
# the texts it read and the vocabulary and n-gram files are the same. (The naive-Bayes tables
# are weights of the embedding, so their flags count too.)
_ENCODER_DEFINING = (
    "dataset",
    "validation_fraction",
    "vocab_size",
    "sequence_length",
    "bigram_vocab_size",
    "trigram_vocab_size",
    "ngram_dim",
    "vocabulary_source",
    "naive_bayes_alpha",
    "naive_bayes_folds",
    "embed_dim",
    "num_heads",
    "key_dim",
    "ff_dim",
    "num_layers",
    "seed",
    "mixed_precision",
    "pretrain_steps",
    "pretrain_batch_size",
    "pretrain_learning_rate",
    "mask_rate",
    "predicted_words",
    "max_steps",
    "strategy",
    "logical_cpus",
)
ENCODER_FORMAT = 2  # what encoder.npz holds and how the stage makes it; raised when that changes


def encoder_folder(output):
    return os.path.join(output, "pretrained")


def planned_steps(config):
    """`--pretrain_steps`, cut to `--max_steps` in a smoke run."""
    if config.max_steps is None:
        return config.pretrain_steps
    return min(config.pretrain_steps, config.max_steps)


def encoder_key(config, run, texts_ids):
    """What made an encoder: the defining flags, the hash of the token ids it read and the
    hashes of the word, pair and triple vocabularies it embeds."""
    key = {name: getattr(config, name) for name in _ENCODER_DEFINING}
    key["format"] = ENCODER_FORMAT
    key["texts"] = hashlib.sha256(np.ascontiguousarray(texts_ids, np.int64).tobytes()).hexdigest()
    for path in (run.vocabulary, run.bigrams, run.trigrams):
        if os.path.exists(path):
            with open(path, "rb") as f:
                key[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return key


def without_held_out(texts_ids, held_out_ids):
    """The rows of `texts_ids` `(n, L)` that are no row of `held_out_ids` `(m, L)`.

    The unlabelled split repeats held-out reviews with small differences (markup, spacing)
    that an exact match of the text misses; as token ids, cut to the run's length, they are
    the same input, and they stay out. A near-copy that differs in a token the model keeps
    is a different input, and stays in."""
    return np.asarray(texts_ids)[~held_out_rows(texts_ids, held_out_ids)]


def held_out_rows(texts_ids, held_out_ids):
    """Whether each row of `texts_ids` `(n, L)` is a row of `held_out_ids` `(m, L)`: `(n,)`."""
    held_out = {row.tobytes() for row in np.asarray(held_out_ids, np.int64)}
    return np.array([row.tobytes() in held_out for row in np.asarray(texts_ids, np.int64)], bool)


def pretrain(config, run, model, texts_ids):
    """Pretrains `model`'s encoder on `texts_ids` `(n, L)` (no label, no held-out review),
    or loads the encoder a previous run into the same folder made with the same configuration.

    Returns the stage's record for `metrics.json` (None with `--pretrain_steps 0`), or the
    string "interrupted" if Ctrl-C or SIGTERM stopped it (its state is saved)."""
    if not config.pretrain_steps:
        return None
    folder = encoder_folder(run.output)
    weights_path = os.path.join(folder, "encoder.npz")
    record_path = os.path.join(folder, "encoder.json")
    key = encoder_key(config, run, texts_ids)
    saved = _read_json(record_path)
    if saved is not None and saved.get("key") == key and os.path.exists(weights_path):
        with np.load(weights_path) as weights:
            masked_lm.set_encoder_weights(model, weights)
        # This run's own stage (resumed after it), or an earlier run's encoder.
        own = os.path.exists(os.path.join(run.checkpoints, "pretrain", "state.json"))
        print(
            f"Pretraining: loading the encoder in {folder} ("
            + ("this run made it" if own else "an earlier run with this configuration made it")
            + f" in {saved['record']['seconds']:.0f} s)"
        )
        return {**saved["record"], "reused": not own}
    record = _train_encoder(config, run, model, texts_ids)
    if record is None:
        return "interrupted"
    os.makedirs(folder, exist_ok=True)
    temporary = weights_path + ".partial.npz"
    np.savez(temporary, **masked_lm.encoder_weights(model))
    os.replace(temporary, weights_path)
    files.write_json_atomic(record_path, {"key": key, "record": record})
    print(f"Pretrained encoder written to {weights_path}")
    return {**record, "reused": False}


def _read(config):
    """Which reviews pretraining reads, in words."""
    if config.vocabulary_source == "train+unsupervised":
        return "train and unlabelled"
    return "train"


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _train_encoder(config, run, model, texts_ids):
    """`planned_steps` of masked-word prediction, resumable. Returns the stage's record, or
    None if interrupted (the state saved)."""
    steps = planned_steps(config)
    # The reviews of a step. Keras's `train_on_batch` gives every replica the whole batch
    # (it does not split it as `fit` does): more replicas compute the same gradient again.
    batch = config.pretrain_batch_size
    if batch > len(texts_ids):
        raise ValueError(
            f"`--pretrain_batch_size` must be at most the number of reviews pretraining reads "
            f"({len(texts_ids)}). Received: pretrain_batch_size={batch}"
        )
    with run.strategy.scope():
        predictor = masked_lm.MaskedWordModel(model, config.predicted_words)
        warmup = max(1, steps // 10)
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0,
            decay_steps=max(1, steps - warmup),
            warmup_target=config.pretrain_learning_rate,
            warmup_steps=warmup,
        )
        predictor.compile(
            optimizer=Adam(schedule),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            jit_compile=False,
        )
        length = min(texts_ids.shape[1], 8)
        predictor((np.ones((1, length), "int32"), np.zeros((1, 1), "int32")))  # builds it
        predictor.optimizer.build(predictor.trainable_variables)
    distribute.fix_keras_for_multi_worker(predictor, run.strategy)
    state = TrainingState(os.path.join(run.checkpoints, "pretrain"), config.save_every)
    state.set_model(predictor)
    if os.path.exists(state.json_path):
        state.restore()
    start = optimizer_step(predictor)
    print(
        f"Pretraining: masked-word prediction on {len(texts_ids)} reviews ({_read(config)}; "
        f"never validation or test), {steps} steps of "
        f"{batch}" + (f", resuming at step {start}" if start else "")
    )
    # Multi-worker Keras finds its strategy in the scope (as `fit_model` trains).
    multi_worker = distribute.is_multi_worker(run.strategy)
    try:
        with interrupts_raised(), run.strategy.scope() if multi_worker else nullcontext():
            logs = _steps(config, predictor, state, texts_ids, start, steps, batch)
    except KeyboardInterrupt:
        state.save()
        print(
            f"\nInterrupted at pretraining step {optimizer_step(predictor)}. State saved to "
            f"{state.directory}.\nContinue with: python -m apps.train_sentiment --resume "
            f"--output {config.output}",
            file=sys.stderr,
        )
        return None
    state.save()  # the finished stage's state: a resumed run knows the encoder is its own
    return {
        "steps": steps,
        "batch_size": batch,
        "reviews": len(texts_ids),
        "loss": round(float(logs.get("loss", float("nan"))), 4),
        "accuracy": round(float(logs.get("accuracy", float("nan"))), 4),
        "seconds": round(state.seconds(), 1),
    }


def _steps(config, predictor, state, texts_ids, start, steps, batch):
    """The training steps from `start` on, with a progress bar. Returns the loss and accuracy
    averaged over the last steps (an exponential moving average, 50 steps' span)."""
    stream = training_stream(
        texts_ids,
        np.zeros(len(texts_ids), "float32"),
        batch,
        config.seed,
        start_step=start,
    ).as_numpy_iterator()
    # As `model.fit`'s `verbose`: a bar ("auto", 1), a line now and then (2), nothing (0).
    bar = keras.utils.Progbar(
        steps,
        verbose=1 if config.verbose in ("auto", "1") else 0,
        stateful_metrics=["loss", "accuracy", "reviews/s"],
    )
    bar.update(start)
    began, average = time.perf_counter(), {}
    for step in range(start, steps):
        ids, _ = next(stream)
        rng = np.random.default_rng([config.seed, step])
        corrupted, positions, targets, weights = masked_lm.hide_words(
            ids, rng, predictor.predicted_words, config.mask_rate
        )
        logs = predictor.train_on_batch(
            (corrupted, positions), targets, sample_weight=weights, return_dict=True
        )
        for name, value in logs.items():
            average[name] = 0.96 * average.get(name, float(value)) + 0.04 * float(value)
        done = step + 1 - start
        rate = done * len(ids) / max(time.perf_counter() - began, 1e-9)
        bar.update(step + 1, [*average.items(), ("reviews/s", rate)])
        if config.verbose == "2" and ((step + 1) % 100 == 0 or step + 1 == steps):
            print(
                f"pretraining step {step + 1}/{steps} - "
                + " - ".join(f"{name}: {value:.4f}" for name, value in average.items())
                + f" - {rate:.1f} reviews/s",
                flush=True,
            )
        if (step + 1) % config.save_every == 0:
            state.save()
    return average
