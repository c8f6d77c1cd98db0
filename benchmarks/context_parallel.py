"""Context parallelism's memory: each device's share of a sequence on the ring, against one
device holding it all.

On 8 simulated CPU devices (`--xla_force_host_platform_device_count=8`, set here before JAX
starts), XLA compiles causal attention's forward and backward (the gradient of `sum(out)` to
q, k and v) three ways, and its memory analysis gives each program's bytes per device:
the ring (`context_parallel="seq"`), and on one device the chunked and the dense paths. The
devices share two cores, so times would say nothing: this script compiles and never runs.
"Temporary" is XLA's buffers beyond the arguments and outputs; "arguments and outputs" are a
device's q, k, v, their gradients and the loss.

Usage:
    python benchmarks/context_parallel.py --lengths 4096 16384 65536 --output BENCHMARKS.md
"""

import argparse
import os
import sys

DEVICES = 8
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, command_line, cpu_name, replace_section  # noqa: E402

MARKERS = ("<!-- context-parallel:start -->", "<!-- context-parallel:end -->")
B, N, K, H = 1, 8, 8, 64


def program_bytes(t, **options):
    """`(temporary, arguments and outputs)` bytes per device of the compiled step."""
    import jax
    import jax.numpy as jnp

    import keras_sdpa

    def loss(q, k, v):
        out = keras_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
        return jnp.sum(out.astype("float32"))

    q = jax.ShapeDtypeStruct((B, t, N, H), "float32")
    kv = jax.ShapeDtypeStruct((B, t, K, H), "float32")
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    memory = step.lower(q, kv, kv).compile().memory_analysis()
    held = memory.argument_size_in_bytes + memory.output_size_in_bytes
    return memory.temp_size_in_bytes, held


def sharded_bytes(t, mesh):
    """The ring's bytes per device: its arguments laid out on the mesh, as a user's are."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import keras_sdpa

    def loss(q, k, v):
        out = keras_sdpa.scaled_dot_product_attention(
            q, k, v, is_causal=True, context_parallel="seq"
        )
        return jnp.sum(out.astype("float32"))

    shard = NamedSharding(mesh.backend_mesh, PartitionSpec(None, "seq"))
    q = jax.ShapeDtypeStruct((B, t, N, H), "float32", sharding=shard)
    kv = jax.ShapeDtypeStruct((B, t, K, H), "float32", sharding=shard)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    memory = step.lower(q, kv, kv).compile().memory_analysis()
    held = memory.argument_size_in_bytes + memory.output_size_in_bytes
    return memory.temp_size_in_bytes, held


def mib(size):
    return f"{size / 2**20:,.1f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--output", help="a Markdown file to write the table into")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((DEVICES,), ["seq"], devices)
    rows = []
    for t in args.lengths:
        keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))
        ring = sharded_bytes(t, mesh)
        keras.distribution.set_distribution(None)
        chunked = program_bytes(t, implementation="chunked")
        dense = program_bytes(t, implementation="dense") if t <= 16384 else None
        rows.append((t, ring, chunked, dense))
        print(t, ring, chunked, dense, flush=True)
    lines = [
        f"### Context parallelism: memory per device (JAX, {DEVICES} simulated devices; "
        f"CPU: {cpu_name()})",
        "",
        f"Produced by: `{command_line(__file__, argv)}`. Causal, forward and backward, "
        f"B={B}, N=K={N}, H={H}, float32; MiB per device from XLA's memory analysis of the "
        "compiled step (compiled, not run). The dense path is left out past T=16,384 (its "
        "`(T, T)` scores alone pass 8 GiB).",
        "",
        "| T | ring: temporary | ring: arguments and outputs | one device, chunked: "
        "temporary | one device, chunked: arguments and outputs | one device, dense: temporary |",
        "|---|---|---|---|---|---|",
    ]
    for t, ring, chunked, dense in rows:
        dense_cell = mib(dense[0]) if dense else "(left out)"
        cells = [f"{t:,}", mib(ring[0]), mib(ring[1]), mib(chunked[0]), mib(chunked[1])]
        lines.append("| " + " | ".join([*cells, dense_cell]) + " |")
    print("\n".join(lines))
    if args.output:
        replace_section(args.output, *MARKERS, "\n".join(lines), before="\n## Notes")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
