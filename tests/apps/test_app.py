"""End-to-end tests of the training app and the plain-TensorFlow predictor, on real IMDB."""

import collections
import json
import os
import re
import shlex
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import TINY_RUN, interrupt_at_step, keras_model_of_run

from apps.classifier import data
from apps.classifier import embedding as embedding_lib
from apps.classifier import model as model_lib
from apps.classifier import optimizer as optimizer_lib
from apps.classifier import pooling as pooling_lib
from apps.serving import compiled, predict
from apps.training import batches as train_batches
from apps.training import build as train_build
from apps.training import fit as train_fit
from apps.training import prepare as train_prepare
from apps.training import train as train_sentiment
from keras_sdpa import ScaledDotProductAttention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    b"A wonderful, moving film with a brilliant cast.",
    b"Dull, predictable and far too long. I want my two hours back.",
]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def run(tiny_run):
    """`(output folder, metrics)` of the session's tiny run, trained once for every module."""
    return tiny_run


@pytest.fixture(scope="module")
def trained(tiny_run):
    """The in-memory Keras model and vectorizer, rebuilt from the run's own files."""
    return keras_model_of_run(*tiny_run)


# What a run must leave, named here rather than read from the app's own list.
EXPECTED_ARTIFACTS = {
    "attention_heatmaps.png",
    "attention.html",
    "attention.jsonl",
    "bigrams.txt",
    "trigrams.txt",
    "history.csv",
    "model.keras",
    "metrics.json",
    "README.md",
    "saved_model",
    "logs",
    "training_curves.png",
    "vocabulary.txt",
    "faithfulness.json",
    "faithfulness.md",
    "faithfulness.png",
    "serving.json",
    "calibration.png",
    "pretrained/encoder.npz",
}


def test_run_writes_every_artifact(run):
    output, metrics = run
    for name in EXPECTED_ARTIFACTS:
        assert os.path.exists(os.path.join(output, name)), name
    assert os.path.exists(os.path.join(output, "saved_model", "saved_model.pb"))
    assert set(metrics["artifacts"].values()) == EXPECTED_ARTIFACTS
    assert not os.path.exists(os.path.join(output, "checkpoints"))  # finished runs clean up
    assert metrics["epochs_run"] == 2 and len(metrics["history"]) == 2
    # The optimizer's count in the best epoch's restored state: 6 steps an epoch.
    assert metrics["train_steps"] == 6 * metrics["best_epoch"]
    assert metrics["test_examples"] == 6 * 32
    assert metrics["validation_examples"] == 6 * 32
    assert metrics["train_examples"] == 22500  # 25,000 minus the 10% validation carve-out
    assert metrics["config"]["num_heads"] == 2
    assert set(metrics["versions"]) == {"python", "tensorflow", "keras", "tensorflow_datasets"}
    assert metrics["train_seconds"] > 0
    assert metrics["command"] == shlex.join(
        ["python", "-m", "apps.train_sentiment", *TINY_RUN, "--output", output]
    )
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert metrics["git_commit"].split("+")[0] == head.stdout.strip()
    else:
        assert metrics["git_commit"] is None


def test_model_is_built_on_our_layer(trained):
    model, _ = trained
    layers = [layer for layer in _walk(model) if isinstance(layer, ScaledDotProductAttention)]
    assert len(layers) == 2  # the block's self-attention and the pooling
    assert not [
        layer for layer in _walk(model) if isinstance(layer, keras.layers.MultiHeadAttention)
    ]


def _walk(layer):
    yield layer
    for child in getattr(layer, "_layers", []):
        yield from _walk(child)


@pytest.fixture(scope="module")
def splits(tiny_run):
    return data.load_splits(seed=tiny_run[1]["config"]["seed"])


def test_metrics_are_what_the_model_measures(run, trained, splits):
    """metrics.json's test accuracy is reproduced by evaluating the saved model anew."""
    output, metrics = run
    model, vectorizer = trained
    count = metrics["test_examples"]
    ids = data.vectorize(vectorizer, splits.test_text[:count])
    probability = model.predict(ids, batch_size=64, verbose=0)[:, 0]
    accuracy = np.mean((probability >= 0.5) == splits.test_label[:count])
    np.testing.assert_allclose(accuracy, metrics["test_accuracy"], atol=1e-6)
    history = metrics["history"]
    with open(os.path.join(output, "history.csv")) as f:
        assert len(f.readlines()) == 1 + len(history)
    # The machine that trained, named by its CPU where /proc/cpuinfo names it, and the card
    # quotes it (not the machine that writes the card).
    with open("/proc/cpuinfo") as f:
        cpu = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    cpu = {key.strip(): value.strip() for key, value in cpu.items()}
    name = cpu.get("model name")
    if name and "cpu family" in cpu:  # x86: its family and model numbers too
        name += f" (family {cpu['cpu family']}, model {cpu['model']})"
    where = f"{os.cpu_count()} logical CPUs"
    assert metrics["machine"] == (f"{name}, {where}" if name else where)
    with open(os.path.join(output, "README.md")) as f:
        assert f"minutes on {metrics['machine']}." in " ".join(f.read().split())


def test_probabilities_are_calibrated_on_validation_as_reported(run, splits):
    """The SavedModel's probabilities. On the run's validation reviews, Keras's cross-entropy
    is stationary at the temperature folded in (it was fitted there, never on test); on its
    test reviews, ECE, log loss and Brier computed here are metrics.json's, after and before."""
    from test_calibration import reference_ece, slope_in_log_temperature

    output, metrics = run
    calibrated = metrics["calibration"]
    assert calibrated["fitted_on"] == "validation" and calibrated["bins"] == 15
    # Before the temperature, the validation loss is Keras's at the kept epoch.
    best = max(metrics["history"], key=lambda row: row["val_accuracy"])
    np.testing.assert_allclose(
        calibrated["validation"]["before"]["log_loss"], best["val_loss"], rtol=1e-5
    )
    serve = tf.saved_model.load(os.path.join(output, "saved_model")).signatures["serving_default"]

    def log_odds(texts):
        p = serve(text=tf.constant(texts))["probability"].numpy().astype("float64")
        return np.log(p) - np.log1p(-p)

    count = metrics["validation_examples"]
    z = log_odds(splits.validation_text[:count])
    assert abs(slope_in_log_temperature(z, splits.validation_label[:count], 1.0)) < 1e-5
    count = metrics["test_examples"]
    z, labels = log_odds(splits.test_text[:count]), splits.test_label[:count]
    for when, scale in (("after", 1.0), ("before", calibrated["temperature"])):
        figures = calibrated["test"][when]
        p = 1 / (1 + np.exp(-scale * z))
        assert figures["examples"] == count
        np.testing.assert_allclose(figures["ece"], reference_ece(p, labels, 15), atol=1e-5)
        log_loss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
        np.testing.assert_allclose(figures["log_loss"], log_loss, rtol=1e-5)
        np.testing.assert_allclose(figures["brier"], np.mean((p - labels) ** 2), rtol=1e-5)
    assert calibrated["test"]["after"]["accuracy"] == pytest.approx(metrics["test_accuracy"])
    with open(os.path.join(output, "README.md")) as f:
        card = f.read()
    assert f"| {calibrated['test']['after']['ece']:.4f} |" in card
    assert "![reliability diagram](calibration.png)" in card
    for bucket in metrics["short_reviews"]["buckets"]:
        assert f"| {bucket['bucket']} | {bucket['examples']:,} |" in card


