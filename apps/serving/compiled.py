"""The classifier as the SavedModel serves it: everything after the embedding in one XLA program.

`compiled_classifier` is what `serving_default` calls (`apps.serving.export`), and what the
training run's report uses for its validation, test and short-review passes.
"""

import tensorflow as tf
from keras import ops

from ..classifier.model import log_odds_from_embeddings

# `compiled_classifier` runs the rows in steps of about this many attention entries per head
# (rows x L x L): one step's (L, L) matrices then stay in the caches. Measured on the shipped
# model (2 cores): all rows at once against steps of 2 rows at L=512 and of 8 at L=192, 0.69x
# and 0.64x the time at batch 256; steps of 2^20 entries or more lost most of it.
CACHED_ENTRIES = 1 << 19


MAX_STEP_ROWS = 32


def step_rows(length, entries=CACHED_ENTRIES, most=MAX_STEP_ROWS):
    """Rows per step for reviews of `length` tokens (an int or a scalar tensor): the largest
    power of two, at most `most`, whose `rows * length**2` attention entries per head stay
    within `entries`; at least 1."""
    length = tf.cast(length, tf.int64)
    rows = tf.constant(1, tf.int32)
    size = 2
    while size <= most:
        rows = tf.where(size * length * length <= entries, size, rows)
        size *= 2
    return rows


def compiled_classifier(model, log_odds=False):
    """`P(positive)` `(B,)` for token ids `(B, L)`, as `model` computes it at inference, with
    everything after the embedding in one XLA program per shape; with `log_odds`, its
    log-odds `z` (`P = sigmoid(z)`), exact where the probability rounds to 0 or 1.

    The embedding stays on TensorFlow's kernels (its word-pair lookup is a hash table, which
    XLA cannot compile); the blocks, the pooling and the head compile together, so XLA fuses
    the layer norms, the feed-forward and the projections around the attention cores. The
    program loops over the rows in steps of `step_rows(L)`, so that each step's `(L, L)`
    attention matrices stay in the CPU's caches; every row is computed as on its own.
    """
    embedding = model.get_layer("embedding")

    finish = tf.identity if log_odds else tf.sigmoid

    def rows_at_once(x, mask):
        return finish(log_odds_from_embeddings(model, x, mask))  # (B,)

    def rows_in_steps(x, mask, step, steps):
        rows, length, width = tf.unstack(tf.shape(x))
        # At least one slot: XLA compiles this branch for empty batches too, and the loop's
        # slice needs a step to read (it runs no step then).
        slots = tf.maximum(steps, 1)
        extra = slots * step - rows  # padded rows: no tokens
        x = tf.reshape(
            tf.pad(x, [[0, extra], [0, 0], [0, 0]]), tf.stack([slots, step, length, width])
        )
        mask = tf.reshape(tf.pad(mask, [[0, extra], [0, 0]]), tf.stack([slots, step, length]))

        def one_step(index, probability):
            part = rows_at_once(x[index], mask[index])  # (step,)
            return index + 1, tf.tensor_scatter_nd_update(probability, [[index]], part[None])

        _, probability = tf.while_loop(
            lambda index, _: index < steps, one_step, (0, tf.zeros(tf.stack([slots, step])))
        )
        return tf.reshape(probability, [-1])[:rows]

    # One trace for every length and batch (XLA still compiles one program per shape): a
    # trace per length bucket stored the whole model in the SavedModel once per bucket, and
    # loading it took 3 s.
    @tf.function(
        jit_compile=True,
        input_signature=[
            tf.TensorSpec([None, None, embedding.embed_dim], embedding.compute_dtype),
            tf.TensorSpec([None, None], tf.bool),
        ],
    )
    def head(x, mask):
        # A loop's body runs on one core: a batch that fits in one step runs at once, on
        # all of them. XLA compiles both branches (about 1 s a program, against 0.55 s for
        # the loop-free one), and runs the one the batch's shape picks.
        step = step_rows(tf.shape(x)[1])
        steps = (tf.shape(x)[0] + step - 1) // step
        return tf.cond(
            steps > 1,
            lambda: rows_in_steps(x, mask, step, steps),
            lambda: rows_at_once(x, mask),
        )

    def probability(ids):
        return head(embedding(ids), ops.not_equal(ids, 0))

    return probability
