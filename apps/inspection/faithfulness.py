"""Does the attention explain the prediction? ERASER's deletion tests on a trained classifier.

Usage:
    python -m apps.faithfulness --data_dir ../shared/data/tensorflow_datasets
    python -m apps.faithfulness --run saved_models/imdb_sdpa --examples 1000
    python -m apps.faithfulness --quick          # 200 reviews, about a minute

For a seeded sample of test reviews it ranks each review's tokens by the pooling attention
(mean over heads, and each head), by attention rollout, by gradient x input and at random, and
measures what deleting the top tokens, or keeping only them, does to P(predicted label), for
k = 1%, 5%, 10%, 20% and 50% of the tokens (`apps/inspection/explain.py` says exactly how). It also
measures Kendall's tau between the attention and gradient rankings (Jain & Wallace, 2019).

It writes into the run folder, and prints the paths:

    faithfulness.json    every number, with standard errors and the sample
    faithfulness.md      the table
    faithfulness.png     drop in P(predicted label) against k, one line per ranking; tau

The run folder is what `apps.train_sentiment` writes. The Keras model comes from its
`model.keras`, or, where only the SavedModel was kept (the shipped run), from the SavedModel's
variables, matched by name; either way it must give the SavedModel's probabilities (to 1e-4)
on the sample before anything is measured.
"""

import dataclasses
import json
import math
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from .. import cli, files  # noqa: E402
from ..classifier import data  # noqa: E402
from ..classifier.run_folder import load_run  # noqa: E402
from . import explain, model_card, records  # noqa: E402

QUICK_EXAMPLES = 200


@dataclasses.dataclass
class Config:
    run: str = "saved_models/imdb_sdpa"  # a training run's folder
    examples: int = 1000  # test reviews, a seeded sample
    quick: bool = False  # 200 reviews
    data_dir: str | None = None  # TFDS folder; else $TFDS_DATA_DIR; else TFDS's default
    seed: int = 0  # the sample and the random ranking
    batch_size: int = 128  # sequences per model call


def _check(config):
    if config.examples < 1:
        raise ValueError(f"`--examples` must be >= 1. Received: examples={config.examples}")
    if config.batch_size < 1:
        raise ValueError(f"`--batch_size` must be >= 1. Received: batch_size={config.batch_size}")


def parse_args(argv=None):
    return cli.parse_config(
        Config,
        argv,
        prog="python -m apps.faithfulness",
        description="ERASER comprehensiveness and sufficiency of attention, gradient x input "
        "and random token rankings on a trained classifier.",
        check=_check,
        presets=lambda args: {"examples": QUICK_EXAMPLES} if args.quick else None,
    )


def rankings_for(inspector, probe, ids, lengths, rng):
    """`{name: [scores (n,) per review]}` for one batch of reviews, and the gradient scores
    and the attention weights (for the viewer)."""
    outputs = inspector.predict(ids, batch_size=probe.batch_size, verbose=0)
    pooling, attention = outputs["pooling"], outputs["attention"]  # (R, N, L), (R, l, N, L, L)
    gradient, _ = probe.gradient_x_input(ids)  # (R, L)
    num_heads = pooling.shape[1]
    names = [explain.ATTENTION] + [f"attention head {h}" for h in range(num_heads)]
    names += ["attention rollout", "gradient x input", "random"]
    rankings = {name: [] for name in names}
    for r, n in enumerate(lengths):
        rankings[explain.ATTENTION].append(pooling[r, :, :n].mean(axis=0))
        for h in range(num_heads):
            rankings[f"attention head {h}"].append(pooling[r, h, :n])
        rankings["attention rollout"].append(
            explain.rollout(pooling[r, :, :n], attention[r, :, :, :n, :n])
        )
        rankings["gradient x input"].append(gradient[r, :n])
        rankings["random"].append(rng.permutation(n).astype(np.float64))
    return rankings


def _mean_and_error(values):
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not len(values):
        return {"mean": None, "standard_error": None}
    error = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None
    return {
        "mean": round(float(values.mean()), 6),
        "standard_error": None if error is None else round(error, 6),
    }