@pytest.mark.large  # counts every pair (triple) of the 25,000 training reviews again
def test_bigrams_are_the_most_frequent_pairs_in_train(run, trained):
    output, metrics = run
    model, vectorizer = trained
    pairs = model.get_layer("embedding").get_bigrams()
    words = vectorizer.get_vocabulary()
    with open(os.path.join(output, "bigrams.txt"), encoding="utf-8") as f:
        assert f.read().splitlines() == [f"{words[a]} {words[b]}" for a, b in pairs]
    # Counted independently with NumPy over the run's training ids.
    splits = data.load_splits(seed=metrics["config"]["seed"])
    ids = data.vectorize(vectorizer, splits.train_text).astype("int64")
    previous, current = ids[:, :-1].ravel(), ids[:, 1:].ravel()
    real = (previous > 0) & (current > 0)
    keys, counts = np.unique(previous[real] * len(words) + current[real], return_counts=True)
    count = dict(zip(keys.tolist(), counts.tolist()))
    kept = [count[a * len(words) + b] for a, b in pairs]
    assert len(pairs) == metrics["config"]["bigram_vocab_size"] < len(keys)
    assert kept == sorted(kept, reverse=True)  # most frequent first
    left_out = np.setdiff1d(keys, [a * len(words) + b for a, b in pairs])
    assert max(count[k] for k in left_out.tolist()) <= kept[-1]


@pytest.mark.large  # counts every pair (triple) of the 25,000 training reviews again
def test_trigrams_are_the_most_frequent_triples_in_train(run, trained):
    output, metrics = run
    model, vectorizer = trained
    triples = model.get_layer("embedding").get_trigrams()
    words = vectorizer.get_vocabulary()
    with open(os.path.join(output, "trigrams.txt"), encoding="utf-8") as f:
        assert f.read().splitlines() == [" ".join(words[i] for i in t) for t in triples]
    # Counted independently with NumPy over the run's training ids.
    splits = data.load_splits(seed=metrics["config"]["seed"])
    ids = data.vectorize(vectorizer, splits.train_text).astype("int64")
    a, b, c = ids[:, :-2].ravel(), ids[:, 1:-1].ravel(), ids[:, 2:].ravel()
    real = (a > 0) & (b > 0) & (c > 0)
    v = len(words)
    keys, counts = np.unique((a[real] * v + b[real]) * v + c[real], return_counts=True)
    count = dict(zip(keys.tolist(), counts.tolist()))
    chosen = [(x * v + y) * v + z for x, y, z in triples]
    kept = [count[k] for k in chosen]
    assert len(triples) == metrics["config"]["trigram_vocab_size"] < len(keys)
    assert kept == sorted(kept, reverse=True)  # most frequent first
    left_out = np.setdiff1d(keys, chosen)
    assert max(count[k] for k in left_out.tolist()) <= kept[-1]


@pytest.mark.large  # reads the 25,000 training reviews three times (the tiny run reads them too)
def test_validation_is_a_fixed_seed_carve_out_of_train():
    first = data.load_splits(seed=3)
    again = data.load_splits(seed=3)
    other = data.load_splits(seed=4)
    np.testing.assert_array_equal(first.validation_text, again.validation_text)
    assert not np.array_equal(first.validation_text, other.validation_text)
    assert len(first.validation_text) == 2500 and len(first.train_text) == 22500
    # Both seeds split the same 25,000 reviews (IMDB's train holds some duplicate texts,
    # so compare multisets, not sets).
    assert collections.Counter(first.train_text) + collections.Counter(first.validation_text) == (
        collections.Counter(other.train_text) + collections.Counter(other.validation_text)
    )
    assert first.test_split == "test"


def test_bigram_keys_pair_each_word_with_the_one_before():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, size=(4, 9))
    ids[0, 5:] = 0  # padding at the end, as TextVectorization pads
    ids[1, :] = 0
    keys = embedding_lib.bigram_keys(ids, 50).numpy()
    expected = np.zeros_like(keys)
    for b, row in enumerate(ids):
        for t in range(1, len(row)):
            if row[t - 1] and row[t]:
                expected[b, t] = row[t - 1] * 50 + row[t]
    np.testing.assert_array_equal(keys, expected)
    assert keys.dtype == np.int64


def test_bigram_embedding_keeps_the_most_frequent_pairs_through_save_and_load(tmp_path):
    # Pair counts: (3, 4) four times, (4, 5) three times, (2, 3) twice; the rest once.
    ids = np.array(
        [[3, 4, 5, 0, 0], [3, 4, 5, 0, 0], [3, 4, 5, 6, 0], [2, 3, 4, 0, 0], [2, 3, 7, 8, 9]]
    )
    model, _ = model_lib.build_classifier(
        vocab_size=10, sequence_length=5, embed_dim=8, key_dim=4, ff_dim=8, bigram_vocab_size=3
    )
    embedding = model.get_layer("embedding")
    embedding.adapt_bigrams(ids)
    assert embedding.get_bigrams() == [(3, 4), (4, 5), (2, 3)]
    looked_up = embedding.bigram_lookup(embedding_lib.bigram_keys(ids[3:4], 10)).numpy()
    np.testing.assert_array_equal(looked_up, [[0, 4, 2, 0, 0]])  # 0: no pair, (3, 4) is 2
    # Rarer pairs share the out-of-vocabulary vector (index 1).
    np.testing.assert_array_equal(
        embedding.bigram_lookup(embedding_lib.bigram_keys(ids[4:5], 10)).numpy(), [[0, 4, 1, 1, 1]]
    )
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("embedding").get_bigrams() == embedding.get_bigrams()
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0))
    # The pair embedding reaches the output: zeroing it changes the prediction.
    table = embedding.bigram_embedding.embeddings
    table.assign(np.zeros(table.shape, "float32"))
    assert np.abs(model.predict(ids, verbose=0) - loaded.predict(ids, verbose=0)).max() > 1e-4


def test_trigram_keys_join_each_word_with_the_two_before():
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 50, size=(4, 9))
    ids[0, 5:] = 0
    ids[1, :] = 0
    ids[2, 3] = 0  # a gap: no triple may span it
    keys = embedding_lib.trigram_keys(ids, 50).numpy()
    expected = np.zeros_like(keys)
    for b, row in enumerate(ids):
        for t in range(2, len(row)):
            if row[t - 2] and row[t - 1] and row[t]:
                expected[b, t] = (row[t - 2] * 50 + row[t - 1]) * 50 + row[t]
    np.testing.assert_array_equal(keys, expected)
    assert keys.dtype == np.int64


