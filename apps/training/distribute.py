"""`tf.distribute` for the training app: the strategy `--strategy` names, and a Keras fix.

    default       one device
    mirrored      MirroredStrategy over every local GPU, else over the CPU devices
                  (`--logical_cpus N` splits the CPU into N, to try it without GPUs)
    multi_worker  MultiWorkerMirroredStrategy, the cluster read from TF_CONFIG

Keras 3's `model.fit` fails under `MultiWorkerMirroredStrategy` in two places
(keras-team/keras#20585, still open for Keras 3.15): it all-reduces an integer
batch to build the model, and it reduces each replica's scalar logs along an axis
they do not have. `fix_keras_for_multi_worker` routes around both; nothing else
changes, and single-worker strategies are left alone.
"""

import os

import tensorflow as tf


def make_strategy(name, logical_cpus=None):
    """The `tf.distribute` strategy that `--strategy` names.

    `default` is one device; `mirrored` is `MirroredStrategy` over every local GPU,
    or over the CPU devices when there is none (`--logical_cpus N` splits the CPU
    into N of them); `multi_worker` is `MultiWorkerMirroredStrategy`, configured
    from `TF_CONFIG`.
    """
    if logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
            )
        except RuntimeError as error:  # TensorFlow has already set up its devices
            raise ValueError(
                "`--logical_cpus` must be set before TensorFlow starts (run the app in a "
                f"fresh process). Received: logical_cpus={logical_cpus} ({error})"
            ) from None
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([d.name for d in devices])
    if not os.environ.get("TF_CONFIG"):
        raise ValueError(
            "`--strategy multi_worker` reads the cluster from the TF_CONFIG environment "
            "variable, which is not set (see the README's 'More than one device'). "
            "Received: strategy='multi_worker'"
        )
    return tf.distribute.MultiWorkerMirroredStrategy()


def worker(strategy):
    """(task type, task index, is chief) of this process; ("worker", 0, True) when alone."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return "worker", 0, True
    task_type, task_id = resolver.task_type, int(resolver.task_id)
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    chief = task_type == "chief" or (not has_chief and task_type == "worker" and task_id == 0)
    return task_type, task_id, chief


def replica_devices(strategy):
    """The device each local replica computed on, from a tiny step run on all of them."""

    def replica_id():
        context = tf.distribute.get_replica_context()
        return tf.cast(context.replica_id_in_sync_group, tf.float32) + tf.zeros([])

    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # "Using MirroredStrategy eagerly has significant overhead"
    try:
        # Eagerly: each replica's result stays on its device (a tf.function copies them).
        per_replica = strategy.run(replica_id)
    finally:
        logger.setLevel(level)
    return [t.device for t in strategy.experimental_local_results(per_replica)]


def is_multi_worker(strategy):
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode()
    )


def fix_keras_for_multi_worker(model, strategy):
    """Lets `model.fit`, `evaluate` and `predict` run under multi-worker `strategy`.

    Call it after building the model in `strategy.scope()`, and call `fit` and the
    others inside that scope too: the model then finds the strategy in the scope
    rather than keeping its own, so Keras skips its integer all-reduce (it builds
    on the first traced step instead), and the scalar logs of the replicas are
    averaged over replicas rather than along an axis 0 they do not have.
    """
    if not is_multi_worker(strategy):
        return
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    model._distribute_strategy = None  # fall back to tf.distribute.get_strategy()
    if getattr(trainer.reduce_per_replica, "_multi_worker_fix", False):
        return
    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and is_multi_worker(strategy):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    reduce_per_replica._multi_worker_fix = True
    trainer.reduce_per_replica = reduce_per_replica
