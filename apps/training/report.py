"""The report: calibration, the test split's evaluation, the exports, and `metrics.json` with
the model card, once training is done."""

import dataclasses
import os
import shlex
import shutil
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from .. import files
from ..classifier import data, short_reviews
from ..inspection import explain, faithfulness, model_card, records
from ..serving import export
from ..serving.compiled import compiled_classifier
from . import calibration, figures
from .batches import eval_dataset
from .fit import optimizer_step

SHORT_REVIEWS = 2000  # test reviews that the short spans are cut from


def report_run(
    config,
    output,
    model,
    inspector,
    vectorizer,
    splits,
    history,
    best_epoch,
    train_seconds,
    stopped,
    validation,
    distribution,
    argv,
    git_commit,
    records=None,
    stages=None,
):
    """Calibrates, evaluates and exports the trained `model`, writes `metrics.json` and the
    model card to `output`, and prints where every artifact went. Returns 0.

    `records`: the `pretraining` and `self_training` stages' (None where one did not run);
    `stages`, the seconds each stage before this one took (the report's own added here)."""
    report_started = time.time()
    global_batch = distribution["global_batch_size"]
    limit = None if config.max_steps is None else config.max_steps * global_batch
    # One compiled classifier for every pass below: it reads the model's variables, so it
    # computes the calibrated log-odds once the temperature is folded in, and each shape's
    # program compiles once for the validation, test and short-review passes.
    classify = compiled_classifier(model, log_odds=True)
    scores = _calibrate_and_evaluate(
        model, classify, vectorizer, splits, validation, global_batch, limit
    )
    by_length = _short_review_accuracy(
        classify,
        vectorizer,
        splits,
        min(SHORT_REVIEWS, limit or SHORT_REVIEWS),
        config.seed,
        global_batch,
    )
    paths, max_difference = _export_model(
        config, output, model, inspector, vectorizer, splits, history, scores["calibration"]
    )
    sharpness = _export_attention(config, output, model, inspector, vectorizer, splits, paths)
    faithfulness_summary = _faithfulness(
        config, output, model, inspector, vectorizer, splits, paths
    )
    metrics = {
        "dataset": config.dataset,
        "test_split": splits.test_split,
        **{key: value for key, value in scores.items() if key != "calibration"},
        "train_examples": len(splits.train_label),
        "epochs_run": len(history),
        "best_epoch": None if best_epoch is None else best_epoch + 1,
        "stopped_early": bool(stopped),
        "train_steps": optimizer_step(model),
        "train_seconds": round(train_seconds, 1),
        **{"pretraining": None, "self_training": None, **(records or {})},
        "stage_seconds": {**(stages or {}), "report": round(time.time() - report_started, 1)},
        "machine": files.machine(),
        "parameters": int(model.count_params()),
        "export_max_abs_difference": max_difference,
        "calibration": scores["calibration"],
        "short_reviews": by_length,
        "faithfulness": faithfulness_summary,
        "pooling_sharpness": sharpness,  # of the exported reviews' pooling weights
        "distribution": distribution,
        "history": history,
        "config": dataclasses.asdict(config),
        "command": shlex.join(["python", "-m", "apps.train_sentiment", *(argv or [])]),
        "git_commit": git_commit,
        "versions": _versions(),
    }
    if metrics["pretraining"]:
        paths["pretrained_encoder"] = os.path.join(output, "pretrained", "encoder.npz")
    paths["metrics"] = os.path.join(output, "metrics.json")
    paths["model_card"] = os.path.join(output, "README.md")
    metrics["artifacts"] = {name: os.path.relpath(path, output) for name, path in paths.items()}
    files.write_json_atomic(paths["metrics"], metrics)
    model_card.write_model_card(metrics, paths["model_card"])
    # The run is complete: its resumable state is no longer needed.
    shutil.rmtree(os.path.join(output, "checkpoints"), ignore_errors=True)
    _print_summary(metrics, paths, train_seconds)
    return 0


