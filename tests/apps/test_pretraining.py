"""The app's pretraining stage: BERT's corruption, the tied prediction, the texts it reads, the
encoder it saves and reuses, and its resume; and the out-of-domain report's sets."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import keras
import numpy as np
import pytest
from conftest import TINY_RUN, interrupt_at_step

from apps.classifier import masked_lm
from apps.classifier import model as model_lib
from apps.inspection import model_card
from apps.training import out_of_domain
from apps.training import pretrain as pretrain_lib
from apps.training import train as train_sentiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.environ.get(
    "TFDS_DATA_DIR", os.path.join(ROOT, "..", "shared", "data", "tensorflow_datasets")
)


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_hide_words_hides_a_share_of_each_review_as_bert_does():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=400)
    ids = np.zeros((400, 200), "int64")
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, 1000, size=n)  # some unknown words (1)
    ids[0], lengths[0] = 0, 200  # an empty review: nothing to hide; then a full one
    ids[1], lengths[1] = rng.integers(2, 1000, size=200), 200
    corrupted, positions, targets, weights = masked_lm.hide_words(
        ids, np.random.default_rng(1), predicted_words=600, rate=0.15
    )
    assert not corrupted[0].any() and not weights[0].any() and not targets[0].any()
    ids, corrupted, positions, targets, weights, lengths = (
        a[1:] for a in (ids, corrupted, positions, targets, weights, lengths)
    )
    assert positions.shape == targets.shape == weights.shape == (399, 30)  # ceil(0.15 * 200)
    changed = corrupted != ids
    hidden, randomized, kept, chosen_total = 0, 0, 0, 0
    for row, n in enumerate(lengths):
        count = int(np.clip(np.round(0.15 * n), 1, 30))
        chosen = positions[row, :count]
        assert len(set(chosen.tolist())) == count and chosen.max() < n  # distinct, no padding
        # Only chosen positions change; the rest of the review is as it was.
        assert not changed[row, np.setdiff1d(np.arange(200), chosen)].any()
        truth = ids[row, chosen]
        predicted = (truth > 1) & (truth < 600)
        np.testing.assert_array_equal(weights[row, :count], predicted.astype("float32"))
        np.testing.assert_array_equal(targets[row, :count], np.where(predicted, truth, 0))
        assert not weights[row, count:].any() and not targets[row, count:].any()
        shown = corrupted[row, chosen]
        hidden += int(np.sum(shown == masked_lm.MASK_ID))
        kept += int(np.sum(shown == truth))
        randomized += int(np.sum((shown != truth) & (shown != masked_lm.MASK_ID)))
        chosen_total += count
    # BERT's 80 / 10 / 10, within sampling error of ~3,000 draws.
    assert abs(hidden / chosen_total - 0.8) < 0.03
    assert abs(randomized / chosen_total - 0.1) < 0.03
    assert abs(kept / chosen_total - 0.1) < 0.03


def _tiny_classifier(seed=0):
    model, _ = model_lib.build_classifier(
        vocab_size=50,
        sequence_length=12,
        embed_dim=8,
        num_heads=2,
        key_dim=4,
        ff_dim=16,
        num_layers=2,
        dropout=0.3,
        seed=seed,
        bigram_vocab_size=40,
        ngram_dim=4,
    )
    # The pair vocabulary is the run's (its file's), not the weights': the same for every seed.
    ids = np.random.default_rng(0).integers(1, 50, size=(64, 12))
    model.get_layer("embedding").adapt_bigrams(ids)
    return model


def test_masked_word_model_scores_hidden_positions_against_the_word_table():
    """Logits at the chosen positions, recomputed with NumPy from the encoder's output: the
    transform, then the first `predicted_words` rows of the word table (tied) and a bias."""
    classifier = _tiny_classifier()
    predictor = masked_lm.MaskedWordModel(classifier, predicted_words=20)
    rng = np.random.default_rng(3)
    ids = rng.integers(1, 50, size=(3, 12)).astype("int32")
    ids[2, 7:] = 0  # padding
    positions = np.array([[0, 5, 11], [3, 3, 1], [6, 2, 0]], "int32")
    predictor.word_bias.assign(rng.normal(size=20).astype("float32"))
    logits = keras.ops.convert_to_numpy(predictor((ids, positions)))
    x = classifier.get_layer("embedding")(ids)
    for name in ("block_0", "block_1"):
        x = classifier.get_layer(name)(x, mask=ids != 0, training=False)
    x = keras.ops.convert_to_numpy(x)
    picked = np.stack([x[b, positions[b]] for b in range(3)])  # (3, 3, 8)
    h = predictor.transform.kernel.numpy()
    z = picked @ h + predictor.transform.bias.numpy()
    z = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))  # Keras's gelu
    z = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-6)
    z = z * predictor.transform_norm.gamma.numpy() + predictor.transform_norm.beta.numpy()
    table = classifier.get_layer("embedding").token_embedding.embeddings.numpy()[:20]
    expected = z @ table.T + predictor.word_bias.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    # The prediction trains the classifier's own word table, in place.
    before = table.copy()
    predictor.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    predictor.train_on_batch((ids, positions), np.ones((3, 3), "int32"))
    after = classifier.get_layer("embedding").token_embedding.embeddings.numpy()[:20]
    assert np.abs(after - before).max() > 0


def test_encoder_weights_carry_the_embedding_and_blocks_only():
    trained, fresh = _tiny_classifier(seed=0), _tiny_classifier(seed=1)
    pooling_before = [w.copy() for w in fresh.get_layer("pooling").get_weights()]
    masked_lm.set_encoder_weights(fresh, masked_lm.encoder_weights(trained))
    ids = np.random.default_rng(4).integers(0, 50, size=(2, 12))
    for name in ("embedding",):
        np.testing.assert_array_equal(
            fresh.get_layer(name)(ids).numpy(), trained.get_layer(name)(ids).numpy()
        )
    for name in ("block_0", "block_1"):
        for a, b in zip(fresh.get_layer(name).get_weights(), trained.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(fresh.get_layer("pooling").get_weights(), pooling_before):
        np.testing.assert_array_equal(a, b)  # the head is not the encoder's


def _recording(monkeypatch):
    """Records the texts each pretraining call receives, and calls through."""
    received = []
    real = train_sentiment.pretrain

    def spy(config, run, model, texts_ids):
        received.append(np.asarray(texts_ids))
        return real(config, run, model, texts_ids)

    monkeypatch.setattr(train_sentiment, "pretrain", spy)
    return received


@pytest.mark.large  # loads and tokenizes IMDB's 100,000 reviews twice
def test_pretraining_reads_train_and_unlabelled_never_validation_or_test(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    received = _recording(monkeypatch)
    flags = [
        *TINY_RUN,
        "--vocabulary_source",
        "train+unsupervised",
        "--epochs",
        "1",
        "--max_steps",
        "2",
        "--inspect_examples",
        "0",
        "--faithfulness_examples",
        "0",
        "--data_dir",
        DATA_DIR,
        "--output",
        str(tmp_path / "run"),
    ]
    assert train_sentiment.main(flags) == 0
    (texts_ids,) = received
    # Independently of the app: TFDS's splits, the run's vocabulary, the same 10% carve-out.
    from apps.classifier import data

    vectorizer = data.make_vectorizer(3000, 96, vocabulary=str(tmp_path / "run" / "vocabulary.txt"))

    def rows(texts):
        return {row.tobytes() for row in data.vectorize(vectorizer, texts).astype("int64")}

    split = {
        name: tfds.as_numpy(
            tfds.load("imdb_reviews", split=name, data_dir=DATA_DIR, batch_size=-1)
        )["text"]
        for name in ("train", "test", "unsupervised")
    }
    order = np.random.default_rng(0).permutation(len(split["train"]))
    validation, train = split["train"][order[:2500]], split["train"][order[2500:]]
    read = {row.tobytes() for row in texts_ids.astype("int64")}
    train_rows, unlabelled_rows = rows(train), rows(split["unsupervised"])
    held_out = rows(validation) | rows(split["test"])
    assert read <= train_rows | unlabelled_rows  # nothing else
    assert not read & held_out  # not even a copy of a held-out review, in train or unlabelled
    assert train_rows - held_out <= read  # all of train
    assert len(read & unlabelled_rows - train_rows) > 45_000  # the unlabelled reviews


@pytest.mark.large  # two app runs after the session's tiny one
def test_a_second_run_reuses_the_encoder_and_a_changed_one_pretrains(
    tiny_run, tmp_path, monkeypatch
):
    first, first_metrics = tiny_run
    assert first_metrics["pretraining"]["reused"] is False
    output = tmp_path / "again"
    shutil.copytree(os.path.join(first, "pretrained"), output / "pretrained")
    for name in ("vocabulary.txt", "bigrams.txt", "trigrams.txt"):
        shutil.copy(os.path.join(first, name), output / name)

    def no_pretraining(*args):
        raise AssertionError("pretrained again")

    monkeypatch.setattr(pretrain_lib, "_train_encoder", no_pretraining)
    flags = [
        *TINY_RUN,
        "--data_dir",
        DATA_DIR,
        "--inspect_examples",
        "0",
        "--faithfulness_examples",
        "0",
    ]
    assert train_sentiment.main([*flags, "--output", str(output)]) == 0
    with open(output / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["pretraining"]["reused"] is True
    assert metrics["stage_seconds"]["pretraining"] == 0.0
    # The same encoder, so the same fine-tuning: the first run's model, weight for weight.
    again = keras.saving.load_model(output / "model.keras")
    before = keras.saving.load_model(os.path.join(first, "model.keras"))
    for a, b in zip(before.get_weights(), again.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # A pretraining flag changed: the saved encoder is not this configuration's.
    with pytest.raises(AssertionError, match="pretrained again"):
        train_sentiment.main([*flags, "--mask_rate", "0.2", "--output", str(output)])


@pytest.mark.large  # two app processes, one interrupted while it pretrains
def test_interrupt_while_pretraining_then_resume_loses_nothing(tiny_run, tmp_path):
    output = str(tmp_path / "imdb")
    tail = ["--inspect_examples", "0", "--faithfulness_examples", "0", "--data_dir", DATA_DIR]
    command = [sys.executable, "-m", "apps.train_sentiment", *TINY_RUN, *tail, "--output", output]
    state = os.path.join(output, "checkpoints", "pretrain", "state.json")
    stderr = interrupt_at_step(command, state, _env(), ROOT, poll=0.01)  # pretraining is quick
    assert b"pretraining step" in stderr and b"--resume" in stderr
    assert not os.path.exists(os.path.join(output, "pretrained"))  # no encoder yet
    resumed = subprocess.run(
        [*command, "--resume"], capture_output=True, env=_env(), cwd=ROOT, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert b"resuming at step" in resumed.stdout
    uninterrupted = keras.saving.load_model(os.path.join(tiny_run[0], "model.keras"))
    continued = keras.saving.load_model(os.path.join(output, "model.keras"))
    for a, b in zip(uninterrupted.get_weights(), continued.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _archive(path, sets):
    """A source archive laid out as vaderSentiment 3.3.2's, holding `sets` {member: text}."""
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tar:
        for name, text in sets.items():
            data = text.encode()
            info = tarfile.TarInfo(f"hutto_ICWSM_2014/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path, mode="w:gz") as tar:
        info = tarfile.TarInfo(out_of_domain.DATA_MEMBER)
        info.size = len(inner.getvalue())
        tar.addfile(info, io.BytesIO(inner.getvalue()))


def test_out_of_domain_sets_binarize_by_sign_and_never_read_the_movie_snippets(tmp_path):
    archive = tmp_path / "vader.tar.gz"
    _archive(
        archive,
        {
            "tweets_GroundTruth.txt": "1\t2.5\tSo lucky.\r\n2\t-1.2\tWorst day.\r\n3\t0\tMeh.\r\n",
            "amazonReviewSnippets_GroundTruth.txt": "1_1\t-0.15\tno picture.\r\n",
            "nytEditorialSnippets_GroundTruth.txt": "1_1\t0.4\tA holiday.\r\n1_2\t0.0\tEvents.\r\n",
            "movieReviewSnippets_GroundTruth.txt": "1\t3.0\tA movie sentence.\r\n",
        },
    )
    sets = out_of_domain.read_sets(archive)
    assert list(sets) == ["tweets", "product reviews", "news editorials"]
    texts, labels, neutral = sets["tweets"]
    assert texts == ["So lucky.", "Worst day."] and labels.tolist() == [1, 0] and neutral == 1
    assert sets["product reviews"][1].tolist() == [0]
    assert sets["news editorials"][0] == ["A holiday."] and sets["news editorials"][2] == 1
    everything = [text for texts, _, _ in sets.values() for text in texts]
    assert "A movie sentence." not in everything


def test_out_of_domain_refuses_an_archive_with_another_hash(tmp_path, capsys):
    """A cached archive that is not the one the report was written for: a clear error, and
    nothing written beside the model."""
    (tmp_path / out_of_domain.ARCHIVE).write_bytes(b"not the archive")
    model = _shipped_copy(tmp_path / "model")
    before = {name: (model / name).read_bytes() for name in ("out_of_domain.json", "README.md")}
    code = out_of_domain.main(["--cache", str(tmp_path), "--model", str(model)])
    assert code == 2
    assert f"cache={str(tmp_path)!r}" in capsys.readouterr().err
    for name, content in before.items():
        assert (model / name).read_bytes() == content, name  # untouched


def _shipped_copy(folder):
    """The shipped run's SavedModel and records, copied: the CLI writes beside its model."""
    shipped = os.path.join(ROOT, "saved_models", "imdb_sdpa")
    shutil.copytree(os.path.join(shipped, "saved_model"), folder / "saved_model")
    for name in ("metrics.json", "out_of_domain.json", "README.md"):
        shutil.copy(os.path.join(shipped, name), folder / name)
    return folder


def test_out_of_domain_checks_the_models_before_it_downloads(tmp_path, capsys):
    code = out_of_domain.main(["--cache", str(tmp_path), "--model", str(tmp_path / "none")])
    assert code == 2 and "model=" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing downloaded
    shipped = os.path.join(ROOT, "saved_models", "imdb_sdpa")
    code = out_of_domain.main(
        ["--cache", str(tmp_path), "--model", shipped, "--baseline", str(tmp_path / "gone")]
    )
    assert code == 2 and "`--baseline` is not a SavedModel" in capsys.readouterr().err
    code = out_of_domain.main(
        ["--cache", str(tmp_path), "--model", shipped, "--baseline_label", "earlier"]
    )
    assert code == 2 and "baseline_label='earlier', baseline=None" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_model_card_quotes_the_out_of_domain_file(tmp_path):
    report = {
        "source": "s",
        "rule": "r",
        "model": "m",
        "pretrain_steps": 1500,
        "sets": {"tweets": {"texts": 4196, "positive": 2897, "accuracy": 0.7311, "ece": 0.0512}},
        "baseline": {
            "model": "b",
            "seed": 0,
            "pretrain_steps": 0,
            "sets": {
                "tweets": {"texts": 4196, "positive": 2897, "accuracy": 0.6311, "ece": 0.1971}
            },
        },
    }
    (tmp_path / "out_of_domain.json").write_text(json.dumps(report))
    section = model_card._out_of_domain_section(str(tmp_path))
    row = next(line for line in section.splitlines() if line.startswith("| tweets"))
    assert row == "| tweets | 4,196 (2,897) | 63.11% | 73.11% | 0.197 | 0.051 |"


@pytest.mark.large  # downloads vaderSentiment's source from PyPI and serves 12,752 texts
def test_shipped_out_of_domain_figures_are_measured_again(tmp_path):
    """The CLI, run again on (a copy of) the shipped model without `--baseline`, measures the
    committed figures and keeps the committed baseline (the pretrained model shipped before #63)."""
    model = _shipped_copy(tmp_path / "model")
    report = json.loads((model / "out_of_domain.json").read_text())
    assert out_of_domain.main(["--model", str(model)]) == 0
    measured = json.loads((model / "out_of_domain.json").read_text())
    for name, result in report["sets"].items():
        assert measured["sets"][name]["texts"] == result["texts"]
        assert abs(measured["sets"][name]["accuracy"] - result["accuracy"]) <= 2e-4
        assert abs(measured["sets"][name]["ece"] - result["ece"]) <= 2e-3
    assert measured["baseline"] == report["baseline"]
    table = model_card.out_of_domain_table(report)
    with open(os.path.join(ROOT, "saved_models", "imdb_sdpa", "README.md")) as f:
        assert table in f.read()
    assert model_card.out_of_domain_table(measured) in (model / "README.md").read_text()


def test_the_tiny_run_pretrained_and_says_so(tiny_run):
    output, metrics = tiny_run
    record = metrics["pretraining"]
    assert record["steps"] == 6 and record["reused"] is False
    assert 22_000 < record["reviews"] <= 22_500  # train, less what reads as held out
    assert set(metrics["stage_seconds"]) == {"data", "pretraining", "fine_tuning", "report"}
    assert metrics["stage_seconds"]["pretraining"] == record["seconds"] > 0
    with open(os.path.join(output, "README.md")) as f:
        card = f.read()
    assert "## Pretraining" in card and f"{record['steps']:,} steps of" in card
    model = keras.saving.load_model(os.path.join(output, "model.keras"))
    with np.load(os.path.join(output, "pretrained", "encoder.npz")) as weights:
        names = set(weights.files)
        masked_lm.set_encoder_weights(model, weights)  # the run's own shapes
    assert {name.split("/")[0] for name in names} == {"embedding", "block_0"}


def test_the_encoder_key_changes_with_what_shapes_the_encoder(tmp_path):
    """Flags that shape the encoder, its texts and its vocabularies change the key; flags of
    the fine-tuning alone do not."""
    for name in ("vocabulary", "bigrams", "trigrams"):
        (tmp_path / f"{name}.txt").write_text(f"{name}\n")
    run = type(
        "Run",
        (),
        {name: str(tmp_path / f"{name}.txt") for name in ("vocabulary", "bigrams", "trigrams")},
    )
    texts = np.arange(12).reshape(3, 4)
    key = pretrain_lib.encoder_key(train_sentiment.parse_args([]), run, texts)
    for flags in (["--learning_rate", "3e-3"], ["--dropout", "0.1"], ["--epochs", "3"]):
        assert pretrain_lib.encoder_key(train_sentiment.parse_args(flags), run, texts) == key
    for flags in (
        ["--naive_bayes_alpha", "1"],
        ["--mask_rate", "0.2"],
        ["--seed", "1"],
        ["--pretrain_steps", "10"],
        ["--num_layers", "2"],
    ):
        assert pretrain_lib.encoder_key(train_sentiment.parse_args(flags), run, texts) != key
    assert pretrain_lib.encoder_key(train_sentiment.parse_args([]), run, texts[:2]) != key
    (tmp_path / "bigrams.txt").write_text("other\n")
    assert pretrain_lib.encoder_key(train_sentiment.parse_args([]), run, texts) != key


def test_pretraining_leaves_out_rows_that_read_as_held_out_reviews():
    texts = np.array([[5, 6, 0], [7, 8, 9], [5, 6, 0], [1, 2, 3]])
    held_out = np.array([[5, 6, 0], [9, 9, 9]])
    np.testing.assert_array_equal(
        pretrain_lib.without_held_out(texts, held_out), [[7, 8, 9], [1, 2, 3]]
    )
