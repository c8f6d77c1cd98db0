"""Fitting: `model.fit` with exact resume (the training state, its callbacks), early stopping,
and Ctrl-C or SIGTERM handled."""

import contextlib
import csv
import json
import os
import signal
import sys
import time

import keras
import numpy as np

from .. import files
from . import distribute
from .batches import training_stream, with_unlabeled
from .config import MONITORS, better


class TrainingState(keras.callbacks.Callback):
    """Saves the exact training state: weights with optimizer state, hence the step.

    The step is the optimizer's own `iterations`, updated inside the train step,
    so it can never disagree with the weights saved next to it. Saves are atomic
    (write, then rename), every `save_every` steps, at every epoch end, and on
    interruption.
    """

    def __init__(self, directory, save_every, seconds_before=0.0):
        super().__init__()
        self.directory = directory
        self.save_every = save_every
        self.seconds_before = seconds_before
        self.weights_path = os.path.join(directory, "state.weights.h5")
        self.json_path = os.path.join(directory, "state.json")
        self.seeds_path = os.path.join(directory, "state.seeds.npz")
        self.started = time.time()

    def restore(self):
        self.model.load_weights(self.weights_path)
        with np.load(self.seeds_path) as saved:
            for variable, key in zip(_seed_states(self.model), saved.files):
                variable.assign(saved[key])
        with open(self.json_path) as f:
            self.seconds_before = json.load(f)["train_seconds"]

    def seconds(self):
        return self.seconds_before + time.time() - self.started

    def on_train_batch_end(self, batch, logs=None):
        if optimizer_step(self.model) % self.save_every == 0:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.save()

    def save(self):
        with _interrupts_deferred():  # a Ctrl-C mid-write would leave the file open
            self._save()

    def _save(self):
        os.makedirs(self.directory, exist_ok=True)
        temporary = self.weights_path + ".partial.weights.h5"
        self.model.save_weights(temporary)
        os.replace(temporary, self.weights_path)
        # The dropout seed generators' states are variables that `save_weights` leaves out;
        # without them a resumed run would draw different dropout masks.
        temporary = self.seeds_path + ".partial.npz"
        np.savez(temporary, *[v.numpy() for v in _seed_states(self.model)])
        os.replace(temporary, self.seeds_path)
        step = optimizer_step(self.model)
        files.write_json_atomic(self.json_path, {"step": step, "train_seconds": self.seconds()})


class AverageSwapped(keras.callbacks.SwapEMAWeights):
    """Keras's `SwapEMAWeights(swap_on_epoch=True)` for a run of `epochs` that may take more
    than one `fit`: validation, and the callbacks after this one at an epoch's end (the kept
    epoch's checkpoint), read the weights' moving average; the steps train the weights.

    After the last epoch of a `fit` (or the one early stopping ends it on; the early stopping
    callback must come before this one), the average is copied into its own slots too, so that
    the `finalize_variable_values` Keras's `fit` ends with leaves it in the model. The trained
    weights are then only in the state the `TrainingState` before this callback saved at that
    epoch's end: a resumed run's first `fit`, which ends inside the run, reloads them, and so
    does an interruption from then on. The swaps hold Ctrl-C and SIGTERM until they are done."""

    def __init__(self, state, epochs):
        super().__init__(swap_on_epoch=True)
        self.state = state
        self.epochs = epochs
        self.average_only = False  # the trained weights only in the saved state

    def on_epoch_begin(self, epoch, logs=None):
        with _interrupts_deferred():
            super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        with _interrupts_deferred():
            super().on_epoch_end(epoch, logs)  # copies the average after the fit's last epoch
            last = epoch == self.params["epochs"] - 1
            if self.model.stop_training and not last:
                self._finalize_ema_values()
            self.average_only = last or self.model.stop_training

    def on_test_begin(self, logs=None):
        with _interrupts_deferred():
            super().on_test_begin(logs)

    def on_test_end(self, logs=None):
        with _interrupts_deferred():
            super().on_test_end(logs)

    def on_train_end(self, logs=None):
        if self.params["epochs"] < self.epochs and not self.model.stop_training:
            self.trained_weights_back()

    def trained_weights_back(self):
        """Puts the trained weights back in the model where the average is (an interruption
        during validation or after an epoch's end), so that the training state saves them."""
        with _interrupts_deferred():
            if self.average_only:
                self.model.load_weights(self.state.weights_path)
            elif self._ema_weights_in_model:
                self._swap_variables()
            self._ema_weights_in_model = False
            self.average_only = False


