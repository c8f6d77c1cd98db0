"""This checkout's layer, core and features against another commit's, in one process.

A change to the core (such as writing it on `keras.ops` for two backends) must not slow it.
This script exports the package of `--commit` with `git archive` into a temporary folder under
another name (`keras_sdpa_before`: its own absolute imports, `from keras_sdpa import ...` and
the backend modules it imports by name, are renamed with it), imports both on the backend Keras
runs (`--backend`, by default `KERAS_BACKEND`, else TensorFlow), and times the same steps of
both in alternating rounds. Two suites (`--suite`, both by default):

    attention  `benchmarks/attention.py`'s float32 steps, B=4, E=256, N=4, H=64: the layer's
               and the core's forward plus backward (the gradient of `sum(out)` to the
               inputs, and to the layer's weights), at each of `--lengths`.
    features   `benchmarks/features.py`'s cases, B=1, H=64, forward plus backward of
               `ops.scaled_dot_product_attention` (the gradient of `sum(out * c)` to q, k
               and v): the chunked path, N=4, with `sliding_window=--window` and without, at
               `--window_length`; 8 query heads on 2 key/value heads and on 8, at
               `--gqa_length`.

A step is compiled as each backend compiles a training step: `tf.function` on TensorFlow (the
core is XLA-compiled inside it), `jax.jit` on JAX. Its tensors are the compiled function's
arguments, and every timed call gets new values (`common.Fed`: x, or q, k, v and c), drawn
before its clock starts. The table has one row per case: the median of the per-round ratios
(this checkout / the commit) and their range. A case the commit cannot run (an argument it
lacks, a backend it does not support) gets its error as its row.

Usage:
    python benchmarks/against_commit.py --commit b0792b8
    python benchmarks/against_commit.py --commit b0792b8 --lengths 512 2048 --output BENCHMARKS.md
    python benchmarks/against_commit.py --commit HEAD~1 --backend jax --suite features
"""

import argparse
import os
import subprocess
import sys
import tempfile
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    alternate,
    at_least_one,
    command_line,
    cpu_name,
    export_commit,
    replace_section,
)
from features import COMPARISONS, variant_arguments  # noqa: E402
from features import H as FEATURE_H  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, E, N, H = 4, 256, 4, 64  # the attention suite's; the features suite's are features.py's
SUITES = ("attention", "features")
BACKENDS = {"tensorflow": "TensorFlow", "jax": "JAX"}
# One section per backend: a run on one never overwrites the other's table.
MARKERS = {
    "tensorflow": ("<!-- against-commit:start -->", "<!-- against-commit:end -->"),
    "jax": ("<!-- against-commit-jax:start -->", "<!-- against-commit-jax:end -->"),
}
FEATURE_LABELS = {
    "window_chunked": "chunked, sliding_window={window}, N=4",
    "full_chunked": "chunked, no window, N=4",
    "gqa_8_2": "GQA, 8 query / 2 key-value heads",
    "mha_8": "8 query / 8 key-value heads",
}


# ---- the steps, on either backend


def tensor(shape, seed):
    """A float32 tensor of the running backend, normal, from a seeded generator."""
    import keras
    import numpy as np

    array = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return keras.ops.convert_to_tensor(array)


def gradient_step(backend, output, inputs, count=None, fixed=(), variables=()):
    """A `Fed` step (`common.Fed`): the compiled gradient of `sum(output(*fixed, *inputs))`
    with respect to `fixed` and the first `count` of `inputs` (all by default; and, on
    TensorFlow, the tracked `variables`), which waits for it. All are arguments of the
    compiled function: `inputs` get new values before each call, `fixed` (JAX's layer
    weights) stay as they are."""
    count = len(inputs) if count is None else count
    if backend == "jax":
        import jax

        def loss(*args):
            return output(*args).sum()

        grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(fixed) + count))))
        return Fed(lambda *args: jax.block_until_ready(grad(*fixed, *args)), inputs)
    import tensorflow as tf

    @tf.function(jit_compile=False)
    def grad(arguments, constants):
        with tf.GradientTape() as tape:
            tape.watch(arguments)
            out = output(*arguments, *constants)  # its gradient: all ones, as sum(out)'s
        return tape.gradient(out, [*arguments, *variables])

    return Fed(lambda *args: grad(list(args[:count]), list(args[count:]))[0].numpy(), inputs)


def attention_step(backend, which, length, package):
    """The layer's or the core's forward plus backward, `attention.py`'s float32 sizes."""
    import keras

    keras.utils.set_random_seed(0)
    if which == "core":
        q, k, v = (tensor((B, length, N, H), seed) for seed in (2, 3, 4))
        return gradient_step(backend, package.scaled_dot_product_attention, [q, k, v])
    x = tensor((B, length, E), 1)
    layer = package.ScaledDotProductAttention(num_heads=N, key_dim=H)
    layer(x, x)
    if backend == "tensorflow":
        return gradient_step(
            backend, lambda x: layer(x, x), [x], variables=layer.trainable_variables
        )
    weights = [v.value for v in layer.trainable_variables]
    others = [v.value for v in layer.non_trainable_variables]

    def output(weights, x):
        return layer.stateless_call(weights, others, x, x)[0]

    return gradient_step(backend, output, [x], fixed=(weights,))


def feature_step(backend, variant, length, window, package):
    """One of `features.py`'s variants, forward plus backward, B=1."""
    import importlib

    attend = importlib.import_module(f"{package.__name__}.ops").scaled_dot_product_attention
    heads, kv_heads, kwargs = variant_arguments(variant, window)
    q = tensor((1, length, heads, FEATURE_H), 1)
    k = tensor((1, length, kv_heads, FEATURE_H), 2)
    v = tensor((1, length, kv_heads, FEATURE_H), 3)
    c = tensor((1, length, heads, FEATURE_H), 4)

    def output(q, k, v, c):
        return attend(q, k, v, **kwargs) * c

    return gradient_step(backend, output, [q, k, v, c], count=3)


