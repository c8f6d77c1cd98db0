"""Accuracy under mixed precision: keras_sdpa's core against Keras, both measured on float64.

For bfloat16 and float16 inputs, each length T and each setting, the same inputs go to

    ours (dense)    keras_sdpa.scaled_dot_product_attention(implementation="dense")
    ours (chunked)  the same, implementation="chunked", chunk_size=T/4
    keras.ops       keras.ops.dot_product_attention (keys and values repeated to N heads)

and the output and the gradients of `sum(out * dO)` with respect to `q`, `k` and `v` are
compared with keras_sdpa's float64 result on the same (half-precision-rounded) numbers, which
is `softmax(Q K^T / sqrt(H) + bias) V` in float64. Settings: a boolean mask, a bias and
grouped-query heads (K = N/2), all at once; and the same with the soft cap (Keras has no soft
cap, so its column is left empty). The table gives the max and the mean absolute error.

Usage:
    python benchmarks/precision.py                       # T in 64 512 2048
    python benchmarks/precision.py --output BENCHMARKS.md  # replaces its section there
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, cpu_name, replace_section  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_sdpa  # noqa: E402

START, END = "<!-- precision:start -->", "<!-- precision:end -->"
B, N, K, H = 2, 4, 2, 64
NAMES = ("out", "dq", "dk", "dv")


def inputs(length, seed=0):
    """float64 arrays: q, k, v, a mask, a bias and an output gradient, the half-precision
    rounding left to the caller."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, length, N, H))
    k = rng.normal(size=(B, length, K, H))
    v = rng.normal(size=(B, length, K, H))
    mask = rng.random((B, 1, length, length)) > 0.2
    bias = rng.normal(size=(1, N, length, length))
    d_out = rng.normal(size=(B, length, N, H))
    return q, k, v, mask, bias, d_out


def outputs(attend, q, k, v, d_out, dtype):
    """The output and the three gradients of `attend`, as float64 arrays."""
    q, k, v = (tf.constant(x, dtype) for x in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = attend(q, k, v)
        loss = tf.reduce_sum(tf.cast(out, tf.float64) * d_out)
    grads = tape.gradient(loss, [q, k, v])
    return [np.asarray(tf.cast(x, tf.float64)) for x in [out, *grads]]


def measure(length, dtype, capped):
    q, k, v, mask, bias, d_out = inputs(length)
    # The half-precision inputs, exactly: every implementation and the reference read these.
    q, k, v = (np.asarray(tf.cast(tf.cast(x, dtype), tf.float64)) for x in (q, k, v))
    cap = 30.0 if capped else None

    def ours(path):
        def attend(q, k, v):
            return keras_sdpa.scaled_dot_product_attention(
                q,
                k,
                v,
                mask,
                bias=tf.cast(bias, q.dtype),
                attn_logits_soft_cap=cap,
                implementation=path,
                chunk_size=max(16, length // 4),
            )

        return attend

    def keras_ops(q, k, v):
        repeat = N // K
        k, v = tf.repeat(k, repeat, axis=2), tf.repeat(v, repeat, axis=2)
        return keras.ops.dot_product_attention(q, k, v, bias=tf.cast(bias, q.dtype), mask=mask)

    want = outputs(ours("dense"), q, k, v, d_out, "float64")
    rows = {}
    candidates = [("ours (dense)", ours("dense")), ("ours (chunked)", ours("chunked"))]
    if not capped:
        candidates.append(("keras.ops", keras_ops))
    for name, attend in candidates:
        got = outputs(attend, q, k, v, d_out, dtype)
        rows[name] = [(np.abs(g - w).max(), np.abs(g - w).mean()) for g, w in zip(got, want)]
    return rows


def table(lengths):
    header = "| dtype | T | setting | implementation | " + " | ".join(
        f"{name} max | {name} mean" for name in NAMES
    )
    lines = [header + " |", "|" + "---|" * (4 + 2 * len(NAMES))]
    for dtype in ("bfloat16", "float16"):
        for length in lengths:
            for capped in (False, True):
                setting = "mask, bias, GQA" + (", soft cap 30" if capped else "")
                print(f"{dtype} T={length} {setting} ...", file=sys.stderr, flush=True)
                for name, errors in measure(length, dtype, capped).items():
                    cells = " | ".join(f"{high:.2e} | {mean:.2e}" for high, mean in errors)
                    lines.append(f"| {dtype} | {length} | {setting} | {name} | {cells} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--output", help="a Markdown file whose precision section is replaced")
    args = parser.parse_args(argv)
    section = (
        "## Accuracy under mixed precision\n\nProduced by:\n\n"
        f"    {command_line(__file__, argv)}\n\n"
        f"On {cpu_name()}. B={B}, N={N}, K={K}, H={H}, T=S. "
        "Absolute errors against keras_sdpa's float64 result "
        "on the same half-precision inputs (the output, and the gradients of sum(out * dO) "
        "with respect to q, k and v). Our products take the half-precision operands and "
        "accumulate in float32; keras.ops.dot_product_attention gets keys and values repeated "
        "to N heads and has no soft cap.\n\n" + table(args.lengths) + "\n"
    )
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)


if __name__ == "__main__":
    main()
