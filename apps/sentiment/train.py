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

import contextlib
import csv
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import cli  # noqa: E402
from ..inspection import explain, faithfulness  # noqa: E402
from ..serving import export  # noqa: E402
from . import buckets, calibration, data, distribute, short_reviews  # noqa: E402
from . import model as model_lib  # noqa: E402


@dataclasses.dataclass
class Config:
    # data
    dataset: str = "imdb_reviews"  # any TFDS text dataset with (text, label)
    data_dir: str | None = None  # TFDS folder; else $TFDS_DATA_DIR; else TFDS's default
    validation_fraction: float = 0.1  # of train, fixed-seed; the test split is for the report only
    vocab_size: int = 30000  # TextVectorization max_tokens
    sequence_length: int = 512  # tokens kept per review (TextVectorization output_sequence_length)
    bigram_vocab_size: int = 200000  # most frequent word pairs embedded; 0 = words only
    trigram_vocab_size: int = 200000  # most frequent word triples embedded; 0 = none
    # width of the pair and triple tables, projected to embed_dim; None = embed_dim itself
    ngram_dim: int | None = 16
    # where the word, pair and triple vocabularies are counted: train, or train+unsupervised
    # (TFDS's unlabelled split: IMDB's 50,000 reviews without a label; never the test split)
    vocabulary_source: str = "train+unsupervised"
    # > 0: each position adds its word's (and pair's, triple's) naive-Bayes log-count ratio,
    # counted on the training labels with this additive smoothing; 0 = none
    naive_bayes_alpha: float = 0.0
    naive_bayes_folds: int = 5  # cross-fitted: a review reads ratios counted on other folds
    # this fraction of the training reviews also trains as a span of 1 to 3 of its sentences,
    # with the review's label (people type short reviews); 0 = whole reviews only
    short_spans: float = 0.0
    # model
    embed_dim: int = 64  # E
    num_heads: int = 2  # N, in the blocks and in the pooling
    key_dim: int = 32  # H
    ff_dim: int = 128  # feed-forward width in each block
    num_layers: int = 1  # self-attention blocks
    pooling_scale: float | None = None  # the pooling attention's logit scale; None = 1/sqrt(H)
    # what the pooling sums, weighed by its attention over the last block's output: that
    # output (block), or each position's own embedding (embedding)
    pooling_values: str = "embedding"
    dropout: float = 0.4
    # training
    # Keras's dtype policy for the run: mixed_bfloat16 or mixed_float16 (loss-scaled), with the
    # classifier's output and the variables in float32; None = float32 throughout
    mixed_precision: str | None = None
    batch_size: int = 64
    epochs: int = 2  # the learning rate decays to 0 at the end of the last one
    learning_rate: float = 1e-3  # Adam, with cosine decay to 0 over the epochs
    weight_decay: float = 0.5  # decoupled (AdamW), times the learning rate; 0 = plain Adam
    monitor: str = "val_accuracy"  # early stopping and the kept epoch: val_loss or val_accuracy
    patience: int = 3  # epochs without a better `monitor` before training stops
    seed: int = 0
    max_steps: int | None = None  # smoke runs: cap steps per epoch and evaluation batches
    save_every: int = 50  # steps between training-state saves (also at every epoch end)
    verbose: str = "auto"  # model.fit's progress bar
    # distribution (tf.distribute); --batch_size is per replica, the global batch is N times it
    strategy: str = (
        "default"  # default (one device) | mirrored (local GPUs, else CPUs) | multi_worker
    )
    logical_cpus: int | None = None  # split the CPU into N devices first (mirrored without GPUs)
    # output
    # a new run folder (git ignores runs/); `--output saved_models/imdb_sdpa` ships the run
    # over the committed model, which the tests and the documentation read
    output: str = "runs/imdb_sdpa"
    inspect_examples: int = 50  # test reviews exported for attention inspection
    faithfulness_examples: int = 200  # test reviews for the deletion tests at the end; 0 = none
    resume: bool = False


# Flags that shape the data, the model or the step sequence; a resumed run must match them.
_RUN_DEFINING = (
    "dataset", "validation_fraction", "vocab_size", "sequence_length", "bigram_vocab_size",
    "trigram_vocab_size", "naive_bayes_alpha", "naive_bayes_folds", "vocabulary_source",
    "embed_dim", "num_heads", "key_dim", "ff_dim", "num_layers", "dropout", "batch_size",
    "learning_rate", "weight_decay", "seed", "max_steps", "epochs", "strategy", "logical_cpus",
    "monitor", "mixed_precision", "pooling_scale", "pooling_values", "ngram_dim", "short_spans",
)  # fmt: skip

