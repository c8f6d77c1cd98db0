"""The core's chunked path against PyTorch's CPU flash attention, measured in one run.

    ours   keras_sdpa.scaled_dot_product_attention(q, k, v, implementation="chunked"), the
           O(T)-memory path, inside `tf.function(jit_compile=True)` (one XLA program)
    torch  torch.nn.functional.scaled_dot_product_attention on the CPU, which runs PyTorch's
           C++ flash attention kernel there (forward and backward)

B=1, N=8, H=64, float32, T=S, causal and not, the forward alone and forward plus backward
(the gradients of `sum(out * c)` to q, k and v, `c` drawn once per call like the inputs).

Each side runs in a process of its own (TensorFlow and PyTorch deadlock in one), started
once; the parent asks each for one timed call in alternating rounds (the order reversed
every round, so neither always runs first), after one warm-up call each, and every call
draws new input values before its clock starts. A ratio is ours / torch, the median of the
per-round ratios with their range. GFLOP/s counts 4·B·N·T·S·H per forward (half of it
causal) and 3x that per forward plus backward; "of matmul" divides by the machine's float32
matmul rate, the faster of the two processes' 2048 x 2048 x 2048 products.

PyTorch is an optional dependency of this script alone (`pip install torch`, the CPU
build); nothing else in the project needs it.

Usage:
    python benchmarks/torch_sdpa.py                                   # T=1024..16384
    python benchmarks/torch_sdpa.py --lengths 1024 4096 --rounds 3
    python benchmarks/torch_sdpa.py --output BENCHMARKS.md            # and its section there
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least_one, command_line, cpu_name, replace_section  # noqa: E402

B, N, H = 1, 8, 64
START, END = "<!-- torch-sdpa:start -->", "<!-- torch-sdpa:end -->"
PASSES = ("fwd", "fwd_bwd")


def flops(length, causal, kind):
    forward = 4 * B * N * length * length * H * (0.5 if causal else 1.0)
    return forward * (3 if kind == "fwd_bwd" else 1)


# ---- the two sides, each in its own child process


def keras_side():
    """`step(length, causal, kind)` of ours: one call on new inputs, its seconds; and the
    process's matmul rate."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    from keras_sdpa import scaled_dot_product_attention

    rng, compiled = np.random.default_rng(0), {}

    def make(causal, kind):
        @tf.function(jit_compile=True)
        def step(q, k, v, c):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = scaled_dot_product_attention(
                    q, k, v, is_causal=causal, implementation="chunked"
                )
                loss = tf.reduce_sum(out * c)
            return [out] if kind == "fwd" else tape.gradient(loss, [q, k, v])

        return step

    def step(length, causal, kind):
        key = (causal, kind)
        compiled[key] = compiled.get(key) or make(causal, kind)
        inputs = [tf.constant(rng.standard_normal((B, length, N, H), "float32")) for _ in "qkvc"]
        start = time.perf_counter()
        [x.numpy() for x in compiled[key](*inputs)]
        return time.perf_counter() - start

    a = tf.constant(rng.standard_normal((2048, 2048), "float32"))
    matmul = tf.function(lambda a: a @ a, jit_compile=True)
    return step, lambda: _rate(lambda: matmul(a).numpy())


def torch_side():
    import torch
    import torch.nn.functional as F

    def step(length, causal, kind):
        grad = kind == "fwd_bwd"
        q, k, v = (torch.randn(B, N, length, H, requires_grad=grad) for _ in "qkv")
        c = torch.randn(B, N, length, H)
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if grad:
                (out * c).sum().backward()
        return time.perf_counter() - start

    a = torch.randn(2048, 2048)
    return step, lambda: _rate(lambda: a @ a)


