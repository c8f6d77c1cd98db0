"""The exported reviews' inspection records, and the files made from them.

A record holds one review's tokens, prediction and attention weights (`make_record`); the
training app and `python -m apps.viewer` export the same seeded sample (`inspection_sample`)
as `attention.jsonl`, the self-contained page `attention.html` (`apps/inspection/page.py`)
and `attention_heatmaps.png`.
"""

import base64
import html
import json

import numpy as np
import tensorflow as tf

from ..files import pyplot, save_figure, write_text_atomic
from . import explain, page


def inspection_sample(size, count, seed):
    """Indices of the `count` (at most `size`) test reviews exported for inspection:
    seeded, sorted, the same for the training app and `python -m apps.viewer`."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(size, min(count, size), replace=False))


def make_record(
    index, text, tokens, label, probability, pooling, attention, gradient=None, deletion=None
):
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
            )
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
