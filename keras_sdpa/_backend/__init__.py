"""What `keras.ops` lacks, one small module per backend, side by side.

The attention math (`_core/layout.py`, `_core/softmax.py`, `_core/mod_calls.py` and the paths)
is written once, on `keras.ops`. What `keras.ops` cannot say the same way on both backends lives
here, with the same names in `tensorflow.py` and `jax.py`, so that a reader compares them line
for line (as Keras's own `keras/src/backend/<name>/nn.py` do): the compiled entry, the custom
gradient, the half-precision product with float32 accumulation, the stateless dropout draw, the
gradient of a `score_mod`, and whether a trace runs inside a caller's compiled step.

`import keras_sdpa` never imports TensorFlow on the JAX backend: the module for the backend
Keras runs is imported on first use.
"""

import importlib

import keras

SUPPORTED = ("tensorflow", "jax")

# The contract: the functions each shim defines, in this order, and what they do
# (`tests/house/test_house.py` checks both shims against it).
CONTRACT = (
    ("do_not_convert", "a function as TensorFlow's AutoGraph should leave it"),
    ("compile", "one XLA program per static configuration: tf.function or jax.jit"),
    ("inside_compiled", "whether a trace runs inside a caller's compiled step"),
    ("tanh", "tanh in the input's float type"),
    ("matmul", "a batched product; half precision multiplied into float32"),
    ("uniform", "stateless uniform draws from a (2,) int32 seed, for dropout"),
    ("new_seed", "a random (2,) int32 seed, for a dropout call given none"),
    ("custom_gradient", "forward(*inputs) -> (outputs, grad), differentiated by grad"),
    ("vjp", "the gradient of a score_mod's logits to the logits, tensors and variables"),
    ("captures_variable_values", "whether a variable read in a trace becomes a constant"),
    ("cache_logits", "queries against a cache's keys in their (B, S, K, H) layout"),
    ("cache_weighted_sum", "weights times a cache's values in their (B, S, K, Hv) layout"),
    ("block_array", "room for the blocks a loop writes one per step"),
    ("write_block", "an array with one block written"),
    ("stack_blocks", "the written blocks, stacked on a new axis 0"),
    ("add_to_block", "grid[i, j] += block"),
    ("fold_in", "a new seed from a seed and a block's index"),
    ("read_block", "one block of the stacked blocks"),
    ("static_value", "a tensor's value where it is known while tracing, else None"),
    ("checked_in_range", "an index checked against its range where the backend can"),
    ("with_static_shape", "a tensor with the static shape a reshape hid"),
    ("per_replica", "a dropout seed distinct per replica of a distribution strategy"),
    ("variable_inputs", "the mods' variables as the program's inputs (JAX) or none"),
    ("ring_mesh", "the distribution's mesh and the size of the axis that shards the sequence"),
    ("ring_map", "a program on each device's shards of the sequence (shard_map)"),
    ("ring_index", "this device's place on the ring"),
    ("ring_send", "arrays sent from each device to another of the ring (ppermute)"),
)


def check():
    """The backend's name; a `ValueError` naming it and the supported ones otherwise."""
    name = keras.backend.backend()
    if name not in SUPPORTED:
        raise ValueError(
            "keras_sdpa runs on Keras's TensorFlow and JAX backends. Set KERAS_BACKEND to "
            f"'tensorflow' or 'jax' before importing keras. Received: KERAS_BACKEND={name!r}"
        )
    return name


def get():
    """The shim module of the running backend (`tensorflow.py` or `jax.py`)."""
    return importlib.import_module(f"keras_sdpa._backend.{check()}")


def do_not_convert(fn):
    """`fn` as TensorFlow's AutoGraph should leave it (it branches only on static values).

    Decided when `keras_sdpa` is imported, which works on every backend: an unsupported one
    raises at the first call instead (`check`).
    """
    if keras.backend.backend() == "tensorflow":
        return get().do_not_convert(fn)
    return fn


def compile(fn, static_argnames=()):
    """`fn` as one XLA program per static configuration, compiled by the running backend (a
    `tf.function(jit_compile=True)` or a `jax.jit`). Made when its module is imported, as
    `do_not_convert` is: on an unsupported backend `fn` is returned and raises at its first
    call (`check`)."""
    if keras.backend.backend() in SUPPORTED:
        return get().compile(fn, static_argnames=static_argnames)
    return fn