# A run recorded before one of these flags existed did what the flag's first default does:
# each flag came in with the behaviour of its day as its default (resumed runs' configs and
# the sweep's recorded runs are read with them).
FIRST_DEFAULTS = {
    "trigram_vocab_size": 0, "ngram_dim": None, "vocabulary_source": "train",
    "naive_bayes_alpha": 0.0, "pooling_scale": None, "pooling_values": "block",
    "mixed_precision": None, "weight_decay": 0.0, "short_spans": 0.0,
}  # fmt: skip

STRATEGIES = ("default", "mirrored", "multi_worker")
VOCABULARY_SOURCES = ("train", "train+unsupervised")
MIXED_PRECISION = ("mixed_bfloat16", "mixed_float16")
MONITORS = {"val_loss": "min", "val_accuracy": "max"}  # the quantity and its better direction


def _check_choice(config, name, choices, alternative=""):
    """A `ValueError` naming `--name` and its value unless the value is one of `choices`."""
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(
            f"`--{name}` must be one of {', '.join(choices)}{alternative}. "
            f"Received: {name}={value!r}"
        )


def _better(value, best, monitor):
    """Whether `value` of `monitor` beats `best` (None: nothing to beat yet)."""
    if best is None:
        return True
    return value < best if MONITORS[monitor] == "min" else value > best


def parse_args(argv=None):
    return cli.parse_config(
        Config,
        argv,
        prog="python -m apps.train_sentiment",
        description=__doc__.split("\n\n")[0],
        check=_check_config,
    )


def _check_config(config):
    positive = (
        "vocab_size", "sequence_length", "embed_dim", "num_heads", "key_dim", "ff_dim",
        "num_layers", "batch_size", "epochs", "patience", "save_every", "naive_bayes_folds",
    )  # fmt: skip
    for name in positive:
        if getattr(config, name) <= 0:
            raise ValueError(
                f"`--{name}` must be positive. Received: {name}={getattr(config, name)}"
            )
    for name in ("max_steps", "ngram_dim"):  # positive, or left out
        if getattr(config, name) is not None and getattr(config, name) <= 0:
            raise ValueError(
                f"`--{name}` must be positive. Received: {name}={getattr(config, name)}"
            )
    if config.vocab_size < 3:
        raise ValueError(
            f"`--vocab_size` must be at least 3. Received: vocab_size={config.vocab_size}"
        )
    if config.bigram_vocab_size < 0:
        raise ValueError(
            "`--bigram_vocab_size` must be >= 0 (0 turns word pairs off). "
            f"Received: bigram_vocab_size={config.bigram_vocab_size}"
        )
    _check_choice(config, "monitor", MONITORS)
    if config.trigram_vocab_size < 0:
        raise ValueError(
            "`--trigram_vocab_size` must be >= 0 (0 turns word triples off). "
            f"Received: trigram_vocab_size={config.trigram_vocab_size}"
        )
    _check_choice(config, "strategy", STRATEGIES)
    if not 0.0 <= config.short_spans <= 1.0:
        raise ValueError(
            f"`--short_spans` must be in [0, 1]. Received: short_spans={config.short_spans}"
        )
    if config.short_spans and config.naive_bayes_alpha:
        # The ratios are cross-fitted by a review's token count: a span of a review falls in
        # another fold than its review, and would read ratios counted on its own label.
        raise ValueError(
            "`--short_spans` cannot be combined with `--naive_bayes_alpha` (a span would read "
            "naive-Bayes ratios counted on its own review). "
            f"Received: short_spans={config.short_spans}, "
            f"naive_bayes_alpha={config.naive_bayes_alpha}"
        )
    if config.logical_cpus is not None and config.logical_cpus <= 0:
        raise ValueError(
            f"`--logical_cpus` must be positive. Received: logical_cpus={config.logical_cpus}"
        )
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"`--dropout` must be in [0, 1). Received: dropout={config.dropout}")
    if config.learning_rate <= 0:
        raise ValueError(
            f"`--learning_rate` must be positive. Received: learning_rate={config.learning_rate}"
        )
    if config.mixed_precision is not None:
        _check_choice(config, "mixed_precision", MIXED_PRECISION, " (or left out)")
    if config.pooling_scale is not None and not config.pooling_scale > 0:
        raise ValueError(
            "`--pooling_scale` must be positive (or left out for 1 / sqrt(key_dim)). "
            f"Received: pooling_scale={config.pooling_scale}"
        )
    _check_choice(config, "vocabulary_source", VOCABULARY_SOURCES)
    _check_choice(config, "pooling_values", model_lib.POOLING_VALUES)
    if config.naive_bayes_alpha < 0:
        raise ValueError(
            "`--naive_bayes_alpha` must be >= 0 (0 turns the naive-Bayes ratios off). "
            f"Received: naive_bayes_alpha={config.naive_bayes_alpha}"
        )
    if config.weight_decay < 0:
        raise ValueError(
            f"`--weight_decay` must be >= 0. Received: weight_decay={config.weight_decay}"
        )
    if config.faithfulness_examples < 0:
        raise ValueError(
            "`--faithfulness_examples` must be >= 0. "
            f"Received: faithfulness_examples={config.faithfulness_examples}"
        )
    if config.inspect_examples < 0:
        raise ValueError(
            "`--inspect_examples` must be >= 0. "
            f"Received: inspect_examples={config.inspect_examples}"
        )


