"""The batches the run trains and evaluates on: in-memory token ids, each batch cut to its
length bucket (`training_stream`, `eval_dataset`)."""

import numpy as np
import tensorflow as tf

from ..classifier import buckets
from ..classifier.data import token_lengths

# Reviews are sorted by length inside windows of this many batches before they are batched, and
# each batch is cut to the first length bucket that holds its longest review. IMDB's median review
# is about 175 words: padded to 512 tokens, most of a step's work was padding.
BUCKET_WINDOW = 32


def _batches_cut_to_bucket(ids, labels, lengths, indices):
    """Maps a dataset of example indices `(B,)` to `(ids (B, size), labels (B,))`, `size` the
    first of `buckets.bucket_sizes(L)` that holds the batch's longest review."""
    sizes = tf.constant(buckets.bucket_sizes(ids.shape[1]), tf.int32)

    def gather(i):
        longest = tf.reduce_max(tf.gather(lengths, i))
        size = sizes[tf.minimum(tf.searchsorted(sizes, [longest])[0], len(sizes) - 1)]
        return tf.gather(ids, i)[:, :size], tf.gather(labels, i)  # (B, size), (B,)

    return indices.map(gather)


def training_stream(ids, labels, batch_size, seed, start_step=0, window=BUCKET_WINDOW):
    """The infinite, deterministic stream of training batches, from batch `start_step` on.

    Pass `p` over the data is one epoch of `len(ids) // batch_size` batches, a pure function of
    `(seed, p)`: the examples in the order `stateless_shuffle(seed, p)` (the last
    `len(ids) % batch_size` left out), sorted by length inside windows of `window` batches,
    batched, the batches shuffled again, and each batch cut to its length bucket. So a resumed
    run sees exactly the batches an uninterrupted one would, every epoch draws new batches, and
    a batch's reviews have similar lengths.
    """
    n, length = ids.shape
    per_pass = n // batch_size
    if per_pass < 1:
        raise ValueError(
            f"`batch_size` must be at most the number of training examples ({n}). "
            f"Received: batch_size={batch_size}"
        )
    lengths = tf.constant(token_lengths(ids))
    ids, labels = tf.constant(ids), tf.constant(labels, tf.float32)

    def one_pass(p):
        pass_seed = tf.stack([tf.cast(seed, tf.int64), p])
        order = tf.random.experimental.stateless_shuffle(tf.range(n), seed=pass_seed)
        order = order[: per_pass * batch_size]  # (P * B,)
        window_of = tf.range(per_pass * batch_size) // (window * batch_size)
        key = window_of * (length + 1) + tf.gather(lengths, order)  # window first, then length
        order = tf.gather(order, tf.argsort(key, stable=True))
        batches = tf.reshape(order, (per_pass, batch_size))  # (P, B)
        shuffle_seed = tf.random.experimental.stateless_fold_in(pass_seed, 1)
        batches = tf.gather(
            batches, tf.random.experimental.stateless_shuffle(tf.range(per_pass), shuffle_seed)
        )
        return tf.data.Dataset.from_tensor_slices(batches)

    indices = tf.data.Dataset.counter().flat_map(one_pass).skip(start_step)  # (B,) each
    stream = _batches_cut_to_bucket(ids, labels, lengths, indices)
    return _shard_by_data(stream.prefetch(tf.data.AUTOTUNE))


def with_unlabeled(stream, unlabeled_ids, batch_size, seed, start_step=0):
    """`stream`'s batches `(ids (B, L), labels (B,))` with a batch of unlabelled token ids
    beside each: `(ids, labels, unlabelled ids (B, L'))`, zipped.

    The unlabelled batches are `training_stream`'s of `unlabeled_ids` `(n, L)` from the same
    `start_step` (passes over them, shuffled by `seed`, each batch cut to its own length
    bucket), so a resumed run reads the same pairs as an uninterrupted one."""
    unlabeled = training_stream(
        unlabeled_ids, np.zeros(len(unlabeled_ids), "float32"), batch_size, seed, start_step
    )
    zipped = tf.data.Dataset.zip(stream, unlabeled)
    return _shard_by_data(zipped.map(lambda labelled, other: (*labelled, other[0])))


def eval_dataset(ids, labels, batch_size, limit=None):
    """The first `limit` examples (all by default), batched in order of length, each batch cut
    to its length bucket. Metrics summed over the examples do not depend on the order."""
    ids, labels = ids[:limit], labels[:limit]
    lengths = token_lengths(ids)
    order = np.argsort(lengths, kind="stable").astype("int32")
    indices = tf.data.Dataset.from_tensor_slices(order).batch(batch_size)
    dataset = _batches_cut_to_bucket(
        tf.constant(ids), tf.constant(labels, tf.float32), tf.constant(lengths), indices
    )
    return _shard_by_data(dataset)


def _shard_by_data(dataset):
    # In-memory data has no files to shard: each worker takes its share of every batch.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)
