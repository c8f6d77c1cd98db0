"""The model card: a run folder's README.md, written from its own `metrics.json`.

It also reads the folder's `serving.json` (`apps.serving.export.measure_serving`) and
`faithfulness.json` (`apps.faithfulness`), `out_of_domain.json` (`apps.out_of_domain`) and
`seeds.json` (`python -m apps.sweep NAME --card`), so every command that writes one of them
rewrites the card the same way.
"""

import json
import os

from ..classifier.buckets import LENGTH_BUCKETS
from ..files import write_text_atomic
from . import explain


def _calibration_section(metrics):
    calibrated = metrics.get("calibration")
    if not calibrated:
        return ""
    rows = "\n".join(
        f"| {when} | {figures['ece']:.4f} | {figures['log_loss']:.4f} | {figures['brier']:.4f} "
        f"| {figures['accuracy']:.2%} |"
        for when, figures in (
            ("trained (T = 1)", calibrated["test"]["before"]),
            (f"calibrated (T = {calibrated['temperature']:.3f})", calibrated["test"]["after"]),
        )
    )
    return f"""
## Calibration

`probability` is calibrated: a temperature `T`, fitted on the validation set after training
(Guo et al., 2017), divides the log-odds, folded into the output layer, so every signature
and `model.keras` give `sigmoid(z / T)`. The predicted labels do not change. On the test split
(ECE over {calibrated["bins"]} equal-width bins of confidence):

| model | ECE | log loss | Brier | accuracy |
|---|---|---|---|---|
{rows}

![reliability diagram](calibration.png)
"""


def _short_reviews_section(metrics):
    short = metrics.get("short_reviews")
    if not short or not short["buckets"]:
        return ""
    rows = "\n".join(
        f"| {b['bucket']} | {b['examples']:,} | {b['median_words']} | {b['accuracy']:.2%} |"
        for b in short["buckets"]
    )
    return f"""
## Short reviews

Spans cut from {short["reviews"]:,} reviews of the `{short["split"]}` split (seed
{short["seed"]}), each with its review's label: one sentence, two or three consecutive ones, four
to eight, and the whole review. A single sentence of a review often says little about its
verdict, so part of the gap is the task's.

| span | spans | median words | accuracy |
|---|---|---|---|
{rows}
"""


def _order(stage):
    """Where `stage` comes in a run ("data", "pretraining", "fine_tuning", "report")."""
    order = ("data", "pretraining", "self_training_labels", "fine_tuning", "report")
    return order.index(stage) if stage in order else len(order)


def command_minutes(stage_seconds):
    """A run's whole command in minutes: every stage of its `stage_seconds` that ran."""
    return sum(seconds for seconds in stage_seconds.values() if seconds is not None) / 60


def _training_sections(metrics):
    """The card's sections between its usage and its epochs, in order."""
    return (
        _pretraining_section(metrics)
        + _self_training_section(metrics)
        + _calibration_section(metrics)
        + _short_reviews_section(metrics)
    )


def _self_training_section(metrics):
    """The card's "Self-training" section, from `metrics.json` (empty without)."""
    record = metrics.get("self_training")
    if not record:
        return ""
    accuracy = record.get("teacher_test_accuracy")
    teacher = f" ({accuracy:.2%} on test)" if accuracy is not None else ""
    return f"""
## Self-training

A finished run with this run's validation set, `{record["teacher"]}`{teacher}, labelled
{record["labelled_by_teacher"]:,} unlabelled reviews (never a validation or test review); the
{record["reviews"]:,} it was surest of, half per class (its probability of its label at least
{record["lowest_confidence"]:.4f}), trained beside the labelled reviews with its labels.
"""