# Reviews are sorted by length inside windows of this many batches before they are batched, and
# each batch is cut to the first length bucket that holds its longest review. IMDB's median review
# is about 175 words: padded to 512 tokens, most of a step's work was padding.
BUCKET_WINDOW = 32


def token_lengths(ids):
    """Each row's length up to its last token `(n,)` (TextVectorization pads at the end)."""
    ids = np.asarray(ids)
    present = ids != 0
    last = ids.shape[1] - np.argmax(present[:, ::-1], axis=1)
    return np.where(present.any(axis=1), last, 0).astype("int32")


def _batches_cut_to_bucket(ids, labels, lengths, indices):
    """Maps a dataset of example indices `(B,)` to `(ids (B, size), labels (B,))`, `size` the
    first of `buckets.bucket_sizes(L)` that holds the batch's longest review."""
    sizes = tf.constant(buckets.bucket_sizes(ids.shape[1]), tf.int32)

    def gather(i):
        longest = tf.reduce_max(tf.gather(lengths, i))
        size = sizes[tf.minimum(tf.searchsorted(sizes, [longest])[0], len(sizes) - 1)]
        return tf.gather(ids, i)[:, :size], tf.gather(labels, i)  # (B, size), (B,)

    return indices.map(gather)


def training_stream(ids, labels, batch_size, seed, start_step=0, window=BUCKET_WINDOW):
    """The infinite, deterministic stream of training batches, from batch `start_step` on.

    Pass `p` over the data is one epoch of `len(ids) // batch_size` batches, a pure function of
    `(seed, p)`: the examples in the order `stateless_shuffle(seed, p)` (the last
    `len(ids) % batch_size` left out), sorted by length inside windows of `window` batches,
    batched, the batches shuffled again, and each batch cut to its length bucket. So a resumed
    run sees exactly the batches an uninterrupted one would, every epoch draws new batches, and
    a batch's reviews have similar lengths.
    """
    n, length = ids.shape
    per_pass = n // batch_size
    if per_pass < 1:
        raise ValueError(
            f"`batch_size` must be at most the number of training examples ({n}). "
            f"Received: batch_size={batch_size}"
        )
    lengths = tf.constant(token_lengths(ids))
    ids, labels = tf.constant(ids), tf.constant(labels, tf.float32)

    def one_pass(p):
        pass_seed = tf.stack([tf.cast(seed, tf.int64), p])
        order = tf.random.experimental.stateless_shuffle(tf.range(n), seed=pass_seed)
        order = order[: per_pass * batch_size]  # (P * B,)
        window_of = tf.range(per_pass * batch_size) // (window * batch_size)
        key = window_of * (length + 1) + tf.gather(lengths, order)  # window first, then length
        order = tf.gather(order, tf.argsort(key, stable=True))
        batches = tf.reshape(order, (per_pass, batch_size))  # (P, B)
        shuffle_seed = tf.random.experimental.stateless_fold_in(pass_seed, 1)
        batches = tf.gather(
            batches, tf.random.experimental.stateless_shuffle(tf.range(per_pass), shuffle_seed)
        )
        return tf.data.Dataset.from_tensor_slices(batches)

    indices = tf.data.Dataset.counter().flat_map(one_pass).skip(start_step)  # (B,) each
    stream = _batches_cut_to_bucket(ids, labels, lengths, indices)
    return _shard_by_data(stream.prefetch(tf.data.AUTOTUNE))


SHORT_REVIEWS = 2000  # test reviews that the short spans are cut from


def eval_dataset(ids, labels, batch_size, limit=None):
    """The first `limit` examples (all by default), batched in order of length, each batch cut
    to its length bucket. Metrics summed over the examples do not depend on the order."""
    ids, labels = ids[:limit], labels[:limit]
    lengths = token_lengths(ids)
    order = np.argsort(lengths, kind="stable").astype("int32")
    indices = tf.data.Dataset.from_tensor_slices(order).batch(batch_size)
    dataset = _batches_cut_to_bucket(
        tf.constant(ids), tf.constant(labels, tf.float32), tf.constant(lengths), indices
    )
    return _shard_by_data(dataset)


