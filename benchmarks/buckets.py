"""The app's training step on length-bucketed batches against the same batches padded to 512.

The classifier is built as `apps.train_sentiment`'s defaults build it (the shipped run's
configuration, vocabulary, word pairs and triples, read from `saved_models/imdb_sdpa`; dropout
as in training) and compiled as the app compiles it (its Adam with weight decay,
`jit_compile=False`). The batches are the app's own: `training_stream`'s on real IMDB training
reviews, each cut to its length bucket; the padded twin of each batch is the same reviews
padded to `--sequence_length` (512), as every batch was before the buckets. Two models with the
same weights take the two kinds of batch, in alternating rounds in one process; ratio =
bucketed / padded, the median of the per-round ratios with their range.

No timed step is fed a batch fed before (the rule `common.Fed` keeps for the other scripts):
the warm-up pass takes the stream's first `--steps` batches, and each round the next `--steps`
ones, new by construction. So that no round compiles, the warm-up also runs one of its
batches cut or padded to each width a round has and its own batches lack.

Usage:
    python benchmarks/buckets.py --data_dir ../shared/data/tensorflow_datasets
    python benchmarks/buckets.py --rounds 5 --steps 24 --output BENCHMARKS.md
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_name, replace_section, time_alternating  # noqa: E402

START, END = "<!-- buckets:start -->", "<!-- buckets:end -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "saved_models", "imdb_sdpa")


def build(config, vectorizer):
    """The shipped configuration's classifier, compiled as the app compiles it."""
    import keras

    from apps.classifier import data
    from apps.classifier import model as model_lib
    from apps.classifier.optimizer import Adam

    keras.utils.set_random_seed(config["seed"])
    model, _ = model_lib.build_classifier(
        vocab_size=vectorizer.vocabulary_size(),
        sequence_length=config["sequence_length"],
        embed_dim=config["embed_dim"],
        num_heads=config["num_heads"],
        key_dim=config["key_dim"],
        ff_dim=config["ff_dim"],
        num_layers=config["num_layers"],
        dropout=config["dropout"],
        seed=config["seed"],
        bigram_vocab_size=config["bigram_vocab_size"],
        trigram_vocab_size=config["trigram_vocab_size"],
        pooling_scale=config["pooling_scale"],
        pooling_values=config["pooling_values"],
        ngram_dim=config["ngram_dim"],
    )
    embedding = model.get_layer("embedding")
    if config["bigram_vocab_size"]:
        embedding.set_bigrams(data.read_ngrams(vectorizer, os.path.join(RUN, "bigrams.txt")))
    if config["trigram_vocab_size"]:
        embedding.set_trigrams(data.read_ngrams(vectorizer, os.path.join(RUN, "trigrams.txt")))
    model.compile(
        optimizer=Adam(config["learning_rate"], weight_decay=config["weight_decay"] or None),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        jit_compile=False,
    )
    return model


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default=os.environ.get("TFDS_DATA_DIR"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="training batches per round")
    parser.add_argument("--output", help="a Markdown file whose buckets section is replaced")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(
            f"--rounds and --steps must be at least 1. Received: {args.rounds}, {args.steps}"
        )
    return args


def load_batches(args, config):
    """The vectorizer, and the passes over the app's training stream: the warm-up's, then one
    per round, each of `--steps` new batches cut to their length buckets (the warm-up's with
    a batch for each width the rounds have and it lacks), and the same padded to the
    configuration's sequence length."""

    from apps.classifier import data
    from apps.training import batches

    length = config["sequence_length"]
    vectorizer = data.make_vectorizer(
        config["vocab_size"], length, vocabulary=os.path.join(RUN, "vocabulary.txt")
    )
    splits = data.load_splits(seed=config["seed"], data_dir=data.resolve_data_dir(args.data_dir))
    ids = data.vectorize(vectorizer, splits.train_text)
    stream = batches.training_stream(ids, splits.train_label, config["batch_size"], config["seed"])
    taken = [(x.numpy(), y.numpy()) for x, y in stream.take((args.rounds + 1) * args.steps)]
    passes = [taken[i : i + args.steps] for i in range(0, len(taken), args.steps)]
    warm = passes[0]
    missing = {x.shape[1] for run in passes[1:] for x, _ in run} - {x.shape[1] for x, _ in warm}
    passes[0] = warm + [(resized(warm[0][0], width), warm[0][1]) for width in sorted(missing)]
    padded = [[(resized(x, length), y) for x, y in run] for run in passes]
    return vectorizer, {"bucketed": passes, "padded": padded}


