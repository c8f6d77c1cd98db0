"""Short texts from outside IMDB, labelled one sentence at a time: how the classifier reads them.

Usage:
    python -m apps.out_of_domain          # the shipped model (keeps its report's baseline)
    python -m apps.out_of_domain --model runs/imdb_sdpa --baseline saved_models/imdb_sdpa

The texts are the human-rated sets of Hutto & Gilbert (2014), "VADER: A Parsimonious Rule-based
Model for Sentiment Analysis of Social Media Text", as `vaderSentiment`'s source distribution
ships them (`pip download --no-binary :all: --no-deps vaderSentiment==3.3.2`, its hash checked):
tweets, product-review snippets and New York Times editorial snippets, each rated from -4 to 4 by
about 20 people. A text is positive if its mean rating is above 0, negative if below, and left
out at exactly 0. The set of movie-review snippets in the same archive is never read: its
sentences are those of a public movie-review test set. These texts are for this report only:
no run trains, tunes or chooses on them.

Writes `out_of_domain.json` into the model's folder (accuracy, ECE and counts per set, for the
model and, with `--baseline`, for another one measured the same way) and, if the folder is a
training run's, writes its model card again with the table.
"""

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np

from .. import files
from ..inspection import model_card

PACKAGE = "vaderSentiment==3.3.2"
ARCHIVE = "vaderSentiment-3.3.2.tar.gz"
ARCHIVE_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
DATA_MEMBER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
# The sets read, by the name the report gives them. movieReviewSnippets_GroundTruth.txt is
# left out on purpose (see the module's docstring).
SETS = {
    "tweets": "hutto_ICWSM_2014/tweets_GroundTruth.txt",
    "product reviews": "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt",
    "news editorials": "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt",
}
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "keras_sdpa", "vader")


def fetch(cache=DEFAULT_CACHE):
    """The path of `vaderSentiment`'s source archive in `cache`, downloaded with pip if it
    is not there; a `ValueError` if its SHA-256 is not the one this report was written for."""
    path = os.path.join(cache, ARCHIVE)
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        print(f"Downloading {PACKAGE}'s source archive into {cache}")
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--quiet",
            "--dest",
            cache,
            PACKAGE,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(path):
            raise ValueError(
                f"`--cache`: pip could not download {PACKAGE} into it. Received: cache={cache!r}"
                f"\n{done.stderr.strip()[-2000:]}"
            )
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != ARCHIVE_SHA256:
        raise ValueError(
            f"`--cache` holds an {ARCHIVE} whose SHA-256 is {digest}, not {ARCHIVE_SHA256}. "
            f"Received: cache={cache!r}"
        )
    return path


def read_sets(archive):
    """`{name: (texts, labels, neutral)}` of `SETS` in the source `archive`: the texts whose
    mean rating is not 0, their labels (1 above 0, 0 below) and how many rated exactly 0."""
    with tarfile.open(archive) as outer:
        inner_bytes = outer.extractfile(DATA_MEMBER).read()
    sets = {}
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        for name, member in SETS.items():
            lines = inner.extractfile(member).read().decode("utf-8").splitlines()
            texts, labels, neutral = [], [], 0
            for line in lines:
                if not line.strip():
                    continue
                _, rating, text = line.split("\t", 2)
                rating = float(rating)
                if rating == 0:
                    neutral += 1
                    continue
                texts.append(text.strip())
                labels.append(int(rating > 0))
            sets[name] = (texts, np.array(labels), neutral)
    return sets


def measure(model_path, sets):
    """`{name: {texts, positive, neutral_left_out, accuracy, ece, log_loss}}` of the
    SavedModel at `model_path` (a SavedModel or a run folder) on `sets`, served from raw text."""
    from ..serving import predict
    from . import calibration

    _, serve, _ = predict.load(predict.resolve_model_path(model_path))
    results = {}
    for name, (texts, labels, neutral) in sets.items():
        answers = predict.predict(serve, texts)
        probability = np.array([answer["probability"] for answer in answers], np.float64)
        probability = np.clip(probability, 1e-7, 1 - 1e-7)
        report = calibration.report(np.log(probability / (1 - probability)), labels)
        results[name] = {
            "texts": len(texts),
            "positive": int(labels.sum()),
            "neutral_left_out": neutral,
            "accuracy": round(report["accuracy"], 4),
            "ece": round(report["ece"], 4),
            "log_loss": round(report["log_loss"], 4),
        }
    return results


def _model_record(folder, label=None):
    """What a result belongs to: the folder (or `label`), its run's config and test accuracy."""
    record = {"model": label or os.path.relpath(os.path.abspath(folder))}
    metrics_path = os.path.join(folder, "metrics.json")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = json.load(f)
        record["seed"] = metrics["config"]["seed"]
        record["pretrain_steps"] = metrics["config"].get("pretrain_steps", 0)
        record["test_accuracy"] = metrics["test_accuracy"]
        record["git_commit"] = metrics.get("git_commit")
    return record


def _check_args(args, predict):
    """Each model path resolves to a SavedModel; errors name the flag that holds the path."""
    if args.baseline_label is not None and args.baseline is None:
        raise ValueError(
            "`--baseline_label` names a baseline: pass `--baseline` with it. "
            f"Received: baseline_label={args.baseline_label!r}, baseline=None"
        )
    for flag in ("model", "baseline"):
        if getattr(args, flag) is not None:
            predict.resolve_model_path(getattr(args, flag), flag)


def _kept_baseline(args):
    """The baseline of the model's last report on the same archive, when no `--baseline` is
    given: the model it was compared with may be gone (an earlier shipped run), and a report
    written again must not lose it."""
    path = os.path.join(args.model, "out_of_domain.json")
    if args.baseline is not None or not os.path.exists(path):
        return None
    with open(path) as f:
        previous = json.load(f)
    if not previous.get("source", "").startswith(f"{PACKAGE} (sdist, sha256 {ARCHIVE_SHA256})"):
        return None
    return previous.get("baseline")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m apps.out_of_domain", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", default=os.path.join("saved_models", "imdb_sdpa"), help="a run folder"
    )
    parser.add_argument("--baseline", default=None, help="another run folder, measured beside")
    parser.add_argument(
        "--baseline_label", default=None, help="the baseline's name in the report (its path)"
    )
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="where the archive is kept")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        from ..serving import predict

        _check_args(args, predict)  # before any download
        kept = _kept_baseline(args)
        sets = read_sets(fetch(args.cache))
        report = {
            "source": f"{PACKAGE} (sdist, sha256 {ARCHIVE_SHA256}), {DATA_MEMBER}",
            "rule": "label 1 if the mean human rating > 0, 0 if < 0; rating 0 left out; "
            "never trained, tuned or chosen on",
            **_model_record(args.model),
            "sets": measure(args.model, sets),
        }
        if args.baseline:
            report["baseline"] = {
                **_model_record(args.baseline, args.baseline_label),
                "sets": measure(args.baseline, sets),
            }
        elif kept is not None:
            report["baseline"] = kept
            print(f"Kept the baseline measured before: {kept['model']} (`--baseline` replaces it)")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    path = os.path.join(args.model, "out_of_domain.json")
    files.write_json_atomic(path, report)
    print(model_card.out_of_domain_table(report))
    print(f"Wrote {path}")
    metrics_path = os.path.join(args.model, "metrics.json")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = json.load(f)
        card = os.path.join(args.model, "README.md")
        model_card.write_model_card(metrics, card)
        print(f"Wrote {card}")
    return 0