class ReviewsPerSecond(keras.callbacks.Callback):
    """Puts `reviews/s` in the progress bar: the reviews trained on since the epoch began over
    the wall time since then, input pipeline and callbacks included. (Keras's bar shows a
    logged value as it is, not averaged, so a per-step rate would jump with each batch's
    length bucket.)"""

    def __init__(self, global_batch):
        super().__init__()
        self.global_batch = global_batch
        self.started = None
        self.reviews = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()
        self.reviews = 0

    def on_train_batch_end(self, batch, logs=None):
        if self.started is None:  # called outside `fit`'s epochs
            self.on_epoch_begin(None)
        self.reviews += self.global_batch
        if logs is not None:
            logs["reviews/s"] = self.reviews / max(time.perf_counter() - self.started, 1e-9)


def optimizer_step(model):
    """The optimizer's step count (`.numpy()`: under a strategy it is a mirrored variable)."""
    return int(model.optimizer.iterations.numpy())


def _seed_states(model):
    """The state variables of every `keras.random.SeedGenerator` in the model, in order."""
    return [v for v in model.variables if v.name == "seed_generator_state"]


class ResumableEarlyStopping(keras.callbacks.EarlyStopping):
    """`EarlyStopping` on `monitor` that replays the epochs in `history.csv` first.

    Keras's callback starts counting afresh in every `fit`; replaying the logged
    epochs makes a resumed run stop exactly where an uninterrupted one would.
    """

    def __init__(self, history_path, monitor="val_loss", **kwargs):
        super().__init__(monitor=monitor, mode=MONITORS[monitor], **kwargs)
        self.history_path = history_path

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        for row in read_history(self.history_path):
            self.wait += 1
            if better(row[self.monitor], self.best, self.monitor):
                self.best, self.best_epoch, self.wait = row[self.monitor], row["epoch"], 0


