"""The TensorFlow side of what `keras.ops` lacks (its JAX twin is `jax.py`)."""

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

try:
    from tensorflow.compiler.xla import xla_data_pb2
except ImportError:  # TensorFlow releases that ship XLA as `local_xla`
    from local_xla.xla import xla_data_pb2


# A caller's `tf.function` converts the functions it calls with AutoGraph on its first trace.
# The core branches only on static values (shapes, dtypes, flags), so conversion would change
# nothing but the time a trace takes: its entry points run as written, as Keras's own steps do
# (benchmarks/tracing.py measures the first call).
def do_not_convert(fn):
    return tf.autograph.experimental.do_not_convert(fn)


def compile(fn, static_argnames=()):
    """`fn` as one XLA program per static configuration (`tf.function(jit_compile=True)`).

    Without AutoGraph: the core's loops are `tf.while_loop`s and its branches are on static
    values. Keyword arguments are static: TensorFlow keys the trace by each one's value
    (hashable values without weak references, such as a `Plan`), or by its identity.

    Inside a caller's XLA program (`jit_compile=True`) `fn` is traced into it instead. A nested
    compiled function's gradient takes the forward's permutations and shapes as arguments that
    XLA must know at compile time; XLA cannot see through the forward call that made them, so
    it made the caller's inputs compile-time constants and compiled the caller's step again for
    every new batch (`tests/layer/test_compiled_once.py`).
    """
    del static_argnames  # tf.function keys its trace by every Python argument
    return _Compiled(fn)


class _Compiled:
    """`fn` compiled by `tf.function(jit_compile=True)`, or traced inline inside a caller's
    XLA program; the `tf.function`'s own methods (`experimental_get_tracing_count`, ...)
    are this object's."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = tf.function(fn, jit_compile=True, reduce_retracing=True, autograph=False)

    def __call__(self, *args, **kwargs):
        if inside_compiled():
            return self.fn(*args, **kwargs)
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def inside_compiled():
    """Whether we are tracing inside a caller's `jit_compile=True` function."""
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # TensorFlow moved its internals: assume not
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph())


def tanh(x):
    """`tanh` in `x`'s float type (as `ops.tanh` is on TensorFlow)."""
    return tf.math.tanh(x)


def matmul(a, b, operand, transpose_a, transpose_b):
    """`a @ b` over the leading axes; with `operand`, in that precision into float32."""
    if operand is None:
        return tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    rank = a.shape.rank
    dims = xla_data_pb2.DotDimensionNumbers()
    dims.lhs_contracting_dimensions.append(rank - 2 if transpose_a else rank - 1)
    dims.rhs_contracting_dimensions.append(rank - 1 if transpose_b else rank - 2)
    dims.lhs_batch_dimensions.extend(range(rank - 2))
    dims.rhs_batch_dimensions.extend(range(rank - 2))
    a, b = tf.cast(a, operand), tf.cast(b, operand)
    return xla.dot_general(a, b, dims, preferred_element_type=tf.float32)


def uniform(shape, seed, dtype):
    """Stateless uniform `[0, 1)` draws for dropout's keep-mask, from a `(2,)` int32 seed.

    Philox explicitly: XLA's CPU default (ThreeFry) is about 100x slower here.
    """
    return tf.random.stateless_uniform(shape, seed, dtype=dtype, alg="philox")


def new_seed():
    """A random `(2,)` int32 seed, for a dropout call given none."""
    return tf.random.uniform((2,), maxval=2**31 - 1, dtype=tf.int32)


def custom_gradient(forward):
    """`forward(*inputs) -> (outputs, grad)`, differentiated by `grad`.

    `grad(*d_outputs, variables=None)` returns the inputs' gradients; when TensorFlow passes
    the variables the forward read (a `score_mod`'s), it returns `(grads, d_variables)`.
    Tensors the forward reads but does not take as inputs (masks, block kinds, a seed, a
    mod's tensors) get no gradient.
    """
    return tf.custom_gradient(forward)


def vjp(fn, raw, params, variables, d_out):
    """The gradient of `fn(raw, params)` against `d_out`, to `raw`, `params` and `variables`."""
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(raw)
        tape.watch(params)
        tape.watch(variables)
        out = fn(raw, params)
    return tape.gradient(
        out,
        [raw, params, variables],
        output_gradients=d_out,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )


