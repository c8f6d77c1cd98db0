"""Speed and memory of keras_sdpa against its peers, measured in the same run.

Two pairs, forward and forward plus backward:

    layer:  keras_sdpa.ScaledDotProductAttention  vs  keras.layers.MultiHeadAttention
    core:   keras_sdpa.scaled_dot_product_attention  vs  keras.ops.dot_product_attention

Both peers run inside `tf.function` (graph mode, TensorFlow's own kernels), the
way `model.fit` runs them by default. Each (length, implementation) runs in a
fresh process so that its peak resident memory is its own.

Usage:
    python benchmarks/attention.py                       # B=4 E=256 N=4 H=64, T=S in 128..4096
    python benchmarks/attention.py --lengths 128 512 --repeats 5
    python benchmarks/attention.py --output BENCHMARKS.md
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

B, E, N, H = 4, 256, 4, 64
IMPLS = ["sdpa_layer", "keras_mha", "sdpa_core", "keras_ops"]
PEERS = {"sdpa_layer": "keras_mha", "sdpa_core": "keras_ops"}


def measure(impl, length, which, repeats):
    """Runs in a child process: median time and peak memory of one implementation and pass."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import keras_sdpa

    x = tf.random.normal((B, length, E))
    q, k, v = (tf.random.normal((B, length, N, H)) for _ in range(3))
    if impl in ("sdpa_layer", "keras_mha"):
        cls = (
            keras_sdpa.ScaledDotProductAttention
            if impl == "sdpa_layer"
            else (keras.layers.MultiHeadAttention)
        )
        layer = cls(num_heads=N, key_dim=H)
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

    @tf.function
    def run_forward():
        return forward(*inputs)

    @tf.function
    def run_backward():
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            loss = tf.reduce_sum(forward(*inputs))
        return tape.gradient(loss, inputs + variables)

    fn = run_forward if which == "fwd" else run_backward
    base = _rss_mib()  # inputs and weights are in; nothing traced or run yet
    sampler = _PeakSampler()
    fn()  # trace and compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        _ = [t.numpy() for t in tf.nest.flatten(out)[:1]]
        times.append(time.perf_counter() - start)
    return {"ms": statistics.median(times) * 1e3, "peak_mib": sampler.stop() - base}


def _rss_mib():
    """Current resident memory of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakSampler:
    """Samples resident memory every millisecond in a thread; `stop()` gives the peak."""

    def __init__(self):
        self.peak = _rss_mib()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            self.peak = max(self.peak, _rss_mib())
            time.sleep(0.001)

    def stop(self):
        self.running = False
        self.thread.join()
        return max(self.peak, _rss_mib())


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


def run_child(impl, length, which, repeats):
    cmd = [sys.executable, __file__, "--child", impl, str(length), which, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:80]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results, lengths, peak_gflops):
    lines = [
        "| pair | T=S | pass | ours ms | peer ms | ratio | ours GFLOP/s | of matmul peak "
        "| ours peak MiB | peer peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ours, peer in PEERS.items():
        for length in lengths:
            for name, factor in (("fwd", 1), ("fwd_bwd", 3)):
                a, b = results[(ours, length, name)], results[(peer, length, name)]
                if "error" in a or "error" in b:
                    lines.append(
                        f"| {ours} vs {peer} | {length} | {name} | "
                        f"{a.get('error', '')} | {b.get('error', '')} | | | | | |"
                    )
                    continue
                flops = factor * 4 * B * N * length * length * H
                gflops = flops / (a["ms"] / 1e3) / 1e9
                lines.append(
                    f"| {ours} vs {peer} | {length} | {name} | {a['ms']:.1f} | {b['ms']:.1f} | "
                    f"**{a['ms'] / b['ms']:.2f}** | {gflops:.1f} | {gflops / peak_gflops:.0%} | "
                    f"{a['peak_mib']:.0f} | {b['peak_mib']:.0f} |"
                )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", help="also write the table to this Markdown file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, length, which = args.child
        print(json.dumps(measure(impl, int(length), which, args.repeats)))
        return

    peak = matmul_gflops()
    print(f"float32 matmul rate of this machine (2048^3, TensorFlow): {peak:.1f} GFLOP/s")
    results = {}
    for length in args.lengths:
        for which in ("fwd", "fwd_bwd"):
            for impl in IMPLS:
                print(f"T=S={length:5d} {which:7s} {impl:11s} ...", end=" ", flush=True)
                results[(impl, length, which)] = run_child(impl, length, which, args.repeats)
                print(results[(impl, length, which)], flush=True)
    text = table(results, args.lengths, peak)
    header = (
        f"B={B}, E={E}, N={N}, H={H}; median of {args.repeats} runs after one warm-up; "
        f"ratio = ours / peer (below 1 is faster); GFLOP/s counts 4·B·N·T·S·H per forward and "
        f"3x that per forward plus backward; peak MiB is the most resident memory "
        f"above the level before the first call (compilation included; sampled every ms; "
        f"one process per implementation, length and pass); matmul peak {peak:.1f} GFLOP/s.\n"
    )
    print()
    print(header)
    print(text)
    if args.output:
        command = "python benchmarks/attention.py " + " ".join(argv if argv else sys.argv[1:])
        notes = ""  # later sections (long sequences, notes) survive a rewrite of the table
        if os.path.exists(args.output):
            with open(args.output) as f:
                old = f.read()
            starts = [old.find(mark) for mark in ("\n<!-- ", "\n## ") if mark in old]
            if starts:  # from the first later section, with its markers
                notes = "\n" + old[min(starts) + 1 :]
        with open(args.output, "w") as f:
            f.write(
                f"# Benchmarks\n\nProduced by:\n\n    {command.strip()}\n\n"
                f"{header}\n{text}\n{notes}"
            )
        print(f"\nwrote {os.path.abspath(args.output)}")


if __name__ == "__main__":
    main()