def evaluate(
    model,
    inspector,
    vectorizer,
    texts,
    labels,
    seed=0,
    batch_size=128,
    fractions=explain.FRACTIONS,
    reviews_per_step=25,
):
    """Runs the tests on `texts`; returns the `faithfulness.json` payload (without `source`)."""
    ids = data.vectorize(vectorizer, np.asarray(texts))
    lengths = (ids != 0).sum(axis=1)
    usable = np.flatnonzero(lengths > 0)  # an empty review has nothing to rank
    probe = explain.ModelProbe(model, batch_size=batch_size)
    rng = np.random.default_rng(seed)
    per_ranking, taus, full, predicted = {}, [], [], []
    progress = keras.utils.Progbar(len(usable), unit_name="review")
    for start in range(0, len(usable), reviews_per_step):
        chosen = usable[start : start + reviews_per_step]
        rankings = rankings_for(inspector, probe, ids[chosen], lengths[chosen], rng)
        scores = explain.erase_scores(
            probe.probability, ids[chosen], lengths[chosen], rankings, fractions
        )
        full.append(scores["full"])
        predicted.append(scores["predicted"])
        for name in rankings:
            for key in ("comprehensiveness", "sufficiency", "without", "only"):
                per_ranking.setdefault(name, {}).setdefault(key, []).append(scores[name][key])
        taus.extend(
            explain.kendall_tau(a, g)
            for a, g in zip(rankings[explain.ATTENTION], rankings["gradient x input"])
        )
        progress.add(len(chosen))
    full = np.concatenate(full) if full else np.zeros(0)
    predicted = np.concatenate(predicted) if predicted else np.zeros(0, dtype=np.int64)
    labels = np.asarray(labels)[usable]
    results, comprehensiveness_aopc = _per_ranking(per_ranking, fractions)
    baseline = comprehensiveness_aopc.get("random")
    versus_random = {
        name: _mean_and_error(aopc - baseline)
        for name, aopc in comprehensiveness_aopc.items()
        if name != "random" and baseline is not None
    }
    return {
        "reviews": int(len(usable)),
        "skipped_empty": int(len(texts) - len(usable)),
        "tokens_median": float(np.median(lengths[usable])) if len(usable) else None,
        "accuracy_on_sample": round(float(np.mean(predicted == labels)), 6)
        if len(usable)
        else None,
        "p_predicted_mean": round(float(np.mean(np.maximum(full, 1 - full))), 6)
        if len(full)
        else None,
        "fractions": list(fractions),
        "rankings": results,
        "comprehensiveness_aopc_minus_random": versus_random,
        "kendall_tau_attention_vs_gradient": _taus(taus),
    }


def _per_ranking(per_ranking, fractions):
    """Each ranking's row of the payload, and its comprehensiveness AOPC per review `(R,)`."""
    flip_column = fractions.index(0.10) if 0.10 in fractions else None
    results, comprehensiveness_aopc = {}, {}
    for name, arrays in per_ranking.items():
        arrays = {key: np.concatenate(value) for key, value in arrays.items()}  # (R, K)
        comprehensiveness_aopc[name] = arrays["comprehensiveness"].mean(axis=1)  # (R,)
        row = {
            "comprehensiveness": [_mean_and_error(c) for c in arrays["comprehensiveness"].T],
            "sufficiency": [_mean_and_error(s) for s in arrays["sufficiency"].T],
            "comprehensiveness_aopc": _mean_and_error(comprehensiveness_aopc[name]),
            "sufficiency_aopc": _mean_and_error(arrays["sufficiency"].mean(axis=1)),
        }
        if flip_column is not None:
            row["label_flips_top_10_percent"] = round(
                float(np.mean(arrays["without"][:, flip_column] < 0.5)), 6
            )
        results[name] = row
    return results, comprehensiveness_aopc


def _taus(taus):
    """Kendall's tau of attention against gradient x input: mean, error, quantiles, values."""
    finite = np.asarray(taus, dtype=np.float64)
    finite = finite[~np.isnan(finite)]
    quantiles = {}
    if len(finite):
        quantiles = {
            q: round(float(np.quantile(finite, float(q))), 6)
            for q in ("0.1", "0.25", "0.5", "0.75", "0.9")
        }
    return {
        **_mean_and_error(finite),
        "quantiles": quantiles,
        "values": [round(float(t), 4) for t in finite],
    }


