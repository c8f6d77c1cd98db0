"""The layer on Keras's JAX backend against Keras's and keras-hub's, measured in one run.

Three rows, each ours against its peer with the same weights, both under `jax.jit`:

    layer    forward plus backward (the gradient to the input and every weight) of
             `ScaledDotProductAttention` against `keras.layers.MultiHeadAttention`, B=4,
             E=256, N=4, H=64, at T=S=512 and 2,048.
    chunked  the same at T=S=8,192, B=1, ours with `flash_attention=True` (the O(T) chunked
             path), time and peak resident memory.
    decode   one generated token against keras-hub's `CachedMultiHeadAttention`: a
             `jax.lax.fori_loop` of `STEPS` cached calls, B=1, N=8, H=64, cache S=8,192.

Times come from alternating rounds of ours and the peer in this one process (each round
`--repeats` calls of each, the median); the table gives the median of the per-round ratios
and their range. Every timed call gets new input values (`common.Fed`), drawn before its
clock starts: the layer rows' `x`, the decode row's token and cache. Peak memory comes from
one child process per implementation.

Usage:
    python benchmarks/jax_backend.py                          # the table
    python benchmarks/jax_backend.py --output BENCHMARKS.md   # and its section there
    python benchmarks/jax_backend.py --rounds 3 --rows layer  # a quick look
"""

import argparse
import json
import os
import subprocess
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    NEW_INPUTS,
    Fed,
    PeakSampler,
    alternate,
    at_least_one,
    command_line,
    cpu_name,
    replace_section,
    rss_mib,
)

B, E, N, H = 4, 256, 4, 64
DECODE_N, DECODE_S, STEPS = 8, 8192, 32
START = "<!-- jax-backend:start -->"
END = "<!-- jax-backend:end -->"


def layer_step(impl, batch, length):
    """A jitted forward plus backward of one attention layer, fed a new `x` each call (`Fed`);
    the weights are arguments too, the same on every call."""
    import jax
    import keras
    import numpy as np

    from keras_sdpa import ScaledDotProductAttention

    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(batch, length, E)).astype("float32")
    if impl == "keras_mha":
        layer = keras.layers.MultiHeadAttention(num_heads=N, key_dim=H)
    else:
        layer = ScaledDotProductAttention(
            num_heads=N, key_dim=H, flash_attention=True if impl == "sdpa_chunked" else None
        )
    layer(x, x)
    weights = [v.value for v in layer.trainable_variables]

    def loss(weights, x):
        out, _ = layer.stateless_call(weights, [], x, x)
        return (out * out).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def step(x):
        jax.block_until_ready(grad(weights, x))

    return Fed(step, [x])


def decode_step(impl):
    """`STEPS` cached one-token calls in one jitted loop; the cache of length DECODE_S. A `Fed`
    step: each call starts from a new token and a new cache (normal values: the cache's
    template is zeros)."""
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np
    from keras_hub.layers import CachedMultiHeadAttention

    from keras_sdpa import ScaledDotProductAttention

    keras.utils.set_random_seed(0)
    width = DECODE_N * H
    x = np.random.default_rng(0).normal(size=(1, 1, width)).astype("float32")
    peer = CachedMultiHeadAttention(num_heads=DECODE_N, key_dim=H)
    peer(x, x)
    layer = peer
    if impl == "sdpa_decode":
        layer = ScaledDotProductAttention(num_heads=DECODE_N, key_dim=H)
        layer(x, x)
        layer.set_weights(peer.get_weights())
    cache = jnp.zeros((1, 2, DECODE_S, DECODE_N, H), "float32")
    weights = [v.value for v in layer.trainable_variables]
    start = DECODE_S - STEPS

    def generate(weights, x, cache):
        def body(i, carry):
            x, cache = carry
            index = start + i
            kwargs = dict(cache=cache, cache_update_index=index)
            if impl == "sdpa_decode":
                kwargs["use_causal_mask"] = True
            else:  # keras-hub's TransformerDecoder masks the cache past the index
                kwargs["attention_mask"] = (jnp.arange(DECODE_S) <= index)[None, None, :]
            (out, cache), _ = layer.stateless_call(weights, [], x, x, **kwargs)
            return out, cache

        return jax.lax.fori_loop(0, STEPS, body, (x, cache))

    run = jax.jit(generate)

    def step(x, cache):
        jax.block_until_ready(run(weights, x, cache))

    return Fed(step, [x, cache])


def make(impl, length):
    if impl in ("sdpa_decode", "keras_hub_decode"):
        return decode_step(impl)
    return layer_step(impl, 1 if length > 2048 else B, length)


def peak_memory(impl, length):
    """In a child process: the peak resident MiB of two calls, compilation included."""
    base = rss_mib()
    sampler = PeakSampler()
    step = make(impl, length)
    step()
    step()
    return {"peak_mib": sampler.stop() - base}


def run_child(impl, length):
    cmd = [sys.executable, __file__, "--child", impl, str(length)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:80]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


ROWS = {
    "layer": [("sdpa_layer", "keras_mha", 512), ("sdpa_layer", "keras_mha", 2048)],
    "chunked": [("sdpa_chunked", "keras_mha", 8192)],
    "decode": [("sdpa_decode", "keras_hub_decode", DECODE_S)],
}


def table(results):
    lines = [
        "| row | T=S | ours ms | peer ms | ratio (range) | ours peak MiB | peer peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for (ours, _, length), (t, mine, theirs) in results.items():
        if ours == "sdpa_decode":
            name = "decode, per token vs keras-hub"
            ms, peer_ms = t["ms"] / STEPS, t["peer_ms"] / STEPS
        else:
            what = "chunked" if ours == "sdpa_chunked" else "layer"
            name, ms, peer_ms = f"{what} fwd+bwd vs Keras MHA", t["ms"], t["peer_ms"]
        mib = [m.get("error") or f"{m['peak_mib']:.0f}" for m in (mine, theirs)]
        lines.append(
            f"| {name} | {length} | {ms:.2f} | {peer_ms:.2f} | **{t['ratio']:.3f}** "
            f"({t['low']:.3f}-{t['high']:.3f}) | {mib[0]} | {mib[1]} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    parser.add_argument("--repeats", type=int, default=3, help="calls per round")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--output", help="also write the section to this Markdown file")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(peak_memory(args.child[0], int(args.child[1]))))
        return 0
    at_least_one(parser, args, "rounds", "repeats")
    import jax

    results = {}
    for row in args.rows:
        for ours, peer, length in ROWS[row]:
            print(f"{row}: {ours} vs {peer} at {length} ...", file=sys.stderr, flush=True)
            timed = alternate(make(ours, length), make(peer, length), args.rounds, args.repeats)
            memory = (run_child(ours, length), run_child(peer, length))
            results[(ours, peer, length)] = (timed, *memory)
    header = (
        f"## On Keras's JAX backend (jax {jax.__version__}, CPU)\n\n"
        f"Produced by:\n\n    {command_line(__file__, argv)}\n\nMachine: {cpu_name()}. "
        f"{NEW_INPUTS} {args.rounds} alternating rounds of {args.repeats} calls; ratio = ours "
        "/ peer (below 1: ours is faster), median of the rounds, with their range. Peak MiB: "
        "the most resident memory of two calls (each with its inputs drawn) above the level "
        "before the step was built, compilation included, one child process each."
    )
    text = header + "\n\n" + table(results) + "\n"
    print(text)
    if args.output:
        replace_section(args.output, START, END, text)  # prints where it wrote
    return 0


if __name__ == "__main__":
    sys.exit(main())