def read_history(path):
    """Rows of `history.csv` (one per epoch; the last row wins if an epoch was logged twice)."""
    if not os.path.exists(path):
        return []
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            rows[int(row["epoch"])] = {
                k: (int(v) if k == "epoch" else float(v)) for k, v in row.items()
            }
    return [rows[epoch] for epoch in sorted(rows)]


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interrupts_raised():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block. (SIGINT too: a process
    started in the background by a shell inherits SIGINT ignored.)"""
    previous = {
        number: signal.signal(number, _raise_keyboard_interrupt)
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def _interrupts_deferred():
    """Holds SIGINT and SIGTERM until the block is done, then raises KeyboardInterrupt."""
    received = []
    previous = {
        number: signal.signal(number, lambda signum, frame: received.append(signum))
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if received:
        raise KeyboardInterrupt(f"signal {received[0]}")


def fit_model(
    config, run, model, train_ids, train_labels, validation, steps_per_epoch, unlabeled_ids=None
):
    """`model.fit` from where the run stands, with checkpoints, early stopping and a saved
    state on Ctrl-C or SIGTERM; with `unlabeled_ids` `(n, L)`, a batch of them beside each
    training batch (`with_unlabeled`). Returns `(train_seconds, stopped_early)`, or None if
    interrupted."""
    distribute.fix_keras_for_multi_worker(model, run.strategy)
    state = TrainingState(run.checkpoints, config.save_every)
    state.set_model(model)  # fit sets it too; restore() and an early Ctrl-C need it before
    if run.resuming and os.path.exists(state.json_path):  # not if pretraining was interrupted
        state.restore()

    step = optimizer_step(model)
    first_epoch, done_in_epoch = divmod(step, steps_per_epoch)
    history = read_history(run.history)
    if run.resuming:
        print(f"Resuming at epoch {first_epoch + 1}, step {step} ({done_in_epoch} into the epoch)")

    callbacks, early_stopping = _callbacks(config, run, state, history)
    stopped = _stopped_early(history, config.patience, config.monitor)

    def stream(start_step):
        """The training batches from batch `start_step` on."""
        batches = training_stream(
            train_ids, train_labels, run.global_batch, config.seed, start_step=start_step
        )
        if unlabeled_ids is None:
            return batches
        return with_unlabeled(batches, unlabeled_ids, run.global_batch, config.seed, start_step)

    try:
        with interrupts_raised():
            _fit_segments(
                config,
                run,
                model,
                stream,
                validation,
                steps_per_epoch,
                callbacks,
                early_stopping,
                stopped,
            )
    except KeyboardInterrupt:
        for callback in callbacks:
            if isinstance(callback, AverageSwapped):
                callback.trained_weights_back()
        state.save()
        print(
            f"\nInterrupted at step {optimizer_step(model)}. "
            f"Training state saved to {run.checkpoints}.\n"
            f"Continue with: python -m apps.train_sentiment --resume --output {config.output}",
            file=sys.stderr,
        )
        return None
    return state.seconds(), stopped


def _fit_segments(
    config,
    run,
    model,
    stream,
    validation,
    steps_per_epoch,
    callbacks,
    early_stopping,
    stopped,
):
    """`model.fit` over what is left of the run's epochs (`_segments`), unless stopped early;
    `stream(start_step)` gives the training batches from a step on."""
    # Multi-worker Keras finds its strategy in the scope (see apps/training/distribute.py);
    # evaluation and export then run on each worker alone, with the same weights.
    multi_worker = distribute.is_multi_worker(run.strategy)
    step = optimizer_step(model)
    for initial_epoch, epochs, steps in _segments(step, steps_per_epoch, config.epochs):
        if stopped:
            break
        fitting = run.strategy.scope() if multi_worker else contextlib.nullcontext()
        with fitting:
            model.fit(
                stream(optimizer_step(model)),
                initial_epoch=initial_epoch,
                epochs=epochs,
                steps_per_epoch=steps,
                validation_data=validation,
                callbacks=callbacks,
                shuffle=False,  # the stream is already shuffled, deterministically
                verbose=int(config.verbose) if config.verbose.isdigit() else config.verbose,
            )
        stopped = early_stopping.stopped_epoch > 0


def _callbacks(config, run, state, history):
    """`fit`'s callbacks, the early stopping among them, picking up the logged `history`."""
    best_so_far = best_row(history, config.monitor)[config.monitor] if history else None
    early_stopping = ResumableEarlyStopping(
        run.history, monitor=config.monitor, patience=config.patience, verbose=1
    )
    # At an epoch's end: early stopping (it only reads the logs) before the weights' average,
    # which copies the average when training stops; the state before the average swaps in.
    callbacks = [
        ReviewsPerSecond(run.global_batch),
        early_stopping,
        state,
        *([AverageSwapped(state, config.epochs)] if config.ema_momentum is not None else []),
        keras.callbacks.CSVLogger(run.history, append=True),
        keras.callbacks.TensorBoard(os.path.join(run.output, "logs")),
        keras.callbacks.ModelCheckpoint(
            run.best_weights,
            monitor=config.monitor,
            mode=MONITORS[config.monitor],
            save_best_only=True,
            save_weights_only=True,
            initial_value_threshold=best_so_far,
        ),
    ]
    return callbacks, early_stopping


def _segments(step, steps_per_epoch, epochs):
    """`(initial_epoch, epochs, steps_per_epoch)` of each `fit` call from `step` on: an
    interrupted epoch first finishes its remaining steps, then whole epochs follow."""
    first_epoch, done_in_epoch = divmod(step, steps_per_epoch)
    segments = []
    if done_in_epoch:
        segments.append((first_epoch, first_epoch + 1, steps_per_epoch - done_in_epoch))
        first_epoch += 1
    if first_epoch < epochs:
        segments.append((first_epoch, epochs, steps_per_epoch))
    return segments


def best_row(history, monitor):
    """The first epoch's row with the best `monitor` (as Keras's callbacks keep it)."""
    best = None
    for row in history:
        if best is None or better(row[monitor], best[monitor], monitor):
            best = row
    return best


def _stopped_early(history, patience, monitor="val_loss"):
    """Whether the logged epochs already ran out of patience (a finished, stopped run)."""
    best, wait = None, 0
    for row in history:
        wait += 1
        if better(row[monitor], best, monitor):
            best, wait = row[monitor], 0
        elif wait >= patience and row["epoch"] > 0:
            return True
    return False