def test_trigram_embedding_keeps_the_most_frequent_triples_through_save_and_load(
    tmp_path, monkeypatch
):
    # Triple counts: (3, 4, 5) three times, (2, 3, 4) twice; the rest once.
    ids = np.array(
        [[3, 4, 5, 0, 0], [3, 4, 5, 0, 0], [3, 4, 5, 6, 0], [2, 3, 4, 0, 0], [2, 3, 4, 8, 9]]
    )
    model, _ = model_lib.build_classifier(
        vocab_size=10,
        sequence_length=5,
        embed_dim=8,
        key_dim=4,
        ff_dim=8,
        bigram_vocab_size=2,
        trigram_vocab_size=2,
    )
    embedding = model.get_layer("embedding")
    embedding.adapt_bigrams(ids)
    embedding.adapt_trigrams(ids)
    assert embedding.get_trigrams() == [(3, 4, 5), (2, 3, 4)]
    looked_up = embedding.trigram_lookup(embedding_lib.trigram_keys(ids[4:5], 10)).numpy()
    np.testing.assert_array_equal(looked_up, [[0, 0, 3, 1, 1]])  # (2, 3, 4) is 3; rarer: 1
    # Keras's saving walks every list it finds among a layer's attributes: the n-gram
    # vocabularies (400,000 entries in the app's default model) must not be among them.
    from keras.src.saving import saving_lib  # private: a spy on what its saving walks

    walked = []
    walk = saving_lib._save_container_state

    def spy(container, *args, **kwargs):
        walked.append(list(container.values() if isinstance(container, dict) else container))
        return walk(container, *args, **kwargs)

    monkeypatch.setattr(saving_lib, "_save_container_state", spy)
    path = str(tmp_path / "model.keras")
    model.save(path)
    monkeypatch.undo()
    assert walked and embedding.get_trigrams() not in walked
    assert embedding.get_bigrams() not in walked
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("embedding").get_trigrams() == embedding.get_trigrams()
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0))
    table = embedding.trigram_embedding.embeddings
    table.assign(np.zeros(table.shape, "float32"))
    assert np.abs(model.predict(ids, verbose=0) - loaded.predict(ids, verbose=0)).max() > 1e-4


@pytest.mark.default_cases("48")
@pytest.mark.parametrize("length", [48, 256])
def test_compiled_classifier_in_steps_matches_the_model(length):
    """The serving head loops over rows in steps of `step_rows(L)` once a batch needs more
    than one: every row must be what the Keras model gives it, for batches of no rows, one
    row, one step, one row past a step, and several steps with a ragged end."""
    model, _ = model_lib.build_classifier(
        vocab_size=50, sequence_length=length, embed_dim=16, key_dim=8, ff_dim=16, seed=3
    )
    classify = compiled.compiled_classifier(model)
    step = int(compiled.step_rows(length))
    assert step == {48: 32, 256: 8}[length]
    rng = np.random.default_rng(0)
    sizes = (0, 1, step, step + 1, 3 * step + 2)
    starts = np.cumsum((0, *sizes))[:-1]
    ids = rng.integers(1, 50, size=(sum(sizes), length)).astype("int32")
    for row in range(len(ids)):  # a length of its own each; a batch's first row has no token
        ids[row, 0 if row in starts else rng.integers(1, length + 1) :] = 0
    # The reference: the Keras model on every row at once (one batch size, one trace).
    expected = model.predict(ids, batch_size=len(ids), verbose=0).reshape(-1)
    for rows, start in zip(sizes, starts):
        got = classify(tf.constant(ids[start : start + rows])).numpy()
        np.testing.assert_allclose(
            got, expected[start : start + rows], atol=2e-6, rtol=0, err_msg=f"rows={rows}"
        )


def test_standardize_handles_markup_and_bad_bytes():
    out = data.standardize(
        tf.constant([b"Great<br />FILM!! don't", b"bad \xff\xfe bytes \xf0\x9f\x98\x80"])
    )
    first, second = out.numpy()
    assert first.split() == [b"great", b"film", b"don't"]
    assert second.split() == [b"bad", b"bytes"]


