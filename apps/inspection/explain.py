"""Token rankings and the ERASER deletion tests: do the attention weights explain a prediction?

A ranking orders a review's `n` real tokens from most to least important. Three kinds:

- the **pooling attention**: the classifier's learned query attending over the review (mean
  over heads, and each head alone);
- **attention rollout** (Abnar & Zuidema, 2020): the pooling weights carried back through each
  block's self-attention, mixed half and half with the residual (`0.5 A + 0.5 I`);
- **gradient x input**: `sum_e dz/dx[t, e] * x[t, e]`, where `x` is the embedding layer's output
  `(B, L, E)` (token + position + word pair) and `z` the log-odds of the predicted label, by
  `tf.GradientTape` on the Keras model;
- a seeded **random** ranking, the floor.

The tests (DeYoung et al., ERASER, ACL 2020), for a fraction `k` of the `n` tokens
(`ceil(k * n)` of them):

- **comprehensiveness**: `P(predicted | review) - P(predicted | review without its top k)`;
- **sufficiency**: `P(predicted | review) - P(predicted | only its top k)`;
- **AOPC**: each averaged over the fractions.

**Deleting a token** removes its id from the sequence the model sees: the later tokens move one
position left, and the word pairs are formed again from the new neighbours, so the model sees
what it would see if the word were not in the text. Deletion acts on the (at most
`sequence_length`) tokens the model read: a long review's words past that length do not move in.
"""

import math

import numpy as np
import tensorflow as tf
from keras import ops

from ..classifier import buckets
from ..classifier import model as model_lib
from ..classifier.data import token_lengths

FRACTIONS = (0.01, 0.05, 0.10, 0.20, 0.50)  # of each review's tokens
ATTENTION = "attention"  # the ranking (pooling, mean over heads) compared with random
DELETED_IN_VIEWER = 5  # tokens deleted for the viewer's one-line test


def top_count(fraction, n):
    """Tokens in the top `fraction` of `n`: `ceil(fraction * n)`, at least 1 when `n > 0`."""
    return min(n, max(1 if n else 0, math.ceil(fraction * n - 1e-9)))


def order_of(scores):
    """Token positions from the highest score to the lowest; ties keep reading order."""
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")


def delete_positions(ids, positions):
    """`ids` `(L,)` with the tokens at `positions` removed, the rest moved left, padded with 0."""
    ids = np.asarray(ids)
    keep = np.ones(len(ids), dtype=bool)
    keep[np.asarray(positions, dtype=np.int64)] = False
    kept = ids[keep]
    return np.concatenate([kept, np.zeros(len(ids) - len(kept), dtype=ids.dtype)])


def keep_positions(ids, positions, n):
    """`ids` `(L,)` with only the tokens at `positions` (of the first `n`), in reading order."""
    drop = np.setdiff1d(np.arange(n), np.asarray(positions, dtype=np.int64))
    return delete_positions(ids, drop)


