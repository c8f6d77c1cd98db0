"""Long sequences: the chunked O(T)-memory core against the dense one and Keras, same run.

Forward plus backward (the gradient of `sum(layer(x, x))` with respect to `x` and
every weight) of one self-attention layer, B=1, N=4, H=64 (E=256), at T=S:

    sdpa_chunked  keras_sdpa.ScaledDotProductAttention(implementation="chunked")
    sdpa_dense    keras_sdpa.ScaledDotProductAttention(implementation="dense")
    keras_mha     keras.layers.MultiHeadAttention

Peak resident memory: each (implementation, length) runs once in its own process, so
its peak is its own. The parent kills a child that passes `--memory_limit_gib` of
resident memory or `--timeout` seconds, and reports that instead.

Time: the implementations whose child finished are then timed in this one process,
in alternating rounds (one call of each per round, after a warm-up call each), and a
ratio is the median of the per-round ratios, with their range: one process per
implementation had moved a ratio by 40% between two runs here. Every timed call (the
child's second call too) gets a new input `x`, drawn before its clock starts (`common.Fed`).

The figure `--plot` (default `benchmarks/long_sequences-<CPU>.png`, one per CPU) shows time
and peak memory against T, log-log, for the three.

Usage:
    python benchmarks/long_sequences.py                          # T=S in 2048..32768
    python benchmarks/long_sequences.py --lengths 2048 4096 --rounds 3
    python benchmarks/long_sequences.py --output BENCHMARKS.md   # replaces its section there
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
    HERE,
    NEW_INPUTS,
    Fed,
    PeakSampler,
    command_line,
    cpu_key,
    cpu_name,
    replace_section,
    rss_mib,
    time_alternating,
)

B, E, N, H = 1, 256, 4, 64
IMPLS = ["sdpa_chunked", "sdpa_dense", "keras_mha"]
START, END = "<!-- long-sequences:start -->", "<!-- long-sequences:end -->"


def make_step(impl, length, chunk_size, dtype=None):
    """A compiled forward+backward step of one implementation at `T=S=length`, fed a new `x`
    each call (`common.Fed`); `dtype` is the layer's dtype policy (None: Keras's global one)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import keras_sdpa

    x = tf.random.normal((B, length, E), seed=1)
    if impl == "keras_mha":
        layer = keras.layers.MultiHeadAttention(num_heads=N, key_dim=H, dtype=dtype)
    else:
        layer = keras_sdpa.ScaledDotProductAttention(
            num_heads=N,
            key_dim=H,
            implementation=impl.removeprefix("sdpa_"),
            chunk_size=chunk_size,
            dtype=dtype,
        )
    layer(x[:, :8], x[:, :8])  # build

    # An argument, not a captured tensor: what a compiled step captures can be a compile-time
    # constant, and the same values every call could hide a recompilation.
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(layer(x, x), "float32"))
        return tape.gradient(loss, [x, *layer.trainable_variables])

    return Fed(lambda x: step(x)[0].numpy(), [x])


def measure(impl, length, chunk_size):
    """In a child process: peak resident memory of the first two calls, and the second's time
    (its new input drawn before the clock starts)."""
    step = make_step(impl, length, chunk_size)
    base = rss_mib()
    sampler = PeakSampler()
    step()  # trace and compile
    inputs = step.draw()
    start = time.perf_counter()
    step.run(*inputs)
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    return {"ms": seconds * 1e3, "peak_mib": peak - base, "rss_mib": peak}


def alternate(impls, length, chunk_size, rounds):
    """Median ms of each implementation over alternating rounds in this process, and the
    per-round ratios of chunked to each other one (median, low, high). The order reverses
    every round, so no implementation always runs first."""
    seconds = time_alternating(
        {impl: make_step(impl, length, chunk_size) for impl in impls}, rounds
    )
    result = {impl: {"ms": statistics.median(t) * 1e3} for impl, t in seconds.items()}
    if "sdpa_chunked" in impls:
        for impl in impls:
            ratios = sorted(a / b for a, b in zip(seconds["sdpa_chunked"], seconds[impl]))
            result[impl]["chunked_ratio"] = (statistics.median(ratios), ratios[0], ratios[-1])
    return result


