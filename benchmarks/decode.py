"""Generation with the key/value cache: time per token against keras-hub, and cache memory.

One jit-compiled program generates `STEPS` tokens in a `tf.while_loop` whose state carries
the cache, as keras-hub's `generate` does. Each step is one attention layer's call on one new
token, N=8 heads of H=64 (E=512), the cache of length S filled up to the step's position:

    keras-hub  per-token time of `ScaledDotProductAttention(..., cache=, cache_update_index=,
               use_causal_mask=True)` against keras-hub's `CachedMultiHeadAttention` with
               the same weights and the (B, 1, S) mask its `TransformerDecoder` builds from
               the index, at S = 1,024, 8,192 and 32,768, B = 1 and 8.
    no cache   the same layer recomputing the whole causal prefix for each token (the last
               row kept), against one cached step, at S = 1,024: the speed-up.
    memory     the cached loop at S = 32,768, B = 1, with 8 key/value heads (MHA) and 2
               (GQA, 4 query heads a group): peak resident MiB above the level after the
               imports, in a child process each (the cache and the compilation included).

Times come from alternating rounds of the two in one process; the table gives the median of
the per-round ratios and their range. Every timed call gets new input values (the token and
the cache's contents, or the prefix), drawn before its clock starts (`common.Fed`).

Usage:
    python benchmarks/decode.py                                  # the table
    python benchmarks/decode.py --rounds 5 --output BENCHMARKS.md
    python benchmarks/decode.py --lengths 1024 --batches 1       # a quick look
"""

import argparse
import os
import sys

# Imported before the memory baseline of a child process (`child_peak_mib` imports this
# module first), so that the peak counts the cache, the step and its compilation only.
import keras
import tensorflow as tf
from keras_hub.layers import CachedMultiHeadAttention

from keras_sdpa import ScaledDotProductAttention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    alternate,
    at_least_one,
    child_peak_mib,
    cpu_name,
    replace_section,
)

START, END = "<!-- decode:start -->", "<!-- decode:end -->"
N, H = 8, 64
STEPS = 16


def make_step(kind, batch, length, kv_heads=N):
    """A `common.Fed` step that generates `STEPS` tokens (or, for "ours_nocache", one) and
    waits: its token and cache (or prefix) are arguments, new values every call."""
    keras.utils.set_random_seed(0)
    width = N * H
    token = tf.random.normal((batch, 1, width))
    if kind == "keras_hub":
        layer = CachedMultiHeadAttention(num_heads=N, key_dim=H)
    else:
        layer = ScaledDotProductAttention(num_heads=N, key_dim=H, num_key_value_heads=kv_heads)
    layer(token, token)  # build

    if kind == "ours_nocache":

        @tf.function(jit_compile=True)
        def recompute(prefix):
            return layer(prefix, prefix, use_causal_mask=True)[:, -1]

        prefix = tf.random.normal((batch, length, width))
        return Fed(lambda prefix: recompute(prefix).numpy(), [prefix])

    def attend(x, cache, index):
        if kind == "keras_hub":
            mask = tf.range(length)[None, None, :] <= index  # (1, 1, S), as TransformerDecoder
            return layer(x, x, cache=cache, cache_update_index=index, attention_mask=mask)
        return layer(x, x, cache=cache, cache_update_index=index, use_causal_mask=True)

    @tf.function(jit_compile=True)
    def generate(x, cache):
        def step(i, x, cache):
            # The positions stay fixed: the last STEPS of the cache, from the Python int
            # `length` that selects the program (its shapes); the cache's contents are new.
            x, cache = attend(x, cache, length - STEPS + i)
            return i + 1, x, cache

        return tf.while_loop(lambda i, *_: i < STEPS, step, (tf.constant(0), x, cache))[1]

    cache = tf.random.normal((batch, 2, length, kv_heads if kind == "ours" else N, H))
    return Fed(lambda x, cache: generate(x, cache).numpy(), [token, cache])


def per_token(ours, peer, rounds, ours_tokens, peer_tokens):
    """`common.alternate`'s rounds (3 calls each), in milliseconds per generated token."""
    result = alternate(ours, peer, rounds, repeats=3)
    scale = peer_tokens / ours_tokens  # a call of ours makes ours_tokens, the peer's peer_tokens
    return {
        "ours_ms": result["ms"] / ours_tokens,
        "peer_ms": result["peer_ms"] / peer_tokens,
        **{key: result[key] * scale for key in ("ratio", "low", "high")},
    }


