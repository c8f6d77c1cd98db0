"""The JAX side of what `keras.ops` lacks (its TensorFlow twin is `tensorflow.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core  # trace_state_clean has no public name


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
    key = jax.random.wrap_key_data(jnp.asarray(seed).astype(jnp.uint32), impl="threefry2x32")
    return jax.random.uniform(key, shape, dtype=dtype)


def new_seed():
    """A random `(2,)` int32 seed, for a dropout call given none.

    Drawn in Python, so inside a `jax.jit` trace it would be one constant for every step:
    there a seed must be given (the layer passes its `SeedGenerator`'s).
    """
    if not jax_core.trace_state_clean():
        raise ValueError(
            "Dropout inside `jax.jit` needs a seed: pass `seed=` (a `(2,)` integer tensor, "
            "e.g. `keras.random.SeedGenerator(1).next()`), or the keep-mask would be the same "
            "at every step. Received: seed=None"
        )
    return jnp.asarray(np.random.randint(0, 2**31 - 1, size=2), jnp.int32)


def custom_gradient(forward):
    """`forward(inputs, constants) -> (outputs, grad)`, differentiated by `grad`.

    Called as `f(inputs, constants)`: `inputs` get gradients, `constants` (masks, ids) none.
    `grad(*d_outputs)` returns the inputs' gradients, one per input. (JAX passes no
    variables: a Keras variable's value enters a JAX program as an input.) `forward` must
    read no tensor of the program around it but through its arguments: a `jax.custom_vjp`
    that closes over one leaks it ("No constant handler for type DynamicJaxprTracer").
    """

    @jax.custom_gradient
    def call(inputs, constants):
        outputs, grad = forward(inputs, constants)

        def rule(d_outputs):
            d = d_outputs if isinstance(outputs, tuple) else (d_outputs,)
            return tuple(grad(*d)), jax.tree_util.tree_map(lambda _: None, constants)

        return outputs, rule

    return call


def vjp(fn, raw, params, variables, d_out):
    """The gradient of `fn(raw, params)` against `d_out`, to `raw` and `params`.

    `variables` is always empty on JAX (see `custom_gradient`).
    """
    _, pullback = jax.vjp(fn, raw, list(params))
    d_raw, d_params = pullback(d_out)
    return d_raw, d_params, []


def set_shape(x, shape):
    """JAX arrays always know their shape."""
    del x, shape
