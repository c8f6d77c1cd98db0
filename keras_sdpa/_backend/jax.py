"""The JAX side of what `keras.ops` lacks (its TensorFlow twin is `tensorflow.py`)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax._src import core as jax_core  # trace_state_clean has no public name
from jax.extend import core as jex


def do_not_convert(fn):
    return fn  # JAX traces Python as written: there is no AutoGraph


def compile(fn, static_argnames=()):
    """`fn` as one XLA program per static configuration (`jax.jit`).

    Keyword arguments named in `static_argnames` key the trace; they must be hashable.
    """
    return jax.jit(fn, static_argnames=static_argnames)


def inside_compiled():
    """JAX knows every shape while tracing, so no choice waits for run time."""
    return True


def tanh(x):
    """`tanh` in `x`'s float type: Keras 3.15's `ops.tanh` gives float32 for float64 on JAX."""
    return jnp.tanh(x)


def matmul(a, b, operand, transpose_a, transpose_b):
    """`a @ b` over the leading axes; with `operand`, in that precision into float32."""
    rank = a.ndim
    contract = ((rank - 2 if transpose_a else rank - 1,), (rank - 1 if transpose_b else rank - 2,))
    batch = (tuple(range(rank - 2)), tuple(range(rank - 2)))
    if operand is None:
        return jax.lax.dot_general(a, b, (contract, batch))
    a, b = a.astype(operand), b.astype(operand)
    return jax.lax.dot_general(a, b, (contract, batch), preferred_element_type=jnp.float32)


def uniform(shape, seed, dtype):
    """Stateless uniform `[0, 1)` draws for dropout's keep-mask, from a `(2,)` int32 seed."""
    return jax.random.uniform(_key(seed), shape, dtype=dtype)


def _key(seed):
    """A `(2,)` integer seed as a ThreeFry key."""
    return jax.random.wrap_key_data(jnp.asarray(seed).astype(jnp.uint32), impl="threefry2x32")


def new_seed():
    """A random `(2,)` int32 seed, for a dropout call given none.

    Drawn in Python, so inside a JAX transformation (`jax.jit`, `jax.grad`, `jax.vmap`) it
    would be one constant of the trace, the same mask at every step: there a seed must be
    given (the layer passes its `SeedGenerator`'s).
    """
    if not jax_core.trace_state_clean():
        raise ValueError(
            "Dropout inside a JAX transformation (jax.jit, jax.grad, jax.vmap) needs a seed: "
            "pass `seed=` (a `(2,)` integer tensor, e.g. from `keras.random.SeedGenerator`), "
            "or the keep-mask would be one constant of the trace. Received: seed=None"
        )
    return jnp.asarray(np.random.randint(0, 2**31 - 1, size=2), jnp.int32)


def custom_gradient(forward):
    """`forward(*inputs) -> (outputs, grad)`, differentiated by `grad`.

    `grad(*d_outputs)` returns the inputs' gradients, one per input (None: a zero gradient).
    `forward` may read tensors it does not take as inputs (masks, block kinds, a seed, a
    mod's tensors); they get no gradient, as on TensorFlow. JAX passes no variables: a Keras
    variable's value enters a JAX program as an input.

    `jax.custom_vjp` (so `jax.custom_gradient`) cannot close over a tracer of the program
    around it: under `jax.grad` the lowering fails ("No constant handler for type:
    DynamicJaxprTracer", JAX 0.10.2). So `forward` and its gradient are traced to jaxprs
    first, and what they read from outside becomes explicit arguments.
    """

    def call(*inputs):
        inputs = [jnp.asarray(x) for x in inputs]
        rule = []  # the gradient's jaxpr and its outputs' structure, set while tracing

        def forward_and_residuals(*inputs):
            out, grad = forward(*inputs)
            d_out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out)

            def gradient(d_out):  # TensorFlow passes a tuple's gradients one by one
                return grad(*d_out) if isinstance(out, tuple) else grad(d_out)

            closed, d_inputs = jax.make_jaxpr(gradient, return_shape=True)(d_out)
            rule.append((closed.jaxpr, jax.tree.structure(d_inputs)))
            return out, closed.consts  # the gradient's residuals

        closed, (out, _) = jax.make_jaxpr(forward_and_residuals, return_shape=True)(*inputs)
        out_tree = jax.tree.structure(out)

        def evaluate(closed_over, inputs):
            return jex.jaxpr_as_fun(jex.ClosedJaxpr(closed.jaxpr, closed_over))(*inputs)

        @jax.custom_vjp
        def run(closed_over, inputs):
            return evaluate(closed_over, inputs)[: out_tree.num_leaves]

        def run_forward(closed_over, inputs):
            flat = evaluate(closed_over, inputs)
            return flat[: out_tree.num_leaves], flat[out_tree.num_leaves :]

        def run_grad(residuals, d_out):
            jaxpr, tree = rule[0]
            d_inputs = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, residuals))(*d_out)
            d_inputs = jax.tree.unflatten(tree, d_inputs)
            d_inputs = [jnp.zeros_like(x) if d is None else d for d, x in zip(d_inputs, avals)]
            return [None] * len(closed.consts), d_inputs

        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
        run.defvjp(run_forward, run_grad)
        return jax.tree.unflatten(out_tree, run(list(closed.consts), inputs))

    return call


