"""One training step of the app's classifier, as shipped, against its Keras-MHA twin.

The shipped configuration (`apps.train_sentiment`'s defaults: E=64, 2 heads of 32, one block
plus attention pooling over each token's embedding, vocabulary 30,000 with 200,000 word pairs
and 200,000 triples 16 wide, batch 64, the app's Adam) is built twice by
`apps.classifier.model.build_classifier`: once as shipped, on
`keras_sdpa.ScaledDotProductAttention`, and once with `keras.layers.MultiHeadAttention` in its
place (same arguments, same weights copied over). Each step is `model.train_on_batch` on a
batch of random token ids, cut to `--length` (one of the app's length buckets: 512, the
longest, by default), compiled as the app compiles it (`apps.classifier.optimizer.Adam`,
`jit_compile=False`: the attention core is XLA-compiled on its own). Every timed step gets new
input values, drawn before its clock starts (`common.Fed`): the batch's rows, ids and labels
together, rotated by one, so each review keeps its label and its padding.

Rounds alternate the two in one process; the table gives the median of the
per-round ratios (ours / Keras) and their range.

`--mixed_precision mixed_bfloat16` instead times the shipped classifier built under that
dtype policy against itself in float32 (same weights), as `apps.train_sentiment
--mixed_precision` builds it, into its own section.

Usage:
    python benchmarks/app_step.py                       # 15 rounds of 5 steps
    python benchmarks/app_step.py --rounds 21 --output BENCHMARKS.md
    python benchmarks/app_step.py --mixed_precision mixed_bfloat16 --output BENCHMARKS.md
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import NEW_INPUTS, Fed, cpu_name, replace_section  # noqa: E402

START, END = "<!-- app-step:start -->", "<!-- app-step:end -->"
MIXED_START, MIXED_END = "<!-- app-step-mixed:start -->", "<!-- app-step-mixed:end -->"
MODEL_ARGUMENTS = (
    "vocab_size",
    "sequence_length",
    "embed_dim",
    "num_heads",
    "key_dim",
    "ff_dim",
    "num_layers",
    "dropout",
    "seed",
    "bigram_vocab_size",
    "trigram_vocab_size",
    "ngram_dim",
    "pooling_values",
)


def shipped_config():
    """The model arguments and batch size of `apps.train_sentiment`'s defaults."""
    from apps.training.config import Config

    config = Config()
    return {name: getattr(config, name) for name in MODEL_ARGUMENTS}, config.batch_size