@pytest.mark.large  # a process of its own; the predictor's tests below serve the same way
def test_saved_model_serves_raw_strings_without_keras_sdpa(run, trained):
    """A fresh process loads the SavedModel with plain TensorFlow and matches the Keras model."""
    output, _ = run
    model, vectorizer = trained
    script = f"""
import json, sys
import tensorflow as tf
loaded = tf.saved_model.load({os.path.join(output, "saved_model")!r})
texts = tf.constant({TEXTS!r} + [b"", b"\\xff\\xfe not utf-8 \\xf0\\x9f\\x98\\x80"])
served = loaded.signatures["serving_default"](text=texts)
out = loaded.signatures["inspect"](text=texts)
assert "keras_sdpa" not in sys.modules and "apps" not in sys.modules
numbers = {{k: v.numpy().tolist() for k, v in out.items() if v.dtype != tf.string}}
numbers["served"] = {{k: v.numpy().tolist() for k, v in served.items()}}
print(json.dumps(numbers))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.strip().splitlines()[-1])
    ids = vectorizer(tf.constant(TEXTS)).numpy()
    expected = model.predict(ids, verbose=0)[:, 0]
    np.testing.assert_allclose(served["probability"][:2], expected, atol=1e-5)
    assert served["label"][:2] == [int(p >= 0.5) for p in expected]
    np.testing.assert_array_equal(served["length"][:2], (ids != 0).sum(-1))
    assert served["length"][2] == 0 and 0.0 <= served["probability"][2] <= 1.0
    # serving_default: the same answer, and nothing per token.
    assert set(served["served"]) == {"probability", "label", "length"}
    np.testing.assert_allclose(served["served"]["probability"], served["probability"], atol=1e-6)
    assert served["served"]["label"] == served["label"]
    pooling = np.asarray(served["pooling"])  # (B, N, L)
    lengths = np.asarray(served["length"])
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(pooling[i, :, :n].sum(-1), 1.0 if n else 0.0, atol=1e-5)
        np.testing.assert_array_equal(pooling[i, :, n:], 0.0)  # never on padding


def test_attention_export_matches_the_model(run, trained):
    output, metrics = run
    model, vectorizer = trained
    with open(os.path.join(output, "attention.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 6
    splits = data.load_splits(seed=metrics["config"]["seed"])
    serve = tf.saved_model.load(os.path.join(output, "saved_model")).signatures["inspect"]
    for record in records:
        text = splits.test_text[record["index"]]
        assert record["text"] == text.decode("utf-8")
        assert record["label"] == int(splits.test_label[record["index"]])
        out = serve(text=tf.constant([text]))
        n = int(out["length"][0])
        assert len(record["tokens"]) == n and "" not in record["tokens"]
        np.testing.assert_allclose(record["pooling"], out["pooling"][0, :, :n], atol=1e-4)
        np.testing.assert_allclose(
            record["attention"], out["attention"][0, :, :, :n, :n], atol=1e-4
        )
        np.testing.assert_allclose(np.sum(record["attention"], -1), 1.0, atol=1e-3)
        # The exported prediction is the SavedModel's, not a number the app reported.
        np.testing.assert_allclose(record["probability"], out["probability"][0], atol=1e-5)
        assert record["prediction"] == int(out["label"][0])
        # The viewer's deletion test, redone on text: the SavedModel on the review's words
        # without its 5 most attended (an out-of-vocabulary word for each [UNK]).
        words = ["qqxqzv" if t == "[UNK]" else t for t in record["tokens"]]
        attended = np.mean(record["pooling"], axis=0)
        top = set(np.argsort(-attended, kind="stable")[:5].tolist())
        rest = " ".join(w for i, w in enumerate(words) if i not in top)
        deletion = record["deletion"]
        assert deletion["k"] == min(5, n)
        np.testing.assert_allclose(
            deletion["without_top_attention"],
            serve(text=tf.constant([rest]))["probability"][0],
            atol=1e-5,
        )
        assert len(record["gradient_x_input"]) == n
    with open(os.path.join(output, "attention.html"), encoding="utf-8") as f:
        page = f.read()
    assert "http://" not in page and "https://" not in page  # nothing fetched
    embedded = json.loads(page.split('type="application/json">')[1].split("</script>")[0])
    assert [e["tokens"] for e in embedded["examples"]] == [r["tokens"] for r in records]
    assert [e["gradient"] for e in embedded["examples"]] == [r["gradient_x_input"] for r in records]
    # The run's quick deletion tests: on the reviews asked for, and in the model card.
    with open(os.path.join(output, "faithfulness.json")) as f:
        payload = json.load(f)
    assert payload["reviews"] + payload["skipped_empty"] == 24
    assert metrics["faithfulness"]["reviews"] == payload["reviews"]
    with open(os.path.join(output, "README.md"), encoding="utf-8") as f:
        assert "## Does the attention explain the prediction?" in f.read()


def _predict(args, stdin=None, env=None):
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from apps import predict; code = predict.main(sys.argv[1:]); "
            "assert 'keras_sdpa' not in sys.modules, 'predict imported keras_sdpa'; sys.exit(code)",
            *args,
        ],
        input=stdin,
        capture_output=True,
        timeout=300,
        env=env or _env(),
        cwd=ROOT,
    )


def test_predict_cli_answers_every_input(run):
    output, _ = run
    megabyte = b"a truly great film " * 60000  # 1.1 MB on one line
    lines = [
        TEXTS[0],
        b"",
        b"\xff\xfe not utf-8",
        "so good \U0001f600\U0001f44d".encode(),
        megabyte,
    ]
    result = _predict(["--model", output, "--json", "--explain"], stdin=b"\n".join(lines) + b"\n")
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    answers = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert len(answers) == len(lines)
    for answer in answers:
        assert answer["label"] in ("positive", "negative") and 0 <= answer["probability"] <= 1
    assert answers[1]["tokens"] == 0 and "note" in answers[1]
    assert answers[2]["text"].startswith("\ufffd")
    assert answers[4]["tokens"] == 96  # truncated to sequence_length, not a crash
    serve = tf.saved_model.load(os.path.join(output, "saved_model")).signatures["serving_default"]
    expected = float(serve(text=tf.constant([TEXTS[0]]))["probability"][0])
    np.testing.assert_allclose(answers[0]["probability"], expected, atol=1e-5)
    top = [t["token"] for t in answers[0]["top_tokens"]]
    assert top and set(top) <= set(data.standardize(TEXTS[0]).numpy().decode().split() + ["[UNK]"])


def test_predict_cli_text_arguments_and_errors(run, capsys, tmp_path):
    output, _ = run
    # A quiet terminal: answers on stdout and nothing on stderr, with an empty XLA cache of
    # its own, then with the programs the first run left in it.
    env = {**_env(), "TF_XLA_FLAGS": ""}  # not the session's cache
    args = ["--model", output, "--xla_cache", str(tmp_path / "xla"), *(t.decode() for t in TEXTS)]
    for attempt in ("empty cache", "programs cached"):
        result = _predict(args, env=env)
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert result.stderr == b"", (attempt, result.stderr.decode()[-3000:])
        assert len(result.stdout.decode().splitlines()) == 2
        assert list(tmp_path.glob("xla/tensorflow-*-cpu-*/*.pb")), "no program was cached"
    # The refusals come before the model loads: in this process (a process each took 7 s).
    capsys.readouterr()
    assert predict.main(["--model", os.path.join(output, "nope"), "text"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "nope" in err
    with pytest.raises(ValueError, match="model="):
        predict.resolve_model_path(os.path.join(output, "nope"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "saved_model.pb").write_bytes(b"not a SavedModel")
    assert predict.main(["--model", str(corrupt), "text"]) == 2
    err = capsys.readouterr().err
    assert "could not be loaded as a SavedModel" in err and str(corrupt) in err
    for flags, message in (
        (["--top_k", "-1"], "top_k=-1"),
        (["--max_bytes", "0"], "max_bytes=0"),
        (["--batch_size", "0"], "batch_size=0"),
        (["--workers", "0"], "workers=0"),
        (["--input", "/no/such/file"], "input='/no/such/file'"),
        (["--input", "/dev/null", "text"], "not both"),
    ):
        code = predict.main(["--model", output, *flags] + ([] if "--input" in flags else ["text"]))
        err = capsys.readouterr().err
        assert code == 2 and message in err, (flags, err[-500:])


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--num_heads", "0"], "num_heads=0"),
        (["--dropout", "1.5"], "dropout=1.5"),
        (["--learning_rate", "-1"], "learning_rate=-1"),
        (["--batch_size", "many"], "invalid int value: 'many'"),
        (["--max_steps", "0"], "max_steps=0"),
        (["--vocab_size", "2"], "vocab_size=2"),
        (["--inspect_examples", "-1"], "inspect_examples=-1"),
        (["--bigram_vocab_size", "-5"], "bigram_vocab_size=-5"),
        (["--naive_bayes_alpha", "-1"], "naive_bayes_alpha=-1.0"),
        (["--naive_bayes_folds", "0"], "naive_bayes_folds=0"),
        (["--mixed_precision", "float8"], "mixed_precision='float8'"),
        (["--pooling_scale", "0"], "pooling_scale=0.0"),
        (["--pooling_values", "sum"], "pooling_values='sum'"),
        (["--ngram_dim", "0"], "ngram_dim=0"),
        (["--short_spans", "1.5"], "short_spans=1.5"),
        (["--pretrain_steps", "-1"], "pretrain_steps=-1"),
        (["--mask_rate", "1.5"], "mask_rate=1.5"),
        (["--predicted_words", "2"], "predicted_words=2"),
        (
            ["--pretrain_steps", "1500", "--predicted_words", "40000"],
            "predicted_words=40000, vocab_size=30000",
        ),
        (["--pretrain_batch_size", "0"], "pretrain_batch_size=0"),
        (["--pretrain_learning_rate", "0"], "pretrain_learning_rate=0.0"),
        (["--word_dropout", "1"], "word_dropout=1.0"),
    ],
    ids=[
        "heads",
        "dropout",
        "lr",
        "batch",
        "max_steps",
        "vocab",
        "inspect",
        "bigrams",
        "nb_alpha",
        "nb_folds",
        "mixed_precision",
        "pooling_scale",
        "pooling_values",
        "ngram_dim",
        "short_spans",
        "pretrain_steps",
        "mask_rate",
        "predicted_words",
        "predicted_words_vocab",
        "pretrain_batch",
        "pretrain_lr",
        "word_dropout",
    ],
)
def test_train_rejects_bad_flags_with_argparse_errors(flags, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_sentiment.main([*flags, "--output", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "usage:" in err


def test_unknown_dataset_is_a_clear_error(tmp_path, capsys):
    code = train_sentiment.main(["--dataset", "no_such_dataset", "--output", str(tmp_path / "x")])
    assert code == 2
    assert "dataset='no_such_dataset'" in capsys.readouterr().err


def test_no_data_and_no_network_says_where_tfds_looked(tmp_path, monkeypatch, capsys):
    """An empty data_dir and a failing download: one actionable message, exit 2, no traceback.

    The download is made to fail the way it does without network (a ConnectionError from
    inside TFDS), instead of waiting out TFDS's retries against a dead address.
    """
    import tensorflow_datasets as tfds

    def no_network(self, *args, **kwargs):
        raise ConnectionError("Failed to establish a new connection: [Errno 101] unreachable")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_network)
    empty = tmp_path / "tfds"
    empty.mkdir()
    code = train_sentiment.main(["--data_dir", str(empty), "--output", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "--data_dir" in err and "ConnectionError" in err
    assert "Traceback" not in err


@pytest.mark.large  # two app processes, one interrupted
def test_interrupt_then_resume_loses_nothing(run, tmp_path, capsys):
    """SIGINT mid-epoch, then --resume: the same final weights as the uninterrupted run."""
    output = str(tmp_path / "imdb")
    # The same training as `run`; the attention export and deletion tests are `run`'s to check.
    tail = ["--inspect_examples", "0", "--faithfulness_examples", "0"]
    command = [sys.executable, "-m", "apps.train_sentiment", *TINY_RUN, *tail, "--output", output]
    state = os.path.join(output, "checkpoints", "state.json")
    stderr = interrupt_at_step(command, state, _env(), ROOT)
    assert b"--resume" in stderr
    with open(state) as f:
        interrupted_at = json.load(f)["step"]
    assert 2 <= interrupted_at < 12

    # Without --resume the app refuses to overwrite the interrupted run (in this process: it
    # refuses before it reads any data).
    capsys.readouterr()
    assert train_sentiment.main([*TINY_RUN, *tail, "--output", output]) == 2
    assert "--resume" in capsys.readouterr().err

    resumed = subprocess.run(
        [*command, "--resume"], capture_output=True, env=_env(), cwd=ROOT, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert f"step {interrupted_at}".encode() in resumed.stdout
    with open(os.path.join(output, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["train_steps"] == 6 * metrics["best_epoch"] and metrics["epochs_run"] == 2
    assert metrics["best_epoch"] == run[1]["best_epoch"]
    uninterrupted = keras.saving.load_model(os.path.join(run[0], "model.keras"))
    continued = keras.saving.load_model(os.path.join(output, "model.keras"))
    # The resumed run read its word pairs back from bigrams.txt, in the same order.
    pairs = uninterrupted.get_layer("embedding").get_bigrams()
    assert len(pairs) == 20000 and continued.get_layer("embedding").get_bigrams() == pairs
    triples = uninterrupted.get_layer("embedding").get_trigrams()
    assert len(triples) == 5000 and continued.get_layer("embedding").get_trigrams() == triples
    for a, b in zip(uninterrupted.get_weights(), continued.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(
        [row["val_loss"] for row in metrics["history"]],
        [row["val_loss"] for row in run[1]["history"]],
        atol=1e-5,
    )


def _synthetic_ids(lengths, width):
    """Token ids `(n, width)` whose row i holds the token i + 1, `lengths[i]` times, then padding:
    a batch's rows name the examples they came from."""
    ids = np.zeros((len(lengths), width), "int32")
    for i, length in enumerate(lengths):
        ids[i, :length] = i + 1
    return ids


