"""The training run's configuration: its flags (`Config`), their checks, a resumed run's match."""

import dataclasses
import json
import os

from ..classifier.pooling import POOLING_VALUES


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
    # in training, each position's embedding (word, pair, triple and position) is zeroed whole
    # with this probability (after word dropout; the position stays attended); 0 = none
    word_dropout: float = 0.0
    # pretraining (apps/training/pretrain.py): masked-word prediction trains the embedding and
    # the blocks first, on the reviews `--vocabulary_source` names (never validation or test)
    pretrain_steps: int = 0  # 0 = no pretraining (docs/app.md: 1,500 steps did not pay)
    pretrain_batch_size: int = 64  # reviews per step (every replica computes all of them)
    # Adam: linear warm-up over the first 10% of the steps, then cosine decay to 0
    pretrain_learning_rate: float = 1e-3
    # of each review's words, hidden as BERT does (80% hidden, 10% a random word, 10% kept)
    mask_rate: float = 0.15
    predicted_words: int = 8192  # the most frequent words are the ones predicted
    # self-training (apps/training/self_training.py): a finished run with this run's validation
    # set labels the unlabelled reviews, and the ones it is surest of train beside the labelled
    # ones, half per class; None = the labelled reviews only
    self_training_from: str | None = None
    self_training_reviews: int = 22500  # unlabelled reviews kept, with --self_training_from
    # the mixed objective (apps/classifier/perturbation.py): the likelihood plus these losses,
    # each times its weight; 0 = off. The adversarial and virtual adversarial ones perturb the
    # embeddings, which are then normalised by their rows' frequencies (Miyato et al., 2017);
    # the virtual adversarial and entropy ones read a batch of unlabelled reviews beside each
    # labelled one (`--vocabulary_source train+unsupervised`'s)
    adversarial_weight: float = 0.0  # the loss at the embeddings plus the worst perturbation
    virtual_adversarial_weight: float = 0.0  # KL(p(x) || p(x + r_vadv)), labelled and unlabelled
    entropy_weight: float = 0.0  # the prediction's entropy on the unlabelled reviews
    perturbation_epsilon: float = 5.0  # the perturbations' norm over a review's embeddings
    # training
    # Keras's dtype policy for the run: mixed_bfloat16 or mixed_float16 (loss-scaled), with the
    # classifier's output and the variables in float32; None = float32 throughout
    mixed_precision: str | None = None
    batch_size: int = 64
    epochs: int = 2  # the learning rate decays to 0 at the end of the last one
    learning_rate: float = 1e-3  # Adam, with cosine decay to 0 over the epochs
    weight_decay: float = 0.5  # decoupled (AdamW), times the learning rate; 0 = plain Adam
    # an exponential moving average of the weights (Keras's `use_ema`, Polyak averaging) with
    # this momentum: validation, the kept epoch and the exports read it; None = no average
    ema_momentum: float | None = None
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
    "dataset",
    "validation_fraction",
    "vocab_size",
    "sequence_length",
    "bigram_vocab_size",
    "trigram_vocab_size",
    "naive_bayes_alpha",
    "naive_bayes_folds",
    "vocabulary_source",
    "embed_dim",
    "num_heads",
    "key_dim",
    "ff_dim",
    "num_layers",
    "dropout",
    "batch_size",
    "learning_rate",
    "weight_decay",
    "ema_momentum",
    "seed",
    "max_steps",
    "epochs",
    "strategy",
    "logical_cpus",
    "monitor",
    "mixed_precision",
    "pooling_scale",
    "pooling_values",
    "ngram_dim",
    "word_dropout",
    "short_spans",
    "pretrain_steps",
    "pretrain_batch_size",
    "pretrain_learning_rate",
    "mask_rate",
    "predicted_words",
    "self_training_from",
    "self_training_reviews",
    "adversarial_weight",
    "virtual_adversarial_weight",
    "entropy_weight",
    "perturbation_epsilon",
)


