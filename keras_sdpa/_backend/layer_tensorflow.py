"""What the layer does differently on TensorFlow; `layer_jax.py` has the same names."""

import tensorflow as tf


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