def _stream_batches(ids, labels, batch_size, seed, steps, start_step=0):
    stream = train_batches.training_stream(ids, labels, batch_size, seed, start_step)
    return [(x.numpy(), y.numpy()) for x, y in stream.take(steps)]


def test_training_batches_are_cut_to_their_length_bucket():
    """Each pass is the examples once each (less the remainder), in batches of similar length,
    each cut to the first length bucket that holds its longest review, reshuffled every pass."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(175), 0.7, size=1000).astype(int) + 1, 600)
    ids = _synthetic_ids(lengths, 512)
    labels = rng.integers(0, 2, size=1000)
    batch_size, per_pass = 32, 1000 // 32
    batches = _stream_batches(ids, labels, batch_size, seed=3, steps=2 * per_pass)
    sizes = (64, 96, 128, 192, 256, 384, 512)
    padded = 0
    passes = []
    for p in range(2):
        seen = []
        for x, y in batches[p * per_pass : (p + 1) * per_pass]:
            rows = x[:, 0] - 1  # (B,), the examples' indices
            seen.extend(rows.tolist())
            np.testing.assert_array_equal(y, labels[rows])
            np.testing.assert_array_equal(x, ids[rows, : x.shape[1]])  # nothing cut but padding
            longest = min(lengths[rows].max(), 512)
            assert x.shape[1] == next(size for size in sizes if size >= longest)
            padded += x.size
        assert len(seen) == len(set(seen)) == per_pass * batch_size
        passes.append(seen)
    assert passes[0] != passes[1] and sorted(passes[0]) != sorted(range(per_pass * batch_size))
    # Sorted inside windows, batches are 0.48x the tokens of full-length ones, 83% of them
    # words; batched in plain shuffled order, nearly every batch holds a review of 512 or more.
    assert padded / (2 * per_pass * batch_size * 512) < 0.6
    assert np.minimum(lengths, 512)[np.concatenate(passes)].sum() / padded > 0.75


def test_training_stream_resumes_on_the_same_batches():
    """The stream from step k is the uninterrupted stream's batches from k, across passes."""
    lengths = np.random.default_rng(1).integers(1, 300, size=200)
    ids, labels = _synthetic_ids(lengths, 256), np.arange(200) % 2
    whole = _stream_batches(ids, labels, 16, seed=5, steps=30)
    for start in (5, 12, 13):  # 12 batches a pass
        resumed = _stream_batches(ids, labels, 16, seed=5, steps=30 - start, start_step=start)
        for (a, b), (c, d) in zip(whole[start:], resumed, strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)
    other = _stream_batches(ids, labels, 16, seed=6, steps=12)
    assert any(a.shape != c.shape or (a != c).any() for (a, _), (c, _) in zip(whole, other))


def test_prediction_does_not_depend_on_the_batch_length():
    """A review's probability at its bucket's length == at the full sequence length, to 1e-5,
    and the bucketed evaluation sees every example once."""
    model, _ = model_lib.build_classifier(
        vocab_size=300,
        sequence_length=256,
        embed_dim=16,
        num_heads=2,
        key_dim=8,
        ff_dim=16,
        dropout=0.0,
        seed=4,
        bigram_vocab_size=50,
    )
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 256, size=96)
    ids = np.zeros((96, 256), "int32")
    for i, length in enumerate(lengths):
        ids[i, :length] = rng.integers(2, 300, size=length)
    model.get_layer("embedding").adapt_bigrams(ids)
    full = model.predict(ids, batch_size=96, verbose=0)[:, 0]
    labels = (np.arange(96) % 2).astype("int64")
    dataset = train_batches.eval_dataset(ids, labels, batch_size=16)
    seen, widths = 0, set()
    for x, y in dataset:
        x = x.numpy()
        widths.add(x.shape[1])
        rows = [int(np.flatnonzero((ids[:, : x.shape[1]] == row).all(axis=1))[0]) for row in x]
        np.testing.assert_array_equal(y.numpy(), labels[rows])
        np.testing.assert_allclose(model(x, training=False)[:, 0], full[rows], atol=1e-5)
        seen += len(rows)
    assert seen == 96 and len(widths) >= 4  # several buckets, each compared with 256
    limited = train_batches.eval_dataset(ids, labels, batch_size=16, limit=40)
    assert sum(len(y) for _, y in limited) == 40