# A run recorded before one of these flags existed did what the flag's first default does:
# each flag came in with the behaviour of its day as its default (resumed runs' configs and
# the sweep's recorded runs are read with them).
FIRST_DEFAULTS = {
    "trigram_vocab_size": 0,
    "ngram_dim": None,
    "vocabulary_source": "train",
    "naive_bayes_alpha": 0.0,
    "pooling_scale": None,
    "pooling_values": "block",
    "mixed_precision": None,
    "weight_decay": 0.0,
    "ema_momentum": None,
    "short_spans": 0.0,
    "pretrain_steps": 0,
    "pretrain_batch_size": 64,
    "pretrain_learning_rate": 1e-3,
    "mask_rate": 0.15,
    "predicted_words": 8192,
    "self_training_from": None,
    "self_training_reviews": 22500,
    "word_dropout": 0.0,
    "adversarial_weight": 0.0,
    "virtual_adversarial_weight": 0.0,
    "entropy_weight": 0.0,
    "perturbation_epsilon": 5.0,
}


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


def better(value, best, monitor):
    """Whether `value` of `monitor` beats `best` (None: nothing to beat yet)."""
    if best is None:
        return True
    return value < best if MONITORS[monitor] == "min" else value > best


def check_config(config):
    """A `ValueError` naming the first flag of `config` that is out of its range."""
    _check_sizes(config)
    _check_training(config)
    _check_pretraining(config)
    _check_self_training(config)
    _check_perturbation(config)


def _check_perturbation(config):
    for name in ("adversarial_weight", "virtual_adversarial_weight", "entropy_weight"):
        if not getattr(config, name) >= 0 or getattr(config, name) == float("inf"):
            raise ValueError(
                f"`--{name}` must be >= 0 and finite (0 turns the loss off). "
                f"Received: {name}={getattr(config, name)}"
            )
    if not 0 < config.perturbation_epsilon < float("inf"):
        raise ValueError(
            "`--perturbation_epsilon` must be positive and finite. "
            f"Received: perturbation_epsilon={config.perturbation_epsilon}"
        )
    perturbing = [
        name
        for name in ("adversarial_weight", "virtual_adversarial_weight")
        if getattr(config, name)
    ]
    if perturbing and config.pretrain_steps:
        # The saved encoder's key does not say whether its embedding read normalised tables.
        raise ValueError(
            f"`--{perturbing[0]}` normalises the embeddings, which pretraining does not (its "
            "word prediction reads the word table as it is): they cannot be combined yet. "
            f"Received: {perturbing[0]}={getattr(config, perturbing[0])}, "
            f"pretrain_steps={config.pretrain_steps}"
        )
    if config.virtual_adversarial_weight and config.mixed_precision == "mixed_bfloat16":
        # The power iteration's step (xi over a review) is about 1e-3 of an embedding's
        # entries: bfloat16's 8 bits round most of it away, and the direction is noise.
        raise ValueError(
            "`--virtual_adversarial_weight` probes the embeddings with a step bfloat16 cannot "
            "hold: use float32 or `--mixed_precision mixed_float16`. "
            f"Received: virtual_adversarial_weight={config.virtual_adversarial_weight}, "
            f"mixed_precision={config.mixed_precision!r}"
        )
    unlabeled = [
        name for name in ("virtual_adversarial_weight", "entropy_weight") if getattr(config, name)
    ]
    if unlabeled and config.vocabulary_source != "train+unsupervised":
        raise ValueError(
            f"`--{unlabeled[0]}` reads the unlabelled reviews, which only "
            "`--vocabulary_source train+unsupervised` reads. "
            f"Received: {unlabeled[0]}={getattr(config, unlabeled[0])}, "
            f"vocabulary_source={config.vocabulary_source!r}"
        )