def _calibrate_and_evaluate(model, classify, vectorizer, splits, validation, global_batch, limit):
    """Fits the temperature on `validation` and folds it into `model`, then evaluates the
    calibrated model on validation and test. Returns `metrics.json`'s accuracy, loss and
    example counts, with its `calibration` section."""
    print("Fitting the probabilities' temperature on the validation set")
    validation_log_odds, validation_labels = _log_odds(classify, validation)
    temperature = calibration.fit_temperature(validation_log_odds, validation_labels)
    if temperature in calibration.TEMPERATURE_RANGE:
        print(
            f"Warning: the temperature ({temperature:g}) is at the end of its range: the "
            f"{len(validation_labels)} validation reviews are all right, or the model has not "
            "learned; its probabilities are not calibrated.",
            file=sys.stderr,
        )
    calibration.fold_temperature(model, temperature)  # every export below is calibrated
    print("Reading the test split once, calibrated")
    # Smoke runs read the first `limit` test reviews: only those are tokenized.
    test_ids = data.vectorize(vectorizer, splits.test_text[:limit])
    test = eval_dataset(test_ids, splits.test_label[: len(test_ids)], global_batch, limit)
    # The folded model's log-odds are the trained model's divided by the temperature.
    test_log_odds, test_labels = _log_odds(classify, test)
    after = {
        "validation": calibration.report(validation_log_odds, validation_labels, temperature),
        "test": calibration.report(test_log_odds, test_labels),
    }
    calibrated = {
        "temperature": temperature,
        "fitted_on": "validation",
        "bins": calibration.ECE_BINS,
        "validation": {
            "before": calibration.report(validation_log_odds, validation_labels),
            "after": after["validation"],
        },
        "test": {
            "before": calibration.report(test_log_odds * temperature, test_labels),
            "after": after["test"],
        },
    }
    return {
        # The calibrated model's accuracy and cross-entropy, from the one pass over each split.
        "test_accuracy": after["test"]["accuracy"],
        "test_loss": after["test"]["log_loss"],
        "test_examples": int(len(test_ids)),
        "validation_accuracy": after["validation"]["accuracy"],
        "validation_loss": after["validation"]["log_loss"],
        "validation_examples": after["validation"]["examples"],
        "calibration": calibrated,
    }


def _export_model(config, output, model, inspector, vectorizer, splits, history, calibrated):
    """The SavedModel (checked against `model` and its serving rate measured), `model.keras`
    and the figures. Returns the artifacts' paths so far and the SavedModel's largest
    difference from `model`."""
    paths = {}
    print("Exporting the SavedModel")
    paths["saved_model"] = export.export_saved_model(
        model, inspector, vectorizer, os.path.join(output, "saved_model")
    )
    max_difference = _check_export(paths["saved_model"], model, vectorizer, splits.test_text[:64])
    print("Measuring the SavedModel's serving rate")
    serving = export.measure_serving(
        paths["saved_model"], splits.test_text[: 256 if config.max_steps else 1024]
    )
    paths["serving"] = files.write_json_atomic(os.path.join(output, "serving.json"), serving)
    paths["keras_model"] = os.path.join(output, "model.keras")
    model.save(paths["keras_model"])
    paths["vocabulary"] = os.path.join(output, "vocabulary.txt")
    if config.bigram_vocab_size:
        paths["bigrams"] = os.path.join(output, "bigrams.txt")
    if config.trigram_vocab_size:
        paths["trigrams"] = os.path.join(output, "trigrams.txt")
    paths["history"] = os.path.join(output, "history.csv")
    paths["calibration"] = figures.write_reliability_diagram(
        calibrated, os.path.join(output, "calibration.png")
    )
    paths["tensorboard"] = os.path.join(output, "logs")
    if history:
        paths["training_curves"] = figures.write_training_curves(
            history, os.path.join(output, "training_curves.png")
        )
    return paths, max_difference


def _export_attention(config, output, model, inspector, vectorizer, splits, paths):
    """The `--inspect_examples` test reviews' attention (`attention.jsonl`, `.html` and the
    heatmaps), their paths added to `paths`. Returns their pooling's sharpness (or None)."""
    if not config.inspect_examples:
        return None
    print(f"Exporting attention for {config.inspect_examples} test reviews")
    chosen = records.inspection_sample(len(splits.test_text), config.inspect_examples, config.seed)
    exported = records.inspect_records(
        inspector,
        vectorizer,
        splits.test_text[chosen],
        splits.test_label[chosen],
        chosen,
        model=model,
    )
    sharpness = records.pooling_sharpness(exported)
    paths["attention_jsonl"] = records.write_attention_jsonl(
        exported, os.path.join(output, "attention.jsonl")
    )
    paths["attention_html"] = records.write_attention_html(
        exported,
        os.path.join(output, "attention.html"),
        title=f"keras-sdpa attention: {config.dataset} test reviews",
    )
    heatmaps = records.write_attention_heatmaps(
        exported, os.path.join(output, "attention_heatmaps.png")
    )
    if heatmaps:
        paths["attention_heatmaps"] = heatmaps
    return sharpness


