"""The training run's figures: loss and accuracy per epoch, and the reliability diagram."""

from ..files import pyplot, save_figure


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
            [b["lower"] for b in bins],
            [b["accuracy"] for b in bins],
            width=width,
            align="edge",
            edgecolor="black",
            alpha=0.75,
            label="accuracy in the bin",
        )
        ax.plot(
            [b["confidence"] for b in bins],
            [b["confidence"] for b in bins],
            "r.",
            label="mean confidence in the bin",
        )
        ax.plot([0.5, 1], [0.5, 1], "k--", linewidth=1, label="perfect calibration")
        ax.set_xlim(0.5, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence, max(p, 1 - p)")
        ax.set_title(f"{title}: ECE {figures['ece']:.4f}")
        ax.grid(alpha=0.3)
        for b in bins:
            ax.text(
                b["lower"] + width / 2,
                0.02,
                f"{b['count'] / figures['examples']:.0%}",
                ha="center",
                fontsize=6,
                rotation=90,
            )
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Reliability on the test split ({calibrated['bins']} bins; bar labels: share)")
    save_figure(fig, path)
    return path
