"""Keras's own training step, `model.compile(jit_compile=True)`: the layer against Keras's MHA.

`jit_compile=True` is what `model.compile()`'s default (`jit_compile="auto"`) resolves to on
TensorFlow wherever a GPU is present, so this is the step most users with a GPU run. The same
small model twice (the attention, a mean over the sequence, a dense head; mean squared error,
Adam), once with `keras_sdpa.ScaledDotProductAttention` and once with
`keras.layers.MultiHeadAttention`, each trained by `train_on_batch`, forward and backward and
the update, on new values every step (`common.Fed`).

Usage:
    python benchmarks/keras_fit.py                          # T=256, 512 and 2,048
    python benchmarks/keras_fit.py --lengths 256 --rounds 5
    python benchmarks/keras_fit.py --output BENCHMARKS.md
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    alternate,
    at_least_one,
    command_line,
    cpu_name,
    replace_section,
)

B, E, N, H = 4, 256, 4, 64
START, END = "<!-- keras-fit:start -->", "<!-- keras-fit:end -->"


def make_step(impl, length):
    """`train_on_batch` of the model with `impl` (`"ours"` or `"keras"`), as a `Fed` step."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    import keras_sdpa

    keras.utils.set_random_seed(0)
    layer_class = {
        "ours": keras_sdpa.ScaledDotProductAttention,
        "keras": keras.layers.MultiHeadAttention,
    }[impl]
    inputs = keras.Input((length, E))
    attended = layer_class(num_heads=N, key_dim=H)(inputs, inputs)  # (B, T, E)
    pooled = keras.layers.GlobalAveragePooling1D()(attended)  # (B, E)
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, length, E)).astype("float32")
    y = rng.standard_normal((B, 1)).astype("float32")
    return Fed(model.train_on_batch, [x, y])


def table(results):
    lines = [
        "| T=S | ours ms | Keras MHA ms | ratio (range) |",
        "|---|---|---|---|",
    ]
    for length, t in results.items():
        lines.append(
            f"| {length} | {t['ms']:.1f} | {t['peer_ms']:.1f} | "
            f"**{t['ratio']:.2f}** ({t['low']:.2f}-{t['high']:.2f}) |"
        )
    return "\n".join(lines)


def describe(args):
    return (
        f"{cpu_name()}. TensorFlow, `model.compile(jit_compile=True)`, `train_on_batch`: "
        f"forward, backward and Adam's update as one XLA program. B={B}, E={E}, N={N}, H={H}, "
        f"self-attention without a mask. {NEW_INPUTS} Times: {args.rounds} alternating rounds "
        f"of ours and Keras's after one call each (the compilation), {args.repeats} steps a "
        f"round (median); ratio = ours / Keras (below 1 is faster), the median of the "
        f"per-round ratios with their range.\n"
    )


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 2048])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--repeats", type=int, default=4, help="steps per round")
    parser.add_argument("--output", help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds", "repeats")
    if min(args.lengths) < 1:
        parser.error(f"--lengths must be at least 1. Received: {args.lengths}")
    return args


def main(argv=None):
    args = parse_arguments(argv)
    print(cpu_name())
    results = {}
    for length in args.lengths:
        print(f"T=S={length:5d} ours vs keras ...", end=" ", flush=True)
        ours, keras_mha = make_step("ours", length), make_step("keras", length)
        results[length] = alternate(ours, keras_mha, args.rounds, args.repeats)
        print(results[length], flush=True)
    header, text = describe(args), table(results)
    print()
    print(header)
    print(text)
    if args.output:
        command = command_line(__file__, argv)
        section = (
            "## Keras's training step under `jit_compile=True`\n\n"
            f"Produced by:\n\n    {command}\n\n{header}\n{text}\n"
        )
        replace_section(args.output, START, END, section, before="\n## Notes")


if __name__ == "__main__":
    main()
