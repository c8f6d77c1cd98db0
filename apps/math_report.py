"""The math app's report: a figure per claim, and `results.md`, the table of the claims.

Written by `python -m apps.math_verified` (`apps/math_verified.py` measures) from its
`metrics.json`'s numbers.
"""

import math

import numpy as np

from . import files


def plot_variance(variance, path_1, path_2, sigmas):
    """Claims 1 and 2: the variances against d_k, with error bars of `sigmas` standard errors."""
    plt = files.pyplot()

    d = np.array([r["d_k"] for r in variance["rows"]], float)
    v = np.array([r["variance"] for r in variance["rows"]])
    se = np.array([r["standard_error"] for r in variance["rows"]])
    figure, axis = plt.subplots(figsize=(5.5, 4))
    axis.errorbar(d, v, yerr=sigmas * se, fmt="o", label=f"measured (bars: {sigmas:g} SE)")
    axis.plot(d, d, "k--", lw=1, label="Var = d_k")
    axis.plot(d, variance["slope"] * d, "C1", lw=1, label=f"fit: slope {variance['slope']:.4f}")
    axis.set(xscale="log", yscale="log", xlabel="d_k", ylabel="Var(q . k)")
    axis.set_title("Claim 1: Var(q . k) = d_k")
    axis.legend()
    files.save_figure(figure, path_1)

    scaled = np.array([r["scaled_variance"] for r in variance["rows"]])
    figure, axis = plt.subplots(figsize=(5.5, 4))
    axis.errorbar(d, v, yerr=sigmas * se, fmt="o", label="q . k")
    axis.errorbar(d, scaled, yerr=sigmas * se / d, fmt="s", label="q . k / sqrt(d_k)")
    axis.axhline(1.0, color="k", ls="--", lw=1)
    axis.set(xscale="log", yscale="log", xlabel="d_k", ylabel="variance of the scores")
    axis.set_title("Claim 2: scaling brings the variance back to 1")
    axis.legend()
    files.save_figure(figure, path_2)


def plot_saturation(saturation, sequence_length, path_3, path_4):
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


def plot_training(training, path):
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


def results_table(metrics, sigmas):
    """`results.md`: one row per claim (what was measured, the number, the bar, whether it
    holds), and the figures; the bars are `sigmas` standard errors wide."""
    quick = " --quick" if metrics["config"]["quick"] else ""
    rows = _premise_rows(metrics, sigmas) + _softmax_rows(metrics) + _training_rows(metrics)
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
    lines += [""] + [f"![claim {i}](claim{i}_{name}.png)" for i, name in PLOTS] + [""]
    return "\n".join(lines)


def _premise_rows(metrics, sigmas):
    """Claims 1 and 2: the variance of the scores, unscaled and scaled."""
    variance = metrics["claims"]["1_variance"]
    core = metrics["claims"]["2_core_score_variance"]
    n = metrics["config"]["samples"]
    variances = ", ".join(f"{r['variance']:.2f}" for r in variance["rows"])
    scaled_variances = ", ".join(f"{r['scaled_variance']:.4f}" for r in variance["rows"])
    core_variances = ", ".join(f"{r['variance']:.3f}" for r in core)
    dims = ", ".join(str(r["d_k"]) for r in variance["rows"])
    return [
        (
            "1. Var(q . k) = d_k",
            f"the derivation's premise, on NumPy's random numbers (not this package): "
            f"Var(q . k) over {n:,} pairs of N(0, I) vectors, d_k = {dims}",
            f"{variances}; fitted slope {variance['slope']:.4f} "
            f"+/- {variance['slope_standard_error']:.4f}",
            f"each within {sigmas:g} SE of d_k, SE = sqrt((2 d_k^2 + 6 d_k) / n); slope within "
            f"{sigmas:g} SE of 1",
            _holds(metrics, "1_variance"),
        ),
        (
            "2. Var(q . k / sqrt(d_k)) = 1",
            "the premise again, the same NumPy pairs scaled; and, measuring this package, "
            "the spread of log A over keys in the core's own output (default scale)",
            f"{scaled_variances}; core: {core_variances}",
            f"each within {sigmas:g} SE of 1",
            _holds(metrics, "2_scaled_variance"),
        ),
    ]


def _softmax_rows(metrics):
    """Claims 3 and 4: the softmax saturates and its gradients vanish, unscaled."""
    saturation = metrics["claims"]["3_saturation"]
    first, last = saturation[0], saturation[-1]
    d_first, d_last = first["d_k"], last["d_k"]
    return [
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
            _holds(metrics, "3_saturation"),
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
            _holds(metrics, "4_gradients"),
        ),
    ]


def _training_rows(metrics):
    """Claims 5 and 6: training, and the real layer's weighted sum."""
    training = metrics["claims"]["5_training"]
    weighted = metrics["claims"]["6_weighted_sum"]
    return [
        (
            "5. Unscaled, training suffers",
            f"the same attention-pooling classifier and data, d_k = {training['key_dim']}, "
            f"{training['examples']:,} examples x {training['epochs']} epochs: first step at "
            "95% validation accuracy; final validation loss",
            f"scaled: {_steps(training['scaled']['steps_to_95'])}, loss "
            f"{training['scaled']['final_val_loss']:.3f}, accuracy "
            f"{training['scaled']['final_val_accuracy']:.3f}; unscaled: "
            f"{_steps(training['unscaled']['steps_to_95'])}, loss "
            f"{training['unscaled']['final_val_loss']:.3f}, accuracy "
            f"{training['unscaled']['final_val_accuracy']:.3f}",
            "scaled reaches 95% at least 2x sooner (or unscaled never) and ends with the "
            "lower loss",
            _holds(metrics, "5_training"),
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
            _holds(metrics, "6_weighted_sum"),
        ),
    ]


def _holds(metrics, key):
    return "yes" if metrics["holds"][key] else "**NO**"


def _steps(steps):
    return "never" if steps is None else f"step {steps}"


PLOTS = (
    (1, "variance"),
    (2, "scaled_variance"),
    (3, "saturation"),
    (4, "gradients"),
    (5, "training"),
)