def _rate(matmul):
    """GFLOP/s of a 2048^3 product, the best of 10 after a warm-up."""
    matmul()
    best = min(_timed(matmul) for _ in range(10))
    return 2 * 2048**3 / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def serve(side):
    """A child: answers each request line (`length causal kind`, or `rate`) with a number."""
    step, rate = {"ours": keras_side, "torch": torch_side}[side]()
    for line in sys.stdin:
        words = line.split()
        if words == ["rate"]:
            answer = rate()
        else:
            answer = step(int(words[0]), words[1] == "causal", words[2])
        print(json.dumps(answer), flush=True)


class Child:
    def __init__(self, side):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", side],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, request):
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark's child stopped on: {request}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


# ---- the parent: alternating rounds, the table


def measure(children, lengths, rounds):
    """`{(T, causal, kind): {"ours": [s...], "torch": [s...]}}`, printing progress."""
    results = {}
    for length in lengths:
        for causal in (False, True):
            for kind in PASSES:
                request = f"{length} {'causal' if causal else 'full'} {kind}"
                for child in children.values():
                    child.ask(request)  # trace, compile, warm up
                times = {side: [] for side in children}
                for index in range(rounds):
                    order = list(children.items())
                    for side, child in order if index % 2 == 0 else order[::-1]:
                        times[side].append(child.ask(request))
                results[length, causal, kind] = times
                ratio = statistics.median(a / b for a, b in zip(times["ours"], times["torch"]))
                print(f"  T={length} {request.split()[1]} {kind}: ours/torch {ratio:.2f}")
    return results


def table(results, rate):
    lines = [
        "| T=S | mask | pass | ours ms | torch ms | ours / torch (range) "
        "| ours GFLOP/s | torch GFLOP/s | ours of matmul | torch of matmul |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (length, causal, kind), times in results.items():
        ours, torch = (statistics.median(times[side]) for side in ("ours", "torch"))
        ratios = sorted(a / b for a, b in zip(times["ours"], times["torch"]))
        work = flops(length, causal, kind) / 1e9
        lines.append(
            f"| {length} | {'causal' if causal else 'none'} | {kind} | {ours * 1e3:.1f} "
            f"| {torch * 1e3:.1f} | **{statistics.median(ratios):.2f}** "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {work / ours:.1f} | {work / torch:.1f} "
            f"| {work / ours / rate:.0%} | {work / torch / rate:.0%} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--output", help="write the table into this Markdown file's section")
    parser.add_argument("--child", choices=["ours", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve(args.child)
    at_least_one(parser, args, "rounds")
    try:
        import torch  # noqa: F401
    except ImportError:
        parser.error("PyTorch is not installed: pip install torch (its CPU build)")
    children = {side: Child(side) for side in ("ours", "torch")}
    try:
        rate = max(child.ask("rate") for child in children.values())
        print(f"matmul: {rate:.1f} GFLOP/s")
        results = measure(children, args.lengths, args.rounds)
    finally:
        for child in children.values():
            child.close()
    section = (
        "## The chunked path against PyTorch's CPU flash attention\n\n"
        f"Produced by:\n\n    {command_line(__file__, argv)}\n\n"
        f"{cpu_name()}. float32, B={B}, N={N}, H={H}, T=S; ours is the core's chunked path "
        "under `tf.function(jit_compile=True)`, torch is "
        "`torch.nn.functional.scaled_dot_product_attention` (its C++ flash kernel), each in "
        f"a process of its own. Every call draws new inputs before its clock starts. Times: "
        f"{args.rounds} alternating rounds of one call each after a warm-up call (median); "
        "ratio = ours / torch, the median of the per-round ratios with their range. GFLOP/s "
        "counts 4·B·N·T·S·H per forward, half of it causal, 3x that per forward plus "
        f"backward; the machine's float32 matmul rate is {rate:.1f} GFLOP/s.\n\n"
        f"{table(results, rate)}\n"
    )
    print()
    print(section)
    if args.output:
        replace_section(args.output, START, END, section, before="\n## Notes")


if __name__ == "__main__":
    main()