def cases(args):
    """`(label, T=S, make)` of each case of the chosen suites; `make(package)` is its step."""
    found = []
    if "attention" in args.suite:
        for which in ("layer", "core"):
            for length in args.lengths:
                found.append(
                    (
                        f"{which}, fwd+bwd",
                        length,
                        partial(attention_step, args.backend, which, length),
                    )
                )
    if "features" in args.suite:
        for _, ours, peer, flag in COMPARISONS:
            for variant in (ours, peer):
                label = FEATURE_LABELS[variant].format(window=args.window) + ", fwd+bwd"
                length = getattr(args, flag)
                make = partial(feature_step, args.backend, variant, length, args.window)
                found.append((label, length, make))
    return found


# ---- the run


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the commit to compare against")
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        help="Keras's backend (default: KERAS_BACKEND, else tensorflow)",
    )
    parser.add_argument("--suite", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 2048], help="T=S of the attention suite"
    )
    parser.add_argument("--window", type=int, default=512, help="the features' sliding window")
    parser.add_argument(
        "--window_length", type=int, default=8192, help="T=S of the features' chunked cases"
    )
    parser.add_argument(
        "--gqa_length", type=int, default=4096, help="T=S of the features' grouped-head cases"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="also write the section to this Markdown file")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds", "repeats", "window", "window_length", "gqa_length")
    if min(args.lengths) < 1:
        parser.error(f"--lengths must be at least 1. Received: {args.lengths}")
    args.suite = [suite for suite in SUITES if suite in args.suite]  # in order, once each
    args.backend_flag = args.backend is not None
    args.backend = args.backend or os.environ.get("KERAS_BACKEND", "tensorflow")
    if args.backend not in BACKENDS:
        parser.error(f"KERAS_BACKEND must be one of {list(BACKENDS)}. Received: {args.backend}")
    commit = git("rev-parse", "--short", args.commit)
    if commit is None:
        parser.error(f"--commit is not a commit of this repository. Received: {args.commit}")
    args.commit_id = commit
    return parser, args


def git(*arguments):
    """The output of `git <arguments>` in this checkout, stripped; None where it fails."""
    result = subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def start_backend(parser, backend):
    """Sets Keras's backend before Keras is imported; the version line of the table."""
    os.environ["KERAS_BACKEND"] = backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if backend == "jax":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import keras

    if keras.backend.backend() != backend:  # Keras was imported before, on another one
        parser.error(f"Keras already runs on {keras.backend.backend()}. Received: {backend}")
    engine = __import__(backend)
    if backend == "tensorflow":  # each case's step is its own `tf.function`, traced once
        engine.get_logger().setLevel("ERROR")
    return f"Keras {keras.__version__} on {BACKENDS[backend]} {engine.__version__}"


def time_cases(found, now, before, args):
    """One table row per case: both packages' median ms and the ratio (now / before)."""
    rows = []
    for label, length, make in found:
        print(f"{label} at T={length} ...", file=sys.stderr, flush=True)
        try:
            timed = alternate(make(now), make(before), args.rounds, args.repeats)
        except Exception as error:  # the commit lacks an argument, or the backend
            first = (str(error).strip().splitlines() or [""])[0].replace("|", "/")
            message = f"{type(error).__name__}: {first[:80]}"
            print(f"  {message}", file=sys.stderr, flush=True)
            rows.append(f"| {label} | {length} | {message} | | |")
            continue
        rows.append(
            f"| {label} | {length} | {timed['ms']:.1f} | {timed['peer_ms']:.1f} "
            f"| **{timed['ratio']:.3f}** ({timed['low']:.3f}-{timed['high']:.3f}) |"
        )
    return rows


def section_text(args, argv, versions, here, rows):
    command = command_line(__file__, argv)
    if args.backend != "tensorflow" and not args.backend_flag:
        command = f"KERAS_BACKEND={args.backend} {command}"
    sizes = []
    if "attention" in args.suite:
        sizes.append(f"B={B}, E={E}, N={N}, H={H}")
    if "features" in args.suite:
        sizes.append(f"features: `benchmarks/features.py`'s cases, B=1, H={FEATURE_H}")
    return (
        f"## {BACKENDS[args.backend]} float32: this checkout ({here}) against "
        f"{args.commit_id}\n\n"
        f"Produced by:\n\n    {command}\n\nMachine: {cpu_name()}. {versions}. {NEW_INPUTS} "
        f"{args.rounds} alternating rounds of {args.repeats} calls, {'; '.join(sizes)}; "
        "ratio = this checkout / the commit, median of the rounds, with their range.\n\n"
        f"| step | T=S | now ms | {args.commit_id} ms | ratio (range) |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )


def main(argv=None):
    parser, args = parse_arguments(argv)
    versions = start_backend(parser, args.backend)
    here = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--", "keras_sdpa"):
        here += " with uncommitted changes to keras_sdpa/"
    with tempfile.TemporaryDirectory() as folder:
        export_commit(args.commit_id, folder)
        sys.path.insert(1, ROOT)  # this checkout's package, after the exported one's folder
        import keras_sdpa_before

        import keras_sdpa

        print(f"this checkout: {os.path.dirname(keras_sdpa.__file__)}", file=sys.stderr)
        rows = time_cases(cases(args), keras_sdpa, keras_sdpa_before, args)
    text = section_text(args, argv, versions, here, rows)
    print(text)
    if args.output:
        replace_section(args.output, *MARKERS[args.backend], text)  # prints where it wrote
    return 0


if __name__ == "__main__":
    sys.exit(main())
