"""The training app under tf.distribute, on this machine: no GPU, loopback only.

`mirrored` runs on the CPU split into two logical devices; `multi_worker` runs as two
worker processes on 127.0.0.1 that find each other through TF_CONFIG. Each run is a
fresh process: TensorFlow fixes its devices and its cluster when it starts.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from apps.training import distribute
from apps.training import train as train_sentiment

# Whole app runs, two of them in two processes: the large tier. Under pytest-xdist, the tests
# that use this module's module fixtures share one worker (tests/conftest.py).
LARGE = pytest.mark.large

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 2 epochs of 6 steps of 2 x 16 reviews, at a learning rate that moves the loss visibly.
RUN = [
    "--epochs",
    "2",
    "--max_steps",
    "6",
    "--batch_size",
    "16",
    "--sequence_length",
    "48",
    "--vocab_size",
    "3000",
    "--embed_dim",
    "16",
    "--key_dim",
    "8",
    "--ff_dim",
    "32",
    "--bigram_vocab_size",
    "20000",
    "--trigram_vocab_size",
    "5000",
    "--vocabulary_source",
    "train",
    "--monitor",
    "val_loss",  # a loss picks the epoch the same way on close runs; accuracy ties
    # The block's output pooled: in 12 steps of 32 reviews its training loss falls visibly
    # (0.714 -> 0.695); pooling the embeddings, the default, has not moved yet (0.690 -> 0.696).
    "--pooling_values",
    "block",
    "--learning_rate",
    "3e-3",
    "--inspect_examples",
    "4",
    "--verbose",
    "2",
    "--patience",
    "2",  # both epochs always run: a 12-step validation loss is noise
    "--faithfulness_examples",
    "16",
    "--dropout",
    "0",  # replicas draw their own dropout masks: without it, 2 x 16 == 1 x 32
    "--pretrain_batch_size",
    "32",
    "--predicted_words",
    "1000",  # 6 steps of the same reviews
]
TIMEOUT = 600
# For the runs of which only the training is compared: no attention export, no deletion tests.
TRAINING_ONLY = ["--inspect_examples", "0", "--faithfulness_examples", "0"]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _app(*args):
    return [sys.executable, "-m", "apps.train_sentiment", *RUN, *args]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _metrics(output):
    with open(os.path.join(output, "metrics.json")) as f:
        return json.load(f)


def _weights(output):
    model = keras.saving.load_model(os.path.join(output, "model.keras"))
    return model.get_weights()


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    output = str(tmp_path_factory.mktemp("mirrored") / "run")
    result = subprocess.run(
        _app("--strategy", "mirrored", "--logical_cpus", "2", "--output", output),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return output, result.stdout


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The same run on one device at the same global batch, 32."""
    output = str(tmp_path_factory.mktemp("one_device") / "run")
    args = _app("--output", output, *TRAINING_ONLY)
    args[args.index("--batch_size") + 1] = "32"
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return output


@LARGE
def test_two_replicas_split_the_batch_one_device_would_see(mirrored, one_device):
    """2 replicas x 16 reviews train the model 1 device x 32 trains: the same batches, split,
    not repeated, and the gradients summed as one. Same weights, same losses."""
    two, one = _metrics(mirrored[0]), _metrics(one_device)
    assert two["distribution"]["global_batch_size"] == one["distribution"]["global_batch_size"]
    for row, want in zip(two["history"], one["history"], strict=True):
        for key in ("loss", "val_loss", "accuracy", "val_accuracy"):
            assert row[key] == pytest.approx(want[key], abs=2e-4), (key, row, want)
    for a, b in zip(_weights(mirrored[0]), _weights(one_device), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-3)