def _pretraining_section(metrics):
    """The card's "Pretraining" section and each stage's time, from `metrics.json`."""
    stages = metrics.get("stage_seconds")
    times = ""
    if stages:
        named = {
            "data": "data",
            "pretraining": "pretraining",
            "self_training_labels": "the teacher's labels",
            "fine_tuning": "fine-tuning",
            "report": "report and export",
        }
        times = (
            "Wall time per stage: "
            + ", ".join(
                f"{named.get(name, name)} {seconds / 60:.1f} min"
                for name, seconds in sorted(stages.items(), key=lambda item: _order(item[0]))
                if seconds is not None
            )
            + f" (total {command_minutes(stages):.1f} min).\n"
        )
    record = metrics.get("pretraining")
    if not record:
        return f"\n## Pretraining\n\nNone (`--pretrain_steps 0`).\n{times}" if stages else ""
    config = metrics["config"]
    reused = " (loaded from `pretrained/`, made by an earlier run with this configuration)"
    read = "the training reviews"
    if config.get("vocabulary_source") == "train+unsupervised":
        read += f" and {config['dataset']}'s unlabelled ones"
    return f"""
## Pretraining

Masked-word prediction (BERT's objective: {config["mask_rate"]:.0%} of each review's words
hidden, the {config["predicted_words"]:,} most frequent predicted through the tied word table) on
{record["reviews"]:,} reviews read without a label: {read}, never a validation or test review.
{record["steps"]:,} steps of {record["batch_size"]} reviews in {record["seconds"] / 60:.1f}
minutes{reused if record.get("reused") else ""}. Over the last steps, {record["accuracy"]:.1%} of
the hidden words were predicted right, at a loss of {record["loss"]:.3f} (Keras's mean over all
of a batch's slots for hidden words, the empty ones counted as 0). The classifier then
fine-tunes the pretrained embedding and blocks on the labels.
{times}"""