def _shard_by_data(dataset):
    # In-memory data has no files to shard: each worker takes its share of every batch.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


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
        if _step(self.model) % self.save_every == 0:
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
        step = _step(self.model)
        export.write_json_atomic(self.json_path, {"step": step, "train_seconds": self.seconds()})


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


def _step(model):
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
            if _better(row[self.monitor], self.best, self.monitor):
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
    with _dtype_policy(config.mixed_precision or "float32"):
        return _train(config, argv, git_commit)


@contextlib.contextmanager
def _dtype_policy(name):
    """Keras's global dtype policy set to `name` for the layers built inside, then restored.

    Under `mixed_float16`, `model.compile` wraps the optimizer in Keras's
    `LossScaleOptimizer` itself (its `auto_scale_loss`)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _train(config, argv, git_commit):
    run = _start_run(config)
    splits, vectorizer, train_ids, validation_ids, counted_ids = _prepare_data(config, run)
    fit_ids, train_labels = train_ids, splits.train_label
    if config.short_spans:
        texts, labels = short_reviews.training_spans(
            splits.train_text, splits.train_label, config.short_spans, config.seed
        )
        print(f"{len(texts)} spans of 1 to 3 sentences train beside the whole reviews")
        if len(texts):
            fit_ids = np.concatenate([train_ids, data.vectorize(vectorizer, texts)])
            train_labels = np.concatenate([train_labels, labels])
    steps_per_epoch = max(1, len(fit_ids) // run.global_batch)
    if config.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, config.max_steps)
    model, inspector = _build_model(
        config, run, vectorizer, train_ids, splits.train_label, counted_ids, steps_per_epoch
    )
    # Smoke runs (`--max_steps`) evaluate the first `max_steps` batches' worth of examples.
    limit = None if config.max_steps is None else config.max_steps * run.global_batch
    validation = eval_dataset(validation_ids, splits.validation_label, run.global_batch, limit)
    fitted = _fit(config, run, model, fit_ids, train_labels, validation, steps_per_epoch)
    if fitted is None:
        return 130  # interrupted; the state is saved
    train_seconds, stopped = fitted
    history = read_history(run.history)
    if os.path.exists(run.best_weights):
        model.load_weights(run.best_weights)
    best_epoch = _best_row(history, config.monitor)["epoch"] if history else None
    return _report(
        config, run.output, model, inspector, vectorizer, splits, history, best_epoch,
        train_seconds, stopped, validation, run.distribution, argv, git_commit,
    )  # fmt: skip


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
    state_json = os.path.join(checkpoints, "state.json")
    config_path = os.path.join(checkpoints, "config.json")
    resuming = False
    if os.path.exists(state_json):
        if not config.resume:
            raise ValueError(
                f"`--output` holds an interrupted run ({checkpoints}). Pass --resume to continue "
                f"it, or remove that folder to start over. Received: output={config.output!r}"
            )
        _check_same_run(config, config_path)
        resuming = True
    elif config.resume:
        print(f"Nothing to resume in {checkpoints}; starting a new run.")
    run = Run(strategy, distribution, global_batch, output, checkpoints, resuming)
    if not resuming:
        for stale in (run.history, os.path.join(output, "logs")):
            if os.path.isdir(stale):
                shutil.rmtree(stale)
            elif os.path.exists(stale):
                os.remove(stale)
    os.makedirs(checkpoints, exist_ok=True)
    export.write_json_atomic(config_path, dataclasses.asdict(config))
    return run


def _prepare_data(config, run):
    """The TFDS splits, the vectorizer (adapted on `--vocabulary_source`, or the interrupted
    run's), the train and validation token ids, and the token ids the pair and triple
    vocabularies are counted on (train's, with the unlabelled reviews' after them)."""
    keras.utils.set_random_seed(config.seed)
    data_dir = data.resolve_data_dir(config.data_dir)
    print(f"Loading {config.dataset} with tensorflow-datasets (data_dir={data_dir or 'default'})")
    splits = data.load_splits(config.dataset, data_dir, config.validation_fraction, config.seed)
    if splits.num_classes != 2:
        raise ValueError(
            "`--dataset` must have two classes (this app has a sigmoid head). "
            f"Received: dataset={config.dataset!r} with {splits.num_classes} classes"
        )
    print(
        f"train {len(splits.train_text)}, validation {len(splits.validation_text)} (from train, "
        f"seed {config.seed}), test {len(splits.test_text)} "
        f"({splits.test_split} split, for the final report only)"
    )
    counted_text = splits.train_text
    if config.vocabulary_source == "train+unsupervised" and not run.resuming:
        unlabeled = data.load_unlabeled(config.dataset, data_dir)
        # IMDB's unlabelled split repeats some labelled reviews word for word (270 of the test
        # split's, 27 of validation's): those stay out, so no held-out text is counted.
        held_out = {*splits.validation_text, *splits.test_text}
        unlabeled = np.array([text for text in unlabeled if text not in held_out], dtype=object)
        print(f"Counting the vocabularies on train and {len(unlabeled)} unlabelled reviews")
        counted_text = np.concatenate([splits.train_text, unlabeled])
    if run.resuming and os.path.exists(run.vocabulary):
        vectorizer = data.make_vectorizer(
            config.vocab_size, config.sequence_length, vocabulary=run.vocabulary
        )
    else:
        vectorizer = data.make_vectorizer(config.vocab_size, config.sequence_length)
        vectorizer.adapt(tf.data.Dataset.from_tensor_slices(counted_text).batch(1024))
        _write_vocabulary(vectorizer, run.vocabulary)
    train_ids = data.vectorize(vectorizer, splits.train_text)  # (n, L)
    validation_ids = data.vectorize(vectorizer, splits.validation_text)
    counted_ids = train_ids
    if len(counted_text) > len(splits.train_text):
        extra = data.vectorize(vectorizer, counted_text[len(splits.train_text) :])
        counted_ids = np.concatenate([train_ids, extra])  # (n + unlabelled, L)
    return splits, vectorizer, train_ids, validation_ids, counted_ids


def _build_model(config, run, vectorizer, train_ids, train_labels, counted_ids, steps_per_epoch):
    """The compiled classifier and its inspector, in the strategy's scope, with the word-pair
    and word-triple vocabularies and the naive-Bayes ratios set."""
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
            seed=config.seed,
            bigram_vocab_size=config.bigram_vocab_size,
            trigram_vocab_size=config.trigram_vocab_size,
            naive_bayes=config.naive_bayes_alpha > 0,
            naive_bayes_folds=config.naive_bayes_folds,
            pooling_scale=config.pooling_scale,
            pooling_values=config.pooling_values,
            ngram_dim=config.ngram_dim,
        )
        # Cosine decay to zero over the planned steps: a function of the optimizer's own
        # step, so a resumed run follows the same schedule.
        schedule = keras.optimizers.schedules.CosineDecay(
            config.learning_rate, decay_steps=steps_per_epoch * config.epochs
        )
        # The attention core is XLA-compiled on its own; the rest of the step runs on TF's
        # kernels (XLA's CPU random numbers make Keras's Dropout far slower under jit).
        model.compile(
            optimizer=model_lib.Adam(schedule, weight_decay=config.weight_decay or None),
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
            pairs = embedding.bigrams
            _write_ngrams(vectorizer, pairs, run.bigrams)
        print(f"{len(pairs)} word pairs have their own embedding")
    if config.trigram_vocab_size:
        embedding = model.get_layer("embedding")
        if run.resuming and os.path.exists(run.trigrams):
            embedding.set_trigrams(data.read_ngrams(vectorizer, run.trigrams))
        else:
            embedding.adapt_trigrams(counted_ids)
            _write_ngrams(vectorizer, embedding.trigrams, run.trigrams)
        print(f"{len(embedding.trigrams)} word triples have their own embedding")
    if config.naive_bayes_alpha:
        # From the training split's labels only; a resumed run counts the same again (and
        # its restored weights hold the same tables).
        model.get_layer("embedding").adapt_naive_bayes(
            train_ids, train_labels, config.naive_bayes_alpha
        )
        print(f"Naive-Bayes log-count ratios counted on {len(train_ids)} training reviews")
    return model, inspector


def _fit(config, run, model, train_ids, train_labels, validation, steps_per_epoch):
    """`model.fit` from where the run stands, with checkpoints, early stopping and a saved
    state on Ctrl-C or SIGTERM. Returns `(train_seconds, stopped_early)`, or None if
    interrupted."""
    multi_worker = distribute.is_multi_worker(run.strategy)
    distribute.fix_keras_for_multi_worker(model, run.strategy)
    state = TrainingState(run.checkpoints, config.save_every)
    state.set_model(model)  # fit sets it too; restore() and an early Ctrl-C need it before
    if run.resuming:
        state.restore()

    step = _step(model)
    first_epoch, done_in_epoch = divmod(step, steps_per_epoch)
    history = read_history(run.history)
    if run.resuming:
        print(f"Resuming at epoch {first_epoch + 1}, step {step} ({done_in_epoch} into the epoch)")

    best_so_far = _best_row(history, config.monitor)[config.monitor] if history else None
    early_stopping = ResumableEarlyStopping(
        run.history, monitor=config.monitor, patience=config.patience, verbose=1
    )
    callbacks = [
        ReviewsPerSecond(run.global_batch),
        state,
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
        early_stopping,
    ]
    stopped = _stopped_early(history, config.patience, config.monitor)
    # SIGINT too: a process started in the background by a shell inherits SIGINT ignored.
    previous_handlers = {
        number: signal.signal(number, _raise_keyboard_interrupt)
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        # An interrupted epoch first finishes its remaining steps, then whole epochs follow.
        segments = []
        if done_in_epoch:
            segments.append((first_epoch, first_epoch + 1, steps_per_epoch - done_in_epoch))
            first_epoch += 1
        if first_epoch < config.epochs:
            segments.append((first_epoch, config.epochs, steps_per_epoch))
        for initial_epoch, epochs, steps in segments:
            if stopped:
                break
            # Multi-worker Keras finds its strategy in the scope (see apps/sentiment/distribute.py);
            # evaluation and export then run on each worker alone, with the same weights.
            fitting = run.strategy.scope() if multi_worker else contextlib.nullcontext()
            with fitting:
                model.fit(
                    training_stream(
                        train_ids,
                        train_labels,
                        run.global_batch,
                        config.seed,
                        start_step=_step(model),
                    ),  # fmt: skip
                    initial_epoch=initial_epoch,
                    epochs=epochs,
                    steps_per_epoch=steps,
                    validation_data=validation,
                    callbacks=callbacks,
                    shuffle=False,  # the stream is already shuffled, deterministically
                    verbose=int(config.verbose) if config.verbose.isdigit() else config.verbose,
                )
            stopped = early_stopping.stopped_epoch > 0
    except KeyboardInterrupt:
        state.save()
        print(
            f"\nInterrupted at step {_step(model)}. Training state saved to {run.checkpoints}.\n"
            f"Continue with: python -m apps.train_sentiment --resume --output {config.output}",
            file=sys.stderr,
        )
        return None
    finally:
        for number, handler in previous_handlers.items():
            signal.signal(number, handler)
    return state.seconds(), stopped


def _report(config, output, model, inspector, vectorizer, splits, history, best_epoch,
            train_seconds, stopped, validation, distribution, argv, git_commit):  # fmt: skip
    steps = config.max_steps
    global_batch = distribution["global_batch_size"]
    limit = None if steps is None else steps * global_batch
    # One compiled classifier for every pass below: it reads the model's variables, so it
    # computes the calibrated log-odds once the temperature is folded in, and each shape's
    # program compiles once for the validation, test and short-review passes.
    classify = model_lib.compiled_classifier(model, log_odds=True)
    print("Fitting the probabilities' temperature on the validation set")
    validation_log_odds, validation_labels = _log_odds(classify, validation)
    temperature = calibration.fit_temperature(validation_log_odds, validation_labels)
    if temperature in calibration.TEMPERATURE_RANGE:
        print(
            f"Warning: the temperature ({temperature:g}) is at the end of its range: the "
            f"{len(validation_labels)} validation reviews are all right, or the model has not "
            "learned; its probabilities are not calibrated.",
            file=sys.stderr,
        )
    calibration.fold_temperature(model, temperature)  # every export below is calibrated
    print("Evaluating the best epoch's weights, calibrated, on validation and test")
    validation_loss, validation_accuracy = model.evaluate(validation, verbose=0)
    # Smoke runs evaluate the first `limit` test reviews: only those are tokenized.
    test_ids = data.vectorize(vectorizer, splits.test_text[:limit])
    test = eval_dataset(test_ids, splits.test_label[: len(test_ids)], global_batch, limit)
    test_loss, test_accuracy = model.evaluate(test, verbose=0)
    # The folded model's log-odds are the trained model's divided by the temperature.
    test_log_odds, test_labels = _log_odds(classify, test)
    calibrated = {
        "temperature": temperature,
        "fitted_on": "validation",
        "bins": calibration.ECE_BINS,
        "validation": {
            "before": calibration.report(validation_log_odds, validation_labels),
            "after": calibration.report(validation_log_odds, validation_labels, temperature),
        },
        "test": {
            "before": calibration.report(test_log_odds * temperature, test_labels),
            "after": calibration.report(test_log_odds, test_labels),
        },
    }
    num_test = len(test_ids)
    num_validation = len(splits.validation_label)
    if steps is not None:
        num_validation = min(num_validation, steps * global_batch)

    by_length = _short_review_accuracy(
        classify, vectorizer, splits, min(SHORT_REVIEWS, limit or SHORT_REVIEWS), config.seed,
        global_batch,
    )  # fmt: skip

    paths = {}
    print("Exporting the SavedModel")
    paths["saved_model"] = export.export_saved_model(
        model, inspector, vectorizer, os.path.join(output, "saved_model")
    )
    max_difference = _check_export(paths["saved_model"], model, vectorizer, splits.test_text[:64])
    print("Measuring the SavedModel's serving rate")
    serving = export.measure_serving(
        paths["saved_model"], splits.test_text[: 256 if config.max_steps else 2048]
    )
    paths["serving"] = export.write_json_atomic(os.path.join(output, "serving.json"), serving)
    paths["keras_model"] = os.path.join(output, "model.keras")
    model.save(paths["keras_model"])
    paths["vocabulary"] = os.path.join(output, "vocabulary.txt")
    if config.bigram_vocab_size:
        paths["bigrams"] = os.path.join(output, "bigrams.txt")
    if config.trigram_vocab_size:
        paths["trigrams"] = os.path.join(output, "trigrams.txt")
    paths["history"] = os.path.join(output, "history.csv")
    paths["calibration"] = export.write_reliability_diagram(
        calibrated, os.path.join(output, "calibration.png")
    )
    paths["tensorboard"] = os.path.join(output, "logs")
    if history:
        paths["training_curves"] = export.write_training_curves(
            history, os.path.join(output, "training_curves.png")
        )

    sharpness = None
    if config.inspect_examples:
        print(f"Exporting attention for {config.inspect_examples} test reviews")
        chosen = export.inspection_sample(
            len(splits.test_text), config.inspect_examples, config.seed
        )
        records = export.inspect_records(
            inspector, vectorizer, splits.test_text[chosen], splits.test_label[chosen], chosen,
            model=model,
        )  # fmt: skip
        sharpness = export.pooling_sharpness(records)
        paths["attention_jsonl"] = export.write_attention_jsonl(
            records, os.path.join(output, "attention.jsonl")
        )
        paths["attention_html"] = export.write_attention_html(
            records, os.path.join(output, "attention.html"),
            title=f"keras-sdpa attention: {config.dataset} test reviews",
        )  # fmt: skip
        heatmaps = export.write_attention_heatmaps(
            records, os.path.join(output, "attention_heatmaps.png")
        )
        if heatmaps:
            paths["attention_heatmaps"] = heatmaps

    faithfulness_summary = None
    if config.faithfulness_examples:
        print(
            f"Deletion tests (apps.faithfulness --quick) on {config.faithfulness_examples} "
            "test reviews"
        )
        chosen = export.inspection_sample(
            len(splits.test_text), config.faithfulness_examples, config.seed
        )
        payload = faithfulness.evaluate(
            model, inspector, vectorizer, splits.test_text[chosen], splits.test_label[chosen],
            seed=config.seed,
        )  # fmt: skip
        payload["source"] = {
            "run": output, "weights": "the trained model, in memory", "dataset": config.dataset,
            "split": splits.test_split, "examples": len(chosen), "seed": config.seed,
        }  # fmt: skip
        paths.update(faithfulness.write_report(payload, output))
        faithfulness_summary = explain.summary(payload)

    import tensorflow_datasets as tfds

    metrics = {
        "dataset": config.dataset,
        "test_split": splits.test_split,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "test_examples": int(num_test),
        "validation_accuracy": float(validation_accuracy),
        "validation_loss": float(validation_loss),
        "validation_examples": int(num_validation),
        "train_examples": len(splits.train_label),
        "epochs_run": len(history),
        "best_epoch": None if best_epoch is None else best_epoch + 1,
        "stopped_early": bool(stopped),
        "train_steps": _step(model),
        "train_seconds": round(train_seconds, 1),
        "parameters": int(model.count_params()),
        "export_max_abs_difference": max_difference,
        "calibration": calibrated,
        "short_reviews": by_length,
        "faithfulness": faithfulness_summary,
        "pooling_sharpness": sharpness,  # of the exported reviews' pooling weights
        "distribution": distribution,
        "history": history,
        "config": dataclasses.asdict(config),
        "command": shlex.join(["python", "-m", "apps.train_sentiment", *(argv or [])]),
        "git_commit": git_commit,
        "versions": {
            "python": sys.version.split()[0],
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "tensorflow_datasets": tfds.__version__,
        },
    }
    paths["metrics"] = os.path.join(output, "metrics.json")
    paths["model_card"] = os.path.join(output, "README.md")
    metrics["artifacts"] = {name: os.path.relpath(path, output) for name, path in paths.items()}
    export.write_json_atomic(paths["metrics"], metrics)
    export.write_model_card(metrics, paths["model_card"])
    # The run is complete: its resumable state is no longer needed.
    shutil.rmtree(os.path.join(output, "checkpoints"), ignore_errors=True)

    before, after = calibrated["test"]["before"], calibrated["test"]["after"]
    print(
        f"\ntest accuracy {test_accuracy:.4f} on {num_test} {splits.test_split} examples "
        f"(validation {validation_accuracy:.4f}); trained {train_seconds / 60:.1f} min, "
        f"{len(history)} epochs\n"
        f"calibration: temperature {temperature:.3f} (fitted on validation); on test, ECE "
        f"{before['ece']:.4f} -> {after['ece']:.4f}, log loss {before['log_loss']:.4f} -> "
        f"{after['log_loss']:.4f}, Brier {before['brier']:.4f} -> {after['brier']:.4f}"
    )
    print("Wrote:")
    for name, path in paths.items():
        print(f"  {name:20s} {path}")
    return 0


def _short_review_accuracy(classify, vectorizer, splits, count, seed, batch_size):
    """Accuracy by review length (`short_reviews.BUCKETS`) on spans cut from `count` test
    reviews: what a person who types one sentence can expect. `classify` is the model's
    `compiled_classifier(model, log_odds=True)`."""
    print(f"Reading spans of {count} test reviews: one sentence, 2-3, a paragraph, the whole")
    buckets_ = []
    for name, (texts, labels) in short_reviews.spans(
        splits.test_text, splits.test_label, count, seed
    ).items():
        if not len(texts):
            continue
        ids = data.vectorize(vectorizer, texts)
        log_odds, ordered = _log_odds(classify, eval_dataset(ids, labels, batch_size))
        buckets_.append(
            {
                "bucket": name,
                "examples": len(labels),
                "accuracy": float(np.mean((log_odds >= 0) == (ordered == 1))),
                "median_words": int(np.median([len(t.split()) for t in texts])),
            }
        )
    return {"split": splits.test_split, "reviews": count, "seed": seed, "buckets": buckets_}


def _log_odds(classify, dataset):
    """The log-odds `(n,)` that `classify` (`compiled_classifier(model, log_odds=True)`) gives
    and the labels `(n,)` of an `eval_dataset`, in its order."""
    log_odds, labels = [], []
    for ids, label in dataset:
        log_odds.append(classify(ids).numpy())
        labels.append(label.numpy())
    return np.concatenate(log_odds).astype("float64"), np.concatenate(labels).astype("int64")


def _git_commit(output=None):
    """The checkout's commit, with `+changes` if its tracked files differ; None outside git.

    The run's own `output` folder is left out of the comparison: a run written over a committed
    one (the shipped model) changes those files itself, not the code that trained it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return None  # installed from a wheel: no checkout of this project here
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        excluded = []
        output = None if output is None else os.path.abspath(output)
        if output is not None and output.startswith(root + os.sep):  # git refuses paths outside
            excluded = [".", f":(exclude){os.path.relpath(output, root)}"]
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *excluded],
            cwd=root, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _check_export(path, model, vectorizer, texts):
    """Reloads the SavedModel and returns its largest difference from the in-memory model."""
    reloaded = tf.saved_model.load(path)
    served = reloaded.signatures["serving_default"](text=tf.constant(texts))
    expected = model.predict(vectorizer(tf.constant(texts)), verbose=0)[:, 0]
    return float(np.max(np.abs(served["probability"].numpy() - expected)))