def resized(ids, width):
    """Token ids `(B, L)` cut or padded (with zeros, the padding id) to `width` positions."""
    import numpy as np

    return np.pad(ids, ((0, 0), (0, max(0, width - ids.shape[1]))))[:, :width]


def time_batches(args, config, vectorizer, batches):
    """Seconds per step of each kind of batch, two models with the same weights in
    alternating rounds of one pass over that round's batches."""
    models = {"bucketed": build(config, vectorizer), "padded": build(config, vectorizer)}
    models["padded"].set_weights(models["bucketed"].get_weights())

    def epoch_of(name):
        passes = iter(batches[name])  # the warm-up's, then each round's

        def step():
            for x, y in next(passes):
                models[name].train_on_batch(x, y)

        return step

    # The first call of each (the warm-up pass) traces and compiles every width.
    seconds = time_alternating({name: epoch_of(name) for name in models}, args.rounds)
    times = {name: [total / args.steps for total in totals] for name, totals in seconds.items()}
    for index in range(args.rounds):
        latest = ", ".join(f"{name} {times[name][index] * 1e3:.0f} ms" for name in models)
        print(f"  round {index + 1}/{args.rounds}: {latest}", file=sys.stderr)
    return times


def section_text(args, config, widths, times):
    length = config["sequence_length"]
    ratios = [a / b for a, b in zip(times["bucketed"], times["padded"])]
    return "\n".join(
        [
            "## The app's training step: length buckets against padding to 512",
            "",
            "Produced by:",
            "",
            f"    python benchmarks/buckets.py --rounds {args.rounds} --steps {args.steps} "
            "--output BENCHMARKS.md",
            "",
            f"On {cpu_name()}. "
            "The shipped configuration (`saved_models/imdb_sdpa/metrics.json`), trained as the "
            f"app trains it, on batches of {config['batch_size']} real IMDB training reviews "
            "of `apps.training.batches.training_stream` (mean width "
            f"{statistics.fmean(widths):.0f} tokens), against the same batches padded to {length}; "
            f"{args.rounds} alternating rounds in one process; ratio = median of the per-round "
            "ratios (bucketed / padded; range in brackets). No timed step gets a batch fed "
            f"before: after a warm-up pass on the stream's first {args.steps} batches (and one "
            "cut or padded to each width it lacked, so that no round compiles), each round "
            f"trains on the next {args.steps}, new by construction.",
            "",
            "| batches | ms per step (median) |",
            "|---|---|",
            f"| cut to their length bucket | {statistics.median(times['bucketed']) * 1e3:.0f} |",
            f"| padded to {length} | {statistics.median(times['padded']) * 1e3:.0f} |",
            f"| **ratio** | **{statistics.median(ratios):.3f}** "
            f"({min(ratios):.3f}-{max(ratios):.3f}) |",
            "",
        ]
    )


def main(argv=None):
    args = parse_arguments(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, ROOT)
    with open(os.path.join(RUN, "metrics.json")) as f:
        config = json.load(f)["config"]
    vectorizer, batches = load_batches(args, config)
    widths = [x.shape[1] for run in batches["bucketed"][1:] for x, _ in run]  # the timed ones
    print(
        f"{args.rounds} rounds of {args.steps} batches of {config['batch_size']}, widths "
        f"{sorted(set(widths))}",
        file=sys.stderr,
    )
    times = time_batches(args, config, vectorizer, batches)
    section = section_text(args, config, widths, times)
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