def _out_of_domain_section(folder):
    """The card's out-of-domain table, from the folder's `out_of_domain.json` (written by
    `python -m apps.out_of_domain`); empty without one."""
    path = os.path.join(folder, "out_of_domain.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        report = json.load(f)
    compared = ""
    if report.get("baseline"):
        compared = (
            f" Beside this model, `{report['baseline']['model']}` (seed "
            f"{report['baseline'].get('seed')}, `--pretrain_steps "
            f"{report['baseline'].get('pretrain_steps')}`, trained at commit "
            f"{str(report['baseline'].get('git_commit'))[:10]}), measured the same way."
        )
    return f"""## Short texts from outside IMDB

Texts that people rated one at a time, none of them a movie review: {report["source"]}. Rule:
{report["rule"]}.{compared} Accuracy, and the expected calibration error of the probability
(15 bins), as `serving_default` gives them from raw text (`out_of_domain.json`):

{out_of_domain_table(report)}

"""


def _short_commit(commit):
    """A recorded commit's first 10 digits, keeping its `+changes`; "not recorded" for None."""
    if commit is None:
        return "not recorded"
    return commit[:10] + ("+changes" if commit.endswith("+changes") else "")


def _seeds_section(folder):
    """The card's "Over seeds" table, from the folder's `seeds.json` (written by
    `python -m apps.sweep NAME --card FOLDER`); empty without one."""
    path = os.path.join(folder, "seeds.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        report = json.load(f)
    rows = "\n".join(
        f"| {row['seed']} | {row['validation_accuracy']:.2%} | {row['test_accuracy']:.2%} "
        f"| {row['minutes']:.1f} | {row['machine']} | {_short_commit(row.get('git_commit'))} |"
        for row in report["seeds"]
    )
    test, validation = report["test_accuracy"], report["validation_accuracy"]
    return f"""## Over seeds

This run's configuration trained again over {len(report["seeds"])} seeds
(`python -m apps.sweep {report["configuration"]}`, each seed's `metrics.json` in
`{report["files"]}/`; `seeds.json`): test **{test["mean"]:.2f} ± {test["std"]:.2f}%** (min
{test["min"]:.2f}%), validation {validation["mean"]:.2f} ± {validation["std"]:.2f}% (min
{validation["min"]:.2f}%), mean ± sample std; each seed's commit is the code it ran (`+changes`:
with uncommitted changes). Minutes are the whole command's (data, training, report and
export); they compare only on one CPU, and vary there with what else ran on it.

| seed | validation | test | minutes in all | CPU | commit |
|---|---|---|---|---|---|
{rows}

"""


def write_model_card(metrics, path):
    """A short README.md for the run's folder, written from `metrics.json`'s own numbers."""
    config = metrics["config"]
    flags = " ".join(
        f"--{name} {value}"
        for name, value in sorted(config.items())
        if name not in ("output", "data_dir", "resume", "verbose") and value is not None
    )
    history = "\n".join(
        f"| {row['epoch'] + 1} | {row['loss']:.4f} | {row['accuracy']:.4f} "
        f"| {row['val_loss']:.4f} | {row['val_accuracy']:.4f} |"
        for row in metrics["history"]
    )
    pairs = _ngram_inputs(config)
    pooled = (
        "each token's own embedding, weighed by the last block's output"
        if config.get("pooling_values") == "embedding"
        else "the last block's output"
    )
    trained_on = metrics.get("machine", "a machine metrics.json does not name")
    card = f"""# {config["dataset"]} sentiment classifier on keras-sdpa

Written by `python -m apps.train_sentiment`; every number below comes from this folder's
`metrics.json`, which the app wrote from what it measured.

- **Test accuracy: {metrics["test_accuracy"]:.2%}** on {metrics["test_examples"]:,} reviews of the
  TFDS `{config["dataset"]}` `{metrics["test_split"]}` split (loss {metrics["test_loss"]:.4f}), used
  for this report only.
- Validation accuracy {metrics["validation_accuracy"]:.2%} on {metrics["validation_examples"]:,}
  reviews carved out of `train` with seed {config["seed"]} (it chose the epoch; it reads higher than
  test because the same movies appear in both); trained on {metrics["train_examples"]:,} reviews.
- Training: {metrics["epochs_run"]} epochs ({metrics["train_steps"]} steps, best epoch
  {metrics["best_epoch"]}, early stopping: {metrics["stopped_early"]}) in
  {metrics["train_seconds"] / 60:.1f} minutes on {trained_on}.
- {metrics["parameters"]:,} parameters. TensorFlow {metrics["versions"]["tensorflow"]}, Keras
  {metrics["versions"]["keras"]}, TFDS {metrics["versions"]["tensorflow_datasets"]}.

## Model

`TextVectorization` (vocabulary {config["vocab_size"]:,}, length {config["sequence_length"]})
-> `Embedding(mask_zero=True)` + positions ({config["embed_dim"]} wide){pairs} ->
{config["num_layers"]} self-attention block(s) of `keras_sdpa.ScaledDotProductAttention`
({config["num_heads"]} heads of {config["key_dim"]}) -> attention pooling (a learned query, the
same layer with T = 1, summing {pooled}) -> `Dense(1, sigmoid)`.

## Use

    python -m apps.predict --model {os.path.relpath(os.path.dirname(path))} "A wonderful film."

or, with TensorFlow alone:

    import tensorflow as tf
    serve = tf.saved_model.load("saved_model").signatures["serving_default"]
    serve(text=tf.constant(["A wonderful film."]))["probability"]


{_training_sections(metrics)}
{_seeds_section(os.path.dirname(path))}{_out_of_domain_section(os.path.dirname(path))}{_serving_section(os.path.dirname(path))}
## Per epoch

| epoch | loss | accuracy | val_loss | val_accuracy |
|---|---|---|---|---|
{history}

## Reproduce

    python -m apps.train_sentiment {flags}

(add `--data_dir` for an existing TFDS folder).
{_faithfulness_section(os.path.dirname(path))}"""
    return write_text_atomic(path, card)


def _ngram_inputs(config):
    """The card's words on what each position adds to its word's embedding: the word pairs
    and triples, and the naive-Bayes ratios ("" for words alone)."""
    counted = "train"
    if config.get("vocabulary_source") == "train+unsupervised":
        counted = "train and the unlabelled reviews"
    pairs = ""
    if config.get("bigram_vocab_size"):
        pairs = (
            f" + the embedding of each word's pair with the word before it (the "
            f"{config['bigram_vocab_size']:,} most frequent pairs in {counted}, `bigrams.txt`)"
        )
    if config.get("trigram_vocab_size"):
        pairs += (
            f" + the embedding of the word triple ending at each word (the "
            f"{config['trigram_vocab_size']:,} most frequent in {counted}, `trigrams.txt`)"
        )
    if pairs and config.get("ngram_dim"):
        pairs += f" (n-gram tables {config['ngram_dim']} wide, one learned projection to the width)"
    if config.get("naive_bayes_alpha"):
        pairs += (
            " + a learned projection of their naive-Bayes log-count ratios (counted on the "
            f"training labels, smoothing {config['naive_bayes_alpha']:g})"
        )
    return pairs


_SIGNATURE_ROWS = "\n".join(
    [
        "| `serving_default` | `text`: `tf.string` `[None]`, raw reviews | `probability` (float32 "
        "`[None]`, P(positive)), `label` (int32 `[None]`, 0/1), `length` (int32 `[None]`, "
        "tokens read; 0 = no known word) |",
        "| `inspect` | the same | the same, plus `tokens` (string `[None, L]`), `attention` "
        "(float32 `[None, layers, N, L, L]`, the blocks' weights) and `pooling` (float32 "
        "`[None, N, L]`, what the classifier looked at) |",
    ]
)


def _serving_section(folder):
    """The card's "Serving" section: the signatures, the rates in `serving.json` (measured by
    the app that exported the model), and a TF Serving command line."""
    measured = ""
    report = os.path.join(folder, "serving.json")
    if os.path.isfile(report):
        with open(report) as f:
            serving = json.load(f)
        measured = (
            f"Measured when it was exported, on {serving['machine']}: "
            f"**{serving['reviews_per_second']:,.0f} reviews/s** through `serving_default` at "
            f"batch {serving['batch_size']} ({serving['reviews']:,} test reviews in the split's "
            f"order, after one pass that compiles), and {serving['batch_1_p50_ms']:.1f} ms p50 "
            f"/ {serving['batch_1_p99_ms']:.1f} ms p99 for one review a call (`serving.json`).\n"
        )
    return f"""## Serving

| signature | input | outputs |
|---|---|---|
{_SIGNATURE_ROWS}

`serving_default` computes each review at the shortest of {", ".join(map(str, LENGTH_BUCKETS))}
positions that holds it, in one call (the masks make this the full-length result); `inspect`
computes every review at `L` and returns every weight: use it to look, not to serve.
{measured}
With TensorFlow Serving (its XLA JIT is experimental and off by default; the attention needs it):

    docker run -p 8501:8501 -v "$PWD/saved_model:/models/sentiment/1" -e MODEL_NAME=sentiment \\
        tensorflow/serving --xla_cpu_compilation_enabled=true
    curl -d '{{"instances": ["A wonderful film."]}}' localhost:8501/v1/models/sentiment:predict

"""


def _faithfulness_section(folder):
    """The card's "Does the attention explain the prediction?" section, from the folder's
    `faithfulness.json` (written by `python -m apps.faithfulness`); empty without one."""
    report = os.path.join(folder, "faithfulness.json")
    if not os.path.isfile(report):
        return ""
    with open(report) as f:
        payload = json.load(f)
    source = payload.get("source", {})
    return f"""
## Does the attention explain the prediction?

ERASER's deletion tests (`python -m apps.faithfulness`: {payload["reviews"]} reviews of the
{source.get("split", "test")} split, seed {source.get("seed", 0)}; `faithfulness.json`,
`faithfulness.png`). Each ranking orders a review's tokens; deleting a token removes it from
the sequence the model sees, as if the word were not in the text.

{explain.markdown_table(payload)}
![faithfulness](faithfulness.png)
"""


def out_of_domain_table(report):
    """The markdown table of `report` (`out_of_domain.json`, written by
    `python -m apps.out_of_domain`): one row per set."""
    baseline = report.get("baseline")
    if baseline:
        before = f"pretrain_steps {baseline.get('pretrain_steps', '?')}"
        after = f"pretrain_steps {report.get('pretrain_steps', '?')}"
        head = (
            f"| set | texts (positive) | accuracy, {before} | accuracy, {after} "
            f"| ECE, {before} | ECE, {after} |\n|---|---|---|---|---|---|"
        )
    else:
        head = "| set | texts (positive) | accuracy | ECE |\n|---|---|---|---|"
    rows = []
    for name, result in report["sets"].items():
        row = f"| {name} | {result['texts']:,} ({result['positive']:,}) |"
        if baseline:
            old = baseline["sets"][name]
            row += f" {old['accuracy']:.2%} | {result['accuracy']:.2%} |"
            row += f" {old['ece']:.3f} | {result['ece']:.3f} |"
        else:
            row += f" {result['accuracy']:.2%} | {result['ece']:.3f} |"
        rows.append(row)
    return "\n".join([head, *rows])
