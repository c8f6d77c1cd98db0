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
claim that stops holding fails `tests/apps/test_math_verified.py`, which asserts
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

from . import cli, files, math_report  # noqa: E402
from .math_training import check_training, measure_training  # noqa: E402

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
        for i, name in math_report.PLOTS
    }
    math_report.plot_variance(
        variance, paths["claim1_variance.png"], paths["claim2_scaled_variance.png"], _SIGMAS
    )
    math_report.plot_saturation(
        saturation,
        config.sequence_length,
        paths["claim3_saturation.png"],
        paths["claim4_gradients.png"],
    )
    math_report.plot_training(training, paths["claim5_training.png"])
    metrics_path = os.path.join(config.output, "metrics.json")
    results_path = os.path.join(config.output, "results.md")
    files.write_json_atomic(metrics_path, metrics)
    files.write_text_atomic(results_path, math_report.results_table(metrics, _SIGMAS))

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