def test_progress_bar_shows_reviews_per_second(capsys):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((64, 3), "float32"), np.zeros((64, 1), "float32")
    callback = train_fit.ReviewsPerSecond(global_batch=16)
    model.fit(x, y, batch_size=16, epochs=1, verbose=1, callbacks=[callback])
    shown = re.findall(r"reviews/s: ([0-9.e+]+)", capsys.readouterr().out)
    assert shown and float(shown[-1]) > 0


def test_reviews_per_second_is_the_epochs_throughput_so_far(monkeypatch):
    """Steps of 1 s, 2 s and 1 s at 16 reviews: the bar reads 16/1, 32/3, 48/4 reviews/s (the
    reviews since the epoch began over the time since), not each step's own rate."""
    clock = iter([10.0, 11.0, 13.0, 14.0, 20.0, 22.0])
    monkeypatch.setattr(train_fit.time, "perf_counter", lambda: next(clock))
    callback = train_fit.ReviewsPerSecond(global_batch=16)
    shown = []
    for epoch, steps in ((0, 3), (1, 1)):
        callback.on_epoch_begin(epoch)
        for step in range(steps):
            logs = {}
            callback.on_train_batch_end(step, logs)
            shown.append(logs["reviews/s"])
    assert shown == pytest.approx([16.0, 32 / 3, 12.0, 8.0])  # the new epoch starts afresh


@pytest.mark.parametrize("monitor", ["val_loss", "val_accuracy"])
def test_early_stopping_replays_the_logged_epochs_on_its_monitor(monitor, tmp_path):
    """Epoch 1 is best on `monitor` (loss falls then rises; accuracy peaks a different way);
    after it, one epoch without improvement stops a patience-1 run, on resume as without it."""
    rows = [  # epoch, val_loss, val_accuracy
        (0, 0.30, 0.86),
        (1, 0.29, 0.88),
        (2, 0.31, 0.87),
    ]
    if monitor == "val_accuracy":  # best accuracy at epoch 2, where the loss is worst
        rows = [(0, 0.30, 0.86), (1, 0.29, 0.87), (2, 0.31, 0.89)]
    path = tmp_path / "history.csv"
    lines = [f"{epoch},{loss},{accuracy}\n" for epoch, loss, accuracy in rows]
    path.write_text("epoch,val_loss,val_accuracy\n" + "".join(lines))
    history = train_fit.read_history(str(path))
    best = 1 if monitor == "val_loss" else 2
    assert train_fit.best_row(history, monitor)["epoch"] == best
    assert train_fit._stopped_early(history, 1, monitor) == (monitor == "val_loss")
    callback = train_fit.ResumableEarlyStopping(str(path), monitor=monitor, patience=1)
    callback.set_model(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]))
    callback.on_train_begin()
    assert (callback.best_epoch, callback.wait) == (best, 2 - best)
    assert callback.best == pytest.approx(
        dict(zip(("val_loss", "val_accuracy"), rows[best][1:]))[monitor]
    )


def test_none_unsets_an_optional_flag():
    """`--ngram_dim none` (any case) gives the full-width tables back: the None that a flag
    with a set default could not otherwise express."""
    config = train_sentiment.parse_args(["--ngram_dim", "none", "--pooling_scale", "None"])
    assert config.ngram_dim is None and config.pooling_scale is None
    assert train_sentiment.parse_args(["--ngram_dim", "32"]).ngram_dim == 32


def test_monitor_and_weight_decay_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        train_sentiment.parse_args(["--monitor", "accuracy"])
    assert "`--monitor` must be one of val_loss, val_accuracy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_sentiment.parse_args(["--weight_decay", "-0.1"])
    assert "weight_decay=-0.1" in capsys.readouterr().err


def test_training_state_restores_weights_optimizer_and_dropout_draws(tmp_path):
    """The default tier's check of what resuming reads back (the interrupted runs are large):
    `TrainingState` saves every 2 steps; a fresh model restored from it has the weights, the
    optimizer's step and moments, and the dropout seed states of the saved one, so one more
    step on the same batch gives both the same weights (a missing seed state draws other
    dropout masks)."""
    x = np.random.default_rng(0).normal(size=(8, 6, 4)).astype("float32")
    y = (x[:, 0, :1] > 0).astype("float32")

    def build():
        inputs = keras.Input((6, 4))
        h = ScaledDotProductAttention(num_heads=2, key_dim=4, dropout=0.5, seed=1)(inputs, inputs)
        out = keras.layers.Dense(1)(keras.layers.Dropout(0.5, seed=2)(h[:, 0]))
        model = keras.Model(inputs, out)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    model = build()
    state = train_fit.TrainingState(str(tmp_path / "checkpoints"), save_every=2)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[state])  # 4 steps: saved at 4
    with open(tmp_path / "checkpoints" / "state.json") as f:
        assert json.load(f)["step"] == 4
    restored = build()
    restored.build((None, 6, 4))
    restored.optimizer.build(restored.trainable_variables)
    again = train_fit.TrainingState(str(tmp_path / "checkpoints"), save_every=2)
    again.set_model(restored)
    again.restore()
    assert train_fit.optimizer_step(restored) == 4
    for name, a, b in (
        ("weights", model.get_weights(), restored.get_weights()),
        (
            "optimizer",
            [v.numpy() for v in model.optimizer.variables],
            [v.numpy() for v in restored.optimizer.variables],
        ),
        (
            "seeds",
            [v.numpy() for v in train_fit._seed_states(model)],
            [v.numpy() for v in train_fit._seed_states(restored)],
        ),
    ):
        assert len(a) == len(b) and len(a) > 0, name
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v, err_msg=name)
    for each in (model, restored):
        each.train_on_batch(x[:2], y[:2])
    for u, v in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_allclose(u, v, atol=1e-6)


def test_resume_refuses_a_different_run(tmp_path, capsys):
    output = tmp_path / "imdb"
    (output / "checkpoints").mkdir(parents=True)
    (output / "checkpoints" / "state.json").write_text('{"step": 3, "train_seconds": 1.0}')
    (output / "checkpoints" / "config.json").write_text(json.dumps({"num_heads": 4}))
    code = train_sentiment.main(["--resume", "--output", str(output), "--num_heads", "2"])
    assert code == 2
    assert "--num_heads (saved 4, received 2)" in capsys.readouterr().err


