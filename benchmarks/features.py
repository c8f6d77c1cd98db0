"""What the new core arguments cost and save: a sliding window, and grouped key/value heads.

Two comparisons of `keras_sdpa.ops.scaled_dot_product_attention`, forward plus
backward (the gradient of `sum(out * c)` with respect to q, k and v):

    window   chunked path with `sliding_window=W` against full chunked attention,
             B=1, N=4, H=64, T=S (default 16,384, W=512). The chunked loops skip the
             blocks outside the band, so the time should fall by about T / (W + C).
    gqa      8 query heads reading 2 key/value heads (GQA 8/2) against 8 full heads,
             B=1, H=64, T=S (default 4,096, the chunked path).

Times come from alternating rounds of the two in one process; the table gives the
median of the per-round ratios and their range. Every timed call gets new input values
(q, k, v and the cotangent c), drawn before its clock starts (`common.Fed`). Peak resident
memory comes from one child process per implementation, where it is that implementation's
own.

Usage:
    python benchmarks/features.py                          # both tables
    python benchmarks/features.py --rounds 5 --output BENCHMARKS.md
    python benchmarks/features.py --window_length 4096 --gqa_length 2048   # quicker
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    at_least_one,
    child_peak_mib,
    cpu_name,
    replace_section,
)

START, END = "<!-- features:start -->", "<!-- features:end -->"
H = 64
# The two comparisons: the row's label, ours, the peer, and the flag that sets their T=S.
COMPARISONS = (
    (
        "chunked, sliding_window={window} vs full chunked (N=4)",
        "window_chunked",
        "full_chunked",
        "window_length",
    ),
    ("GQA 8 query / 2 key-value heads vs 8 full heads", "gqa_8_2", "mha_8", "gqa_length"),
)


def variant_arguments(name, window):
    """The query heads, the key/value heads and the core's keyword arguments of a variant."""
    return {
        "full_chunked": (4, 4, dict(implementation="chunked")),
        "window_chunked": (4, 4, dict(implementation="chunked", sliding_window=window)),
        "mha_8": (8, 8, dict()),
        "gqa_8_2": (8, 2, dict()),
    }[name]


def make_step(variant, length, window):
    """A compiled forward+backward step of one variant, fed new q, k, v and c each call
    (`common.Fed`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from keras_sdpa.ops import scaled_dot_product_attention

    heads, kv_heads, kwargs = variant_arguments(variant, window)
    q = tf.random.normal((1, length, heads, H), seed=1)
    k = tf.random.normal((1, length, kv_heads, H), seed=2)
    v = tf.random.normal((1, length, kv_heads, H), seed=3)
    c = tf.random.normal((1, length, heads, H), seed=4)

    # Arguments, not captured tensors: what a compiled step captures can be a compile-time
    # constant, and the same values every call could hide a recompilation.
    @tf.function
    def step(q, k, v, c):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(scaled_dot_product_attention(q, k, v, **kwargs) * c)
        return tape.gradient(loss, [q, k, v])

    return Fed(lambda *inputs: step(*inputs)[0].numpy(), [q, k, v, c])


def timed(step):
    """Seconds of one call of a `Fed` step, its new inputs drawn before the clock starts."""
    inputs = step.draw()
    start = time.perf_counter()
    step.run(*inputs)
    return time.perf_counter() - start


def alternate(ours, peer, length, window, rounds):
    """Per-round times of two variants, alternating in this process."""
    steps = {name: make_step(name, length, window) for name in (ours, peer)}
    for step in steps.values():
        step()  # trace and compile
    times = {ours: [], peer: []}
    for index in range(rounds):
        order = (ours, peer) if index % 2 == 0 else (peer, ours)
        for name in order:
            times[name].append(timed(steps[name]))
        print(
            f"  round {index + 1}/{rounds}: {ours} {times[ours][-1]:.2f} s, "
            f"{peer} {times[peer][-1]:.2f} s",
            file=sys.stderr,
        )
    return times


def peak_memory(variant, length, window):
    """In a child process: peak resident MiB above the level before the first call."""
    return child_peak_mib("features", (variant, length, window))


def row(label, ours, peer, length, window, rounds):
    print(f"{label}: T={length}", file=sys.stderr)
    times = alternate(ours, peer, length, window, rounds)
    ratios = [a / b for a, b in zip(times[ours], times[peer])]
    memory = {name: peak_memory(name, length, window) for name in (ours, peer)}
    return {
        "label": label,
        "length": length,
        "ours_s": statistics.median(times[ours]),
        "peer_s": statistics.median(times[peer]),
        "ratio": statistics.median(ratios),
        "low": min(ratios),
        "high": max(ratios),
        "ours_mib": memory[ours],
        "peer_mib": memory[peer],
    }


def table(rows, args):
    lines = [
        "## Sliding window and grouped heads",
        "",
        "Produced by:",
        "",
        f"    python benchmarks/features.py --rounds {args.rounds} --output BENCHMARKS.md",
        "",
        f"On {cpu_name()}. "
        "`keras_sdpa.ops.scaled_dot_product_attention`, forward plus backward, B=1, H=64. "
        f"{NEW_INPUTS} Times: {args.rounds} alternating rounds in one process after one "
        "warm-up each; "
        "ratio = median of the per-round ratios (range in brackets). Peak MiB: resident "
        "memory above the level before the first call, one child process each "
        "(compilation included).",
        "",
        "| comparison | T=S | ours s | peer s | time ratio | ours peak MiB | peer peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['length']} | {r['ours_s']:.2f} | {r['peer_s']:.2f} | "
            f"**{r['ratio']:.3f}** ({r['low']:.3f}-{r['high']:.3f}) | {r['ours_mib']} | "
            f"{r['peer_mib']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--window_length", type=int, default=16384)
    parser.add_argument("--gqa_length", type=int, default=4096)
    parser.add_argument("--output", help="a Markdown file whose features section is replaced")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds")
    rows = [
        row(
            label.format(window=args.window),
            ours,
            peer,
            getattr(args, flag),
            args.window,
            args.rounds,
        )
        for label, ours, peer, flag in COMPARISONS
    ]
    section = table(rows, args)
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