def kendall_tau(a, b):
    """Kendall's tau-b between two score vectors (ties counted as in tau-b); NaN below 2 items
    or when either vector is constant."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2:
        return float("nan")
    i, j = np.triu_indices(len(a), 1)
    sign_a, sign_b = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    pairs = len(i)
    denominator = math.sqrt((pairs - np.sum(sign_a == 0)) * (pairs - np.sum(sign_b == 0)))
    return float(np.sum(sign_a * sign_b) / denominator) if denominator else float("nan")


def rollout(pooling, attention):
    """Attention rollout: `pooling` `(N, n)` and the blocks' `attention` `(layers, N, n, n)`
    -> `(n,)` relevance of each input token. Heads are averaged; each block's matrix is mixed
    with the identity (the residual) and its rows renormalized."""
    relevance = np.asarray(pooling, dtype=np.float64).mean(axis=0)  # (n,)
    n = relevance.shape[0]
    for layer in np.asarray(attention, dtype=np.float64)[::-1]:  # last block first
        mixed = 0.5 * layer.mean(axis=0) + 0.5 * np.eye(n)  # (n, n)
        mixed /= np.maximum(mixed.sum(axis=-1, keepdims=True), 1e-12)
        relevance = relevance @ mixed  # (n,)
    return relevance


class ModelProbe:
    """The Keras classifier, as the functions the rankings and the tests need.

    `model` maps token ids `(B, L)` to `P(positive)` `(B, 1)`, as
    `apps.classifier.model.build_classifier` builds it;
    `apps.classifier.model.log_odds_from_embeddings` starts it from the embeddings.
    """

    def __init__(self, model, batch_size=128):
        self.model = model
        self.batch_size = batch_size
        self._probability = tf.function(
            lambda ids: self.model(ids, training=False)[:, 0], reduce_retracing=True
        )
        self._gradient = tf.function(self._gradient_x_input, reduce_retracing=True)

    def probability(self, ids):
        """`P(positive)` `(B,)` float64 for token ids `(B, L)`, in batches of similar length.

        Each batch is cut to the first length bucket (`buckets.bucket_sizes(L)`) that holds its
        longest row, as the training and the SavedModel cut theirs: the padding after a row's
        last token is masked, so the cut changes no probability, only the work (a deletion
        test's kept tokens are a few of the review's)."""
        ids = np.asarray(ids, dtype=np.int32)
        lengths = token_lengths(ids)
        sizes = buckets.bucket_sizes(ids.shape[1])
        order = np.argsort(lengths, kind="stable")
        out = np.zeros(len(ids))
        for start in range(0, len(ids), self.batch_size):
            rows = order[start : start + self.batch_size]
            size = sizes[buckets.bucket_of(int(lengths[rows].max()), sizes)]
            out[rows] = self._probability(tf.constant(ids[rows, :size])).numpy()
        return out

    def log_odds_from_embeddings(self, x, mask):
        """The classifier's log-odds `(B,)` from the embedding output `x` `(B, L, E)`."""
        return model_lib.log_odds_from_embeddings(self.model, x, mask)

    def _gradient_x_input(self, ids):
        mask = ops.not_equal(ids, 0)  # (B, L)
        x = self.model.get_layer("embedding")(ids)  # (B, L, E)
        with tf.GradientTape() as tape:
            tape.watch(x)
            z = self.log_odds_from_embeddings(x, mask)  # (B,)
            sign = tf.where(z >= 0, tf.ones_like(z), -tf.ones_like(z))  # the predicted label
            target = tf.reduce_sum(sign * z)
        gradient = tape.gradient(target, x)  # (B, L, E)
        scores = tf.reduce_sum(gradient * x, axis=-1)  # (B, L)
        return scores * tf.cast(mask, scores.dtype), tf.sigmoid(z)

    def gradient_x_input(self, ids):
        """Gradient x input `(B, L)` towards each review's predicted label (0 on padding),
        and `P(positive)` `(B,)` from the same pass."""
        ids = np.asarray(ids, dtype=np.int32)
        scores, probabilities = [], []
        for start in range(0, len(ids), self.batch_size):
            s, p = self._gradient(tf.constant(ids[start : start + self.batch_size]))
            scores.append(s.numpy())
            probabilities.append(p.numpy())
        return np.concatenate(scores), np.concatenate(probabilities).astype(np.float64)


def deletion_variants(ids, n, order, fractions=FRACTIONS):
    """For one review: `(comprehensiveness inputs, sufficiency inputs)`, one row per fraction."""
    without, only = [], []
    for fraction in fractions:
        top = order[: top_count(fraction, n)]
        without.append(delete_positions(ids, top))
        only.append(keep_positions(ids, top, n))
    return without, only


def erase_scores(probability, ids, lengths, rankings, fractions=FRACTIONS):
    """Comprehensiveness and sufficiency of each ranking, per review and fraction.

    Args:
        probability: a function, token ids `(B, L)` -> `P(positive)` `(B,)`.
        ids: token ids `(R, L)`, 0 = padding after the `lengths[r]` real tokens.
        lengths: real tokens per review `(R,)`.
        rankings: `{name: [scores (n_r,) per review]}`; higher = more important.
        fractions: the `k` values, fractions of each review's tokens.

    Returns:
        A dict: `full` `(R,)` P(positive); `predicted` `(R,)` the predicted label; and per
        ranking `{"comprehensiveness": (R, K), "sufficiency": (R, K), "without": (R, K),
        "only": (R, K)}`, the last two the P(predicted label) after deleting or keeping.
    """
    ids = np.asarray(ids)
    full = probability(ids)  # (R,)
    predicted = (full >= 0.5).astype(np.int64)
    sign_full = np.where(predicted == 1, full, 1 - full)  # P(predicted label)
    names = list(rankings)
    rows = []
    for r in range(len(ids)):
        for name in names:
            order = order_of(rankings[name][r])
            without, only = deletion_variants(ids[r], int(lengths[r]), order, fractions)
            rows.extend(without + only)
    out = probability(np.stack(rows)) if rows else np.zeros(0)
    out = out.reshape(len(ids), len(names), 2, len(fractions))  # (R, rankings, 2, K)
    as_predicted = np.where(predicted[:, None, None, None] == 1, out, 1 - out)
    results = {"full": full, "predicted": predicted}
    for index, name in enumerate(names):
        without, only = as_predicted[:, index, 0], as_predicted[:, index, 1]  # (R, K)
        results[name] = {
            "without": without,
            "only": only,
            "comprehensiveness": sign_full[:, None] - without,
            "sufficiency": sign_full[:, None] - only,
        }
    return results


