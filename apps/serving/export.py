"""SavedModel export with a raw-string signature, and attention export for inspection.

The SavedModel's signatures take raw text and run the app's own `TextVectorization`
and model inside one TensorFlow graph, so anyone with TensorFlow can serve it
(`apps/serving/predict.py`, TF Serving) without this package: `serving_default` returns the
label and probability, `inspect` the tokens and attention weights too.
"""

import base64
import functools
import html
import json
import os
import shutil

import keras
import numpy as np
import tensorflow as tf

from ..inspection import explain, page
from ..sentiment import model as model_lib
from ..sentiment.buckets import LENGTH_BUCKETS, bucket_sizes  # noqa: F401 (part of this module's API)

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
    classify = model_lib.compiled_classifier(model)  # ids (B, L) -> P(positive) (B,)

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
        "machine": _machine(),
    }


def write_text_atomic(path, text):
    """Writes `text` (a string, or an iterable of strings) to `path` as UTF-8, via a
    temporary file and a rename: an interrupted write never leaves half a file."""
    temporary = f"{path}.partial"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines([text] if isinstance(text, str) else text)
    os.replace(temporary, path)
    return path


def write_json_atomic(path, payload):
    return write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def inspection_sample(size, count, seed):
    """Indices of the `count` (at most `size`) test reviews exported for inspection:
    seeded, sorted, the same for the training app and `python -m apps.viewer`."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(size, min(count, size), replace=False))


def make_record(index, text, tokens, label, probability, pooling, attention,
                gradient=None, deletion=None):  # fmt: skip
    """One inspection record over the `n` real tokens of a review.

    `pooling` is `(N, n)` and `attention` `(layers, N, n, n)` (row: the attending
    token; column: the attended one). Padding never appears. With the Keras model at
    hand, `gradient` `(n,)` is gradient x input towards the predicted label and
    `deletion` the viewer's deletion test (`deletion_test`).
    """
    record = {
        "index": int(index),
        "text": text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text,
        "tokens": [str(t) for t in tokens],
        "label": int(label),
        "prediction": int(probability >= 0.5),
        "probability": round(float(probability), 6),
        "pooling": np.round(pooling, 5).tolist(),
        "attention": np.round(attention, 5).tolist(),
    }
    if gradient is not None:
        record["gradient_x_input"] = np.round(gradient, 6).tolist()
    if deletion is not None:
        record["deletion"] = deletion
    return record


def deletion_test(probability, ids, n, attention, seed):
    """The viewer's one-line test for one review: P(positive) after deleting its `k` (5, or
    fewer in a short review) most attended tokens, and after deleting `k` random ones.

    `probability` maps ids `(B, L)` to P(positive); `attention` `(n,)` is the pooling
    attention, mean over heads; the random tokens are seeded by `seed` (the review's index).
    """
    k = min(explain.DELETED_IN_VIEWER, n)
    top = explain.order_of(attention)[:k]
    chosen = np.random.default_rng(seed).choice(n, k, replace=False) if n else []
    rows = [explain.delete_positions(ids, top), explain.delete_positions(ids, chosen)]
    without_top, without_random = probability(np.stack(rows))
    return {
        "k": int(k),
        "without_top_attention": round(float(without_top), 6),
        "without_random": round(float(without_random), 6),
    }


def inspect_records(inspector, vectorizer, texts, labels, indices=None, model=None):
    """`make_record` for each review, from the in-memory inspector model.

    `indices` are the reviews' positions in their split (default: 0, 1, ...). With `model`
    (the Keras classifier), each record also gets gradient x input and the deletion test.
    """
    indices = range(len(texts)) if indices is None else indices
    vocabulary = np.array(vectorizer.get_vocabulary(), dtype=object)
    ids = vectorizer(tf.constant(texts)).numpy()  # (B, L)
    outputs = inspector.predict(ids, batch_size=16, verbose=0)
    if model is not None:
        probe = explain.ModelProbe(model)
        gradients, _ = probe.gradient_x_input(ids)  # (B, L)
    records = []
    for i, (index, text) in enumerate(zip(indices, texts)):
        n = int((ids[i] != 0).sum())
        pooling = outputs["pooling"][i, :, :n]  # (N, n)
        extra = {}
        if model is not None:
            extra = {
                "gradient": gradients[i, :n],
                "deletion": deletion_test(
                    probe.probability, ids[i], n, pooling.mean(axis=0), int(index)
                ),
            }
        records.append(
            make_record(
                index,
                text,
                vocabulary[ids[i, :n]],
                labels[i],
                outputs["probability"][i, 0],
                pooling,
                outputs["attention"][i, :, :, :n, :n],
                **extra,
            )  # fmt: skip
        )
    return records


def pooling_sharpness(records):
    """How far the pooling weights are from uniform, over the records and their heads.

    Returns `normalized_entropy`, the mean of `H(p) / log(n)` (1 = uniform over the review's
    `n` tokens, 0 = all weight on one), `top_weight_times_uniform`, the mean of `max(p) * n`
    (1 = uniform, `n` = one token), and the number of `reviews` (those of 2 tokens or more).
    Near-uniform pooling averages the positions, and a ranking by its weights then rests on
    small differences (see `apps.faithfulness`).
    """
    entropies, tops = [], []
    for record in records:
        weights = np.asarray(record["pooling"], dtype="float64")  # (N, n)
        n = weights.shape[1]
        if n < 2:
            continue
        weights = weights / weights.sum(axis=1, keepdims=True)  # undo the rounding to 1e-5
        logs = np.log(np.where(weights > 0, weights, 1.0))
        entropies.extend(-(weights * logs).sum(axis=1) / np.log(n))
        tops.extend(weights.max(axis=1) * n)
    if not entropies:
        return None
    return {
        "normalized_entropy": round(float(np.mean(entropies)), 5),
        "top_weight_times_uniform": round(float(np.mean(tops)), 4),
        "reviews": len(entropies) // len(records[0]["pooling"]),
    }


def write_attention_jsonl(records, path):
    return write_text_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))


_MAX_TEXT = 20_000  # characters of each review kept for the page's text and search


def write_attention_html(records, path, title="keras-sdpa attention"):
    """A self-contained viewer (no network): the records embedded as JSON.

    To keep the file small the self-attention matrices are embedded as base64 bytes,
    each row scaled so its largest weight is 255, with the row maxima beside them
    (a weight comes back to within 1/510 of its row's maximum); the pooling weights
    and each token's received attention (the column mean over attending tokens) are
    exact to 5 decimals.
    """
    examples = []
    for record in records:
        n, heads = len(record["tokens"]), len(record["pooling"])
        attention = np.asarray(record["attention"], dtype=np.float32)
        attention = attention.reshape(len(record["attention"]), heads, n, n)  # (layers, N, n, n)
        # An empty review has n = 0: max and mean over no tokens become empty arrays.
        row_max = attention.max(axis=-1, initial=0.0)  # (layers, N, n)
        received = attention.sum(axis=-2) / max(1, n)  # (layers, N, n)
        scaled = attention / np.where(row_max > 0, row_max, 1.0)[..., None]  # rows peak at 1
        rows = np.round(scaled * 255).astype(np.uint8)
        extra = {}
        if "gradient_x_input" in record:
            extra["gradient"] = record["gradient_x_input"]
        if "deletion" in record:
            extra["deletion"] = record["deletion"]
        examples.append(
            {
                **extra,
                "text": record["text"][:_MAX_TEXT],
                "tokens": record["tokens"],
                "label": record["label"],
                "prediction": record["prediction"],
                "probability": record["probability"],
                "pooling": record["pooling"],
                "received": np.round(received, 5).tolist(),
                "row_max": row_max.round(7).tolist(),
                "rows": [
                    [base64.b64encode(head.tobytes()).decode() for head in layer] for layer in rows
                ],
            }
        )
    payload = json.dumps({"title": title, "examples": examples}, ensure_ascii=False)
    # Reviews are user text. Inside <script>, "<!--<script>" would keep the HTML parser in the
    # data block past its end tag, and "</script>" would end it early: escape <, > and & as
    # JSON \u escapes (as Django's json_script does), and the two JavaScript line separators.
    for char in "<>&\u2028\u2029":
        payload = payload.replace(char, f"\\u{ord(char):04x}")
    document = page.TEMPLATE.replace("__TITLE__", html.escape(title)).replace("__DATA__", payload)
    return write_text_atomic(path, document)


def pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path):
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)


def write_attention_heatmaps(records, path, max_examples=3, max_tokens=40):
    """PNG: for a few short reviews, the pooling weights and each head's self-attention."""
    plt = pyplot()

    short = sorted(
        (r for r in records if 0 < len(r["tokens"]) <= max_tokens), key=lambda r: len(r["tokens"])
    )
    chosen = (short or sorted(records, key=lambda r: len(r["tokens"])))[:max_examples]
    if not chosen:
        return None
    num_heads = len(chosen[0]["pooling"])
    fig, axes = plt.subplots(
        len(chosen), num_heads + 1, figsize=(5 * (num_heads + 1), 4.8 * len(chosen)), squeeze=False
    )
    for row, record in enumerate(chosen):
        tokens = record["tokens"][:max_tokens]
        n = len(tokens)
        pooling = np.asarray(record["pooling"])[:, :n]  # (N, n)
        ax = axes[row, 0]
        ax.imshow(pooling, aspect="auto", cmap="viridis")
        ax.set_yticks(range(num_heads), [f"head {h}" for h in range(num_heads)])
        ax.set_xticks(range(n), tokens, rotation=90, fontsize=7)
        verdict = "pos" if record["prediction"] else "neg"
        truth = "pos" if record["label"] else "neg"
        ax.set_title(
            f"pooling attention\npredicted {verdict} ({record['probability']:.2f}), label {truth}"
        )
        attention = np.asarray(record["attention"])[0]  # (N, n, n), first block
        for head in range(num_heads):
            ax = axes[row, head + 1]
            ax.imshow(attention[head][:n, :n], cmap="viridis")
            ax.set_xticks(range(n), tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(n), tokens, fontsize=6)
            ax.set_title(f"block 0, head {head}: query row attends to key column")
    save_figure(fig, path)
    return path


def write_training_curves(history, path):
    """PNG of loss and accuracy per epoch, train and validation."""
    plt = pyplot()

    epochs = [row["epoch"] + 1 for row in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        ax.plot(epochs, [row[metric] for row in history], "o-", label="train")
        ax.plot(epochs, [row[f"val_{metric}"] for row in history], "o-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("ScaledDotProductAttention sentiment classifier")
    save_figure(fig, path)
    return path


def write_reliability_diagram(calibrated, path):
    """PNG: the test split's accuracy against confidence per bin, before and after the
    temperature (`metrics.json`'s `calibration`), with each bin's share of the reviews."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), sharey=True)
    temperature = calibrated["temperature"]
    for ax, (when, title) in zip(
        axes, (("before", "trained (T = 1)"), ("after", f"calibrated (T = {temperature:.2f})"))
    ):
        figures = calibrated["test"][when]
        bins = figures["bins"]
        width = bins[0]["upper"] - bins[0]["lower"] if bins else 1.0
        ax.bar(
            [b["lower"] for b in bins], [b["accuracy"] for b in bins], width=width,
            align="edge", edgecolor="black", alpha=0.75, label="accuracy in the bin",
        )  # fmt: skip
        ax.plot([b["confidence"] for b in bins], [b["confidence"] for b in bins], "r.",
                label="mean confidence in the bin")  # fmt: skip
        ax.plot([0.5, 1], [0.5, 1], "k--", linewidth=1, label="perfect calibration")
        ax.set_xlim(0.5, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence, max(p, 1 - p)")
        ax.set_title(f"{title}: ECE {figures['ece']:.4f}")
        ax.grid(alpha=0.3)
        for b in bins:
            ax.text(b["lower"] + width / 2, 0.02, f"{b['count'] / figures['examples']:.0%}",
                    ha="center", fontsize=6, rotation=90)  # fmt: skip
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Reliability on the test split ({calibrated['bins']} bins; bar labels: share)")
    save_figure(fig, path)
    return path


def _calibration_section(metrics):
    calibrated = metrics.get("calibration")
    if not calibrated:
        return ""
    rows = "\n".join(
        f"| {when} | {figures['ece']:.4f} | {figures['log_loss']:.4f} | {figures['brier']:.4f} "
        f"| {figures['accuracy']:.2%} |"
        for when, figures in (
            ("trained (T = 1)", calibrated["test"]["before"]),
            (f"calibrated (T = {calibrated['temperature']:.3f})", calibrated["test"]["after"]),
        )
    )
    return f"""
## Calibration

`probability` is calibrated: a temperature `T`, fitted on the validation set after training
(Guo et al., 2017), divides the log-odds, folded into the output layer, so every signature
and `model.keras` give `sigmoid(z / T)`. The predicted labels do not change. On the test split
(ECE over {calibrated["bins"]} equal-width bins of confidence):

| model | ECE | log loss | Brier | accuracy |
|---|---|---|---|---|
{rows}

![reliability diagram](calibration.png)
"""


def _short_reviews_section(metrics):
    short = metrics.get("short_reviews")
    if not short or not short["buckets"]:
        return ""
    rows = "\n".join(
        f"| {b['bucket']} | {b['examples']:,} | {b['median_words']} | {b['accuracy']:.2%} |"
        for b in short["buckets"]
    )
    return f"""
## Short reviews

Spans cut from {short["reviews"]:,} reviews of the `{short["split"]}` split (seed
{short["seed"]}), each with its review's label: one sentence, two or three consecutive ones, four
to eight, and the whole review. A single sentence of a review often says little about its
verdict, so part of the gap is the task's.

| span | spans | median words | accuracy |
|---|---|---|---|
{rows}
"""


def write_model_card(metrics, path):
    """A short README.md for the run's folder, written from `metrics.json`'s own numbers."""
    config = metrics["config"]
    flags = " ".join(
        f"--{name} {value}"
        for name, value in sorted(config.items())
        if name not in ("output", "data_dir", "resume", "verbose") and value is not None
    )
    history = "\n".join(
        f"| {row['epoch'] + 1} | {row['loss']:.4f} | {row['accuracy']:.4f} "
        f"| {row['val_loss']:.4f} | {row['val_accuracy']:.4f} |"
        for row in metrics["history"]
    )
    counted = "train"
    if config.get("vocabulary_source") == "train+unsupervised":
        counted = "train and the unlabelled reviews"
    pairs = ""
    if config.get("bigram_vocab_size"):
        pairs = (
            f" + the embedding of each word's pair with the word before it (the "
            f"{config['bigram_vocab_size']:,} most frequent pairs in {counted}, `bigrams.txt`)"
        )
    if config.get("trigram_vocab_size"):
        pairs += (
            f" + the embedding of the word triple ending at each word (the "
            f"{config['trigram_vocab_size']:,} most frequent in {counted}, `trigrams.txt`)"
        )
    if pairs and config.get("ngram_dim"):
        pairs += f" (n-gram tables {config['ngram_dim']} wide, one learned projection to the width)"
    if config.get("naive_bayes_alpha"):
        pairs += (
            " + a learned projection of their naive-Bayes log-count ratios (counted on the "
            f"training labels, smoothing {config['naive_bayes_alpha']:g})"
        )
    pooled = (
        "each token's own embedding, weighed by the last block's output"
        if config.get("pooling_values") == "embedding"
        else "the last block's output"
    )
    card = f"""# {config["dataset"]} sentiment classifier on keras-sdpa

Written by `python -m apps.train_sentiment`; every number below comes from this folder's
`metrics.json`, which the app wrote from what it measured.

- **Test accuracy: {metrics["test_accuracy"]:.2%}** on {metrics["test_examples"]:,} reviews of the
  TFDS `{config["dataset"]}` `{metrics["test_split"]}` split (loss {metrics["test_loss"]:.4f}), used
  for this report only.
- Validation accuracy {metrics["validation_accuracy"]:.2%} on {metrics["validation_examples"]:,}
  reviews carved out of `train` with seed {config["seed"]} (it chose the epoch; it reads higher than
  test because the same movies appear in both); trained on {metrics["train_examples"]:,} reviews.
- Training: {metrics["epochs_run"]} epochs ({metrics["train_steps"]} steps, best epoch
  {metrics["best_epoch"]}, early stopping: {metrics["stopped_early"]}) in
  {metrics["train_seconds"] / 60:.1f} minutes on {_machine()}.
- {metrics["parameters"]:,} parameters. TensorFlow {metrics["versions"]["tensorflow"]}, Keras
  {metrics["versions"]["keras"]}, TFDS {metrics["versions"]["tensorflow_datasets"]}.

## Model

`TextVectorization` (vocabulary {config["vocab_size"]:,}, length {config["sequence_length"]})
-> `Embedding(mask_zero=True)` + positions ({config["embed_dim"]} wide){pairs} ->
{config["num_layers"]} self-attention block(s) of `keras_sdpa.ScaledDotProductAttention`
({config["num_heads"]} heads of {config["key_dim"]}) -> attention pooling (a learned query, the
same layer with T = 1, summing {pooled}) -> `Dense(1, sigmoid)`.

## Use

    python -m apps.predict --model {os.path.relpath(os.path.dirname(path))} "A wonderful film."

or, with TensorFlow alone:

    import tensorflow as tf
    serve = tf.saved_model.load("saved_model").signatures["serving_default"]
    serve(text=tf.constant(["A wonderful film."]))["probability"]


{_calibration_section(metrics)}{_short_reviews_section(metrics)}
{_serving_section(os.path.dirname(path))}
## Per epoch

| epoch | loss | accuracy | val_loss | val_accuracy |
|---|---|---|---|---|
{history}

## Reproduce

    python -m apps.train_sentiment {flags}

(add `--data_dir` for an existing TFDS folder).
{_faithfulness_section(os.path.dirname(path))}"""
    return write_text_atomic(path, card)


_SIGNATURE_ROWS = "\n".join(
    [
        "| `serving_default` | `text`: `tf.string` `[None]`, raw reviews | `probability` (float32 "
        "`[None]`, P(positive)), `label` (int32 `[None]`, 0/1), `length` (int32 `[None]`, "
        "tokens read; 0 = no known word) |",
        "| `inspect` | the same | the same, plus `tokens` (string `[None, L]`), `attention` "
        "(float32 `[None, layers, N, L, L]`, the blocks' weights) and `pooling` (float32 "
        "`[None, N, L]`, what the classifier looked at) |",
    ]
)


def _serving_section(folder):
    """The card's "Serving" section: the signatures, the rates in `serving.json` (measured by
    the app that exported the model), and a TF Serving command line."""
    measured = ""
    report = os.path.join(folder, "serving.json")
    if os.path.isfile(report):
        with open(report) as f:
            serving = json.load(f)
        measured = (
            f"Measured when it was exported, on {serving['machine']}: "
            f"**{serving['reviews_per_second']:,.0f} reviews/s** through `serving_default` at "
            f"batch {serving['batch_size']} ({serving['reviews']:,} test reviews in the split's "
            f"order, after one pass that compiles), and {serving['batch_1_p50_ms']:.1f} ms p50 "
            f"/ {serving['batch_1_p99_ms']:.1f} ms p99 for one review a call (`serving.json`).\n"
        )
    return f"""## Serving

| signature | input | outputs |
|---|---|---|
{_SIGNATURE_ROWS}

`serving_default` computes each review at the shortest of {", ".join(map(str, LENGTH_BUCKETS))}
positions that holds it, in one call (the masks make this the full-length result); `inspect`
computes every review at `L` and returns every weight: use it to look, not to serve.
{measured}
With TensorFlow Serving (its XLA JIT is experimental and off by default; the attention needs it):

    docker run -p 8501:8501 -v "$PWD/saved_model:/models/sentiment/1" -e MODEL_NAME=sentiment \\
        tensorflow/serving --xla_cpu_compilation_enabled=true
    curl -d '{{"instances": ["A wonderful film."]}}' localhost:8501/v1/models/sentiment:predict

"""


def _faithfulness_section(folder):
    """The card's "Does the attention explain the prediction?" section, from the folder's
    `faithfulness.json` (written by `python -m apps.faithfulness`); empty without one."""
    report = os.path.join(folder, "faithfulness.json")
    if not os.path.isfile(report):
        return ""
    with open(report) as f:
        payload = json.load(f)
    source = payload.get("source", {})
    return f"""
## Does the attention explain the prediction?

ERASER's deletion tests (`python -m apps.faithfulness`: {payload["reviews"]} reviews of the
{source.get("split", "test")} split, seed {source.get("seed", 0)}; `faithfulness.json`,
`faithfulness.png`). Each ranking orders a review's tokens; deleting a token removes it from
the sequence the model sees, as if the word were not in the text.

{explain.markdown_table(payload)}
![faithfulness](faithfulness.png)
"""


def _machine():
    cores = os.cpu_count()
    return f"{cores} CPU cores" if cores else "this machine"
