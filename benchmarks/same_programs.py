"""This checkout's compiled attention programs against another commit's, as XLA optimized them.

A refactor that must not change speed can show more than equal timings: the same program. This
script exports `--commit`'s `keras_sdpa/` (as `keras_sdpa_before`, `common.export_commit`),
compiles each case's forward, and forward plus backward, with both packages on the running
backend (`jax.jit(...).lower().compile()`, or `tf.function(jit_compile=True)`'s
`experimental_get_compiler_ir(stage="optimized_hlo")`), and compares the optimized HLO with
names, source locations and stack frames taken out. "same" means XLA runs the same operations
in the same order on the same shapes.

Usage:
    python benchmarks/same_programs.py --commit eac81cd
    KERAS_BACKEND=jax python benchmarks/same_programs.py --commit eac81cd --output BENCHMARKS.md
"""

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, command_line, cpu_name, export_commit, replace_section  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MARKERS = {
    "tensorflow": ("<!-- same-programs:start -->", "<!-- same-programs:end -->"),
    "jax": ("<!-- same-programs-jax:start -->", "<!-- same-programs-jax:end -->"),
}
Q, KV, DECODE_Q = (2, 64, 4, 16), (2, 64, 2, 16), (2, 1, 4, 16)  # (B, T|S, N|K, H)
RAGGED_Q, RAGGED_KV = (2, 40, 4, 16), (2, 60, 2, 16)  # T != S, neither a multiple of 16
# name: (options, query shape); "bias", "alibi", "document" and "cache" are made per package.
CASES = {
    "dense": (dict(), Q),
    "dense, mask, bias, soft cap": (dict(mask="causal", bias="bias", attn_logits_soft_cap=20.0), Q),
    "dense, dropout": (dict(dropout_rate=0.1, training=True, seed=3), Q),
    "dense, ALiBi score_mod": (dict(score_mod="alibi"), Q),
    "dense, bfloat16": (dict(dtype="bfloat16"), Q),
    "chunked, causal": (dict(is_causal=True, implementation="chunked", chunk_size=16), Q),
    "chunked, window, dropout": (
        dict(
            sliding_window=20,
            implementation="chunked",
            chunk_size=16,
            dropout_rate=0.1,
            training=True,
            seed=3,
        ),
        Q,
    ),
    "chunked, bias": (dict(bias="bias", implementation="chunked", chunk_size=16), Q),
    "chunked, chunked_local mask_mod": (
        dict(mask_mod="local", implementation="chunked", chunk_size=16),
        Q,
    ),
    "chunked, ALiBi score_mod": (
        dict(score_mod="alibi", implementation="chunked", chunk_size=16),
        Q,
    ),
    "chunked, causal, bfloat16": (
        dict(dtype="bfloat16", implementation="chunked", chunk_size=16, is_causal=True),
        Q,
    ),
    "chunked, T=40, S=60, key padding": (
        dict(implementation="chunked", chunk_size=16, mask="ragged"),
        RAGGED_Q,
        RAGGED_KV,
    ),
    "chunked, block_mask, float16": (
        dict(
            mask_mod="local",
            block_mask=True,
            implementation="chunked",
            chunk_size=16,
            dtype="float16",
        ),
        Q,
    ),
    "dense, float64, T=40, S=60": (dict(dtype="float64"), RAGGED_Q, RAGGED_KV),
    "decode, key padding": (dict(implementation="decode", mask="cache"), DECODE_Q),
    "decode, window, ALiBi score_mod": (
        dict(implementation="decode", sliding_window=8, score_mod="alibi"),
        DECODE_Q,
    ),
}


def normalize(text):
    """The optimized HLO without what differs between two copies of one program: instruction
    and computation names, source locations and stack frames, the module's name."""
    lines = text.splitlines()
    tables = r"^(\d+ |FileNames|FunctionNames|FileLocations|StackFrames)"
    text = "\n".join(line for line in lines if not re.match(tables, line))
    text = re.sub(r",? ?stack_frame_id=\d+", "", text)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%x", text)
    text = re.sub(r"HloModule [^\s,]+", "HloModule m", text)
    return re.sub(r"\b(fused|wrapped|region|body|cond|closed_call)[\w.\-]*", "f", text)


