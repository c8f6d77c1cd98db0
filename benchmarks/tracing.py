"""What a caller's `tf.function` pays to trace the core: this package as written, against the
same code converted by AutoGraph.

A `tf.function` converts what it calls with AutoGraph, and everything that calls, on its first
trace. `scaled_dot_product_attention` and `create_block_mask` are `do_not_convert`: their
branches are on static values, so conversion changes nothing but the time. Here a caller's
`tf.function` computes the chunked path's forward and gradient with a document `mask_mod`
through a block map (T=S=256, B=2, N=4, H=32), once with the public functions ("as written")
and once with their undecorated originals (`__wrapped__`, which AutoGraph converts, as it
did before).

Each first call (trace, conversion, XLA compilation and one run) is timed in a new process,
since AutoGraph keeps what it converted for the life of a process; the two run in alternating
rounds, and the table gives the median of the per-round ratios and their range.

Usage:
    python benchmarks/tracing.py                                  # the table
    python benchmarks/tracing.py --rounds 5 --output BENCHMARKS.md
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import at_least_one, cpu_name, replace_section  # noqa: E402

START, END = "<!-- tracing:start -->", "<!-- tracing:end -->"
B, T, N, H = 2, 256, 4, 32
VARIANTS = ("as_written", "converted")


def first_call_seconds(variant):
    """In this process: seconds of the first call of a caller's `tf.function`."""
    import time

    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    from keras_sdpa import mods, ops

    attend, block_mask = ops.scaled_dot_product_attention, ops.create_block_mask
    if variant == "converted":
        attend, block_mask = attend.__wrapped__, block_mask.__wrapped__
    segments = tf.constant(np.repeat(np.arange(4), T // 4)[None].repeat(B, 0))  # (B, T)
    q, k, v = (tf.random.normal((B, T, N, H), seed=seed) for seed in range(3))

    @tf.function
    def step(q, k, v):
        mod = mods.document(segments)
        blocks = block_mask(mod, B, N, T, T, block_size=64)
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v, mask_mod=mod, block_mask=blocks, implementation="chunked")
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, [q, k, v])

    start = time.perf_counter()
    step(q, k, v)[0].numpy()
    return time.perf_counter() - start


def child(variant):
    here = os.path.dirname(os.path.abspath(__file__))
    script = (
        f"import sys, json; sys.path.insert(0, {here!r}); import tracing as m; "
        f"print(json.dumps(m.first_call_seconds({variant!r})))"
    )
    # XLA's defaults, and no persistent cache (`TF_XLA_FLAGS`): every first call compiles.
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("XLA_FLAGS", "TF_XLA_FLAGS")
    }
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        raise RuntimeError(f"{variant} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(seconds, args):
    ratios = [a / b for a, b in zip(seconds["as_written"], seconds["converted"])]
    ours, peer = (statistics.median(seconds[v]) for v in VARIANTS)
    return "\n".join(
        [
            "## Tracing the core inside a caller's tf.function",
            "",
            "Produced by:",
            "",
            f"    python benchmarks/tracing.py --rounds {args.rounds} --output BENCHMARKS.md",
            "",
            f"On {cpu_name()}. The first call of a caller's `tf.function` (trace, AutoGraph, "
            f"XLA compilation and one run): the chunked path's forward and gradient with a "
            f"document `mask_mod` and its block map, B={B}, T=S={T}, N={N}, H={H}. A new "
            f"process for each call, under XLA's default flags and without a persistent XLA "
            f"cache, {args.rounds} alternating rounds; ratio = median of the per-round ratios "
            "(range in brackets).",
            "",
            "| the package's entry points | first call s | time ratio |",
            "|---|---|---|",
            f"| as written (`do_not_convert`) | {ours:.2f} | **{statistics.median(ratios):.3f}** "
            f"({min(ratios):.3f}-{max(ratios):.3f}) |",
            f"| converted by AutoGraph (`__wrapped__`) | {peer:.2f} | 1 |",
        ]
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="a Markdown file whose trace section is replaced")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds")
    seconds = {variant: [] for variant in VARIANTS}
    for index in range(args.rounds):
        for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
            seconds[variant].append(child(variant))
            print(f"round {index + 1}: {variant} {seconds[variant][-1]:.2f} s", file=sys.stderr)
    section = table(seconds, args)
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)


if __name__ == "__main__":
    main()
