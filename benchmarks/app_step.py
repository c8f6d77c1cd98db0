"""One training step of the app's classifier, as shipped, against its Keras-MHA twin.

The shipped configuration (`apps.train_sentiment`'s defaults: E=64, 2 heads of 32, one
block plus attention pooling, L=512, vocabulary 10,000 with 20,000 word pairs, batch
64, the app's Adam) is built twice by `apps.model.build_classifier`: once as shipped, on
`keras_sdpa.ScaledDotProductAttention`, and once with `keras.layers.MultiHeadAttention`
in its place (same arguments, same weights copied over). Each step is
`model.train_on_batch` on the same batch of random token ids, compiled as the app
compiles it (`apps.model.Adam`, `jit_compile=False`: the attention core is XLA-compiled
on its own).

Rounds alternate the two in one process; the table gives the median of the
per-round ratios (ours / Keras) and their range.

Usage:
    python benchmarks/app_step.py                       # 15 rounds of 5 steps
    python benchmarks/app_step.py --rounds 21 --output BENCHMARKS.md
"""

import argparse
import os
import statistics
import sys
import time

START, END = "<!-- app-step:start -->", "<!-- app-step:end -->"
MODEL_ARGUMENTS = (
    "vocab_size", "sequence_length", "embed_dim", "num_heads", "key_dim", "ff_dim",
    "num_layers", "dropout", "seed", "bigram_vocab_size",
)  # fmt: skip


def shipped_config():
    """The model arguments and batch size of `apps.train_sentiment`'s defaults."""
    from apps.train_sentiment import Config

    config = Config()
    return {name: getattr(config, name) for name in MODEL_ARGUMENTS}, config.batch_size


def build(kind, ids, config):
    """The classifier as shipped (`"sdpa"`) or with Keras's MultiHeadAttention (`"keras_mha"`)."""
    import keras

    from apps import model as model_lib

    original = model_lib.ScaledDotProductAttention
    if kind == "keras_mha":
        model_lib.ScaledDotProductAttention = keras.layers.MultiHeadAttention
    try:
        keras.utils.set_random_seed(0)
        model, _ = model_lib.build_classifier(**config)
    finally:
        model_lib.ScaledDotProductAttention = original
    model.get_layer("embedding").adapt_bigrams(ids)  # the word-pair vocabulary
    model.compile(model_lib.Adam(1e-3), "binary_crossentropy", jit_compile=False)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--output", help="a Markdown file whose app-step section is replaced")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(
            f"--rounds and --steps must be at least 1. Received: {args.rounds}, {args.steps}"
        )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np

    rng = np.random.default_rng(0)
    config, batch = shipped_config()
    lengths = rng.integers(90, config["sequence_length"] + 1, batch)  # real reviews vary
    ids = rng.integers(2, config["vocab_size"], (batch, config["sequence_length"]))
    ids[np.arange(config["sequence_length"])[None, :] >= lengths[:, None]] = 0  # padding
    labels = rng.integers(0, 2, batch).astype("float32")

    models = {kind: build(kind, ids, config) for kind in ("sdpa", "keras_mha")}
    models["keras_mha"].set_weights(models["sdpa"].get_weights())
    for model in models.values():
        model.train_on_batch(ids, labels)  # trace and compile
        model.train_on_batch(ids, labels)
    times = {name: [] for name in models}
    for index in range(args.rounds):
        order = list(models) if index % 2 == 0 else list(reversed(models))
        for name in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                models[name].train_on_batch(ids, labels)
            times[name].append((time.perf_counter() - start) / args.steps)
        print(f"  round {index + 1}/{args.rounds}: sdpa {times['sdpa'][-1] * 1e3:.0f} ms, "
              f"keras_mha {times['keras_mha'][-1] * 1e3:.0f} ms", file=sys.stderr)  # fmt: skip
    ratios = [a / b for a, b in zip(times["sdpa"], times["keras_mha"])]
    section = "\n".join(
        [
            "## The app's training step",
            "",
            "Produced by:",
            "",
            f"    python benchmarks/app_step.py --rounds {args.rounds} --steps {args.steps} "
            "--output BENCHMARKS.md",
            "",
            "The shipped classifier (E=64, 2 heads of 32, one block plus attention pooling, "
            f"L=512, batch {batch}, dropout {config['dropout']}, word pairs) against the same "
            "model with `keras.layers.MultiHeadAttention` swapped in, same weights; "
            "`train_on_batch` as the app compiles it (its Adam, `jit_compile=False`); "
            f"{args.rounds} alternating rounds of "
            f"{args.steps} steps in one process; ratio = median of the per-round ratios "
            "(range in brackets).",
            "",
            "| model | ms per step (median) |",
            "|---|---|",
            f"| shipped, keras_sdpa | {statistics.median(times['sdpa']) * 1e3:.0f} |",
            f"| Keras MHA twin | {statistics.median(times['keras_mha']) * 1e3:.0f} |",
            f"| **ratio** | **{statistics.median(ratios):.3f}** "
            f"({min(ratios):.3f}-{max(ratios):.3f}) |",
            "",
        ]
    )
    print(section)
    if args.output:
        from features import replace_section

        replace_section(args.output, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
