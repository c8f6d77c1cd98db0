"""Speed and memory of keras_sdpa against its peers, measured in the same run.

Two pairs, forward and forward plus backward:

    layer:  keras_sdpa.ScaledDotProductAttention  vs  keras.layers.MultiHeadAttention
    core:   keras_sdpa.scaled_dot_product_attention  vs  keras.ops.dot_product_attention

Both peers run inside `tf.function` (graph mode, TensorFlow's own kernels), the
way `model.fit` runs them by default. Times come from alternating rounds of ours and
the peer in this one process (each round: `--repeats` calls of each, median), and the
table gives the median of the per-round ratios with their range: one process per
implementation had moved a ratio by 40% between two runs here. Peak resident memory
comes from one child process per implementation, length and pass, where it is that
implementation's own.

Usage:
    python benchmarks/attention.py                       # B=4 E=256 N=4 H=64, T=S in 128..4096
    python benchmarks/attention.py --lengths 512 2048 --rounds 5
    python benchmarks/attention.py --output BENCHMARKS.md
    python benchmarks/attention.py --policy mixed_bfloat16 --lengths 512 2048
    python benchmarks/attention.py --jit_compile --lengths 512   # the whole step under XLA

`--policy` sets Keras's dtype policy before the layers are built (the core pair gets
inputs in the policy's compute dtype); `--jit_compile` compiles each whole step, peer
included, with `tf.function(jit_compile=True)`, as `model.compile(jit_compile=True)` does.
The header names the CPU and whether it has AMX or AVX-512 BF16 units.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    PeakSampler,
    alternate,
    command_line,
    cpu_name,
    replace_section,
    rss_mib,
    write_head,
)

B, E, N, H = 4, 256, 4, 64
IMPLS = ["sdpa_layer", "keras_mha", "sdpa_core", "keras_ops"]
PEERS = {"sdpa_layer": "keras_mha", "sdpa_core": "keras_ops"}


def make_step(impl, length, which, policy="float32", jit_compile=False):
    """A compiled call of one implementation and pass (`fwd` or `fwd_bwd`), fed new values
    each call (`common.Fed`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import keras_sdpa

    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    x = tf.random.normal((B, length, E), seed=1)
    q, k, v = (
        tf.cast(tf.random.normal((B, length, N, H), seed=seed), compute) for seed in (2, 3, 4)
    )
    if impl in ("sdpa_layer", "keras_mha"):
        cls = (
            keras_sdpa.ScaledDotProductAttention
            if impl == "sdpa_layer"
            else (keras.layers.MultiHeadAttention)
        )
        layer = cls(num_heads=N, key_dim=H, seed=0)
        layer(x, x)
        inputs = [x]
        variables = layer.trainable_variables

        def forward(x):
            return layer(x, x)
    else:
        attend = (
            keras_sdpa.scaled_dot_product_attention
            if impl == "sdpa_core"
            else keras.ops.dot_product_attention
        )
        inputs = [q, k, v]
        variables = []

        def forward(q, k, v):
            return attend(q, k, v)

    # The inputs are arguments, not captured tensors: XLA folds captured constants at
    # compile time (a captured core step measured 3.9 ms, 338% of the matmul peak).
    @tf.function(jit_compile=jit_compile)
    def run_forward(*args):
        return forward(*args)

    # A random cotangent: with `sum(out)` the output's gradient is all ones, and a whole-step
    # XLA program turns the products with it into reductions (a core step read 5.9 ms, 406%
    # of the matmul peak).
    out_shape = x.shape if impl in ("sdpa_layer", "keras_mha") else q.shape
    cotangent = tf.random.normal(out_shape, seed=5)

    @tf.function(jit_compile=jit_compile)
    def run_backward(cotangent, *args):
        args = list(args)
        with tf.GradientTape() as tape:
            tape.watch(args)
            loss = tf.reduce_sum(tf.cast(forward(*args), "float32") * cotangent)
        return tape.gradient(loss, args + variables)

    fn = run_forward if which == "fwd" else run_backward

    def step(*args):
        out = fn(*args)
        _ = [t.numpy() for t in tf.nest.flatten(out)[:1]]

    return Fed(step, inputs if which == "fwd" else [cotangent, *inputs])


def peak_memory(impl, length, which, policy, jit_compile):
    """Runs in a child process: the peak resident memory of one call, compilation included."""
    step = make_step(impl, length, which, policy, jit_compile)
    base = rss_mib()  # inputs and weights are in; nothing traced or run yet
    sampler = PeakSampler()
    step()
    step()
    return {"peak_mib": sampler.stop() - base}


def matmul_gflops():
    """This machine's float32 matmul rate through TensorFlow, for the fraction column."""
    import tensorflow as tf

    a = tf.random.normal((2048, 2048))
    mm = tf.function(lambda: tf.matmul(a, a))
    mm()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        mm().numpy()
        times.append(time.perf_counter() - start)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def run_child(impl, length, which, policy, jit_compile):
    cmd = [sys.executable, __file__, "--child", impl, str(length), which, "--policy", policy]
    cmd += ["--jit_compile"] if jit_compile else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:80]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(times, memory, lengths, peak_gflops):
    lines = [
        "| pair | T=S | pass | ours ms | peer ms | ratio (range) | ours GFLOP/s | of matmul peak "
        "| ours peak MiB | peer peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ours, peer in PEERS.items():
        for length in lengths:
            for name, factor in (("fwd", 1), ("fwd_bwd", 3)):
                t = times[(ours, length, name)]
                a, b = memory[(ours, length, name)], memory[(peer, length, name)]
                mib = [m.get("error") or f"{m['peak_mib']:.0f}" for m in (a, b)]
                if "error" in t:
                    lines.append(
                        f"| {ours} vs {peer} | {length} | {name} | {t['error']} | | | | | "
                        f"{mib[0]} | {mib[1]} |"
                    )
                    continue
                flops = factor * 4 * B * N * length * length * H
                gflops = flops / (t["ms"] / 1e3) / 1e9
                lines.append(
                    f"| {ours} vs {peer} | {length} | {name} | {t['ms']:.1f} | "
                    f"{t['peer_ms']:.1f} | **{t['ratio']:.2f}** ({t['low']:.2f}-{t['high']:.2f}) "
                    f"| {gflops:.1f} | {gflops / peak_gflops:.0%} | {mib[0]} | {mib[1]} |"
                )
    return "\n".join(lines)


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--repeats", type=int, default=3, help="calls per round")
    parser.add_argument("--output", help="also write the table to this Markdown file")
    parser.add_argument(
        "--policy", default="float32", help="Keras dtype policy, e.g. mixed_bfloat16"
    )
    parser.add_argument(
        "--jit_compile", action="store_true", help="compile each whole step with XLA"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def measure_memory(args):
    """`{(impl, length, pass): peak}`, each from its own child process."""
    memory = {}
    for length in args.lengths:
        for which in ("fwd", "fwd_bwd"):
            for impl in IMPLS:
                print(f"peak memory T=S={length:5d} {which:7s} {impl:11s} ...", end=" ", flush=True)
                memory[(impl, length, which)] = run_child(
                    impl, length, which, args.policy, args.jit_compile
                )
                print(memory[(impl, length, which)], flush=True)
    return memory


def measure_times(args):
    """`{(ours, length, pass): alternate's result}`, each pair in alternating rounds here."""
    times = {}
    for length in args.lengths:
        for which in ("fwd", "fwd_bwd"):
            for ours, peer in PEERS.items():
                print(f"time T=S={length:5d} {which:7s} {ours} vs {peer} ...", end=" ", flush=True)
                try:
                    result = alternate(
                        make_step(ours, length, which, args.policy, args.jit_compile),
                        make_step(peer, length, which, args.policy, args.jit_compile),
                        args.rounds,
                        args.repeats,
                    )
                except Exception as error:  # out of memory at the longest lengths
                    result = {"error": f"{type(error).__name__}: {str(error)[:60]}"}
                times[(ours, length, which)] = result
                print(result, flush=True)
    return times


def describe(args, peak):
    """The paragraph above the table: the machine, the settings and what the columns mean."""
    step = "the whole step under `jit_compile=True`" if args.jit_compile else "`tf.function`"
    return (
        f"{cpu_name()}. Policy `{args.policy}`, {step}. "
        f"B={B}, E={E}, N={N}, H={H}. {NEW_INPUTS} "
        f"Times: {args.rounds} alternating rounds of ours and the "
        f"peer in one process after one warm-up call each, {args.repeats} calls a round "
        f"(median); ratio = ours / peer (below 1 is faster), the median of the per-round "
        f"ratios with their range. GFLOP/s counts 4·B·N·T·S·H per forward and 3x that per "
        f"forward plus backward. Peak MiB is the most resident memory above the level before "
        f"the first call (compilation included; sampled every ms; one child process per "
        f"implementation, length and pass). Matmul peak {peak:.1f} GFLOP/s.\n"
    )


def write(args, argv, header, text):
    """The float32 table at the top of `--output`; another policy or compilation in its own
    section, so that the float32 table stays on top."""
    command = command_line(__file__, argv)
    if args.policy != "float32" or args.jit_compile:
        name = args.policy + ("-jit" if args.jit_compile else "")
        title = f"## Attention under `{args.policy}`" + (
            ", whole step under XLA" if args.jit_compile else ""
        )
        section = f"{title}\n\nProduced by:\n\n    {command}\n\n{header}\n{text}\n"
        replace_section(
            args.output,
            f"<!-- attention-{name}:start -->",
            f"<!-- attention-{name}:end -->",
            section,
        )
    else:  # later sections (long sequences, notes) survive a rewrite of the table
        write_head(
            args.output,
            f"# Benchmarks\n\nProduced by:\n\n    {command}\n\n{header}\n{text}\n",
        )


def main(argv=None):
    args = parse_arguments(argv)
    if args.child:
        impl, length, which = args.child
        print(json.dumps(peak_memory(impl, int(length), which, args.policy, args.jit_compile)))
        return
    print(cpu_name())

    peak = matmul_gflops()
    print(f"float32 matmul rate of this machine (2048^3, TensorFlow): {peak:.1f} GFLOP/s")
    memory = measure_memory(args)
    times = measure_times(args)
    text = table(times, memory, args.lengths, peak)
    header = describe(args, peak)
    print()
    print(header)
    print(text)
    if args.output:
        write(args, argv, header, text)


if __name__ == "__main__":
    main()