def test_adam_sums_repeated_rows_of_a_sparse_gradient():
    """The app's Adam on an Embedding whose rows repeat in the batch == Adam on the dense
    gradient, written out in NumPy (Keras 3.15's own Adam squares the repeated rows apart)."""
    lr, beta_1, beta_2, epsilon = 0.1, 0.9, 0.999, 1e-7
    embedding = keras.layers.Embedding(5, 3)
    embedding.build((None,))
    weights = embedding.embeddings.numpy().astype(np.float64)
    optimizer = optimizer_lib.Adam(lr, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
    ids = np.array([1, 1, 3, 1, 4])
    rng = np.random.default_rng(0)
    m, v = np.zeros_like(weights), np.zeros_like(weights)
    for step in (1, 2):
        upstream = rng.normal(size=(len(ids), 3))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(embedding(tf.constant(ids)) * upstream)
        (gradient,) = tape.gradient(loss, embedding.trainable_variables)
        assert isinstance(gradient, tf.IndexedSlices) and len(gradient.indices) == len(ids)
        optimizer.apply([gradient], embedding.trainable_variables)
        dense = np.zeros_like(weights)
        np.add.at(dense, ids, upstream)
        m = beta_1 * m + (1 - beta_1) * dense
        v = beta_2 * v + (1 - beta_2) * dense**2
        alpha = lr * np.sqrt(1 - beta_2**step) / (1 - beta_1**step)
        weights = weights - alpha * m / (np.sqrt(v) + epsilon)
        np.testing.assert_allclose(embedding.embeddings.numpy(), weights, atol=1e-5)


@pytest.mark.large  # counts the words of 72,000 reviews
def test_vocabularies_counted_on_train_and_the_unlabelled_reviews(tmp_path, capsys):
    """`--vocabulary_source train+unsupervised` counts the words on train and TFDS's 50,000
    unlabelled reviews, and hands the pair and triple counts both: train's ids, then theirs."""
    config = train_sentiment.parse_args(
        [
            "--vocab_size",
            "2000",
            "--predicted_words",
            "1000",
            "--sequence_length",
            "32",
            "--output",
            str(tmp_path / "a"),
            "--vocabulary_source",
            "train+unsupervised",
        ]
    )
    run = train_sentiment.Run(None, {}, 32, config.output, str(tmp_path / "a" / "c"), False)
    os.makedirs(config.output)
    splits, vectorizer, train_ids, _, counted_ids = train_prepare.prepare_data(config, run)
    unlabeled = data.load_unlabeled("imdb_reviews")
    assert len(unlabeled) == 50000
    # Less the unlabelled reviews that repeat a validation or test review word for word.
    test_texts = set(data.load_test_split("imdb_reviews")[0])
    held_out = test_texts | set(splits.validation_text)
    unlabeled = np.array([text for text in unlabeled if text not in held_out], dtype=object)
    assert len(unlabeled) < 50000 - 270 and len(counted_ids) == len(train_ids) + len(unlabeled)
    np.testing.assert_array_equal(splits.unlabeled_text, unlabeled)  # self-training's reviews
    np.testing.assert_array_equal(counted_ids[: len(train_ids)], train_ids)
    np.testing.assert_array_equal(counted_ids[-64:], data.vectorize(vectorizer, unlabeled[-64:]))
    # The vocabulary is the most frequent words of train and the unlabelled reviews together.
    words = collections.Counter()
    texts = np.concatenate([splits.train_text, unlabeled])
    for start in range(0, len(texts), 4096):
        for text in data.standardize(tf.constant(texts[start : start + 4096])).numpy():
            words.update(text.decode().split())
    expected = [word for word, _ in words.most_common(2000 - 2)]
    assert vectorizer.get_vocabulary()[2:200] == expected[:198]
    assert f"{len(unlabeled)} unlabelled reviews" in capsys.readouterr().out


def test_predicted_words_are_checked_only_when_the_run_pretrains():
    config = train_sentiment.parse_args(["--vocab_size", "2000", "--pretrain_steps", "0"])
    assert config.vocab_size == 2000 and config.predicted_words > 2000


def test_vocabulary_source_is_checked(capsys):
    with pytest.raises(SystemExit):
        train_sentiment.parse_args(["--vocabulary_source", "test"])
    assert "vocabulary_source='test'" in capsys.readouterr().err


def test_mixed_precision_builds_half_precision_layers_with_a_float32_probability():
    """Under `--mixed_precision` the classifier's layers compute in bfloat16 and its core gets
    bfloat16 operands, while the probability and the variables stay float32; the global
    policy is restored after the run."""
    before = keras.config.dtype_policy().name
    with train_build.dtype_policy("mixed_bfloat16"):
        model, inspector = model_lib.build_classifier(
            vocab_size=50, sequence_length=16, embed_dim=8, num_heads=2, key_dim=4, ff_dim=8
        )
        ids = np.random.default_rng(0).integers(1, 50, (3, 16))
        probability, pooling = model(ids), inspector(ids)["pooling"]
    assert keras.config.dtype_policy().name == before
    assert model.get_layer("block_0").compute_dtype == "bfloat16"
    assert pooling.dtype == "bfloat16"  # the pooling attention ran on bfloat16 operands
    assert probability.dtype == "float32"
    assert {w.dtype for w in model.weights if w.dtype.startswith("float")} == {"float32"}


def test_one_head_builds_and_classifies():
    """`--num_heads 1`: the block's single head projects back to the embedding width (our
    layer's single head has no `W_O` by default, and the residual needs one)."""
    model, inspector = model_lib.build_classifier(
        vocab_size=50, sequence_length=16, embed_dim=8, num_heads=1, key_dim=4, ff_dim=8
    )
    ids = np.random.default_rng(0).integers(1, 50, (3, 16))
    assert model(ids).shape == (3, 1)
    assert inspector(ids)["pooling"].shape == (3, 1, 16)


def test_pooling_scale_multiplies_the_pooling_logits():
    """`pooling_scale=s`: the pooling weights are softmax(s * q k^T), checked against the
    default-scale model's own logits recovered from its weights (same weights copied)."""
    ids = np.random.default_rng(0).integers(1, 50, (2, 16))
    pools, weights = {}, None
    for scale in (None, 2.0):
        keras.utils.set_random_seed(0)
        model, inspector = model_lib.build_classifier(
            vocab_size=50,
            sequence_length=16,
            embed_dim=8,
            num_heads=2,
            key_dim=4,
            ff_dim=8,
            pooling_scale=scale,
        )
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        pools[scale] = np.asarray(inspector(ids)["pooling"], "float64")  # (B, N, L)
    logits = np.log(pools[None]) * np.sqrt(4.0)  # q k^T, up to a per-row constant
    want = np.exp(2.0 * logits - (2.0 * logits).max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(pools[2.0], want, atol=1e-5)
    reloaded = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(model.get_layer("pooling"))
    )
    assert reloaded.scale == 2.0


def test_word_dropout_drops_whole_positions_in_training_only():
    """`word_dropout=p`: in training, the model reads its embedding with each position kept
    whole or dropped whole (kept ones times 1 / (1 - p)), checked against the same model at
    inference fed those embeddings; at inference the layer is the identity, and 0 adds none."""
    ids = np.random.default_rng(0).integers(1, 50, (4, 16))
    ids[:, 12:] = 0  # padding
    mask = ids != 0
    keras.utils.set_random_seed(0)
    model, _ = model_lib.build_classifier(
        vocab_size=50,
        sequence_length=16,
        embed_dim=8,
        key_dim=4,
        ff_dim=8,
        dropout=0.0,
        pooling_values="embedding",
        word_dropout=0.5,
    )
    layer = model.get_layer("word_dropout")
    (state,) = [v for v in layer.variables if v.name == "seed_generator_state"]
    before = np.asarray(state)
    trained = np.asarray(model(ids, training=True))[:, 0]
    state.assign(before)  # the same draws again, of the same (B, L, 1) shape
    kept = np.asarray(layer(np.ones((4, 16, 8), "float32"), training=True))
    assert set(np.unique(kept)) == {0.0, 2.0} and np.ptp(kept, axis=-1).max() == 0.0
    embedded = np.asarray(model.get_layer("embedding")(ids)) * kept
    want = 1 / (1 + np.exp(-np.asarray(model_lib.log_odds_from_embeddings(model, embedded, mask))))
    np.testing.assert_allclose(trained, want, rtol=1e-5, atol=1e-6)
    inferred = np.asarray(model(ids, training=False))[:, 0]
    assert np.abs(trained - inferred).max() > 1e-4  # some position was dropped
    np.testing.assert_array_equal(layer(embedded, training=False), embedded)
    without, _ = model_lib.build_classifier(vocab_size=50, sequence_length=16, dropout=0.0)
    assert "word_dropout" not in [layer.name for layer in without.layers]


def test_pooling_sharpness_reads_uniform_as_1_and_one_token_as_0():
    from apps.inspection import records

    uniform = {"pooling": np.full((2, 8), 1 / 8).tolist()}
    one_token = {"pooling": np.eye(1, 8).repeat(2, 0).tolist()}
    assert records.pooling_sharpness([uniform]) == {
        "normalized_entropy": 1.0,
        "top_weight_times_uniform": 1.0,
        "reviews": 1,
    }
    both = records.pooling_sharpness([uniform, one_token])
    assert both == {"normalized_entropy": 0.5, "top_weight_times_uniform": 4.5, "reviews": 2}


def test_pooling_values_embedding_sums_each_tokens_own_embedding(tmp_path):
    """`pooling_values="embedding"`: P(positive) is the classifier over the pooling weights
    (which the block's output gives) times each position's own embedding, projected by the
    pooling's W_V and W_O, checked in NumPy from the layers' weights; and not the sum over
    the block's output. It survives save and load, and the gradient path agrees."""
    keras.utils.set_random_seed(0)
    model, inspector = model_lib.build_classifier(
        vocab_size=50,
        sequence_length=16,
        embed_dim=8,
        num_heads=2,
        key_dim=4,
        ff_dim=8,
        dropout=0.0,
        pooling_values="embedding",
    )
    ids = np.random.default_rng(0).integers(1, 50, (3, 16))
    ids[1, 9:] = 0  # padding
    embedded = np.asarray(model.get_layer("embedding")(ids), "float64")  # (B, L, E)
    blocks = np.asarray(model.get_layer("block_0")(embedded, mask=ids != 0), "float64")
    weights = np.asarray(inspector(ids)["pooling"], "float64")  # (B, N, L)
    attention = model.get_layer("pooling").attention
    value_kernel = np.asarray(attention._value_dense.kernel, "float64")  # (E, N, H)
    value_bias = np.asarray(attention._value_dense.bias, "float64")  # (N, H)
    output_kernel = np.asarray(attention._output_dense.kernel, "float64")  # (N, H, E)
    output_bias = np.asarray(attention._output_dense.bias, "float64")  # (E,)
    classifier = model.get_layer("classifier")

    def probability(values):
        projected = np.einsum("ble,enh->blnh", values, value_kernel) + value_bias
        pooled = np.einsum("bnl,blnh->bnh", weights, projected)
        pooled = np.einsum("bnh,nhe->be", pooled, output_kernel) + output_bias
        logit = pooled @ np.asarray(classifier.kernel, "float64") + np.asarray(classifier.bias)
        return 1 / (1 + np.exp(-logit[:, 0]))

    got = np.asarray(model(ids))[:, 0]
    np.testing.assert_allclose(got, probability(embedded), atol=1e-5)
    assert np.abs(got - probability(blocks)).max() > 1e-3
    log_odds = model_lib.log_odds_from_embeddings(model, embedded.astype("float32"), ids != 0)
    np.testing.assert_allclose(1 / (1 + np.exp(-np.asarray(log_odds))), got, atol=1e-5)
    model.save(tmp_path / "model.keras")
    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    assert reloaded.get_layer("pooling").values_from == "embedding"
    np.testing.assert_allclose(np.asarray(reloaded(ids))[:, 0], got, atol=1e-6)
    with pytest.raises(ValueError, match="values_from='sum'"):
        pooling_lib.AttentionPooling(2, 4, values_from="sum")
    pooling = model.get_layer("pooling")
    with pytest.raises(ValueError, match="values_from='embedding', values=None"):
        pooling(blocks.astype("float32"), mask=ids != 0)


def test_ngram_dim_projects_the_pair_and_triple_tables_to_the_width(tmp_path):
    """`ngram_dim=d`: the pair and triple tables are d wide, and a position's embedding is
    its word's and position's plus one projection of its pair's and triple's rows summed,
    checked in NumPy from the tables; it survives save and load."""
    embedding = embedding_lib.TokenAndPositionEmbedding(
        50, 16, 8, bigram_vocab_size=30, trigram_vocab_size=20, ngram_dim=3
    )
    ids = np.random.default_rng(0).integers(1, 6, (4, 16))  # few words: pairs and triples repeat
    embedding.adapt_bigrams(ids)
    embedding.adapt_trigrams(ids)
    got = np.asarray(embedding(ids), "float64")  # (B, L, E)
    assert embedding.bigram_embedding.embeddings.shape == (32, 3)
    assert embedding.trigram_embedding.embeddings.shape == (22, 3)
    words = np.asarray(embedding.token_embedding.embeddings, "float64")[ids]
    positions = np.asarray(embedding.position_embedding.embeddings, "float64")[:16]
    pairs = np.asarray(embedding.bigram_lookup(embedding_lib.bigram_keys(ids, 50)))
    triples = np.asarray(embedding.trigram_lookup(embedding_lib.trigram_keys(ids, 50)))
    assert (pairs > 1).any() and (triples > 1).any()  # in-vocabulary n-grams looked up
    ngrams = (
        np.asarray(embedding.bigram_embedding.embeddings, "float64")[pairs]
        + np.asarray(embedding.trigram_embedding.embeddings, "float64")[triples]
    )  # (B, L, 3)
    projection = np.asarray(embedding.ngram_projection.kernel, "float64")  # (3, E)
    np.testing.assert_allclose(got, words + positions + ngrams @ projection, atol=1e-6)
    reloaded = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(embedding))
    assert reloaded.ngram_dim == 3
    with pytest.raises(ValueError, match="ngram_dim=0"):
        embedding_lib.TokenAndPositionEmbedding(50, 16, 8, bigram_vocab_size=30, ngram_dim=0)


def test_a_new_run_into_a_folder_drops_the_seeds_carded_for_the_run_before(tmp_path):
    """`seeds.json` (`python -m apps.sweep NAME --card`) checked the folder's earlier run's
    configuration; a new run's card must not quote it."""
    from apps.training import config as train_config
    from apps.training import train as train_lib

    output = tmp_path / "run"
    output.mkdir()
    (output / "seeds.json").write_text("{}")
    train_lib._start_run(train_config.Config(output=str(output)))
    assert not (output / "seeds.json").exists()
