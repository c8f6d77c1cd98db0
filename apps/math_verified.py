"""The math, verified: measure each claim of the derivation of scaled dot-product attention.

Usage:
    python -m apps.math_verified                      # about 2 minutes on 2 CPU cores
    python -m apps.math_verified --quick              # smaller samples, for the tests
    python -m apps.math_verified --output /tmp/math

The derivation of `Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V` makes six
checkable claims. This app measures each one, mostly through this package's own
code (`keras_sdpa.ops.scaled_dot_product_attention` and the layer), and writes:

    results.md          claim, what was measured, the number, the bar, and whether it holds
    metrics.json        every measured number, the config and the versions
    claim1_variance.png ... claim5_training.png

Every bar is stated from the sample size (a number of standard errors), so a
claim that stops holding fails `tests/test_math_verified.py`, which asserts
each claim from this app's own measurements.
"""

import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_sdpa import ScaledDotProductAttention  # noqa: E402
from keras_sdpa.ops import scaled_dot_product_attention  # noqa: E402

from . import cli, files  # noqa: E402

# Standard errors a measurement may lie from its prediction before a claim fails.
# A false failure at 5 standard errors has probability below 1e-6 per number.
_SIGMAS = 5.0


@dataclasses.dataclass
class Config:
    key_dims: tuple = (4, 16, 64, 256, 1024)  # d_k for claims 1-4
    samples: int = 100_000  # (q, k) pairs per d_k, claims 1-2
    sequence_length: int = 128  # keys per softmax row, claims 3-4
    rows: int = 1024  # softmax rows (queries) per d_k, claims 3-4
    # claim 5: the same model trained with scale=1 and scale=1/sqrt(d_k)
    train_key_dim: int = 512
    train_examples: int = 20_000
    train_epochs: int = 4
    train_batch_size: int = 128
    learning_rate: float = 1e-3
    eval_every: int = 25  # training steps between validation measurements
    seed: int = 0
    output: str = "saved_models/math_verified"
    quick: bool = False  # smaller samples and training, for tests


_QUICK = dict(samples=20_000, rows=256, train_examples=6_000, train_epochs=2, eval_every=10)


def parse_args(argv=None):
    return cli.parse_config(
        Config,
        argv,
        prog="python -m apps.math_verified",
        description=__doc__.split("\n\n")[0],
        check=_check_config,
        presets=lambda args: _QUICK if args.quick else None,  # explicit flags still win
    )


def _check_config(config):
    for name in ("samples", "sequence_length", "rows", "train_key_dim", "train_examples"):
        if getattr(config, name) <= 1:
            raise ValueError(
                f"`--{name}` must be at least 2. Received: {name}={getattr(config, name)}"
            )
    for name in ("train_epochs", "train_batch_size", "eval_every"):
        if getattr(config, name) <= 0:
            raise ValueError(
                f"`--{name}` must be positive. Received: {name}={getattr(config, name)}"
            )
    if len(config.key_dims) < 2 or min(config.key_dims) <= 0:
        raise ValueError(
            "`--key_dims` needs at least two positive sizes. "
            f"Received: key_dims={list(config.key_dims)}"
        )
    if not config.learning_rate > 0:
        raise ValueError(
            f"`--learning_rate` must be positive. Received: learning_rate={config.learning_rate}"
        )


# Claims 1 and 2: the variance of q . k, and of q . k / sqrt(d_k).