def _write_vocabulary(vectorizer, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Index 0 (padding) and 1 (OOV) are the layer's own; it adds them back on load.
    export.write_text_atomic(path, (f"{token}\n" for token in vectorizer.get_vocabulary()[2:]))


def _write_ngrams(vectorizer, ngrams, path):
    """One n-gram per line ("not good"), most frequent first: the lookup's own order."""
    words = vectorizer.get_vocabulary()
    export.write_text_atomic(path, (" ".join(words[i] for i in ngram) + "\n" for ngram in ngrams))


def _best_row(history, monitor):
    """The first epoch's row with the best `monitor` (as Keras's callbacks keep it)."""
    best = None
    for row in history:
        if best is None or _better(row[monitor], best[monitor], monitor):
            best = row
    return best


def _stopped_early(history, patience, monitor="val_loss"):
    """Whether the logged epochs already ran out of patience (a finished, stopped run)."""
    best, wait = None, 0
    for row in history:
        wait += 1
        if _better(row[monitor], best, monitor):
            best, wait = row[monitor], 0
        elif wait >= patience and row["epoch"] > 0:
            return True
    return False


def _check_same_run(config, config_path):
    if not os.path.exists(config_path):
        return
    with open(config_path) as f:
        saved = json.load(f)
    # A run saved before a flag existed ran with the flag's first default.
    saved = {**FIRST_DEFAULTS, **saved}
    changed = [
        f"--{name} (saved {saved.get(name)!r}, received {getattr(config, name)!r})"
        for name in _RUN_DEFINING
        if saved.get(name) != getattr(config, name)
    ]
    if changed:
        raise ValueError(
            "`--resume` must continue the same run, but these flags differ from the saved run: "
            + ", ".join(changed)
        )


def main(argv=None):
    try:
        config = parse_args(argv)
        return train(config, argv=sys.argv[1:] if argv is None else list(argv))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