def vjp(fn, raw, params, variables, d_out):
    """The gradient of `fn(raw, params)` against `d_out`, to `raw` and `params`.

    `variables` is always empty on JAX (see `custom_gradient`).
    """
    _, pullback = jax.vjp(fn, raw, list(params))
    d_raw, d_params = pullback(d_out)
    return d_raw, d_params, []


def captures_variable_values():
    """True: `jax.jit` fixes a variable read from outside its inputs as a constant of the trace."""
    return True


def cache_logits(q, key):
    """`q (B, K, G, T, H)` against a cache's `key (B, S, K, H)`: logits `(B, K, G, T, S)`,
    a dot on the transposed cache (JAX's XLA does not fuse TensorFlow's multiply-and-reduce
    into one read: `_core/decode.py`)."""
    b, k, g, t, h = q.shape
    rows = q.reshape(b, k, g * t, h)  # a group's heads as rows of one product
    raw = matmul(rows, jnp.swapaxes(key, 1, 2), None, False, True)  # (B, K, G T, S)
    return raw.reshape(b, k, g, t, -1)


def cache_weighted_sum(weights, value):
    """`weights (B, K, G, T, S)` times a cache's `value (B, S, K, Hv)`: `(B, K, G, T, Hv)`."""
    b, k, g, t, s = weights.shape
    rows = weights.reshape(b, k, g * t, s)
    out = matmul(rows, jnp.swapaxes(value, 1, 2), None, False, False)  # (B, K, G T, Hv)
    return out.reshape(b, k, g, t, -1)


# ---- the chunked path's loops


def block_array(size, shape, dtype):
    """Room for `size` blocks of `shape`, written one per step of a loop (`write_block`)."""
    return jnp.zeros((size, *shape), dtype)


def write_block(array, index, block):
    """`array` with block `index` written."""
    index = jnp.asarray(index, jnp.int32)  # int64 under jax_enable_x64; dynamic_slice: one type
    return jax.lax.dynamic_update_index_in_dim(array, block.astype(array.dtype), index, 0)


def stack_blocks(array):
    """The blocks of `array`, stacked on a new axis 0 (they already are)."""
    return array


def add_to_block(grid, i, j, block):
    """`grid[i, j] += block`: a scatter-add of one block into a grid of blocks."""
    return grid.at[i, j].add(block)


def fold_in(seed, data):
    """A new `(2,)` seed from `seed` and the integer `data` (a block's index), for `uniform`.

    ThreeFry, as `uniform` draws.
    """
    return jax.random.key_data(jax.random.fold_in(_key(seed), data))


def read_block(blocks, index):
    """Block `index` of the stacked `blocks` (an array)."""
    index = jnp.asarray(index, jnp.int32)  # int64 under jax_enable_x64 (see `write_block`)
    return jax.lax.dynamic_index_in_dim(blocks, index, 0, keepdims=False)


# ---- the layer's


def static_value(x):
    """The value of `x` as NumPy where it is known while tracing (a concrete array), else
    None (a tracer inside `jax.jit`)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def checked_in_range(index, last, message):
    """`index` unchecked: a traced value is known only inside the compiled program, where
    JAX has no assert (as XLA drops TensorFlow's); concrete values were checked already."""
    del last, message
    return index


def with_static_shape(x, shape):
    """`x`: JAX's shapes are always static."""
    del shape
    return x


def per_replica(seed):
    """`seed` unchanged: a JAX program sharded over devices draws one array for the whole
    batch, so no two shards share a dropout mask."""
    return seed


def variable_inputs(variables):
    """The variables' values: `jax.jit` would compile a variable in as a constant, so its
    value enters the program as an input (and the gradient reaches a trainable one)."""
    return tuple(v.value for v in variables)


# ---- context parallelism: the ring over a mesh axis


def ring_mesh(axis):
    """The active `keras.distribution`'s mesh, as JAX's `Mesh`, and the size of its `axis`."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        raise ValueError(
            f"`context_parallel={axis!r}` shards the sequence over an axis of the "
            "distribution's device mesh, and no distribution is set: set one with "
            "`keras.distribution.set_distribution(...)` whose `DeviceMesh` has that axis. "
            f"Received: context_parallel={axis!r}"
        )
    mesh = distribution.device_mesh
    if axis not in mesh.axis_names:
        raise ValueError(
            f"`context_parallel` must name an axis of the distribution's device mesh, "
            f"{tuple(mesh.axis_names)}. Received: context_parallel={axis!r}"
        )
    return mesh.backend_mesh, mesh.shape[list(mesh.axis_names).index(axis)]


def ring_map(program, mesh, axis, arrays, per_device_scalar=False):
    """`program` on each device's shards of `arrays`, split on axis 1 over `axis`; its output
    split the same way (or one scalar a device)."""
    spec = jax.sharding.PartitionSpec(None, axis)
    out = jax.sharding.PartitionSpec(axis) if per_device_scalar else spec
    in_specs = tuple(spec for _ in arrays)
    mapped = jax.shard_map(program, mesh=mesh, in_specs=in_specs, out_specs=out, check_vma=False)
    return mapped(*arrays)


def ring_index(axis):
    """This device's place on the ring."""
    return jax.lax.axis_index(axis)


def ring_send(tree, axis, destinations):
    """Every array of `tree` sent from each device `d` to device `destinations[d]`."""
    return jax.lax.ppermute(tree, axis, list(enumerate(destinations)))