def _cell(stat):
    if stat["mean"] is None:
        return "-"
    error = "" if stat["standard_error"] is None else f" ± {stat['standard_error']:.3f}"
    return f"{stat['mean']:.3f}{error}"


def markdown_table(payload):
    """The Markdown report: comprehensiveness and sufficiency per ranking, and the verdict."""
    fractions = payload["fractions"]
    header = " | ".join(f"k={f:.0%}" for f in fractions)
    lines = [
        f"Comprehensiveness (drop in P(predicted label) when the top k tokens are deleted; "
        f"higher = the ranking found what the model used), on {payload['reviews']} test reviews:",
        "",
        f"| ranking | {header} | AOPC | label flips at 10% |",
        "|---|" + "---|" * (len(fractions) + 2),
    ]
    for name, row in payload["rankings"].items():
        cells = " | ".join(_cell(c) for c in row["comprehensiveness"])
        flips = row.get("label_flips_top_10_percent")
        flips = "-" if flips is None else f"{flips:.1%}"
        lines.append(f"| {name} | {cells} | {_cell(row['comprehensiveness_aopc'])} | {flips} |")
    lines += [
        "",
        "Sufficiency (drop when only the top k tokens are kept; lower = the tokens suffice):",
        "",
        f"| ranking | {header} | AOPC |",
        "|---|" + "---|" * (len(fractions) + 1),
    ]
    for name, row in payload["rankings"].items():
        cells = " | ".join(_cell(s) for s in row["sufficiency"])
        lines.append(f"| {name} | {cells} | {_cell(row['sufficiency_aopc'])} |")
    tau = payload["kendall_tau_attention_vs_gradient"]
    lines += ["", verdict(payload), ""]
    if tau["mean"] is not None:
        lines += [
            f"Kendall's tau between the attention and gradient x input rankings, per review: "
            f"mean {_cell(tau)}, median {tau['quantiles']['0.5']:.3f} "
            f"(10th-90th percentile {tau['quantiles']['0.1']:.3f} to "
            f"{tau['quantiles']['0.9']:.3f}).",
            "",
        ]
    return "\n".join(lines)


def verdict(payload):
    """One honest sentence on what the comprehensiveness numbers say."""
    gap = payload["comprehensiveness_aopc_minus_random"]
    rankings = payload["rankings"]
    if ATTENTION not in gap or gap[ATTENTION]["standard_error"] in (None, 0):
        return "Too few reviews to compare the rankings."
    attention = gap[ATTENTION]
    z = attention["mean"] / attention["standard_error"]
    best = max(rankings, key=lambda name: rankings[name]["comprehensiveness_aopc"]["mean"])
    evidence = (
        f"Deleting the most attended tokens lowers P(predicted label) by "
        f"{rankings[ATTENTION]['comprehensiveness_aopc']['mean']:.3f} on average over k "
        f"(random tokens: {rankings['random']['comprehensiveness_aopc']['mean']:.3f}), "
        f"{attention['mean']:.3f} more, {z:.1f} standard errors"
    )
    if z <= 3:
        return evidence + ": the attention does not explain the prediction better than chance here."
    if best == ATTENTION:
        return evidence + (
            ": the pooling attention points at what the model used, and no other ranking "
            "here does better."
        )
    better = rankings[best]["comprehensiveness_aopc"]["mean"]
    return (
        evidence + f": the attention carries real signal, but {best} finds more of what the model "
        f"used ({better:.3f}), so the attention is a partial explanation, not the whole one."
    )


def summary(payload):
    """The headline numbers of a faithfulness payload, for `metrics.json` and the model card."""
    rankings = payload["rankings"]
    return {
        "reviews": payload["reviews"],
        "comprehensiveness_aopc": {
            name: row["comprehensiveness_aopc"] for name, row in rankings.items()
        },
        "attention_minus_random": payload["comprehensiveness_aopc_minus_random"].get(ATTENTION),
        "kendall_tau_attention_vs_gradient": {
            key: payload["kendall_tau_attention_vs_gradient"][key]
            for key in ("mean", "standard_error")
        },
        "verdict": verdict(payload),
    }
