"""Train a sentiment classifier on ScaledDotProductAttention and export it.

Usage:
    python -m apps.train_sentiment --data_dir ../shared/data/tensorflow_datasets   # runs/imdb_sdpa
    python -m apps.train_sentiment --resume            # continue an interrupted run
    python -m apps.train_sentiment --output saved_models/imdb_sdpa   # ship: the committed model
    python -m apps.train_sentiment --epochs 1 --max_steps 20 --output /tmp/smoke
    python -m apps.train_sentiment --strategy mirrored       # every local GPU (or CPU device)
    TF_CONFIG='{...}' python -m apps.train_sentiment --strategy multi_worker

Loads a TFDS text dataset (default `imdb_reviews`), carves a fixed-seed
validation set out of train, trains with `model.fit` (progress bar with reviews/s,
early stopping on `--monitor`, validation accuracy by default, a checkpoint every
epoch and every `--save_every` steps), fits a temperature on the validation set so that
the probabilities are calibrated (folded into the output layer: every export gives the
calibrated probability), reports on the test split once at the end, and writes to `--output`:

    saved_model/         SavedModel; serving_default takes raw strings
    model.keras          the trained Keras model (token ids -> P(positive))
    vocabulary.txt       the TextVectorization vocabulary
    bigrams.txt          the word pairs that have their own embedding, most frequent first
    trigrams.txt         the same for word triples
    metrics.json         what this run measured, with its config and versions
    training_curves.png  loss and accuracy per epoch
    history.csv          the same numbers, one row per epoch
    logs/                TensorBoard
    attention.jsonl      per test review: tokens, label, prediction, weights per head
    attention.html       a self-contained viewer for the same
    attention_heatmaps.png
    faithfulness.json    the deletion tests of apps.faithfulness (and .md, .png)
    calibration.png      the reliability diagram, before and after the temperature
    serving.json         serving_default's reviews/s and latency, measured after the export
    README.md            the model card, written from metrics.json

Ctrl-C or SIGTERM saves the exact training state (weights, optimizer, step);
`--resume` continues from it on the same batches an uninterrupted run would see.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import cli, files  # noqa: E402
from ..classifier import data  # noqa: E402
from ..classifier.perturbation import Perturbation  # noqa: E402
from . import distribute  # noqa: E402
from .batches import eval_dataset  # noqa: E402
from .build import build_model, dtype_policy  # noqa: E402
from .config import Config, check_config, check_same_run  # noqa: E402
from .fit import best_row, fit_model, read_history  # noqa: E402
from .prepare import prepare_data, training_examples  # noqa: E402
from .pretrain import pretrain, without_held_out  # noqa: E402
from .report import report_run  # noqa: E402
from .self_training import pseudo_labelled  # noqa: E402


def parse_args(argv=None):
    return cli.parse_config(
        Config,
        argv,
        prog="python -m apps.train_sentiment",
        description=__doc__.split("\n\n")[0],
        check=check_config,
    )


@dataclasses.dataclass
class Run:
    """Where a training run writes, and how it is distributed (`_start_run`)."""

    strategy: tf.distribute.Strategy
    distribution: dict  # recorded in metrics.json
    global_batch: int
    output: str  # this task's folder (a worker's own, beside the chief's)
    checkpoints: str
    resuming: bool

    @property
    def history(self):
        return os.path.join(self.output, "history.csv")

    @property
    def vocabulary(self):
        return os.path.join(self.output, "vocabulary.txt")

    @property
    def bigrams(self):
        return os.path.join(self.output, "bigrams.txt")

    @property
    def trigrams(self):
        return os.path.join(self.output, "trigrams.txt")

    @property
    def best_weights(self):
        return os.path.join(self.checkpoints, "best.weights.h5")


def train(config, argv=None):
    """The whole run: set up, data, model, fit, then report and export. Returns an exit code.

    `argv`, the flags given, goes to `metrics.json` with the code's git commit, read now:
    the code that trains, whatever changes in the checkout while it does."""
    git_commit = _git_commit(config.output)
    with dtype_policy(config.mixed_precision or "float32"):
        return _train(config, argv, git_commit)


def _train(config, argv, git_commit):
    started = time.time()
    run = _start_run(config)
    splits, vectorizer, train_ids, validation_ids, counted_ids = prepare_data(config, run)
    fit_ids, train_labels = training_examples(config, splits, vectorizer, train_ids)
    held_out, unlabeled = _held_out_and_unlabeled(
        config, splits, vectorizer, train_ids, validation_ids, counted_ids
    )
    self_training = None
    if config.self_training_from:
        unlabeled_ids = counted_ids[len(train_ids) :]  # splits.unlabeled_text's
        pseudo_ids, pseudo_labels, self_training = pseudo_labelled(
            config, splits, vectorizer, unlabeled_ids, held_out, run.global_batch
        )
        fit_ids = np.concatenate([fit_ids, pseudo_ids])
        train_labels = np.concatenate([train_labels, pseudo_labels.astype(train_labels.dtype)])
        self_training["fit_examples"] = len(fit_ids)  # the labelled, the spans, the teacher's
    steps_per_epoch = max(1, len(fit_ids) // run.global_batch)
    if config.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, config.max_steps)
    model, inspector = build_model(
        config, run, vectorizer, train_ids, splits.train_label, counted_ids, steps_per_epoch
    )
    data_seconds = time.time() - started - (self_training["seconds"] if self_training else 0)
    # The texts the vocabularies are counted on: train's, and the unlabelled reviews with
    # `--vocabulary_source train+unsupervised`, less any that read as a validation or test one.
    pretraining = None
    if config.pretrain_steps:
        texts_ids = without_held_out(counted_ids, held_out)
        if len(texts_ids) < len(counted_ids):
            print(
                f"{len(counted_ids) - len(texts_ids)} reviews left out of pretraining: as token "
                "ids they are a validation or test review"
            )
        pretraining = pretrain(config, run, model, texts_ids)
    if pretraining == "interrupted":
        return 130  # the state is saved
    # Smoke runs (`--max_steps`) evaluate the first `max_steps` batches' worth of examples.
    limit = None if config.max_steps is None else config.max_steps * run.global_batch
    validation = eval_dataset(validation_ids, splits.validation_label, run.global_batch, limit)
    fitted = fit_model(
        config, run, model, fit_ids, train_labels, validation, steps_per_epoch, unlabeled
    )
    if fitted is None:
        return 130  # interrupted; the state is saved
    train_seconds, stopped = fitted
    history = read_history(run.history)
    if os.path.exists(run.best_weights):
        model.load_weights(run.best_weights)
    best_epoch = best_row(history, config.monitor)["epoch"] if history else None
    stages = {
        "data": round(data_seconds, 1),
        # A reused encoder costs this run nothing; its record keeps what it cost to make.
        "pretraining": pretraining and (0.0 if pretraining["reused"] else pretraining["seconds"]),
        "fine_tuning": round(train_seconds, 1),
    }
    if self_training:
        stages["self_training_labels"] = self_training["seconds"]
    return report_run(
        config,
        run.output,
        model,
        inspector,
        vectorizer,
        splits,
        history,
        best_epoch,
        train_seconds,
        stopped,
        validation,
        run.distribution,
        argv,
        git_commit,
        records={"pretraining": pretraining, "self_training": self_training},
        stages=stages,
    )


def _held_out_and_unlabeled(config, splits, vectorizer, train_ids, validation_ids, counted_ids):
    """The validation and test reviews as token ids, never read unlabelled (None where no
    stage reads unlabelled reviews), and the unlabelled ones the perturbation losses read, less
    any that reads as a held-out one (None where no loss reads them)."""
    reads_unlabeled = Perturbation.from_flags(dataclasses.asdict(config)).reads_unlabeled
    if not (config.pretrain_steps or config.self_training_from or reads_unlabeled):
        return None, None
    held_out = np.concatenate([validation_ids, data.vectorize(vectorizer, splits.test_text)])
    if not reads_unlabeled:
        return held_out, None
    return held_out, without_held_out(counted_ids[len(train_ids) :], held_out)


def _start_run(config):
    """The strategy, the output folder, and whether this run resumes an interrupted one."""
    strategy = distribute.make_strategy(config.strategy, config.logical_cpus)  # before any TF op
    replicas = strategy.num_replicas_in_sync
    global_batch = config.batch_size * replicas
    task_type, task_id, chief = distribute.worker(strategy)
    output = os.path.abspath(config.output)
    if not chief:
        # Every worker runs the whole program (evaluation and export are collective too);
        # only the chief's files are the run's. The others write beside it, as Keras does.
        output = os.path.join(output, f"workertemp_{task_id}")
    distribution = {
        "strategy": type(strategy).__name__,
        "replicas": replicas,
        "replica_devices": distribute.replica_devices(strategy),
        "batch_size_per_replica": config.batch_size,
        "global_batch_size": global_batch,
        "task": f"{task_type}:{task_id}",
        "chief": chief,
    }
    print(
        f"Strategy {distribution['strategy']}: {replicas} replica(s) on "
        f"{', '.join(distribution['replica_devices'])}; global batch {global_batch} "
        f"({config.batch_size} per replica); task {distribution['task']}"
        + ("" if chief else f", writing to {output}")
    )
    checkpoints = os.path.join(output, "checkpoints")
    states = [os.path.join(checkpoints, *stage, "state.json") for stage in ((), ("pretrain",))]
    config_path = os.path.join(checkpoints, "config.json")
    resuming = False
    if any(os.path.exists(state) for state in states):
        if not config.resume:
            raise ValueError(
                f"`--output` holds an interrupted run ({checkpoints}). Pass --resume to continue "
                f"it, or remove that folder to start over. Received: output={config.output!r}"
            )
        check_same_run(config, config_path)
        resuming = True
    elif config.resume:
        print(f"Nothing to resume in {checkpoints}; starting a new run.")
    run = Run(strategy, distribution, global_batch, output, checkpoints, resuming)
    if not resuming:
        # A model card's seeds (`python -m apps.sweep NAME --card`) were another run's.
        for stale in (
            run.history,
            os.path.join(output, "logs"),
            os.path.join(output, "seeds.json"),
        ):
            if os.path.isdir(stale):
                shutil.rmtree(stale)
            elif os.path.exists(stale):
                os.remove(stale)
    os.makedirs(checkpoints, exist_ok=True)
    files.write_json_atomic(config_path, dataclasses.asdict(config))
    return run


def _git_commit(output=None):
    """The checkout's commit, with `+changes` if its tracked files differ; None outside git.

    The run's own `output` folder and the sweep's table (`python -m apps.sweep` rewrites it
    after its runs, so the next sweep's runs would find it changed) are left out of the
    comparison: those files change with the runs, not with the code that trained them."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return None  # installed from a wheel: no checkout of this project here
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        excluded = [".", ":(exclude)saved_models/experiments/seeds/README.md"]
        output = None if output is None else os.path.abspath(output)
        if output is not None and output.startswith(root + os.sep):  # git refuses paths outside
            excluded.append(f":(exclude){os.path.relpath(output, root)}")
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *excluded],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv=None):
    try:
        config = parse_args(argv)
        return train(config, argv=sys.argv[1:] if argv is None else list(argv))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