def table(rows, nocache, memory, args):
    lines = [
        "## Generation with the key/value cache",
        "",
        "Produced by:",
        "",
        f"    python benchmarks/decode.py --rounds {args.rounds} --output BENCHMARKS.md",
        "",
        f"On {cpu_name()}. One attention layer, N={N} heads of H={H}, float32, {STEPS} tokens "
        "a call of one jit-compiled `tf.while_loop` carrying the cache (as keras-hub's "
        f"`generate`). {NEW_INPUTS} Times: {args.rounds} alternating rounds in one process "
        "after one warm-up each; ratio = median of the per-round ratios (range in brackets).",
        "",
        "Per generated token, against keras-hub's `CachedMultiHeadAttention` (same weights; "
        "its mask built from the index as its `TransformerDecoder` does; ours with "
        "`use_causal_mask=True`):",
        "",
        "| B | S | ours ms/token | keras-hub ms/token | time ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = "yes" if r["ratio"] <= 0.8 else "**no**"
        lines.append(
            f"| {r['batch']} | {r['length']} | {r['ours_ms']:.2f} | {r['peer_ms']:.2f} | "
            f"**{r['ratio']:.3f}** ({r['low']:.3f}-{r['high']:.3f}) | <= 0.80 | {met} |"
        )
    if nocache:
        speedup = 1.0 / nocache["ratio"]
        lines += [
            "",
            f"Against no cache (the layer recomputing the causal prefix of {nocache['length']} "
            "for each token, B=1): "
            f"{nocache['ours_ms']:.2f} ms against {nocache['peer_ms']:.2f} ms a token, "
            f"**{speedup:.1f}x faster** (range {1 / nocache['high']:.1f}-"
            f"{1 / nocache['low']:.1f}x).",
        ]
    if memory:
        lines += [
            "",
            f"Peak memory of {STEPS} cached steps at S={args.memory_length}, B=1 (resident MiB "
            "above the level with the weights and the cache in place: the compiled loop, its "
            "compilation and its copies, one child process each); "
            "the cache itself is B x 2 x S x K x H x 4 bytes:",
            "",
            "| key/value heads K | cache MiB | peak MiB |",
            "|---|---|---|",
        ]
        for heads, mib in memory:
            size = 2 * args.memory_length * heads * H * 4 / 2**20
            lines.append(f"| {heads} ({'MHA' if heads == N else 'GQA'}) | {size:.0f} | {mib} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument(
        "--max_tokens",
        type=int,
        default=8 * 8192,
        help="skip B x S above this (B=8 at S=32,768 takes minutes a round)",
    )
    parser.add_argument("--nocache_length", type=int, default=1024)
    parser.add_argument("--memory_length", type=int, default=32768)
    parser.add_argument("--output", help="a Markdown file whose decode section is replaced")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds")
    rows = []
    for batch in (int(b) for b in args.batches.split(",") if b):
        for length in (int(s) for s in args.lengths.split(",") if s):
            if batch * length > args.max_tokens:
                continue
            print(f"keras-hub: B={batch} S={length}", file=sys.stderr)
            ours, peer = make_step("ours", batch, length), make_step("keras_hub", batch, length)
            row = per_token(ours, peer, args.rounds, STEPS, STEPS)
            rows.append(dict(row, batch=batch, length=length))
            print(f"  {row}", file=sys.stderr)
    nocache = None
    if args.nocache_length:
        length = args.nocache_length
        print(f"no cache: S={length}", file=sys.stderr)
        cached, recompute = make_step("ours", 1, length), make_step("ours_nocache", 1, length)
        nocache = dict(per_token(cached, recompute, args.rounds, STEPS, 1), length=length)
    memory = []
    if args.memory_length:
        for heads in (N, 2):
            print(f"memory: K={heads}", file=sys.stderr)
            memory.append((heads, child_peak_mib("decode", ("ours", 1, args.memory_length, heads))))
    section = table(rows, nocache, memory, args)
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