def _check_self_training(config):
    if config.self_training_reviews < 2 or config.self_training_reviews % 2:
        raise ValueError(
            "`--self_training_reviews` must be even and at least 2 (half per class). "
            f"Received: self_training_reviews={config.self_training_reviews}"
        )
    if config.self_training_from is None:
        return
    if config.vocabulary_source != "train+unsupervised":
        raise ValueError(
            "`--self_training_from` labels the unlabelled reviews, which only "
            "`--vocabulary_source train+unsupervised` reads. "
            f"Received: vocabulary_source={config.vocabulary_source!r}"
        )
    needed = ("metrics.json", "saved_model", "vocabulary.txt")
    if not all(os.path.exists(os.path.join(config.self_training_from, f)) for f in needed):
        raise ValueError(
            "`--self_training_from` must be a finished run's folder (with metrics.json, "
            "saved_model/ and vocabulary.txt). Received: "
            f"self_training_from={config.self_training_from!r}"
        )


def _check_sizes(config):
    positive = (
        "vocab_size",
        "sequence_length",
        "embed_dim",
        "num_heads",
        "key_dim",
        "ff_dim",
        "num_layers",
        "batch_size",
        "epochs",
        "patience",
        "save_every",
        "naive_bayes_folds",
        "pretrain_batch_size",
        "pretrain_learning_rate",
    )
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


def _check_pretraining(config):
    if config.pretrain_steps < 0:
        raise ValueError(
            "`--pretrain_steps` must be >= 0 (0 turns pretraining off). "
            f"Received: pretrain_steps={config.pretrain_steps}"
        )
    if not 0.0 < config.mask_rate < 1.0:
        raise ValueError(f"`--mask_rate` must be in (0, 1). Received: mask_rate={config.mask_rate}")
    # A run without pretraining predicts no words: `--vocab_size` alone may go below 8,192.
    if config.pretrain_steps and config.predicted_words > config.vocab_size:
        raise ValueError(
            "`--predicted_words` must be at most `--vocab_size` (the words the model knows). "
            f"Received: predicted_words={config.predicted_words}, vocab_size={config.vocab_size}"
        )
    if config.predicted_words < 3:
        raise ValueError(
            "`--predicted_words` must be at least 3 (ids 0 and 1 are padding and unknown). "
            f"Received: predicted_words={config.predicted_words}"
        )


def _check_training(config):
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
    for name in ("dropout", "word_dropout"):
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ValueError(
                f"`--{name}` must be in [0, 1). Received: {name}={getattr(config, name)}"
            )
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
    _check_choice(config, "pooling_values", POOLING_VALUES)
    if config.naive_bayes_alpha < 0:
        raise ValueError(
            "`--naive_bayes_alpha` must be >= 0 (0 turns the naive-Bayes ratios off). "
            f"Received: naive_bayes_alpha={config.naive_bayes_alpha}"
        )
    if config.weight_decay < 0:
        raise ValueError(
            f"`--weight_decay` must be >= 0. Received: weight_decay={config.weight_decay}"
        )
    if config.ema_momentum is not None and not 0.0 < config.ema_momentum < 1.0:
        raise ValueError(
            "`--ema_momentum` must be in (0, 1) (or left out for no average). "
            f"Received: ema_momentum={config.ema_momentum}"
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


def differing_flags(config, recorded, names, recorded_as, received_as="received"):
    """`--NAME (<recorded_as> X, <received_as> Y)` for each flag of `names` whose value in
    `recorded` (another run's saved config) is not `config`'s. A run recorded before a flag
    existed ran with the flag's first default."""
    recorded = {**FIRST_DEFAULTS, **recorded}
    return [
        f"--{name} ({recorded_as} {recorded.get(name)!r}, {received_as} {getattr(config, name)!r})"
        for name in names
        if recorded.get(name) != getattr(config, name)
    ]


def check_same_run(config, config_path):
    if not os.path.exists(config_path):
        return
    with open(config_path) as f:
        saved = json.load(f)
    changed = differing_flags(config, saved, _RUN_DEFINING, "saved")
    if changed:
        raise ValueError(
            "`--resume` must continue the same run, but these flags differ from the saved run: "
            + ", ".join(changed)
        )
