"""The chunked path's default blocks against fixed block sizes, measured in one run.

Forward plus backward (the gradients of `sum(out * c)` to q, k and v) of
`keras_sdpa.scaled_dot_product_attention(q, k, v, implementation="chunked")` inside
`tf.function(jit_compile=True)`, B=1, H=64, float32, T=S, for each number of heads and mask:
the default blocks (no `chunk_size`: sized to `B N C^2` scores of 16 MiB,
`keras_sdpa/_core/chunk_sizes.py`) and each `--sizes` block given as `chunk_size`. The dense path
runs beside them where its scores fit `--dense_up_to`.

Times: alternating rounds of every configuration in this one process, one call each a round
after a warm-up call, each call on new input values drawn before its clock starts; a ratio is
against blocks of 2048 (the default before the blocks were sized), the median of the
per-round ratios with their range.

Usage:
    python benchmarks/block_sizes.py                                 # T=8192, N=4 and 8
    python benchmarks/block_sizes.py --length 4096 --heads 8 --rounds 3
    python benchmarks/block_sizes.py --output BENCHMARKS.md          # and its section there
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    at_least_one,
    command_line,
    cpu_name,
    replace_section,
    time_alternating,
)

B, H = 1, 64
START, END = "<!-- block-sizes:start -->", "<!-- block-sizes:end -->"


def make_step(length, heads, causal, chunk_size, implementation="chunked"):
    """A compiled forward plus backward at `T=S=length`, fed new inputs every call."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from keras_sdpa import scaled_dot_product_attention

    @tf.function(jit_compile=True)
    def step(q, k, v, c):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = scaled_dot_product_attention(
                q, k, v, is_causal=causal, implementation=implementation, chunk_size=chunk_size
            )
            loss = tf.reduce_sum(out * c)
        return tape.gradient(loss, [q, k, v])

    inputs = [tf.random.normal((B, length, heads, H), seed=n) for n in range(4)]
    return Fed(lambda *x: [g.numpy() for g in step(*x)], inputs)


def default_blocks(length, heads):
    from keras import ops

    from keras_sdpa._core import plan as _plan
    from keras_sdpa._core import request as _request

    q = ops.zeros((B, length, heads, H))
    plan, _ = _plan.make(q, q, q, request=_request.Request(implementation="chunked"))
    return plan.query_chunk_size, plan.chunk_size


def rows(length, heads, causal, sizes, rounds, dense):
    steps = {"default": make_step(length, heads, causal, None)}
    steps.update({str(size): make_step(length, heads, causal, size) for size in sizes})
    if dense:
        steps["dense"] = make_step(length, heads, causal, None, "dense")
    seconds = time_alternating(steps, rounds)
    base = seconds["2048"]
    cq, ck = default_blocks(length, heads)
    out = []
    for name, times in seconds.items():
        ratios = sorted(a / b for a, b in zip(times, base))
        label = f"default ({cq} x {ck})" if name == "default" else name
        out.append(
            f"| {length} | {heads} | {'causal' if causal else 'none'} | {label} "
            f"| {statistics.median(times) * 1e3:.0f} | **{statistics.median(ratios):.2f}** "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        )
        print(out[-1], flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--dense_up_to", type=float, default=2.0, help="GiB of dense scores")
    parser.add_argument("--output", help="write the table into this Markdown file's section")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds", "length")
    sizes = sorted(set(args.sizes) | {2048})
    lines = [
        "| T=S | N | mask | blocks | ms | / blocks of 2048 (range) |",
        "|---|---|---|---|---|---|",
    ]
    for heads in args.heads:
        for causal in (False, True):
            dense = B * heads * args.length**2 * 4 / 2**30 <= args.dense_up_to
            lines += rows(args.length, heads, causal, sizes, args.rounds, dense)
    section = (
        "## Block sizes of the chunked path\n\n"
        f"Produced by:\n\n    {command_line(__file__, argv)}\n\n"
        f"{cpu_name()}. The core's chunked path, forward plus backward under "
        f"`tf.function(jit_compile=True)`, float32, B={B}, H={H}: the default blocks (sized "
        "to 16 MiB of scores a step) and blocks given as `chunk_size`. "
        f"{NEW_INPUTS} Times: {args.rounds} alternating rounds of one call each after a "
        "warm-up call (median); a ratio is against blocks of 2048, the median of the "
        "per-round ratios with their range.\n\n" + "\n".join(lines) + "\n"
    )
    print()
    print(section)
    if args.output:
        replace_section(args.output, START, END, section, before="\n## Notes")


if __name__ == "__main__":
    main()