def run_child(impl, length, chunk_size, timeout, memory_limit_gib):
    """Runs one measurement in a child; kills it past the time or memory limit."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        impl,
        str(length),
        *(["--chunk_size", str(chunk_size)] if chunk_size else []),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start, peak = time.time(), 0.0
    try:
        while proc.poll() is None:
            peak = max(peak, _child_rss_gib(proc.pid))
            if peak > memory_limit_gib:
                proc.kill()
                return {"error": f"stopped at {peak:.1f} GiB resident (limit {memory_limit_gib})"}
            if time.time() - start > timeout:
                proc.kill()
                return {"error": f"stopped after {timeout} s (time limit)"}
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        lines = stderr.strip().splitlines() or ["killed"]
        # TensorFlow's last line is often just the op's name; the reason is the error line.
        reasons = [line for line in lines if "Error" in line or "RESOURCE_EXHAUSTED" in line]
        reason = (reasons or lines)[-1].strip()
        return {"error": f"exit {proc.returncode}: {reason[:120]}"}
    return json.loads(stdout.strip().splitlines()[-1])


def _child_rss_gib(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return 0.0


def table(memory, times, lengths):
    lines = [
        "| T=S | chunked ms | dense ms | Keras MHA ms | chunked / dense time "
        "| chunked / Keras time | chunked peak MiB | dense peak MiB | Keras peak MiB "
        "| chunked / dense memory |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(impl, length):
        if "error" in memory[(impl, length)]:
            return memory[(impl, length)]["error"]
        return f"{times[length][impl]['ms']:.0f}"

    def time_ratio(impl, length):
        found = times[length].get(impl, {}).get("chunked_ratio")
        if found is None or "sdpa_chunked" not in times[length]:
            return "-"
        return f"**{found[0]:.2f}** ({found[1]:.2f}-{found[2]:.2f})"

    def mib(impl, length):
        result = memory[(impl, length)]
        return "-" if "error" in result else f"{result['peak_mib']:.0f}"

    for length in lengths:
        c, d = memory[("sdpa_chunked", length)], memory[("sdpa_dense", length)]
        memory_ratio = "-"
        if "error" not in c and "error" not in d:
            memory_ratio = f"**{c['peak_mib'] / d['peak_mib']:.2f}**"
        lines.append(
            f"| {length} | {ms('sdpa_chunked', length)} | {ms('sdpa_dense', length)} "
            f"| {ms('keras_mha', length)} | {time_ratio('sdpa_dense', length)} "
            f"| {time_ratio('keras_mha', length)} | {mib('sdpa_chunked', length)} "
            f"| {mib('sdpa_dense', length)} | {mib('keras_mha', length)} | {memory_ratio} |"
        )
    return "\n".join(lines)


def plot(memory, times, lengths, path):
    """Time and peak memory against T, log-log, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "sdpa_chunked": "keras_sdpa, chunked",
        "sdpa_dense": "keras_sdpa, dense",
        "keras_mha": "keras.layers.MultiHeadAttention",
    }
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, label in labels.items():
        ran = [t for t in lengths if "error" not in memory[(impl, t)]]
        left.plot(ran, [times[t][impl]["ms"] / 1e3 for t in ran], "o-", label=label)
        right.plot(ran, [memory[(impl, t)]["peak_mib"] / 1024 for t in ran], "o-", label=label)
    for axis, name in ((left, "seconds, forward + backward"), (right, "peak memory, GiB")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length T = S")
        axis.set_ylabel(name)
        axis.grid(True, which="both", alpha=0.3)
    left.set_title("Time (alternating rounds, one process)")
    right.set_title("Peak resident memory (one process each)")
    right.legend(loc="upper left")
    figure.suptitle(
        f"One self-attention layer, B={B}, E={E}, N={N}, H={H}; a missing point ran out"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--chunk_size", type=int, help="default: the library's own blocks")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per measurement")
    parser.add_argument("--memory_limit_gib", type=float, default=16.0)
    parser.add_argument("--output", help="write the table into this Markdown file's section")
    parser.add_argument(
        "--plot",
        help="where the log-log figure of time and memory goes "
        "(default: benchmarks/long_sequences-<this CPU>.png)",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, length = args.child
        print(json.dumps(measure(impl, int(length), args.chunk_size)))
        return

    memory = {}
    for length in args.lengths:
        for impl in IMPLS:
            print(f"peak memory T=S={length:6d} {impl:13s} ...", end=" ", flush=True)
            memory[(impl, length)] = run_child(
                impl, length, args.chunk_size, args.timeout, args.memory_limit_gib
            )
            print(memory[(impl, length)], flush=True)
    times = {}
    for length in args.lengths:
        ran = [impl for impl in IMPLS if "error" not in memory[(impl, length)]]
        print(f"time T=S={length:6d} {', '.join(ran)} ...", end=" ", flush=True)
        times[length] = alternate(ran, length, args.chunk_size, args.rounds) if ran else {}
        print(times[length], flush=True)
    text = table(memory, times, args.lengths)
    figure = plot(
        memory,
        times,
        args.lengths,
        args.plot or os.path.join(HERE, f"long_sequences-{cpu_key()}.png"),
    )
    # The figure's path as the Markdown file (or, without one, the current folder) sees it.
    figure_link = os.path.relpath(figure, os.path.dirname(os.path.abspath(args.output or "-")))
    section = (
        "## Long sequences\n\n"
        f"Produced by:\n\n    {command_line(__file__, argv)}\n\n"
        f"{cpu_name()}. One self-attention layer, forward plus backward, B={B}, E={E}, "
        f"N={N}, H={H}, chunk_size={args.chunk_size or 'the default'}. {NEW_INPUTS} "
        f"Times: {args.rounds} alternating rounds of the implementations in one process, one "
        f"call each a round after a warm-up call (median); ratios are the median of the "
        f"per-round ratios (range). Peak MiB: the most resident memory above the level before "
        f"the first call, one child process per implementation "
        f"and length; a child is stopped past {args.memory_limit_gib:g} GiB resident or "
        f"{args.timeout} s, and then not timed.\n\n{text}\n\n"
        f"![time and memory against T]({figure_link})\n"
    )
    print()
    print(section)
    if args.output:
        replace_section(
            args.output, START, END, section, before="\n## Notes", missing="# Benchmarks\n"
        )
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
