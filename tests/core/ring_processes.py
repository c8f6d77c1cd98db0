"""One process of a ring over several processes (issue #79), for
`tests/backends/test_jax_backend.py`.

    python tests/core/ring_processes.py OUT.npz PROCESSES PROCESS_ID ADDRESS

runs causal attention with the sequence sharded over all the processes' CPU devices (4 a
process, `keras.distribution.initialize` over localhost, JAX's gloo CPU collectives), its
gradients to q, k and v, and writes them (gathered on every process) to OUT.npz. With one
process the same program runs on that process's devices: the reference.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import keras_sdpa  # noqa: E402

B, T, N, K, H = 2, 64, 4, 2, 8


def main(out, processes, process_id, address):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if processes > 1:
        keras.distribution.initialize(address, num_processes=processes, process_id=process_id)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["seq"], devices)
    keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))
    rng = np.random.default_rng(0)
    shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H))
    arrays = [rng.normal(size=shape).astype("float32") for shape in shapes]
    c = rng.normal(size=(B, T, N, H)).astype("float32")
    sharded = NamedSharding(mesh.backend_mesh, PartitionSpec(None, "seq"))
    q, k, v = (jax.make_array_from_callback(x.shape, sharded, lambda i, x=x: x[i]) for x in arrays)

    def loss(q, k, v):
        out = keras_sdpa.scaled_dot_product_attention(
            q, k, v, is_causal=True, context_parallel="seq"
        )
        return jnp.sum(out * c), out

    everywhere = NamedSharding(mesh.backend_mesh, PartitionSpec())
    step = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), out_shardings=everywhere
    )
    (_, attended), grads = step(q, k, v)
    dq, dk, dv = (np.asarray(g) for g in grads)
    np.savez(out, out=np.asarray(attended), dq=dq, dk=dk, dv=dv)
    print(f"process {process_id} of {processes}: {len(devices)} devices, wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
