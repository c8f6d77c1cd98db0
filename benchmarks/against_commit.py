"""This checkout's layer and core against another commit's, on TensorFlow, in one process.

A change to the core (such as writing it on `keras.ops` for two backends) must not slow the
TensorFlow programs. This script exports the package of `--commit` with `git archive` into a
temporary folder under another name (`keras_sdpa_before`), imports both, and times the same
steps of `benchmarks/attention.py`'s float32 table (B=4, E=256, N=4, H=64; the layer's and the
core's forward plus backward, compiled as there) in alternating rounds: the table gives the
median of the per-round ratios (this checkout / the commit) and their range.

Usage:
    python benchmarks/against_commit.py --commit b0792b8
    python benchmarks/against_commit.py --commit b0792b8 --lengths 512 2048 --output BENCHMARKS.md
"""

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import alternate, cpu_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, E, N, H = 4, 256, 4, 64
START = "<!-- against-commit:start -->"
END = "<!-- against-commit:end -->"


def export_commit(commit, folder):
    """The commit's `keras_sdpa/` as the package `keras_sdpa_before` under `folder`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "keras_sdpa"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            text = tar.extractfile(member).read().decode()
            text = re.sub(r"\bkeras_sdpa\b(?=[.\s])", "keras_sdpa_before", text)
            path = os.path.join(folder, member.name.replace("keras_sdpa", "keras_sdpa_before", 1))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, folder)


def make_step(package, which, length):
    """One compiled forward plus backward of the layer or the core, on fixed inputs."""
    import keras
    import tensorflow as tf

    x = tf.random.normal((B, length, E), seed=1)
    if which == "layer":
        layer = package.ScaledDotProductAttention(num_heads=N, key_dim=H)
        layer(x, x)
        variables = layer.trainable_variables

        @tf.function(jit_compile=False)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, x)
            return tape.gradient(out, [x, *variables])

        inputs = (x,)
    else:
        q, k, v = (tf.random.normal((B, length, N, H), seed=s) for s in (2, 3, 4))

        @tf.function(jit_compile=False)
        def step(q, k, v):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = package.scaled_dot_product_attention(q, k, v)
            return tape.gradient(out, [q, k, v])

        inputs = (q, k, v)
    del keras

    def run():
        _ = [t.numpy() for t in step(*inputs)[:1]]

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the commit to compare against")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="also write the section to this Markdown file")
    args = parser.parse_args(argv)
    for name in ("rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1. Received: {getattr(args, name)}")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", args.commit], cwd=ROOT, capture_output=True, text=True
    )
    if commit.returncode != 0:
        parser.error(f"--commit is not a commit of this repository. Received: {args.commit}")
    commit = commit.stdout.strip()
    here = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        export_commit(commit, folder)
        import keras_sdpa_before

        import keras_sdpa

        rows = []
        for which in ("layer", "core"):
            for length in args.lengths:
                print(f"{which} at T={length} ...", file=sys.stderr, flush=True)
                timed = alternate(
                    make_step(keras_sdpa, which, length),
                    make_step(keras_sdpa_before, which, length),
                    args.rounds, args.repeats,
                )  # fmt: skip
                rows.append(
                    f"| {which}, fwd+bwd | {length} | {timed['ms']:.1f} | {timed['peer_ms']:.1f} "
                    f"| **{timed['ratio']:.3f}** ({timed['low']:.3f}-{timed['high']:.3f}) |"
                )
    command = "python benchmarks/against_commit.py " + " ".join(argv or sys.argv[1:])
    text = (
        f"## TensorFlow float32: this checkout ({here}) against {commit}\n\n"
        f"Produced by:\n\n    {command.strip()}\n\nMachine: {cpu_name()}. {args.rounds} "
        f"alternating rounds of {args.repeats} calls, B={B}, E={E}, N={N}, H={H}; ratio = this "
        "checkout / the commit, median of the rounds, with their range.\n\n"
        f"| step | T=S | now ms | {commit} ms | ratio (range) |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    print(text)
    if args.output:
        from features import replace_section

        replace_section(args.output, START, END, text)  # prints where it wrote
    return 0


if __name__ == "__main__":
    sys.exit(main())