def plot(payload, path):
    """Drop in P(predicted label) against k per ranking (deleted, and kept only), and tau."""
    plt = files.pyplot()
    fractions = [100 * f for f in payload["fractions"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for key, ax, title in (
        ("comprehensiveness", axes[0], "top k deleted: drop in P(predicted) (higher = faithful)"),
        ("sufficiency", axes[1], "only top k kept: drop in P(predicted) (lower = sufficient)"),
    ):
        for name, row in payload["rankings"].items():
            means = [c["mean"] for c in row[key]]
            errors = [c["standard_error"] or 0.0 for c in row[key]]
            style = "k--" if name == "random" else "o-"
            ax.errorbar(fractions, means, yerr=errors, fmt=style, capsize=3, label=name, alpha=0.9)
        ax.set_xscale("log")
        ax.set_xticks(fractions, [f"{f:g}%" for f in fractions])
        ax.set_xlabel("k, % of the review's tokens")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("P(predicted | review) - P(predicted | changed review)")
    axes[0].legend(fontsize=8)
    taus = payload["kendall_tau_attention_vs_gradient"]["values"]
    axes[2].hist(taus, bins=30, range=(-1, 1), color="#0969da")
    axes[2].set_xlabel("Kendall's tau, attention vs gradient x input")
    axes[2].set_ylabel("reviews")
    axes[2].set_title("agreement of the rankings, per review", fontsize=10)
    fig.suptitle(f"Faithfulness on {payload['reviews']} test reviews (ERASER deletion tests)")
    files.save_figure(fig, path)
    return path


def write_report(payload, folder):
    """Writes faithfulness.json, .md and .png into `folder`; returns their paths."""
    paths = {
        "faithfulness_json": os.path.join(folder, "faithfulness.json"),
        "faithfulness_md": os.path.join(folder, "faithfulness.md"),
        "faithfulness_png": os.path.join(folder, "faithfulness.png"),
    }
    files.write_json_atomic(paths["faithfulness_json"], payload)
    files.write_text_atomic(paths["faithfulness_md"], explain.markdown_table(payload))
    plot(payload, paths["faithfulness_png"])
    return paths


def check_against_saved_model(run, saved_model, texts, tolerance=1e-4):
    """The largest |P(positive)| difference between the Keras model and the SavedModel on
    `texts`; a `ValueError` beyond `tolerance`."""
    loaded = tf.saved_model.load(saved_model)
    serve = loaded.signatures["serving_default"]
    served = np.concatenate(
        [
            serve(text=tf.constant(texts[i : i + 64]))["probability"].numpy()
            for i in range(0, len(texts), 64)
        ]
    )
    ids = data.vectorize(run.vectorizer, texts)
    ours = explain.ModelProbe(run.model).probability(ids)
    difference = float(np.max(np.abs(served - ours))) if len(texts) else 0.0
    if difference > tolerance:
        raise ValueError(
            f"the Keras model rebuilt from {run.weights_from} differs from the SavedModel by "
            f"{difference:.2g} in P(positive) (tolerance {tolerance}); not measuring it"
        )
    return difference


def main(argv=None):
    config = parse_args(argv)
    try:
        run = load_run(config.run)
        dataset = run.metrics["config"]["dataset"]
        data_dir = data.resolve_data_dir(config.data_dir)
        where = data_dir or "default"
        print(f"Loading the {dataset} test split with tensorflow-datasets (data_dir={where})")
        texts, labels, split = data.load_test_split(dataset, data_dir)
        chosen = records.inspection_sample(len(texts), config.examples, config.seed)
        difference = check_against_saved_model(
            run, os.path.join(config.run, "saved_model"), texts[chosen[:64]]
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"Weights from {run.weights_from}: P(positive) within {difference:.1g} of the SavedModel. "
        f"Ranking and deleting tokens in {len(chosen)} {split} reviews"
    )
    payload = evaluate(
        run.model,
        run.inspector,
        run.vectorizer,
        texts[chosen],
        labels[chosen],
        seed=config.seed,
        batch_size=config.batch_size,
    )
    payload["source"] = {
        "run": os.path.abspath(config.run),
        "weights": os.path.abspath(run.weights_from),
        "saved_model_max_abs_difference": difference,
        "dataset": dataset,
        "split": split,
        "examples": len(chosen),
        "seed": config.seed,
    }
    paths = write_report(payload, config.run)
    metrics = os.path.join(config.run, "metrics.json")
    if os.path.isfile(metrics):  # a training run's folder: its model card quotes this report
        with open(metrics) as f:
            paths["model_card"] = model_card.write_model_card(
                json.load(f), os.path.join(config.run, "README.md")
            )
    print("\n" + explain.verdict(payload))
    print("Wrote:")
    for name, path in paths.items():
        print(f"  {name:18s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