def captures_variable_values():
    """False: a TensorFlow program reads a variable it captures by reference, at every run."""
    return False


def cache_logits(q, key):
    """`q (B, K, G, T, H)` against a cache's `key (B, S, K, H)`: logits `(B, K, G, T, S)`,
    a multiply-and-reduce that reads the cache where it lies (no transposed copy)."""
    # (B, 1, K, G, T, H) * (B, S, K, 1, 1, H), summed over H: (B, S, K, G, T).
    raw = tf.reduce_sum(q[:, None] * key[:, :, :, None, None, :], axis=-1)
    return tf.transpose(raw, [0, 2, 3, 4, 1])


def cache_weighted_sum(weights, value):
    """`weights (B, K, G, T, S)` times a cache's `value (B, S, K, Hv)`: `(B, K, G, T, Hv)`."""
    weights_s = tf.transpose(weights, [0, 4, 1, 2, 3])  # (B, S, K, G, T)
    # (B, S, K, G, T, 1) * (B, S, K, 1, 1, Hv), summed over S: (B, K, G, T, Hv).
    return tf.reduce_sum(weights_s[..., None] * value[:, :, :, None, None, :], axis=1)


# ---- the chunked path's loops


def block_array(size, shape, dtype):
    """Room for `size` blocks of `shape`, written one per step of a loop (`write_block`).

    A `TensorArray`, which XLA lowers to one stacked buffer. Its element shape is given only
    when it is a scalar's: the blocks' own shapes are left to the first write, as before the
    port (the same XLA program).
    """
    return tf.TensorArray(dtype, size=size, element_shape=() if shape == () else None)


def write_block(array, index, block):
    """`array` with block `index` written."""
    return array.write(index, block)


def stack_blocks(array):
    """The blocks of `array`, stacked on a new axis 0."""
    return array.stack()


def add_to_block(grid, i, j, block):
    """`grid[i, j] += block`: a scatter-add of one block into a grid of blocks."""
    return tf.tensor_scatter_nd_add(grid, tf.stack([i, j])[None], block[None])  # (1, 2) index


def fold_in(seed, data):
    """A new `(2,)` seed from `seed` and the integer `data` (a block's index), for `uniform`.

    Philox, as `uniform` draws.
    """
    return tf.random.experimental.stateless_fold_in(seed, data, alg="philox")


def read_block(blocks, index):
    """Block `index` of the stacked `blocks` (a tensor), without `keras.ops.take`'s wrap of
    negative indices: the same XLA program as before the port."""
    return tf.gather(blocks, index)


# ---- the layer's


def static_value(x):
    """The value of `x` as NumPy where it is known while tracing (a constant, an eager
    tensor), else None."""
    return tf.get_static_value(x)


def checked_in_range(index, last, message):
    """`index`, raising `InvalidArgumentError` with `message` when the graph runs if a value
    is outside `[0, last]`. Inside an XLA program the asserts are dropped."""
    checks = [
        tf.debugging.assert_greater_equal(index, 0, message=message),
        tf.debugging.assert_less_equal(index, last, message=message),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(index)


def with_static_shape(x, shape):
    """`x` with the static `shape` (None where unknown) that a traced graph may have lost."""
    x.set_shape(shape)
    return x


def per_replica(seed):
    """A `(2,)` seed made distinct for each replica of a `tf.distribute` strategy.

    The seed generator's state is a mirrored variable that every replica advances
    alike, so without this all replicas would drop the same attention weights.
    Outside a strategy (one replica) the seed is unchanged.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return seed
    replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
    return seed + tf.stack([replica * 1_000_003, tf.zeros_like(replica)])


def variable_inputs(variables):
    """Nothing: TensorFlow's programs read variables by reference."""
    del variables
    return ()


# ---- context parallelism: the ring over a mesh axis


def ring_mesh(axis):
    """Refused: the ring is JAX's `shard_map` and `ppermute`."""
    raise ValueError(
        "`context_parallel` shards the sequence with JAX's `shard_map`: it runs on Keras's "
        f"JAX backend (KERAS_BACKEND=jax), not on TensorFlow. Received: context_parallel={axis!r}"
    )


def ring_map(program, mesh, axis, arrays, per_device_scalar=False):
    raise ring_mesh(axis)


def ring_index(axis):
    raise ring_mesh(axis)


def ring_send(tree, axis, destinations):
    raise ring_mesh(axis)
