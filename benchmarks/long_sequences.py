"""Long sequences: the chunked O(T)-memory core against the dense one and Keras, same run.

Forward plus backward (the gradient of `sum(layer(x, x))` with respect to `x` and
every weight) of one self-attention layer, B=1, N=4, H=64 (E=256), at T=S:

    sdpa_chunked  keras_sdpa.ScaledDotProductAttention(implementation="chunked")
    sdpa_dense    keras_sdpa.ScaledDotProductAttention(implementation="dense")
    keras_mha     keras.layers.MultiHeadAttention

Each (implementation, length) runs in its own process, so its peak resident
memory is its own. The parent kills a child that passes `--memory_limit_gib` of
resident memory or `--timeout` seconds, and reports that instead of a time.

Usage:
    python benchmarks/long_sequences.py                          # T=S in 2048..32768
    python benchmarks/long_sequences.py --lengths 2048 4096 --repeats 3
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
from attention import _PeakSampler, _rss_mib  # noqa: E402

B, E, N, H = 1, 256, 4, 64
IMPLS = ["sdpa_chunked", "sdpa_dense", "keras_mha"]
START, END = "<!-- long-sequences:start -->", "<!-- long-sequences:end -->"


def measure(impl, length, repeats, chunk_size):
    """In a child process: median forward+backward time and peak resident memory."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import keras_sdpa

    x = tf.random.normal((B, length, E))
    if impl == "keras_mha":
        layer = keras.layers.MultiHeadAttention(num_heads=N, key_dim=H)
    else:
        layer = keras_sdpa.ScaledDotProductAttention(
            num_heads=N,
            key_dim=H,
            implementation=impl.removeprefix("sdpa_"),
            chunk_size=chunk_size,
        )
    layer(x[:, :8], x[:, :8])  # build

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, x))
        return tape.gradient(loss, [x, *layer.trainable_variables])

    base = _rss_mib()
    sampler = _PeakSampler()
    step()[0].numpy()  # trace and compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()[0].numpy()
        times.append(time.perf_counter() - start)
    peak = sampler.stop()
    return {"ms": statistics.median(times) * 1e3, "peak_mib": peak - base, "rss_mib": peak}


def run_child(impl, length, repeats, chunk_size, timeout, memory_limit_gib):
    """Runs one measurement in a child; kills it past the time or memory limit."""
    cmd = [
        sys.executable, __file__, "--child", impl, str(length),
        "--repeats", str(repeats), "--chunk_size", str(chunk_size),
    ]  # fmt: skip
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


def table(results, lengths):
    lines = [
        "| T=S | chunked ms | dense ms | Keras MHA ms | chunked / dense time "
        "| chunked / Keras time | chunked peak MiB | dense peak MiB | Keras peak MiB "
        "| chunked / dense memory |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(result, key, fmt):
        return fmt.format(result[key]) if "error" not in result else result["error"]

    def ratio(a, b, key):
        if "error" in a or "error" in b:
            return "-"
        return f"**{a[key] / b[key]:.2f}**"

    for length in lengths:
        c, d, k = (results[(impl, length)] for impl in IMPLS)
        lines.append(
            f"| {length} | {cell(c, 'ms', '{:.0f}')} | {cell(d, 'ms', '{:.0f}')} "
            f"| {cell(k, 'ms', '{:.0f}')} | {ratio(c, d, 'ms')} | {ratio(c, k, 'ms')} "
            f"| {cell(c, 'peak_mib', '{:.0f}')} | {cell(d, 'peak_mib', '{:.0f}')} "
            f"| {cell(k, 'peak_mib', '{:.0f}')} | {ratio(c, d, 'peak_mib')} |"
        )
    return "\n".join(lines)


def write_section(path, section):
    """Replaces this script's section of `path` (between its markers), keeping the rest."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"{START}\n{section}\n{END}"
    if START in old and END in old:
        new = old[: old.index(START)] + block + old[old.index(END) + len(END) :]
    elif "\n## Notes" in old:
        at = old.index("\n## Notes")
        new = old[:at] + "\n" + block + "\n" + old[at:]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk_size", type=int, default=2048)  # the library default
    parser.add_argument("--timeout", type=int, default=600, help="seconds per measurement")
    parser.add_argument("--memory_limit_gib", type=float, default=16.0)
    parser.add_argument("--output", help="write the table into this Markdown file's section")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, length = args.child
        print(json.dumps(measure(impl, int(length), args.repeats, args.chunk_size)))
        return

    results = {}
    for length in args.lengths:
        for impl in IMPLS:
            print(f"T=S={length:6d} {impl:13s} ...", end=" ", flush=True)
            results[(impl, length)] = run_child(
                impl, length, args.repeats, args.chunk_size, args.timeout, args.memory_limit_gib
            )
            print(results[(impl, length)], flush=True)
    text = table(results, args.lengths)
    command = "python benchmarks/long_sequences.py " + " ".join(argv if argv else sys.argv[1:])
    section = (
        "## Long sequences\n\n"
        f"Produced by:\n\n    {command.strip()}\n\n"
        f"One self-attention layer, forward plus backward, B={B}, E={E}, N={N}, H={H}, "
        f"chunk_size={args.chunk_size}; median of {args.repeats} runs after one warm-up "
        f"(compilation); peak MiB is the most resident memory above the level before the first "
        f"call, one process per implementation and length; a run is stopped past "
        f"{args.memory_limit_gib:g} GiB resident or {args.timeout} s.\n\n{text}\n"
    )
    print()
    print(section)
    if args.output:
        write_section(args.output, section)
        print(f"wrote {os.path.abspath(args.output)}")


if __name__ == "__main__":
    main()