def measure_dot_product_variance(key_dims, samples, seed):
    """Var(q . k) and Var(q . k / sqrt(d_k)) for q, k ~ N(0, I_{d_k}), in NumPy float64.

    The standard error of a sample variance is `sqrt((mu_4 - sigma^4) / n)`. For
    `s = q . k` with standard normal components, `E[s^2] = d_k` and
    `E[s^4] = 3 d_k^2 + 6 d_k`, so `SE(Var) = sqrt((2 d_k^2 + 6 d_k) / n)`.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for d_k in key_dims:
        dots = []
        for start in range(0, samples, 8192):  # bounded memory at d_k = 1024
            n = min(8192, samples - start)
            q = rng.standard_normal((n, d_k))
            k = rng.standard_normal((n, d_k))
            dots.append(np.einsum("nh,nh->n", q, k))  # (n,)
        dots = np.concatenate(dots)
        standard_error = math.sqrt((2 * d_k**2 + 6 * d_k) / samples)
        rows.append(
            {
                "d_k": d_k,
                "variance": float(dots.var(ddof=1)),
                "standard_error": standard_error,
                "scaled_variance": float((dots / math.sqrt(d_k)).var(ddof=1)),
                "scaled_standard_error": standard_error / d_k,
            }
        )
    # Least squares through the origin, weighted by 1 / SE^2: Var = slope * d_k.
    d = np.array([r["d_k"] for r in rows], float)
    v = np.array([r["variance"] for r in rows])
    w = 1.0 / np.array([r["standard_error"] for r in rows]) ** 2
    slope = float(np.sum(w * d * v) / np.sum(w * d * d))
    slope_error = float(1.0 / math.sqrt(np.sum(w * d * d)))
    return {"rows": rows, "slope": slope, "slope_standard_error": slope_error}


def check_variance(result, sigmas=_SIGMAS):
    """Claim 1: every Var(q . k) within `sigmas` standard errors of d_k, and the slope of 1."""
    each = all(
        abs(r["variance"] - r["d_k"]) <= sigmas * r["standard_error"] for r in result["rows"]
    )
    return each and abs(result["slope"] - 1.0) <= sigmas * result["slope_standard_error"]


def check_scaled_variance(result, sigmas=_SIGMAS):
    """Claim 2: every Var(q . k / sqrt(d_k)) within `sigmas` standard errors of 1."""
    return all(
        abs(r["scaled_variance"] - 1.0) <= sigmas * r["scaled_standard_error"]
        for r in result["rows"]
    )


def measure_core_score_variance(key_dims, sequence_length, rows, seed):
    """Claim 2 through the core: the variance of the scores it actually scaled.

    Within one softmax row, `log A_ij = s_ij - logsumexp_j(s_ij)`, so the spread of
    `log A_ij` over the keys j is the spread of the scaled scores `s_ij`. For a
    query q it is `|q|^2 / d_k`, whose mean over queries is 1 when the scale is
    `1 / sqrt(d_k)`: the core's default scale is the derivation's. The standard
    error comes from the spread of the 16 independent batches.
    """
    out = []
    for d_k in key_dims:
        q, k = _queries_and_keys(d_k, sequence_length, rows, seed)
        _, weights = scaled_dot_product_attention(q, k, k, return_weights=True)  # default scale
        log_weights = np.log(weights.numpy().astype(np.float64))  # (B, 1, T, S)
        per_batch = log_weights.var(axis=-1, ddof=1).mean(axis=(1, 2))  # (B,)
        out.append(
            {
                "d_k": d_k,
                "variance": float(per_batch.mean()),
                "standard_error": float(per_batch.std(ddof=1) / math.sqrt(len(per_batch))),
            }
        )
    return out


def check_core_score_variance(rows, sigmas=_SIGMAS):
    """Claim 2 through the core: the spread of its scaled scores within `sigmas` SE of 1."""
    return all(abs(r["variance"] - 1.0) <= sigmas * r["standard_error"] for r in rows)


# Claims 3 and 4: saturation of the softmax, and its vanishing gradient.


_BATCHES = 16  # independent sets of keys, so that their sample covariance averages out


def _queries_and_keys(d_k, sequence_length, rows, seed):
    """`rows` standard normal queries in 16 batches, each with its own S keys."""
    rng = np.random.default_rng([seed, d_k])
    t = max(1, rows // _BATCHES)
    q = rng.standard_normal((_BATCHES, t, 1, d_k)).astype(np.float32)  # (B, T, N, H)
    k = rng.standard_normal((_BATCHES, sequence_length, 1, d_k)).astype(np.float32)  # (B, S, N, H)
    return tf.constant(q), tf.constant(k)


def measure_saturation(key_dims, sequence_length, rows, seed):
    """Claims 3 and 4, with `scale=1` and with `1 / sqrt(d_k)`.

    The weights come from `scaled_dot_product_attention(..., return_weights=True)`.
    The gradient is this package's own: `softmax_jacobian_norms` differentiates the
    core's weights through its hand-written backward pass, one row of the Jacobian
    `diag(p) - p p^T` at a time, and gives its Frobenius norm per row.
    """
    out = []
    for d_k in key_dims:
        q, k = _queries_and_keys(d_k, sequence_length, rows, seed)
        row = {"d_k": d_k}
        for name, scale in (("unscaled", 1.0), ("scaled", 1.0 / math.sqrt(d_k))):
            _, weights = scaled_dot_product_attention(q, k, k, scale=scale, return_weights=True)
            p = weights.numpy()[:, 0].astype(np.float64)  # (B, T, S)
            entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)
            scores = tf.einsum("btnh,bsnh->bts", q, k) * scale  # (B, T, S)
            norms = softmax_jacobian_norms(scores)  # (B * T,)
            row[name] = {
                "entropy": float(entropy.mean()),
                "max_weight": float(p.max(-1).mean()),
                "jacobian_norm": float(norms.mean()),
                "jacobian_norm_median": float(np.median(norms)),
            }
        out.append(row)
    return out


def softmax_jacobian_norms(scores):
    """`||d weights / d scores||_F` per row, through `keras_sdpa`'s own gradient.

    The scores `(B, T, S)` enter the core as its additive `bias` (with zero queries
    and keys, the logits are the bias itself), and the weights it returns are
    differentiated by `tf.GradientTape`, which runs the core's hand-written backward
    pass (the `d_weights` path of its custom gradient). Upstream gradient `e_j` gives
    row `j` of each row's Jacobian; the squares of all `S` rows sum to `||J||_F^2`.
    """
    batch, t, s = scores.shape
    bias = tf.cast(scores, tf.float32)[:, None]  # (B, 1, T, S)
    zeros_q = tf.zeros((batch, t, 1, 1))
    zeros_k = tf.zeros((batch, s, 1, 1))
    squares = np.zeros((batch, t))
    for j in range(s):
        with tf.GradientTape() as tape:
            tape.watch(bias)
            _, weights = scaled_dot_product_attention(
                zeros_q, zeros_k, zeros_k, bias=bias, return_weights=True
            )  # (B, 1, T, S)
            picked = weights[..., j]  # (B, 1, T): weight j of every row
        row_j = tape.gradient(picked, bias).numpy()[:, 0].astype(np.float64)  # (B, T, S)
        squares += np.sum(row_j**2, -1)
    return np.sqrt(squares).reshape(-1)


def check_saturation(rows, sequence_length):
    """Claim 3: unscaled, the entropy falls with d_k to near 0 and the max weight near 1;
    scaled, both stay put.

    Scaled scores are N(0, 1), so the entropy stays near `log S - 1/2` (a Gaussian
    of unit variance in the exponent) at every d_k; the bar is 10% of that.
    """
    unscaled = [r["unscaled"] for r in rows]
    scaled = [r["scaled"] for r in rows]
    falls = all(a["entropy"] > b["entropy"] for a, b in zip(unscaled, unscaled[1:]))
    saturated = unscaled[-1]["entropy"] < 0.5 and unscaled[-1]["max_weight"] > 0.8
    expected = math.log(sequence_length) - 0.5
    steady = all(abs(s["entropy"] - expected) <= 0.1 * expected for s in scaled)
    return falls and saturated and steady


def check_gradients(rows):
    """Claim 4, on the median row (the typical query).

    Unscaled, the softmax Jacobian first grows with d_k (scores of variance d_k > 1
    sharpen a flat softmax), peaks, then falls at every larger d_k as the softmax
    saturates, ending below a tenth of the scaled one; scaled, it stays within a
    factor of 2 across every d_k.
    """
    unscaled = [r["unscaled"]["jacobian_norm_median"] for r in rows]
    scaled = [r["scaled"]["jacobian_norm_median"] for r in rows]
    peak = int(np.argmax(unscaled))
    falls = all(a > b for a, b in zip(unscaled[peak:], unscaled[peak + 1 :]))
    vanished = peak < len(rows) - 1 and unscaled[-1] < 0.1 * scaled[-1]
    steady = max(scaled) <= 2 * min(scaled)
    return falls and vanished and steady


# Claim 5: training with and without the scaling.


def majority_task(examples, sequence_length, vocab_size, seed):
    """Token sequences labelled 1 when most of their tokens come from the lower half of
    the vocabulary: a bag-of-words sentiment task that attention pooling solves by
    averaging over every token, which a saturated softmax cannot do."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, (examples, sequence_length)).astype(np.int32)
    labels = ((tokens < vocab_size // 2).sum(1) > sequence_length // 2).astype(np.float32)
    return tokens, labels


def pooling_classifier(key_dim, scale, sequence_length, vocab_size, embed_dim, seed):
    """Embedding -> LayerNormalization -> attention pooling (a learned query, our layer
    with T = 1) -> Dense(1, sigmoid).

    The normalized inputs and the `fan_in` initializer give the projected queries
    and keys components of variance 1, the derivation's premise, at every `key_dim`.
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((sequence_length,), dtype="int32")
    x = keras.layers.Embedding(vocab_size, embed_dim, embeddings_initializer="normal")(tokens)
    x = keras.layers.LayerNormalization()(x)  # (B, S, E), unit variance per token
    first = keras.ops.zeros_like(tokens[:, :1])  # (B, 1): one learned query per example
    query = keras.layers.Embedding(1, embed_dim, embeddings_initializer="normal")(first)
    pooled = ScaledDotProductAttention(
        key_dim=key_dim,
        value_dim=embed_dim,
        scale=scale,
        kernel_initializer="lecun_normal",  # variance 1 / fan_in: Var(q_i) = Var(k_i) = 1
        name="pooling",
    )(query, x)  # (B, 1, E)
    probability = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(pooled))
    return keras.Model(tokens, probability)


class _Evaluate(keras.callbacks.Callback):
    """Validation loss and accuracy every `every` training steps, and the training loss."""

    def __init__(self, data, every):
        super().__init__()
        self.data, self.every = data, every
        self.steps, self.val_loss, self.val_accuracy, self.loss = [], [], [], []
        self.step = 0

    def evaluate(self):
        loss, accuracy = self.model.evaluate(*self.data, batch_size=1000, verbose=0)
        self.steps.append(self.step)
        self.val_loss.append(float(loss))
        self.val_accuracy.append(float(accuracy))

    def on_train_begin(self, logs=None):
        self.evaluate()

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        self.loss.append(float(logs["loss"]))
        if self.step % self.every == 0:
            self.evaluate()


def measure_training(config, progress):
    sequence_length, vocab_size, embed_dim = 33, 64, 64
    train = majority_task(config.train_examples, sequence_length, vocab_size, config.seed)
    validation = majority_task(2000, sequence_length, vocab_size, config.seed + 1)
    runs = {}
    for name, scale in (("scaled", None), ("unscaled", 1.0)):
        progress(f"claim 5: training with {name} scores (d_k = {config.train_key_dim})")
        model = pooling_classifier(
            config.train_key_dim, scale, sequence_length, vocab_size, embed_dim, config.seed
        )
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
        evaluate = _Evaluate(validation, config.eval_every)
        start = time.perf_counter()
        model.fit(
            *train,
            batch_size=config.train_batch_size,
            epochs=config.train_epochs,
            shuffle=True,
            callbacks=[evaluate],
            verbose=0,
        )
        evaluate.evaluate()  # the final point
        runs[name] = {
            "steps": evaluate.steps,
            "val_loss": evaluate.val_loss,
            "val_accuracy": evaluate.val_accuracy,
            "train_loss": evaluate.loss,
            "seconds": time.perf_counter() - start,
            "steps_to_95": _first_step(evaluate.steps, evaluate.val_accuracy, 0.95),
            "final_val_accuracy": evaluate.val_accuracy[-1],
            "final_val_loss": evaluate.val_loss[-1],
        }
    return {
        "task": "majority vote of 33 tokens from a vocabulary of 64 (lower half = positive)",
        "key_dim": config.train_key_dim,
        "examples": config.train_examples,
        "validation_examples": 2000,
        "epochs": config.train_epochs,
        **runs,
    }


def _first_step(steps, accuracies, bar):
    return next((s for s, a in zip(steps, accuracies) if a >= bar), None)


def check_training(result):
    """Claim 5: scaled reaches 95% validation accuracy, at least twice as fast as
    unscaled (or unscaled never does), and ends with the lower validation loss.

    The validation set has 2,000 examples: the standard error of an accuracy near
    0.95 is 0.005, far inside the gaps this checks.
    """
    scaled, unscaled = result["scaled"], result["unscaled"]
    if scaled["steps_to_95"] is None:
        return False
    faster = unscaled["steps_to_95"] is None or unscaled["steps_to_95"] >= 2 * scaled["steps_to_95"]
    return faster and scaled["final_val_loss"] < unscaled["final_val_loss"]


# Claim 6: rows of A are distributions, and output row i = sum_j A_ij V_j.


def measure_weighted_sum(seed):
    """On the real layer, two heads with W_O, a padding mask and one fully masked row.

    The derivation's `A = softmax(mask(Q K^T / sqrt(d_k)))` is recomputed in NumPy
    float64 from the inputs and the layer's own `W_Q`, `W_K` (not from the weights
    the layer returns), and `out = concat_h(A_h V_h) W_O + b_O` with
    `V = X_v W_V + b_V`. The weights the layer returns are compared with `A` too.
    """
    rng = np.random.default_rng(seed)
    batch, t, s, width, heads, key_dim, value_dim = 2, 5, 7, 12, 2, 8, 6
    query = rng.standard_normal((batch, t, width)).astype(np.float32)
    value = rng.standard_normal((batch, s, width)).astype(np.float32)
    mask = np.ones((batch, t, s), bool)
    mask[0, :, 5:] = False  # padding: the last two keys of example 0
    mask[1, 3, :] = False  # a query that may attend to nothing
    layer = ScaledDotProductAttention(heads, key_dim, value_dim=value_dim)
    out, returned = layer(query, value, attention_mask=mask, return_attention_scores=True)
    out, returned = out.numpy().astype(np.float64), returned.numpy().astype(np.float64)
    w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o = (w.numpy().astype(np.float64) for w in layer.weights)
    q = np.einsum("bte,enh->bnth", query, w_q) + b_q[:, None]  # (B, N, T, H)
    k = np.einsum("bse,enh->bnsh", value, w_k) + b_k[:, None]  # (B, N, S, H)
    v = np.einsum("bse,enh->bnsh", value, w_v) + b_v[:, None]  # (B, N, S, Hv)
    allowed = mask[:, None]  # (B, 1, T, S)
    scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / math.sqrt(key_dim), -np.inf)
    row_max = scores.max(-1, keepdims=True)
    exp = np.where(allowed, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    total = exp.sum(-1, keepdims=True)
    a = exp / np.where(total > 0, total, 1.0)  # (B, N, T, S); a fully masked row is 0
    heads_out = np.einsum("bnts,bnsh->btnh", a, v)  # (B, T, N, Hv): sum_j A_ij V_j
    want = np.einsum("btnh,nho->bto", heads_out, w_o) + b_o  # (B, T, E)
    open_rows = mask.any(-1)[:, None, :].repeat(heads, 1)  # (B, N, T)
    return {
        "min_weight": float(returned.min()),
        "max_row_sum_error": float(np.abs(returned.sum(-1)[open_rows] - 1).max()),
        "max_masked_weight": float(np.abs(returned[~mask[:, None].repeat(heads, 1)]).max()),
        "fully_masked_row_sum": float(np.abs(returned[1, :, 3]).sum()),
        "max_weight_error": float(np.abs(returned - a).max()),
        "max_output_error": float(np.abs(out - want).max()),
        "output_scale": float(np.abs(want).max()),
    }


def check_weighted_sum(result, tolerance=1e-5):
    """Claim 6, to float32 round-off: weights >= 0, rows sum to 1 (fully masked rows to 0),
    masked keys get exactly 0, the weights are the derivation's `A`, and the output is
    the weighted sum of the values."""
    return (
        result["min_weight"] >= 0.0
        and result["max_row_sum_error"] <= tolerance
        and result["max_masked_weight"] == 0.0
        and result["fully_masked_row_sum"] == 0.0
        and result["max_weight_error"] <= tolerance
        and result["max_output_error"] <= tolerance * max(1.0, result["output_scale"])
    )


# Report.


def _plot_variance(variance, path_1, path_2):
    plt = files.pyplot()

    d = np.array([r["d_k"] for r in variance["rows"]], float)
    v = np.array([r["variance"] for r in variance["rows"]])
    se = np.array([r["standard_error"] for r in variance["rows"]])
    figure, axis = plt.subplots(figsize=(5.5, 4))
    axis.errorbar(d, v, yerr=_SIGMAS * se, fmt="o", label=f"measured (bars: {_SIGMAS:g} SE)")
    axis.plot(d, d, "k--", lw=1, label="Var = d_k")
    axis.plot(d, variance["slope"] * d, "C1", lw=1, label=f"fit: slope {variance['slope']:.4f}")
    axis.set(xscale="log", yscale="log", xlabel="d_k", ylabel="Var(q . k)")
    axis.set_title("Claim 1: Var(q . k) = d_k")
    axis.legend()
    files.save_figure(figure, path_1)

    scaled = np.array([r["scaled_variance"] for r in variance["rows"]])
    figure, axis = plt.subplots(figsize=(5.5, 4))
    axis.errorbar(d, v, yerr=_SIGMAS * se, fmt="o", label="q . k")
    axis.errorbar(d, scaled, yerr=_SIGMAS * se / d, fmt="s", label="q . k / sqrt(d_k)")
    axis.axhline(1.0, color="k", ls="--", lw=1)
    axis.set(xscale="log", yscale="log", xlabel="d_k", ylabel="variance of the scores")
    axis.set_title("Claim 2: scaling brings the variance back to 1")
    axis.legend()
    files.save_figure(figure, path_2)


def _plot_saturation(saturation, sequence_length, path_3, path_4):
    plt = files.pyplot()

    d = [r["d_k"] for r in saturation]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("unscaled", "o-"), ("scaled", "s-")):
        left.plot(d, [r[name]["entropy"] for r in saturation], style, label=name)
        right.plot(d, [r[name]["max_weight"] for r in saturation], style, label=name)
    left.axhline(math.log(sequence_length), color="k", ls=":", lw=1, label="log S (uniform)")
    left.set(xscale="log", xlabel="d_k", ylabel="mean row entropy (nats)")
    right.set(xscale="log", xlabel="d_k", ylabel="mean max weight", ylim=(0, 1.05))
    left.legend()
    right.legend()
    figure.suptitle(f"Claim 3: without scaling the softmax saturates (S = {sequence_length})")
    files.save_figure(figure, path_3)

    figure, axis = plt.subplots(figsize=(5.5, 4))
    for name, color in (("unscaled", "C0"), ("scaled", "C1")):
        median = [r[name]["jacobian_norm_median"] for r in saturation]
        mean = [r[name]["jacobian_norm"] for r in saturation]
        axis.plot(d, median, "o-", color=color, label=f"{name}, median row")
        axis.plot(d, mean, ":", color=color, label=f"{name}, mean")
    axis.set(xscale="log", yscale="log", xlabel="d_k", ylabel="||d softmax / d scores||_F")
    axis.set_title("Claim 4: saturated softmax, vanishing gradient")
    axis.legend()
    files.save_figure(figure, path_4)


def _plot_training(training, path):
    plt = files.pyplot()

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, color in (("scaled", "C0"), ("unscaled", "C3")):
        run = training[name]
        label = "1/sqrt(d_k)" if name == "scaled" else "scale = 1"
        left.plot(np.arange(1, len(run["train_loss"]) + 1), run["train_loss"], color, alpha=0.3)
        left.plot(run["steps"], run["val_loss"], color, lw=2, label=f"{label} (validation)")
        right.plot(run["steps"], run["val_accuracy"], color, lw=2, label=label)
    left.set(xlabel="training step", ylabel="binary cross-entropy", ylim=(0, None))
    left.legend()
    right.axhline(0.95, color="k", ls=":", lw=1)
    right.set(xlabel="training step", ylabel="validation accuracy", ylim=(0.4, 1.01))
    right.legend()
    figure.suptitle(f"Claim 5: training at d_k = {training['key_dim']} (faint: training loss)")
    files.save_figure(figure, path)


def _results_table(metrics):
    variance = metrics["claims"]["1_variance"]
    saturation = metrics["claims"]["3_saturation"]
    training = metrics["claims"]["5_training"]
    weighted = metrics["claims"]["6_weighted_sum"]
    core = metrics["claims"]["2_core_score_variance"]
    first, last = saturation[0], saturation[-1]
    d_first, d_last = first["d_k"], last["d_k"]
    n = metrics["config"]["samples"]

    quick = " --quick" if metrics["config"]["quick"] else ""

    def fmt_steps(steps):
        return "never" if steps is None else f"step {steps}"

    def holds(key):
        return "yes" if metrics["holds"][key] else "**NO**"

    variances = ", ".join(f"{r['variance']:.2f}" for r in variance["rows"])
    scaled_variances = ", ".join(f"{r['scaled_variance']:.4f}" for r in variance["rows"])
    core_variances = ", ".join(f"{r['variance']:.3f}" for r in core)
    dims = ", ".join(str(r["d_k"]) for r in variance["rows"])
    rows = [
        (
            "1. Var(q . k) = d_k",
            f"the derivation's premise, on NumPy's random numbers (not this package): "
            f"Var(q . k) over {n:,} pairs of N(0, I) vectors, d_k = {dims}",
            f"{variances}; fitted slope {variance['slope']:.4f} "
            f"+/- {variance['slope_standard_error']:.4f}",
            f"each within {_SIGMAS:g} SE of d_k, SE = sqrt((2 d_k^2 + 6 d_k) / n); slope within "
            f"{_SIGMAS:g} SE of 1",
            holds("1_variance"),
        ),
        (
            "2. Var(q . k / sqrt(d_k)) = 1",
            "the premise again, the same NumPy pairs scaled; and, measuring this package, "
            "the spread of log A over keys in the core's own output (default scale)",
            f"{scaled_variances}; core: {core_variances}",
            f"each within {_SIGMAS:g} SE of 1",
            holds("2_scaled_variance"),
        ),
        (
            "3. Unscaled, the softmax saturates",
            f"mean row entropy and max weight of the core's weights, S = "
            f"{metrics['config']['sequence_length']}, unscaled vs scaled",
            f"d_k = {d_first}: entropy {first['unscaled']['entropy']:.2f} vs "
            f"{first['scaled']['entropy']:.2f}; d_k = {d_last}: entropy "
            f"{last['unscaled']['entropy']:.3f} vs {last['scaled']['entropy']:.2f}, max weight "
            f"{last['unscaled']['max_weight']:.3f} vs {last['scaled']['max_weight']:.3f}",
            "unscaled: entropy falls with d_k, < 0.5 nats and max weight > 0.8 at the largest; "
            "scaled: entropy within 10% of log S - 1/2 at every d_k",
            holds("3_saturation"),
        ),
        (
            "4. Unscaled, the gradients vanish",
            "median over rows of the Frobenius norm of d A / d scores, through the core's "
            "hand-written backward pass (scores fed as its bias), unscaled vs scaled; the mean "
            "in brackets",
            f"d_k = {d_first}: {first['unscaled']['jacobian_norm_median']:.3g} vs "
            f"{first['scaled']['jacobian_norm_median']:.3g}; d_k = {d_last}: "
            f"{last['unscaled']['jacobian_norm_median']:.2g} vs "
            f"{last['scaled']['jacobian_norm_median']:.3g} "
            f"({last['unscaled']['jacobian_norm']:.3g} vs {last['scaled']['jacobian_norm']:.3g})",
            "unscaled peaks, then falls at every larger d_k to < 1/10 of scaled; scaled within "
            "a factor 2 across d_k",
            holds("4_gradients"),
        ),
        (
            "5. Unscaled, training suffers",
            f"the same attention-pooling classifier and data, d_k = {training['key_dim']}, "
            f"{training['examples']:,} examples x {training['epochs']} epochs: first step at "
            "95% validation accuracy; final validation loss",
            f"scaled: {fmt_steps(training['scaled']['steps_to_95'])}, loss "
            f"{training['scaled']['final_val_loss']:.3f}, accuracy "
            f"{training['scaled']['final_val_accuracy']:.3f}; unscaled: "
            f"{fmt_steps(training['unscaled']['steps_to_95'])}, loss "
            f"{training['unscaled']['final_val_loss']:.3f}, accuracy "
            f"{training['unscaled']['final_val_accuracy']:.3f}",
            "scaled reaches 95% at least 2x sooner (or unscaled never) and ends with the "
            "lower loss",
            holds("5_training"),
        ),
        (
            "6. Rows of A are distributions; out_i = sum_j A_ij V_j",
            "the real layer (2 heads, W_O, padding, a fully masked row) against NumPy float64: "
            "A recomputed from the inputs and the layer's W_Q, W_K; out from A, W_V, W_O",
            f"min A {weighted['min_weight']:.2g}; max |row sum - 1| "
            f"{weighted['max_row_sum_error']:.2g}; masked weights "
            f"{weighted['max_masked_weight']:g}; "
            f"fully masked row sum {weighted['fully_masked_row_sum']:g}; max |A - returned| "
            f"{weighted['max_weight_error']:.2g}; max |out - A V W_O| "
            f"{weighted['max_output_error']:.2g}",
            "A >= 0; row sums within 1e-5 of 1; masked exactly 0; returned weights and output "
            "within 1e-5 (relative)",
            holds("6_weighted_sum"),
        ),
    ]
    lines = [
        "# The math, verified",
        "",
        f"Written by `python -m apps.math_verified{quick}` in {metrics['seconds']:.0f} s "
        f"(TensorFlow {metrics['versions']['tensorflow']}, "
        f"Keras {metrics['versions']['keras']}). Every number is in `metrics.json`.",
        "",
        "| claim | measured | result | bar | holds |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [""] + [f"![claim {i}](claim{i}_{name}.png)" for i, name in _PLOTS] + [""]
    return "\n".join(lines)


_PLOTS = (
    (1, "variance"),
    (2, "scaled_variance"),
    (3, "saturation"),
    (4, "gradients"),
    (5, "training"),
)


def run(config):
    start = time.perf_counter()
    os.makedirs(config.output, exist_ok=True)

    def progress(message):
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    progress(f"claims 1-2: Var(q . k) over {config.samples:,} pairs per d_k")
    variance = measure_dot_product_variance(config.key_dims, config.samples, config.seed)
    core_variance = measure_core_score_variance(
        config.key_dims, config.sequence_length, config.rows, config.seed
    )
    progress(f"claims 3-4: softmax over {config.sequence_length} keys, {config.rows} rows per d_k")
    saturation = measure_saturation(
        config.key_dims, config.sequence_length, config.rows, config.seed
    )
    training = measure_training(config, progress)
    progress("claim 6: the real layer against its own weights in NumPy")
    weighted = measure_weighted_sum(config.seed)

    metrics = {
        "claims": {
            "1_variance": variance,
            "2_core_score_variance": core_variance,
            "3_saturation": saturation,
            "5_training": training,
            "6_weighted_sum": weighted,
        },
        "holds": {
            "1_variance": check_variance(variance),
            "2_scaled_variance": check_scaled_variance(variance)
            and check_core_score_variance(core_variance),
            "3_saturation": check_saturation(saturation, config.sequence_length),
            "4_gradients": check_gradients(saturation),
            "5_training": check_training(training),
            "6_weighted_sum": check_weighted_sum(weighted),
        },
        "config": dataclasses.asdict(config),
        "seconds": time.perf_counter() - start,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
    }
    paths = {
        f"claim{i}_{name}.png": os.path.join(config.output, f"claim{i}_{name}.png")
        for i, name in _PLOTS
    }
    _plot_variance(variance, paths["claim1_variance.png"], paths["claim2_scaled_variance.png"])
    _plot_saturation(
        saturation,
        config.sequence_length,
        paths["claim3_saturation.png"],
        paths["claim4_gradients.png"],
    )
    _plot_training(training, paths["claim5_training.png"])
    metrics_path = os.path.join(config.output, "metrics.json")
    results_path = os.path.join(config.output, "results.md")
    files.write_json_atomic(metrics_path, metrics)
    files.write_text_atomic(results_path, _results_table(metrics))

    progress("done")
    for claim, ok in metrics["holds"].items():
        print(f"  claim {claim.replace('_', ' ', 1):<22} {'holds' if ok else 'DOES NOT HOLD'}")
    print("Wrote:")
    for path in (results_path, metrics_path, *paths.values()):
        print(f"  {path}")
    return metrics


def main(argv=None):
    config = parse_args(argv)
    # Each d_k is a new shape for the core; its retracing warnings are expected here.
    tf.get_logger().setLevel("ERROR")
    metrics = run(config)
    return 0 if all(metrics["holds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
