"""The weights' moving average (`--ema_momentum`): Keras's EMA, checked against the recurrence in
NumPy, read by validation and the kept epoch's checkpoint, and the same when a resumed run
takes two `fit`s."""

import types

import keras
import numpy as np
import pytest

from apps.classifier.optimizer import Adam
from apps.training import fit as train_fit
from apps.training.config import Config, check_config

MOMENTUM = 0.6
STEPS_PER_EPOCH = 4


class _Steps(keras.callbacks.Callback):
    """The trained weights after every step."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer=Adam(0.05, use_ema=True, ema_momentum=MOMENTUM),
        loss="binary_crossentropy",
        jit_compile=False,
    )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * STEPS_PER_EPOCH, 3)).astype("float32")
    return x, (x[:, 0] > 0).astype("float32")


class _StopAfter(keras.callbacks.Callback):
    """Early stopping at the end of epoch `epoch`."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = epoch == self.epoch


def _fit(tmp_path, segments, new_process=False, stop_after=None):
    """Fits a new model over `segments`, `[(initial_epoch, epochs)]`, one `fit` each, as a
    resumed run does, with the app's callbacks in the app's order (a new model restored from
    the training state for each segment after the first with `new_process`). Returns the
    model, the steps, the validation losses, the checkpoint of the last epoch and the swap."""
    model = _model()
    state = train_fit.TrainingState(str(tmp_path / "state"), save_every=1000)
    steps = _Steps()
    checkpoint = str(tmp_path / "last.weights.h5")
    x, y = _data()
    losses = []
    for index, (initial_epoch, epochs) in enumerate(segments):
        if new_process and index:
            model = _model()
            model.optimizer.build(model.trainable_variables)  # as apps.training.build does
            state.set_model(model)
            state.restore()
        state.set_model(model)
        swap = train_fit.AverageSwapped(state, epochs=segments[-1][1])
        callbacks = [
            steps,
            *([] if stop_after is None else [_StopAfter(stop_after)]),
            state,
            swap,
            keras.callbacks.ModelCheckpoint(checkpoint, monitor="loss", save_weights_only=True),
        ]
        history = model.fit(
            x,
            y,
            batch_size=8,
            initial_epoch=initial_epoch,
            epochs=epochs,
            validation_data=(x, y),
            callbacks=callbacks,
            shuffle=False,
            verbose=0,
        )
        losses += history.history["val_loss"]
    return model, steps.weights, losses, checkpoint, swap


def _average(steps):
    """Keras's EMA: the first step's weights, then `m * average + (1 - m) * weights`."""
    average = steps[0]
    for weights in steps[1:]:
        average = [MOMENTUM * a + (1 - MOMENTUM) * w for a, w in zip(average, weights)]
    return average


def _loss(weights):
    model = _model()
    model.set_weights(weights)
    x, y = _data()
    return model.evaluate(x, y, batch_size=8, verbose=0)


def test_validation_and_the_checkpoint_read_the_average_and_the_steps_train_the_weights(
    tmp_path,
):
    model, steps, losses, checkpoint, _ = _fit(tmp_path, [(0, 2)])
    assert len(steps) == 2 * STEPS_PER_EPOCH
    for epoch in range(2):
        average = _average(steps[: (epoch + 1) * STEPS_PER_EPOCH])
        np.testing.assert_allclose(losses[epoch], _loss(average), rtol=1e-5)
    expected = _average(steps)
    for ours, theirs in zip(model.get_weights(), expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    kept = _model()
    kept.load_weights(checkpoint)
    for ours, theirs in zip(kept.get_weights(), expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    # The training state holds the trained weights, not their average: a resumed run goes on
    # from them.
    state = _model()
    state.load_weights(str(tmp_path / "state" / "state.weights.h5"))
    for ours, theirs in zip(state.get_weights(), steps[-1]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize("new_process", [False, True])
def test_a_resumed_run_in_two_fits_trains_and_averages_as_one_fit(tmp_path, new_process):
    one, steps_one, losses_one, *_ = _fit(tmp_path / "one", [(0, 2)])
    two, steps_two, losses_two, *_ = _fit(tmp_path / "two", [(0, 1), (1, 2)], new_process)
    for step_one, step_two in zip(steps_one, steps_two, strict=True):
        for a, b in zip(step_one, step_two):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(losses_one, losses_two, rtol=1e-6)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_early_stopping_leaves_the_average_in_the_model(tmp_path):
    model, steps, *_ = _fit(tmp_path, [(0, 3)], stop_after=0)
    assert len(steps) == STEPS_PER_EPOCH
    for ours, theirs in zip(model.get_weights(), _average(steps)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_an_interruption_after_the_last_epoch_saves_the_trained_weights(tmp_path):
    """Once `fit`'s last epoch has copied the average into its slots, an interruption (the
    app's `trained_weights_back`, then the state saved) gives back the trained weights."""
    model, steps, _, _, swap = _fit(tmp_path, [(0, 2)])
    swap.trained_weights_back()
    for ours, theirs in zip(model.get_weights(), steps[-1]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_the_app_saves_the_training_state_before_the_average_swaps_in(tmp_path):
    """The app's callbacks: the state (trained weights) at an epoch's end, then the swap, then
    the callbacks that read the average (the kept epoch's checkpoint among them)."""
    run = types.SimpleNamespace(
        global_batch=8,
        history=str(tmp_path / "history.csv"),
        output=str(tmp_path),
        best_weights=str(tmp_path / "best.weights.h5"),
    )
    state = train_fit.TrainingState(str(tmp_path / "state"), save_every=10)
    for momentum in (None, 0.99):
        config = Config(ema_momentum=momentum)
        callbacks, _ = train_fit._callbacks(config, run, state, [])
        kinds = [type(callback) for callback in callbacks]
        if momentum is None:
            assert train_fit.AverageSwapped not in kinds
            continue
        swap = kinds.index(train_fit.AverageSwapped)
        assert kinds[swap - 1] is train_fit.TrainingState
        assert kinds.index(train_fit.ResumableEarlyStopping) < swap
        assert kinds.index(keras.callbacks.ModelCheckpoint) > swap


@pytest.mark.parametrize("momentum", [0.0, 1.0, -0.5, 1.5])
def test_ema_momentum_out_of_range_is_refused_by_name(momentum):
    with pytest.raises(ValueError, match=rf"`--ema_momentum` must be in \(0, 1\).*{momentum}"):
        check_config(Config(ema_momentum=momentum))