def _faithfulness(config, output, model, inspector, vectorizer, splits, paths):
    """The deletion tests on `--faithfulness_examples` test reviews, their report's paths added
    to `paths`. Returns their summary for `metrics.json` (or None)."""
    if not config.faithfulness_examples:
        return None
    print(
        f"Deletion tests (apps.faithfulness --quick) on {config.faithfulness_examples} test reviews"
    )
    chosen = records.inspection_sample(
        len(splits.test_text), config.faithfulness_examples, config.seed
    )
    payload = faithfulness.evaluate(
        model,
        inspector,
        vectorizer,
        splits.test_text[chosen],
        splits.test_label[chosen],
        seed=config.seed,
    )
    payload["source"] = {
        "run": output,
        "weights": "the trained model, in memory",
        "dataset": config.dataset,
        "split": splits.test_split,
        "examples": len(chosen),
        "seed": config.seed,
    }
    paths.update(faithfulness.write_report(payload, output))
    return explain.summary(payload)


def _versions():
    import tensorflow_datasets as tfds

    return {
        "python": sys.version.split()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "tensorflow_datasets": tfds.__version__,
    }


def _print_summary(metrics, paths, train_seconds):
    calibrated = metrics["calibration"]
    before, after = calibrated["test"]["before"], calibrated["test"]["after"]
    print(
        f"\ntest accuracy {metrics['test_accuracy']:.4f} on {metrics['test_examples']} "
        f"{metrics['test_split']} examples (validation {metrics['validation_accuracy']:.4f}); "
        f"trained {train_seconds / 60:.1f} min, {metrics['epochs_run']} epochs\n"
        f"calibration: temperature {calibrated['temperature']:.3f} (fitted on validation); on "
        f"test, ECE {before['ece']:.4f} -> {after['ece']:.4f}, log loss "
        f"{before['log_loss']:.4f} -> {after['log_loss']:.4f}, Brier {before['brier']:.4f} -> "
        f"{after['brier']:.4f}"
    )
    print("Wrote:")
    for name, path in paths.items():
        print(f"  {name:20s} {path}")


def _short_review_accuracy(classify, vectorizer, splits, count, seed, batch_size):
    """Accuracy by review length (`short_reviews.BUCKETS`) on spans cut from `count` test
    reviews: what a person who types one sentence can expect. `classify` is the model's
    `compiled_classifier(model, log_odds=True)`."""
    print(f"Reading spans of {count} test reviews: one sentence, 2-3, a paragraph, the whole")
    buckets_ = []
    for name, (texts, labels) in short_reviews.spans(
        splits.test_text, splits.test_label, count, seed
    ).items():
        if not len(texts):
            continue
        ids = data.vectorize(vectorizer, texts)
        log_odds, ordered = _log_odds(classify, eval_dataset(ids, labels, batch_size))
        buckets_.append(
            {
                "bucket": name,
                "examples": len(labels),
                "accuracy": float(np.mean((log_odds >= 0) == (ordered == 1))),
                "median_words": int(np.median([len(t.split()) for t in texts])),
            }
        )
    return {"split": splits.test_split, "reviews": count, "seed": seed, "buckets": buckets_}


def _log_odds(classify, dataset):
    """The log-odds `(n,)` that `classify` (`compiled_classifier(model, log_odds=True)`) gives
    and the labels `(n,)` of an `eval_dataset`, in its order."""
    log_odds, labels = [], []
    for ids, label in dataset:
        log_odds.append(classify(ids).numpy())
        labels.append(label.numpy())
    return np.concatenate(log_odds).astype("float64"), np.concatenate(labels).astype("int64")


def _check_export(path, model, vectorizer, texts):
    """Reloads the SavedModel and returns its largest difference from the in-memory model."""
    reloaded = tf.saved_model.load(path)
    served = reloaded.signatures["serving_default"](text=tf.constant(texts))
    expected = model.predict(vectorizer(tf.constant(texts)), verbose=0)[:, 0]
    return float(np.max(np.abs(served["probability"].numpy() - expected)))
