"""What `score_mod` and `mask_mod` cost and save, against the unmasked core and the built-ins.

`keras_sdpa.ops.scaled_dot_product_attention`, forward plus backward (the gradient of
`sum(out * c)` with respect to q, k and v), B=1, N=4, H=64:

    skipping   chunked, T=S=8,192: a mask_mod against no mask at all. The chunked loops
               never compute the blocks the mod empties, so the time falls with them:
               causal (about half the blocks) as `mods.causal()` and as a plain function,
               document with 8 equal segments (1/8), sliding_window(512).
               `mods.causal()` and `mods.sliding_window()` run as the built-in arguments
               (skipped by range); the plain function and `document` go through the block
               map.
    same as    a mod against the built-in argument that computes the same thing: causal
               as `mask_mod` (the built-in mod, and a plain function) against
               `is_causal=True`, ALiBi as `score_mod` against the same ALiBi as
               `attention_bias`, on the chunked path (T=8,192) and the dense one (T=2,048).
    memory     chunked with a document mask (8 equal segments) at T=16,384 and T=32,768:
               peak resident memory in a child process each. O(T) memory doubles with T;
               anything of size T x S would quadruple.

Times come from alternating rounds of the two in one process; the table gives the median of
the per-round ratios and their range. Every timed call gets new input values (q, k, v, the
cotangent c, and the segment ids or the bias where a variant reads them), drawn before its
clock starts (`common.Fed`).

Usage:
    python benchmarks/mods.py                                  # the table
    python benchmarks/mods.py --rounds 5 --output BENCHMARKS.md
    python benchmarks/mods.py --length 4096 --dense_length 1024 --memory_lengths 8192,16384
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
    child_peak_mib,
    cpu_name,
    replace_section,
    time_alternating,
)

START, END = "<!-- mods:start -->", "<!-- mods:end -->"
N, H = 4, 64


def arguments(variant, length):
    """The core's keyword arguments for one variant at `T=S=length`, as a function of the
    variant's tensors (the segment ids of `document`, the ALiBi bias), and those tensors."""
    import numpy as np

    from keras_sdpa import mods

    path = dict(implementation="dense" if variant.endswith("_dense") else "chunked")
    variant = variant.removesuffix("_dense")
    if variant == "document_mod":  # (1, T); `Fed` rotates them over B=1: the same values
        segments = np.repeat(np.arange(8), -(-length // 8))[None, :length]
        return lambda ids: dict(mask_mod=mods.document(ids), **path), [segments]
    if variant == "alibi_bias":  # (1, N, T, S); redrawn as floats of ALiBi's mean and spread,
        # which cost what ALiBi's values do (the core reads a bias whatever its values)
        distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
        slopes = mods.alibi_slopes(N)[:, None, None]
        bias = (-slopes * distance)[None].astype("float32")
        return lambda bias: dict(bias=bias, **path), [bias]
    kwargs = {
        "none": dict(),
        "causal_mod": dict(mask_mod=mods.causal()),
        "causal_fn": dict(mask_mod=causal_function),
        "causal_arg": dict(is_causal=True),
        "window_mod": dict(mask_mod=mods.sliding_window(512)),
        "alibi_mod": dict(score_mod=mods.alibi(N)),
    }[variant] | path
    return lambda: kwargs, []


def causal_function(b, h, q_idx, kv_idx):
    """Causal as a plain function: the block map and per-block tests, not the built-in."""
    return q_idx >= kv_idx


def make_step(variant, length):
    """A compiled forward+backward step of one variant, fed new q, k, v, c and the variant's
    tensors each call (`common.Fed`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from keras_sdpa.ops import scaled_dot_product_attention

    kwargs_of, tensors = arguments(variant, length)
    q, k, v, c = (tf.random.normal((1, length, N, H), seed=seed) for seed in range(4))

    # Arguments, not captured tensors: what a compiled step captures can be a compile-time
    # constant, and the same values every call could hide a recompilation.
    @tf.function
    def step(q, k, v, c, *tensors):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = scaled_dot_product_attention(q, k, v, **kwargs_of(*tensors))
            loss = tf.reduce_sum(out * c)
        return tape.gradient(loss, [q, k, v])

    return Fed(lambda *inputs: step(*inputs)[0].numpy(), [q, k, v, c, *tensors])


def compare(label, ours, peer, length, rounds, target):
    print(f"{label}: T={length}", file=sys.stderr)
    steps = {ours: make_step(ours, length), peer: make_step(peer, length)}
    seconds = time_alternating(steps, rounds)
    ratios = [a / b for a, b in zip(seconds[ours], seconds[peer])]
    print(f"  ratios {[round(r, 3) for r in ratios]}", file=sys.stderr)
    return {
        "label": label,
        "length": length,
        "ours_s": statistics.median(seconds[ours]),
        "peer_s": statistics.median(seconds[peer]),
        "ratio": statistics.median(ratios),
        "low": min(ratios),
        "high": max(ratios),
        "target": target,
    }


def peak_memory(variant, length):
    """In a child process: peak resident MiB above the level before the first call."""
    return child_peak_mib("mods", (variant, length), timeout=3600)


def table(rows, memory, args):
    lines = [
        "## Programmable attention: score_mod and mask_mod",
        "",
        "Produced by:",
        "",
        f"    python benchmarks/mods.py --rounds {args.rounds} --output BENCHMARKS.md",
        "",
        f"On {cpu_name()}. "
        f"`keras_sdpa.ops.scaled_dot_product_attention`, forward plus backward, B=1, N={N}, "
        f"H={H}, default block sizes (2048 unmasked, 512 causal or with a mask_mod, 256 for "
        f"the window of 512). {NEW_INPUTS} Times: {args.rounds} alternating rounds in one "
        "process after one warm-up each; ratio = median of the per-round ratios (range in "
        "brackets).",
        "",
        "| comparison | T=S | ours s | peer s | time ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = "yes" if r["ratio"] <= r["target"] else "**no**"
        lines.append(
            f"| {r['label']} | {r['length']} | {r['ours_s']:.3f} | {r['peer_s']:.3f} | "
            f"**{r['ratio']:.3f}** ({r['low']:.3f}-{r['high']:.3f}) | <= {r['target']:.2f} | "
            f"{met} |"
        )
    lines += [
        "",
        "Peak memory of the chunked path with a document mask (8 equal segments), resident "
        "MiB above the level before the first call, one child process each (compilation "
        "included):",
        "",
        "| T=S | peak MiB |",
        "|---|---|",
    ]
    lines += [f"| {length} | {mib} |" for length, mib in memory]
    if len(memory) == 2 and all(isinstance(m, int) for _, m in memory):
        growth = memory[1][1] / max(memory[0][1], 1)
        factor = memory[1][0] / memory[0][0]
        lines += [
            "",
            f"T x{factor:g}: peak memory x{growth:.2f} (linear would be x{factor:g}, "
            f"T x S would be x{factor * factor:g}).",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--dense_length", type=int, default=2048)
    parser.add_argument("--memory_lengths", default="16384,32768")
    parser.add_argument("--output", help="a Markdown file whose mods section is replaced")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds")
    lengths = [int(x) for x in args.memory_lengths.split(",") if x]
    t, d = args.length, args.dense_length
    rows = [
        compare("`mods.causal()` vs no mask, chunked", "causal_mod", "none", t, args.rounds, 0.60),
        compare(
            "causal as a plain function vs no mask, chunked",
            "causal_fn",
            "none",
            t,
            args.rounds,
            0.60,
        ),
        compare(
            "`document` (8 segments) vs no mask, chunked",
            "document_mod",
            "none",
            t,
            args.rounds,
            0.25,
        ),
        compare(
            "`sliding_window(512)` vs no mask, chunked", "window_mod", "none", t, args.rounds, 0.20
        ),
        compare(
            "`mods.causal()` vs `is_causal=True`, chunked",
            "causal_mod",
            "causal_arg",
            t,
            args.rounds,
            1.10,
        ),
        compare(
            "causal as a plain function vs `is_causal=True`, chunked",
            "causal_fn",
            "causal_arg",
            t,
            args.rounds,
            1.10,
        ),
        compare(
            "ALiBi `score_mod` vs ALiBi `bias`, chunked",
            "alibi_mod",
            "alibi_bias",
            t,
            args.rounds,
            1.10,
        ),
        compare(
            "causal as a plain function vs `is_causal=True`, dense",
            "causal_fn_dense",
            "causal_arg_dense",
            d,
            args.rounds,
            1.10,
        ),
        compare(
            "ALiBi `score_mod` vs ALiBi `bias`, dense",
            "alibi_mod_dense",
            "alibi_bias_dense",
            d,
            args.rounds,
            1.10,
        ),
    ]
    memory = [(length, peak_memory("document_mod", length)) for length in lengths]
    section = table(rows, memory, args)
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