def build(kind, ids, config, policy="float32"):
    """The classifier as shipped (`"sdpa"`) or with Keras's MultiHeadAttention (`"keras_mha"`),
    its layers built under the dtype `policy`."""
    import keras

    from apps.classifier import model as model_lib
    from apps.classifier import pooling
    from apps.classifier.optimizer import Adam
    from apps.training.build import dtype_policy

    class KerasTwin(keras.layers.MultiHeadAttention):
        """Keras's layer under our layer's arguments: it has no `scale`, only the default."""

        def __init__(self, *args, scale=None, **kwargs):
            if scale is not None:
                raise ValueError(f"The Keras twin takes no `scale`. Received: scale={scale}")
            super().__init__(*args, **kwargs)

    # The blocks (`model`) and the pooling (`pooling`) each name the attention layer.
    modules = (model_lib, pooling)
    original = model_lib.ScaledDotProductAttention
    if kind == "keras_mha":
        for module in modules:
            module.ScaledDotProductAttention = KerasTwin
    try:
        keras.utils.set_random_seed(0)
        with dtype_policy(policy):
            model, _ = model_lib.build_classifier(**config)
    finally:
        for module in modules:
            module.ScaledDotProductAttention = original
    embedding = model.get_layer("embedding")
    if config["bigram_vocab_size"]:
        embedding.adapt_bigrams(ids)  # the word-pair vocabulary
    if config["trigram_vocab_size"]:
        embedding.adapt_trigrams(ids)
    model.compile(Adam(1e-3), "binary_crossentropy", jit_compile=False)
    return model


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--output", help="a Markdown file whose app-step section is replaced")
    parser.add_argument(
        "--length", type=int, help="tokens per batch, a length bucket (default: the app's longest)"
    )
    parser.add_argument(
        "--mixed_precision", help="time this dtype policy against float32 instead of Keras MHA"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(
            f"--rounds and --steps must be at least 1. Received: {args.rounds}, {args.steps}"
        )
    return parser, args


def random_batch(length, config, batch):
    """Token ids (padded past each review's length) and labels of one batch, seeded."""
    import numpy as np

    rng = np.random.default_rng(0)
    # Real reviews vary: a bucket holds reviews from the bucket below it up to its length.
    lengths = rng.integers(max(1, length * 2 // 3), length + 1, batch)
    ids = rng.integers(2, config["vocab_size"], (batch, length))
    ids[np.arange(length)[None, :] >= lengths[:, None]] = 0  # padding
    labels = rng.integers(0, 2, batch).astype("float32")
    return ids, labels


class Rotated(Fed):
    """`model.train_on_batch(ids, labels)` as a `Fed` step whose inputs are all rotated by one
    row each call, the float labels too (0 or 1, not drawn as normals): each row keeps its
    label and its padding, and the batch's values change."""

    def draw(self):
        import keras
        import numpy as np

        self.arrays = [np.roll(x, 1, axis=0) for x in self.arrays]
        return [keras.ops.convert_to_tensor(x, str(x.dtype)) for x in self.arrays]


def time_steps(args, models, ids, labels):
    """Seconds per step of each model (the first one's weights copied into the second), in
    alternating rounds of `--steps` steps after two that trace and compile; each step's
    inputs drawn (`Rotated`) before its clock starts."""
    names = list(models)
    models[names[1]].set_weights(models[names[0]].get_weights())
    steps = {name: Rotated(model.train_on_batch, [ids, labels]) for name, model in models.items()}
    for step in steps.values():
        step()  # trace and compile
        step()
    times = {name: [] for name in models}
    for index in range(args.rounds):
        order = list(models) if index % 2 == 0 else list(reversed(models))
        for name in order:
            seconds = 0.0
            for _ in range(args.steps):
                inputs = steps[name].draw()
                start = time.perf_counter()
                steps[name].run(*inputs)
                seconds += time.perf_counter() - start
            times[name].append(seconds / args.steps)
        latest = ", ".join(f"{name} {times[name][-1] * 1e3:.0f} ms" for name in names)
        print(f"  round {index + 1}/{args.rounds}: {latest}", file=sys.stderr)
    return times


def describe(args, config, length, batch, names):
    """The section's title, its command's flags, what it compares, its rows (label, model),
    what its ratio divides and its markers."""
    if args.mixed_precision:
        what = (
            f"The shipped classifier (L={length}, batch {batch}) built under "
            f"`{args.mixed_precision}` "
            "(as `apps.train_sentiment --mixed_precision` builds it) against itself in float32, "
            "same weights; `train_on_batch`"
        )
        title = f"The app's training step under {args.mixed_precision}"
        flags = f"--mixed_precision {args.mixed_precision} "
        rows = [(name, name) for name in names]
        return title, flags, what, rows, "mixed / float32", (MIXED_START, MIXED_END)
    what = (
        "The shipped classifier (E=64, 2 heads of 32, one block plus attention pooling over "
        f"the embeddings, L={length}, batch {batch}, dropout {config['dropout']}, word pairs "
        "and triples) against the same "
        "model with `keras.layers.MultiHeadAttention` swapped in, same weights; "
        "`train_on_batch` as the app compiles it (its Adam, `jit_compile=False`)"
    )
    rows = [("shipped, keras_sdpa", "sdpa"), ("Keras MHA twin", "keras_mha")]
    return "The app's training step", "", what, rows, "ours / Keras", (START, END)


def section_text(args, length, times, ratios, description):
    title, flags, what, rows, ratio_of, _ = description
    return "\n".join(
        [
            f"## {title}",
            "",
            "Produced by:",
            "",
            f"    python benchmarks/app_step.py {flags}--rounds {args.rounds} --steps {args.steps} "
            f"{'' if args.length is None else f'--length {length} '}--output BENCHMARKS.md",
            "",
            f"On {cpu_name()}. {what}; {args.rounds} alternating rounds of {args.steps} steps "
            f"in one process. {NEW_INPUTS} Here the batch's token ids and their labels are "
            "rotated together, each review keeping its label. Ratio = median of the per-round "
            f"ratios ({ratio_of}; range in brackets).",
            "",
            "| model | ms per step (median) |",
            "|---|---|",
            *(f"| {label} | {statistics.median(times[name]) * 1e3:.0f} |" for label, name in rows),
            f"| **ratio** | **{statistics.median(ratios):.3f}** "
            f"({min(ratios):.3f}-{max(ratios):.3f}) |",
            "",
        ]
    )


def main(argv=None):
    parser, args = parse_arguments(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config, batch = shipped_config()
    length = args.length or config["sequence_length"]
    if not 2 <= length <= config["sequence_length"]:
        parser.error(
            f"--length must be between 2 and {config['sequence_length']}. Received: {length}"
        )
    ids, labels = random_batch(length, config, batch)
    if args.mixed_precision:
        names = ("float32", args.mixed_precision)
        models = {name: build("sdpa", ids, config, name) for name in names}
    else:
        names = ("sdpa", "keras_mha")
        models = {kind: build(kind, ids, config) for kind in names}
    times = time_steps(args, models, ids, labels)
    ratios = [a / b for a, b in zip(times[names[0]], times[names[1]])]
    if args.mixed_precision:
        ratios = [1 / ratio for ratio in ratios]  # mixed over float32
    description = describe(args, config, length, batch, names)
    section = section_text(args, length, times, ratios, description)
    print(section)
    if args.output:
        replace_section(args.output, *description[-1], section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
