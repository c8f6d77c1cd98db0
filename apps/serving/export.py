"""The SavedModel export: raw-string signatures, each review computed at its length bucket.

The SavedModel's signatures take raw text and run the app's own `TextVectorization`
and model inside one TensorFlow graph, so anyone with TensorFlow can serve it
(`apps/serving/predict.py`, TF Serving) without this package: `serving_default` returns the
label and probability, `inspect` the tokens and attention weights too.
"""

import functools
import os
import shutil

import keras
import numpy as np
import tensorflow as tf

from ..classifier.buckets import LENGTH_BUCKETS, bucket_sizes  # noqa: F401 (part of this module's API)
from ..files import machine
from .compiled import compiled_classifier

PAD = ""  # the vectorizer's padding token (id 0)
ROW_STEP = 32  # a group's rows are padded to a power of two up to this, then to a multiple of it


def padded_rows(n, step=ROW_STEP):
    """Rows a group of `n` is padded to (int32 scalar): the next power of two up to `step`,
    then the next multiple of `step`; 0 for 0. A few batch shapes, so XLA compiles a few
    programs per length, and at most `step - 1` padded rows."""
    m = n - 1
    for shift in (1, 2, 4, 8, 16):
        m = tf.bitwise.bitwise_or(m, tf.bitwise.right_shift(m, shift))
    power = m + 1
    multiple = (n + step - 1) // step * step
    return tf.where(n > step, multiple, tf.where(n > 0, power, 0))


def length_groups(ids, sizes):
    """Each row's group, `(B,)` or `()` for one row `(L,)`: the index of the shortest of
    `sizes` that holds its tokens."""
    lengths = tf.reduce_sum(tf.cast(ids != 0, tf.int32), axis=-1)
    return tf.add_n([tf.cast(lengths > size, tf.int32) for size in sizes[:-1]] + [0 * lengths])


def classify_by_length(probability, ids, sizes):
    """`P(positive)` `(B,)` for token ids `(B, L)`, each review computed at the shortest of
    `sizes` that holds its tokens; `probability` maps ids `(n, size)` to `(n,)`.

    `tf.dynamic_partition` groups the rows by that length, the model runs once per group on
    the ids cut to it, and `tf.dynamic_stitch` puts the results back in order. The masks and
    positions make this the full-length result (to float rounding): padding is never attended
    to. Each group's batch is padded (`padded_rows`), so XLA compiles a few programs per
    length, not one per batch size.

    A batch of one review skips the grouping: its ids are cut to its length's size and
    `probability` runs once (one review a call: 0.73x the time of grouping it; cutting the ids
    to a size taken from `sizes`, 0.96x that of choosing among one `probability` call per size
    with `tf.switch_case`).
    """
    # The grouped path is a function of its own that the graph does not inline: `tf.cond`
    # becomes a switch and a merge in the graph, and one review would otherwise carry a dead
    # value through each of the grouped path's 200-odd ops (0.95x the time without them).
    groups = tf.function(
        functools.partial(_classify_groups, probability, sizes=sizes),
        experimental_attributes={"_noinline": True},
    )
    return tf.cond(
        tf.shape(ids)[0] == 1,
        lambda: _classify_one(probability, ids, sizes),
        lambda: groups(ids),
    )


def _classify_one(probability, ids, sizes):
    size = tf.gather(sizes, length_groups(ids[0], sizes))
    return probability(ids[:, :size])


def _classify_groups(probability, ids, sizes):
    group = length_groups(ids, sizes)  # (B,)
    parts = tf.dynamic_partition(ids, group, len(sizes))
    rows = tf.dynamic_partition(tf.range(tf.shape(ids)[0]), group, len(sizes))
    probabilities = []
    # Every group runs, empty or not: skipping the empty ones with `tf.cond` measured slower
    # (batch 256: 786 against 917 reviews/s; one review a call: 3.9 against 3.4 ms p50).
    # An empty group runs at the shortest length, so all of them share one zero-row program:
    # a batch of one length group (`apps.predict`'s) compiles two programs, not seven.
    for part, size in zip(parts, sizes):
        count = tf.shape(part)[0]
        width = tf.where(count > 0, size, sizes[0])
        part = tf.pad(part[:, :width], [[0, padded_rows(count) - count], [0, 0]])
        probabilities.append(probability(part)[:count])
    return tf.dynamic_stitch(rows, probabilities)  # (B,)


