"""The chunked path under `mixed_bfloat16` against itself in float32, at long lengths.

One self-attention layer (`keras_sdpa.ScaledDotProductAttention(implementation="chunked")`,
B=1, E=256, N=4, H=64, `chunk_size` 2048), forward plus backward, built twice in one
process: with `dtype="float32"` and with `dtype="mixed_bfloat16"` (bfloat16 products with
float32 accumulation in the core, bfloat16 projections). Alternating rounds, one call of
each per round after a warm-up call; the ratio is the median of the per-round ratios
(mixed / float32), with their range. Every timed call gets a new input `x`, drawn before its
clock starts (`long_sequences.make_step` returns a `common.Fed` step).

Usage:
    python benchmarks/chunked_mixed.py                       # T=S=8192, 3 rounds
    python benchmarks/chunked_mixed.py --lengths 8192 --output BENCHMARKS.md
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    command_line,
    cpu_name,
    replace_section,
    time_alternating,
)
from long_sequences import B, E, H, N, make_step  # noqa: E402

START, END = "<!-- chunked-mixed:start -->", "<!-- chunked-mixed:end -->"
POLICIES = ("float32", "mixed_bfloat16")


def alternate(length, chunk_size, rounds):
    steps = {policy: make_step("sdpa_chunked", length, chunk_size, policy) for policy in POLICIES}
    seconds = time_alternating(steps, rounds)
    ratios = sorted(a / b for a, b in zip(seconds["mixed_bfloat16"], seconds["float32"]))
    return {policy: statistics.median(t) * 1e3 for policy, t in seconds.items()}, ratios


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk_size", type=int, default=2048)
    parser.add_argument("--output", help="a Markdown file whose chunked-mixed section is replaced")
    args = parser.parse_args(argv)
    lines = [
        "## The chunked path under mixed_bfloat16",
        "",
        "Produced by:",
        "",
        f"    {command_line(__file__, argv)}",
        "",
        f"{cpu_name()}. One chunked self-attention layer, forward plus backward, B={B}, E={E}, "
        f"N={N}, H={H}, chunk_size={args.chunk_size}. {NEW_INPUTS} Times: {args.rounds} "
        "alternating rounds in one process after a warm-up call each; ratio = median of the "
        "per-round ratios (mixed_bfloat16 / float32), range in brackets.",
        "",
        "| T=S | float32 ms | mixed_bfloat16 ms | ratio (range) |",
        "|---|---|---|---|",
    ]
    for length in args.lengths:
        print(f"T=S={length} ...", file=sys.stderr, flush=True)
        ms, ratios = alternate(length, args.chunk_size, args.rounds)
        lines.append(
            f"| {length} | {ms['float32']:.0f} | {ms['mixed_bfloat16']:.0f} | "
            f"**{statistics.median(ratios):.2f}** ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        )
    section = "\n".join(lines) + "\n"
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)


if __name__ == "__main__":
    main()