@LARGE
def test_mirrored_trains_on_both_replicas(mirrored):
    output, stdout = mirrored
    metrics = _metrics(output)
    distribution = metrics["distribution"]
    assert distribution["strategy"] == "MirroredStrategy" and distribution["replicas"] == 2
    # Both logical CPUs ran a step of their own.
    assert [d.rsplit("/", 1)[-1] for d in distribution["replica_devices"]] == [
        "device:CPU:0",
        "device:CPU:1",
    ]
    assert distribution["global_batch_size"] == 32 and "global batch 32 (16 per replica)" in stdout
    # 6 steps per epoch of the global batch: the data was split, not repeated per replica.
    # (train_steps is the optimizer's count in the best epoch's restored state.)
    assert metrics["epochs_run"] == 2 and metrics["train_steps"] == 6 * metrics["best_epoch"]
    assert metrics["test_examples"] == 6 * 32
    history = metrics["history"]
    assert len(history) == 2 and history[1]["loss"] < history[0]["loss"]


@LARGE
def test_mirrored_model_exports_and_serves_raw_text(mirrored):
    output, _ = mirrored
    texts = ["A wonderful film.", "Dull and far too long."]
    # What the Keras model the run saved predicts for the same texts, in this process.
    metrics = _metrics(output)
    from apps.classifier import data

    vectorizer = data.make_vectorizer(
        metrics["config"]["vocab_size"],
        metrics["config"]["sequence_length"],
        vocabulary=os.path.join(output, "vocabulary.txt"),
    )
    model = keras.saving.load_model(os.path.join(output, "model.keras"))
    expected = model.predict(vectorizer(tf.constant(texts)), verbose=0)[:, 0]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from apps import predict; code = predict.main(sys.argv[1:]); "
            "assert 'keras_sdpa' not in sys.modules; sys.exit(code)",
            "--model",
            output,
            "--json",
            "A wonderful film.",
            "Dull and far too long.",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == 2
    np.testing.assert_allclose([a["probability"] for a in answers], expected, atol=1e-5)


@LARGE
def test_multi_worker_on_loopback_ends_with_identical_weights(mirrored, tmp_path):
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    output = str(tmp_path / "run")
    workers = []
    try:
        for index in range(2):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            workers.append(
                subprocess.Popen(
                    _app("--strategy", "multi_worker", "--output", output, *TRAINING_ONLY),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=_env(TF_CONFIG=tf_config),
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
        logs = [worker.communicate(timeout=TIMEOUT) for worker in workers]
    finally:
        for worker in workers:  # also on a timeout or a failed assertion: no stray workers
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    for worker, (stdout, stderr) in zip(workers, logs):
        assert worker.returncode == 0, stdout[-2000:] + stderr[-4000:]

    chief_output = output
    other_output = os.path.join(output, "workertemp_1")
    chief, other = _metrics(chief_output), _metrics(other_output)
    for metrics, task in ((chief, "worker:0"), (other, "worker:1")):
        distribution = metrics["distribution"]
        assert distribution["replicas"] == 2 and distribution["task"] == task
        assert distribution["global_batch_size"] == 32
        assert metrics["epochs_run"] == 2
        assert metrics["train_steps"] == 6 * metrics["best_epoch"]
    assert chief["distribution"]["chief"] and not other["distribution"]["chief"]
    for a, b in zip(_weights(chief_output), _weights(other_output), strict=True):
        np.testing.assert_array_equal(a, b)
    assert chief["history"] == other["history"]
    # Two workers of one replica each compute what two local replicas do.
    mirrored_history = _metrics(mirrored[0])["history"]
    for row, want in zip(chief["history"], mirrored_history, strict=True):
        assert row["val_loss"] == pytest.approx(want["val_loss"], abs=1e-4)


def test_bad_strategy_flags(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        train_sentiment.parse_args(["--strategy", "tpu"])
    assert exit_info.value.code == 2
    assert "`--strategy` must be one of default, mirrored, multi_worker" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_sentiment.parse_args(["--logical_cpus", "0"])
    assert "logical_cpus=0" in capsys.readouterr().err
    # --logical_cpus once TensorFlow has set up its devices.
    tf.config.list_logical_devices("CPU")
    with pytest.raises(ValueError, match=r"`--logical_cpus` must be set before TensorFlow starts"):
        distribute.make_strategy("default", logical_cpus=2)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="reads the cluster from the TF_CONFIG"):
        distribute.make_strategy("multi_worker")