def inputs(options, query_shape, kv_shape, package):
    """The case's `q`, `k`, `v` and its options, with its tensors and mods made."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    options = dict(options)
    dtype = options.pop("dtype", "float32")

    def tensor(shape):
        return keras.ops.convert_to_tensor(rng.standard_normal(shape).astype("float32"), dtype)

    q, k, v = tensor(query_shape), tensor(kv_shape), tensor(kv_shape)
    made = {
        "bias": lambda: tensor((1, Q[2], Q[1], KV[1])),
        "alibi": lambda: package.mods.alibi(Q[2]),
        "local": lambda: package.mods.chunked_local(8),
        "causal": lambda: np.tril(np.ones((Q[1], KV[1]), bool))[None, None],
        "cache": lambda: np.arange(KV[1])[None, None, None, :] < 50,
        "ragged": lambda: np.arange(kv_shape[1])[None, None, None, :] < 50,
    }
    options = {key: made[value]() if value in made else value for key, value in options.items()}
    if options.pop("block_mask", False):  # made by the package, for the call's sizes
        b, t, n, _ = query_shape
        options["block_mask"] = package.create_block_mask(
            options["mask_mod"], b, n, t, kv_shape[1], block_size=options["chunk_size"]
        )
    return (q, k, v), options


def optimized_hlo(package, options, query_shape, kv_shape, backward):
    """The optimized HLO of one case's forward (or forward plus backward) with `package`."""
    import keras

    (q, k, v), options = inputs(options, query_shape, kv_shape, package)

    def forward(q, k, v):
        return package.scaled_dot_product_attention(q, k, v, **options)

    if keras.backend.backend() == "jax":
        import jax

        def loss(q, k, v):
            return (forward(q, k, v).astype("float32") ** 2).sum()

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if backward else forward)
        return step.lower(q, k, v).compile().as_text()
    import tensorflow as tf

    def gradient(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(tf.cast(forward(q, k, v), "float32") ** 2)
        return tape.gradient(loss, [q, k, v])

    step = tf.function(gradient if backward else forward, jit_compile=True)
    specs = [tf.TensorSpec(x.shape, x.dtype) for x in (q, k, v)]  # parameters, not constants
    return step.experimental_get_compiler_ir(*specs)(stage="optimized_hlo")


def compare(now, before):
    """`[(case, forward, forward and backward)]`: "same", "differs" or the error of each."""
    rows = []
    for name, (options, query_shape, *kv_shape) in CASES.items():
        kv_shape = kv_shape[0] if kv_shape else KV
        cells = []
        for backward in (False, True):
            if backward and name.startswith("decode"):
                cells.append("(inference only)")
                continue
            try:
                a, b = (
                    normalize(optimized_hlo(p, options, query_shape, kv_shape, backward))
                    for p in (now, before)
                )
                cells.append(f"same ({len(a.splitlines())} lines)" if a == b else "differs")
            except Exception as error:  # noqa: BLE001 (a case one commit cannot run)
                cells.append(f"error: {type(error).__name__}")
            print(f"{name}, {'backward' if backward else 'forward'}: {cells[-1]}", flush=True)
        rows.append((name, *cells))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the commit to compare with")
    parser.add_argument("--output", help="a Markdown file to write the table into")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    import keras

    import keras_sdpa

    backend = keras.backend.backend()
    with tempfile.TemporaryDirectory() as folder:
        export_commit(args.commit, folder)
        import keras_sdpa_before

        rows = compare(keras_sdpa, keras_sdpa_before)
    title = "TensorFlow" if backend == "tensorflow" else "JAX"
    lines = [
        f"### The compiled programs against {args.commit}, {title} (CPU: {cpu_name()})",
        "",
        f"Produced by: `KERAS_BACKEND={backend} {command_line(__file__, argv)}`. Shapes: "
        "B=2, T=S=64 unless named, 4 query and 2 key/value heads, H=16, blocks of 16.",
        "",
        "| case | forward | forward and backward |",
        "|---|---|---|",
        *(f"| {name} | {forward} | {backward} |" for name, forward, backward in rows),
    ]
    print("\n".join(lines))
    if args.output:
        replace_section(args.output, *MARKERS[backend], "\n".join(lines))
    same = all(cell.startswith(("same", "(")) for row in rows for cell in row[1:])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