def export_saved_model(model, inspector, vectorizer, path, buckets=LENGTH_BUCKETS):
    """Writes a SavedModel to `path` atomically (a temporary folder, then a rename).

    Both signatures take `text`, a `tf.string` batch `[None]` of raw reviews.

    `serving_default(text)` returns `probability` `(B,)` float32 P(positive) (calibrated when
    the model's temperature was folded in, as the app does), `label` `(B,)`
    int32 0/1 and `length` `(B,)` int32, the number of tokens read (0: no known word).
    Each review is computed at the shortest of `buckets` that holds it (`classify_by_length`).

    `inspect(text)` returns the same three, plus `tokens` `(B, L)` strings ("" for padding),
    `attention` `(B, layers, N, L, L)` the self-attention weights and `pooling` `(B, N, L)`
    the pooling attention (what the classifier looked at), at the full length `L`.
    """
    vocabulary = tf.constant(vectorizer.get_vocabulary())
    sizes = bucket_sizes(vectorizer.get_config()["output_sequence_length"], buckets)
    # Only the lookup tables (the vectorizer's, and the word-pair lookup's) are tracked by
    # hand: `add_endpoint` tracks the variables the endpoints use by itself, and tracking the
    # model too would store every weight twice (keras-team/keras#23553).
    archive = keras.export.ExportArchive()
    archive.track(vectorizer)
    embedding = inspector.get_layer("embedding")
    if embedding.bigram_vocab_size:
        archive.track(embedding.bigram_lookup)
    if embedding.trigram_vocab_size:
        archive.track(embedding.trigram_lookup)
    text_spec = tf.TensorSpec([None], tf.string, name="text")
    classify = compiled_classifier(model)  # ids (B, L) -> P(positive) (B,)

    def serve(text):
        ids = vectorizer(text)  # (B, L) int
        probability = classify_by_length(classify, ids, sizes)  # (B,)
        return {
            "probability": probability,
            "label": tf.cast(probability >= 0.5, tf.int32),
            "length": tf.reduce_sum(tf.cast(ids != 0, tf.int32), axis=-1),  # (B,)
        }

    def inspect(text):
        ids = vectorizer(text)  # (B, L) int
        outputs = inspector(ids, training=False)
        probability = tf.reshape(outputs["probability"], [-1])  # (B,)
        return {
            "probability": probability,
            "label": tf.cast(probability >= 0.5, tf.int32),
            "length": tf.reduce_sum(tf.cast(ids != 0, tf.int32), axis=-1),  # (B,)
            "tokens": tf.gather(vocabulary, ids),  # (B, L)
            "attention": outputs["attention"],  # (B, layers, N, L, L)
            "pooling": outputs["pooling"],  # (B, N, L)
        }

    # Plain functions with their signature: `add_endpoint` makes them `tf.function`s that the
    # save traces once. A `tf.function` traced before was traced again by the save, and the
    # SavedModel held every graph twice (1.6 against 1.1 MB, loaded in 1.06 against 0.54 s).
    archive.add_endpoint("serving_default", serve, input_signature=[text_spec])
    archive.add_endpoint("inspect", inspect, input_signature=[text_spec])
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    temporary = f"{path}.partial-{os.getpid()}"
    previous = f"{path}.previous-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    # Serving never differentiates the model, so the custom gradients' functions (the
    # attention core's) stay out: 0.3 MB less graph, loaded in 0.83x the time.
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    archive.write_out(temporary, options=options, verbose=False)
    # Two renames: a crash between them leaves the old model at `previous`, never a
    # half-written one at `path`.
    if os.path.exists(path):
        os.replace(path, previous)
    os.replace(temporary, path)
    shutil.rmtree(previous, ignore_errors=True)
    return path


def measure_serving(path, texts, batch_size=256, single=100):
    """What a service would see from the SavedModel at `path` on `texts` (in their order):
    `serving_default` reviews/s at `batch_size`, after one pass that compiles, and the p50
    and p99 latency of one review a call. `benchmarks/serving.py` measures more."""
    import time

    loaded = tf.saved_model.load(path)
    serve = loaded.signatures["serving_default"]
    texts = list(texts)

    def one_pass():
        start = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            serve(text=tf.constant(texts[i : i + batch_size]))
        return len(texts) / (time.perf_counter() - start)

    one_pass()  # compiles each length bucket and batch shape once
    rate = one_pass()
    delays = []
    for text in texts[:single] * 2:  # the first round compiles batch 1
        start = time.perf_counter()
        serve(text=tf.constant([text]))["probability"].numpy()
        delays.append(time.perf_counter() - start)
    delays = np.sort(delays[len(delays) // 2 :])
    return {
        "reviews": len(texts),
        "batch_size": batch_size,
        "reviews_per_second": round(rate, 1),
        "batch_1_p50_ms": round(float(np.percentile(delays, 50)) * 1e3, 3),
        "batch_1_p99_ms": round(float(np.percentile(delays, 99)) * 1e3, 3),
        "machine": machine(),
    }
