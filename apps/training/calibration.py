"""Temperature scaling (Guo et al., 2017, "On Calibration of Modern Neural Networks"), and the
figures that say how calibrated a classifier's probabilities are.

The classifier's `P(positive)` is `sigmoid(z)` of its log-odds `z`. A temperature `T > 0`,
fitted on the validation split after training, replaces it with `sigmoid(z / T)`: the labels it
predicts are unchanged (the sign of `z` is), and its probabilities say how often it is right.
`fold_temperature` divides the output layer's kernel and bias by `T`, so the model, its
`.keras` file and every signature of its SavedModel give the calibrated probability.
"""

import numpy as np

ECE_BINS = 15  # equal-width bins of confidence, Guo et al.'s choice
# The temperatures searched: far outside any trained model's, and inside float64's range.
TEMPERATURE_RANGE = (1e-3, 1e3)


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # stable for any z


def _checked(log_odds, labels):
    z = np.asarray(log_odds, np.float64).reshape(-1)
    y = np.asarray(labels, np.float64).reshape(-1)
    if z.shape != y.shape or not len(z):
        raise ValueError(
            "`log_odds` and `labels` must be of one non-zero length. "
            f"Received: {len(z)} log-odds and {len(y)} labels"
        )
    if not np.all(np.isfinite(z)):
        raise ValueError(f"`log_odds` must be finite. Received: {int(np.sum(~np.isfinite(z)))} not")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError(f"`labels` must be 0 or 1. Received: {sorted(set(y.tolist()))[:5]}")
    return z, y


def fit_temperature(log_odds, labels):
    """The temperature `T` that minimizes the mean negative log-likelihood of `labels` under
    `sigmoid(log_odds / T)`.

    The loss is convex in `a = 1 / T`, and its derivative, `mean((sigmoid(a z) - y) z)`, rises
    with `a`: bisection on `log a` finds its zero to float64 precision. Where the derivative
    keeps one sign over `TEMPERATURE_RANGE` (every review right, or the log-odds carry no
    information), the end of the range is returned.
    """
    z, y = _checked(log_odds, labels)

    def slope(log_a):
        return np.mean((_sigmoid(np.exp(log_a) * z) - y) * z)

    low, high = np.log(1.0 / TEMPERATURE_RANGE[1]), np.log(1.0 / TEMPERATURE_RANGE[0])
    if slope(low) >= 0:
        return TEMPERATURE_RANGE[1]
    if slope(high) <= 0:
        return TEMPERATURE_RANGE[0]
    for _ in range(200):
        middle = 0.5 * (low + high)
        if slope(middle) < 0:
            low = middle
        else:
            high = middle
    return float(np.exp(-0.5 * (low + high)))


def report(log_odds, labels, temperature=1.0, bins=ECE_BINS):
    """Accuracy, expected calibration error, log loss and Brier score of `sigmoid(log_odds /
    temperature)` against `labels`, and the reliability diagram's bins.

    ECE is Guo et al.'s: the confidence of a prediction is the probability of the label it
    predicts, `max(p, 1 - p)`; the predictions are put in `bins` equal-width bins of
    confidence over [0, 1] (a bin holds its upper edge), and ECE is the mean over bins of
    |accuracy - mean confidence|, weighed by the share of predictions in the bin. The log loss
    is computed from the log-odds, so a probability that rounds to 0 or 1 in float32 still
    counts what it costs.
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be positive. Received: temperature={temperature}")
    z, y = _checked(log_odds, labels)
    z = z / temperature
    p = _sigmoid(z)
    predicted = (p >= 0.5).astype(np.float64)
    correct = predicted == y
    confidence = np.maximum(p, 1.0 - p)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    table, ece = [], 0.0
    for index in range(bins):
        members = which == index
        count = int(members.sum())
        if not count:
            continue
        mean_confidence = float(confidence[members].mean())
        accuracy = float(correct[members].mean())
        ece += count / len(z) * abs(accuracy - mean_confidence)
        table.append(
            {
                "lower": float(edges[index]),
                "upper": float(edges[index + 1]),
                "count": count,
                "confidence": mean_confidence,
                "accuracy": accuracy,
            }
        )
    # -log sigmoid(z) for y = 1, -log sigmoid(-z) for y = 0: softplus(-z) and softplus(z).
    signed = np.where(y == 1, -z, z)
    log_loss = float(np.mean(np.logaddexp(0.0, signed)))
    return {
        "examples": len(z),
        "accuracy": float(correct.mean()),
        "ece": float(ece),
        "log_loss": log_loss,
        "brier": float(np.mean((p - y) ** 2)),
        "bins": table,
    }


def fold_temperature(model, temperature):
    """Divides the output layer's (`classifier`, a `Dense(1, sigmoid)`) kernel and bias by
    `temperature`: the model then computes `sigmoid(z / temperature)`."""
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"`temperature` must be positive. Received: temperature={temperature}")
    classifier = model.get_layer("classifier")
    classifier.kernel.assign(classifier.kernel / temperature)
    if classifier.bias is not None:
        classifier.bias.assign(classifier.bias / temperature)
