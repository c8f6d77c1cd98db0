"""What the layer does differently on JAX; `layer_tensorflow.py` has the same names."""

import jax
import numpy as np


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
