"""The deletion tests and rankings of `apps.faithfulness` / `apps.inspection.explain`, checked
against synthetic models with a known answer, finite differences, brute force and the SavedModel."""

import itertools
import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from apps.classifier import data, run_folder
from apps.classifier import model as model_lib
from apps.inspection import explain, faithfulness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(ROOT, "saved_models", "imdb_sdpa")
OUT_OF_VOCABULARY = "qqxqzv"
KEY_TOKEN = 7  # the one token the synthetic model reads


def key_token_model(ids):
    """P(positive) is 0.9 when token 7 is among the ids, else 0.3; nothing else matters."""
    return np.where((np.asarray(ids) == KEY_TOKEN).any(axis=1), 0.9, 0.3)


def _synthetic_reviews(rng, count=6, length=40):
    ids = np.zeros((count, length), dtype=np.int32)
    lengths = rng.integers(12, length, size=count)
    where = []
    for r, n in enumerate(lengths):
        ids[r, :n] = rng.integers(8, 500, size=n)  # never 7 by chance
        position = int(rng.integers(0, n))
        ids[r, position] = KEY_TOKEN
        where.append(position)
    return ids, lengths, where


def test_deletion_finds_the_one_token_the_model_reads():
    rng = np.random.default_rng(0)
    ids, lengths, where = _synthetic_reviews(rng)
    for r, n in enumerate(lengths):
        # Deleting each token alone: only the key token moves the prediction.
        drops = [
            key_token_model(ids[r : r + 1])[0]
            - key_token_model(explain.delete_positions(ids[r], [t])[None])[0]
            for t in range(n)
        ]
        assert int(np.argmax(drops)) == where[r] and max(drops) == pytest.approx(0.6)
    first = [np.where(np.arange(n) == w, 1.0, rng.random(n) * 0.5) for n, w in zip(lengths, where)]
    last = [np.where(np.arange(n) == w, -1.0, rng.random(n)) for n, w in zip(lengths, where)]
    shuffled = [rng.random(n) for n in lengths]
    scores = explain.erase_scores(
        key_token_model, ids, lengths, {"first": first, "last": last, "random": shuffled}
    )
    # The ranking that puts the key token first removes all of its evidence at every k ...
    np.testing.assert_allclose(scores["first"]["comprehensiveness"], 0.6)
    np.testing.assert_allclose(scores["first"]["sufficiency"], 0.0)
    # ... the one that puts it last removes none of it until k reaches every token.
    np.testing.assert_allclose(scores["last"]["comprehensiveness"], 0.0)
    np.testing.assert_allclose(scores["last"]["sufficiency"], 0.6)
    top = scores["first"]["comprehensiveness"].mean()
    assert scores["random"]["comprehensiveness"].mean() < top


def test_deleting_a_token_is_as_if_the_word_were_not_in_the_text():
    vectorizer = data.make_vectorizer(50, 12)
    vectorizer.adapt(tf.constant(["not a good film at all but the cast is fine"]))
    text = "not a good film, at all! but the cast is fine"
    ids = vectorizer(tf.constant([text])).numpy()[0]
    words = ["not", "a", "good", "film", "at", "all", "but", "the", "cast", "is", "fine"]
    for positions in ([0], [2, 3], [10], [1, 4, 7]):
        without = " ".join(w for i, w in enumerate(words) if i not in positions)
        expected = vectorizer(tf.constant([without])).numpy()[0]
        np.testing.assert_array_equal(explain.delete_positions(ids, positions), expected)
        kept = " ".join(w for i, w in enumerate(words) if i in positions)
        expected = vectorizer(tf.constant([kept])).numpy()[0]
        np.testing.assert_array_equal(explain.keep_positions(ids, positions, 11), expected)


def test_top_count_is_a_ceiling_and_never_zero():
    assert [explain.top_count(f, 150) for f in explain.FRACTIONS] == [2, 8, 15, 30, 75]
    assert [explain.top_count(f, 3) for f in explain.FRACTIONS] == [1, 1, 1, 1, 2]
    assert explain.top_count(0.5, 0) == 0


def _brute_force_tau_b(a, b):
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            ties_a += 1
            ties_b += 1
        elif da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif da * db > 0:
            concordant += 1
        else:
            discordant += 1
    pairs = len(a) * (len(a) - 1) // 2
    return (concordant - discordant) / np.sqrt((pairs - ties_a) * (pairs - ties_b))


def test_kendall_tau_matches_brute_force_with_ties():
    rng = np.random.default_rng(1)
    for n in (2, 5, 17):
        a, b = rng.integers(0, 4, n), rng.integers(0, 4, n)
        if len(set(a)) > 1 and len(set(b)) > 1:
            assert explain.kendall_tau(a, b) == pytest.approx(_brute_force_tau_b(a, b))
    a = rng.random(30)
    assert explain.kendall_tau(a, a) == pytest.approx(1.0)
    assert explain.kendall_tau(a, -a) == pytest.approx(-1.0)
    assert np.isnan(explain.kendall_tau([1.0], [2.0]))


def test_rollout_through_self_attention_on_the_diagonal_is_the_pooling():
    pooling = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])  # (N, n)
    identity = np.broadcast_to(np.eye(3), (1, 2, 3, 3))  # (layers, N, n, n)
    np.testing.assert_allclose(explain.rollout(pooling, identity), pooling.mean(axis=0))
    # Every token attending only to token 0: half the relevance moves to token 0.
    to_first = np.zeros((1, 2, 3, 3))
    to_first[..., 0] = 1.0
    expected = 0.5 * pooling.mean(axis=0) + 0.5 * np.array([1.0, 0.0, 0.0])
    np.testing.assert_allclose(explain.rollout(pooling, to_first), expected)


@pytest.fixture
def tiny_float64_model():
    # The global policy, once read, no longer follows floatx: set both.
    previous, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        keras.utils.set_random_seed(3)
        model, inspector = model_lib.build_classifier(
            vocab_size=20,
            sequence_length=7,
            embed_dim=6,
            num_heads=2,
            key_dim=3,
            ff_dim=5,
            dropout=0.0,
            bigram_vocab_size=4,
        )
        model.get_layer("embedding").set_bigrams([(2, 3), (3, 4), (5, 6), (4, 2)])
        yield model, inspector
    finally:
        keras.config.set_floatx(previous)
        keras.config.set_dtype_policy(policy)


def test_gradient_x_input_matches_finite_differences(tiny_float64_model):
    model, _ = tiny_float64_model
    probe = explain.ModelProbe(model)
    ids = np.array([[2, 3, 4, 9, 0, 0, 0], [5, 6, 1, 2, 4, 11, 3]], dtype=np.int32)
    scores, probability = probe.gradient_x_input(ids)
    np.testing.assert_allclose(probability, probe.probability(ids), atol=1e-12)
    x = model.get_layer("embedding")(ids).numpy()  # (B, L, E)
    mask = tf.constant(ids != 0)

    def log_odds(values):
        return probe.log_odds_from_embeddings(tf.constant(values), mask).numpy()

    sign = np.sign(log_odds(x))
    epsilon = 1e-6
    expected = np.zeros(ids.shape)
    for b, t, e in itertools.product(*map(range, x.shape)):
        up, down = x.copy(), x.copy()
        up[b, t, e] += epsilon
        down[b, t, e] -= epsilon
        derivative = (log_odds(up)[b] - log_odds(down)[b]) / (2 * epsilon)
        expected[b, t] += sign[b] * derivative * x[b, t, e]
    expected *= ids != 0
    np.testing.assert_allclose(scores, expected, atol=1e-8)
    # The log-odds are the model's own: sigmoid of them is its P(positive).
    np.testing.assert_allclose(1 / (1 + np.exp(-log_odds(x))), model(ids)[:, 0], atol=1e-12)


def test_probability_cuts_each_batch_to_its_bucket_and_keeps_the_rows_order():
    """`ModelProbe.probability` sorts rows by length and cuts each batch to its length bucket:
    the probabilities come back in the rows' order, each the model's on the whole row."""
    keras.utils.set_random_seed(4)
    model, _ = model_lib.build_classifier(
        vocab_size=50, sequence_length=200, embed_dim=8, num_heads=2, key_dim=4, ff_dim=8
    )
    rng = np.random.default_rng(0)
    lengths = rng.permutation([1, 3, 40, 64, 65, 90, 97, 130, 150, 199, 200, 0, 7])
    ids = np.zeros((len(lengths), 200), dtype=np.int32)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(2, 50, size=n)
    # A deleted token inside a row: its length is up to its last token (65, bucket 96, where
    # its 64 tokens alone would fit the bucket of 64 and lose the last one).
    ids[np.flatnonzero(lengths == 65)[0], 10] = 0
    expected = [float(model(ids[row : row + 1], training=False)[0, 0]) for row in range(len(ids))]
    for batch_size in (3, 1):
        probe = explain.ModelProbe(model, batch_size=batch_size)
        np.testing.assert_allclose(probe.probability(ids), expected, atol=1e-6)


@pytest.fixture(scope="module")
def shipped():
    return run_folder.load_run(SHIPPED)


@pytest.fixture(scope="module")
def test_split():
    texts, labels, _ = data.load_test_split("imdb_reviews")
    return texts, labels


def test_shipped_run_loads_from_its_saved_model_and_gives_its_probabilities(shipped, test_split):
    texts = test_split[0][:40]
    loaded = tf.saved_model.load(os.path.join(SHIPPED, "saved_model"))
    served = loaded.signatures["inspect"](text=tf.constant(texts))
    ids = data.vectorize(shipped.vectorizer, texts)
    np.testing.assert_array_equal(
        ids[:, : served["tokens"].shape[1]] != 0, served["tokens"].numpy() != b""
    )
    ours = explain.ModelProbe(shipped.model).probability(ids)
    np.testing.assert_allclose(ours, served["probability"].numpy(), atol=1e-5)


def test_deleted_tokens_score_as_the_saved_model_scores_the_text_without_them(shipped, test_split):
    """The Keras model on ids with tokens removed == the SavedModel on the text re-joined from
    the other words (an out-of-vocabulary word stands for each `[UNK]`)."""
    loaded = tf.saved_model.load(os.path.join(SHIPPED, "saved_model"))
    serve = loaded.signatures["inspect"]
    texts = test_split[0][:60]
    out = serve(text=tf.constant(texts))
    ids = data.vectorize(shipped.vectorizer, texts)
    probe = explain.ModelProbe(shipped.model)
    rows, rejoined = [], []
    for r in range(len(texts)):
        n = int(out["length"][r])
        tokens = [t.decode() for t in out["tokens"][r, :n].numpy()]
        tokens = [OUT_OF_VOCABULARY if t == "[UNK]" else t for t in tokens]
        if n >= ids.shape[1]:
            continue  # deletion would pull in the words past the model's length
        top = explain.order_of(out["pooling"][r, :, :n].numpy().mean(axis=0))[: max(1, n // 10)]
        rows.append(explain.delete_positions(ids[r], top))
        rejoined.append(" ".join(t for i, t in enumerate(tokens) if i not in set(top)))
    assert len(rows) >= 50
    np.testing.assert_allclose(
        probe.probability(np.stack(rows)),
        serve(text=tf.constant(rejoined))["probability"].numpy(),
        atol=1e-5,
    )


@pytest.mark.large  # the shipped model on 120 real reviews
def test_attention_beats_random_on_real_reviews(shipped, test_split):
    """A property of the shipped model, measured here: deleting its most attended tokens
    lowers P(predicted label) more than deleting random ones, by more than 3 standard errors."""
    texts, labels = test_split
    chosen = np.random.default_rng(5).choice(len(texts), 120, replace=False)
    payload = faithfulness.evaluate(
        shipped.model, shipped.inspector, shipped.vectorizer, texts[chosen], labels[chosen], seed=5
    )
    gap = payload["comprehensiveness_aopc_minus_random"]["attention"]
    assert gap["mean"] > 3 * gap["standard_error"], gap
    assert payload["reviews"] == 120
    assert payload["accuracy_on_sample"] > 0.8


def test_hostile_reviews_flow_through(shipped, tmp_path):
    texts = np.array(
        [
            b"",
            b"great",
            b"<!--<script>alert(1)</script>",
            b"\xff\xfe bad bytes",
            "🎬🍿".encode(),
            b"the " * 2000,
        ],
    )
    payload = faithfulness.evaluate(
        shipped.model, shipped.inspector, shipped.vectorizer, texts, np.zeros(len(texts))
    )
    assert payload["skipped_empty"] >= 1  # "" (and the emoji, unknown words are [UNK] tokens)
    assert payload["reviews"] + payload["skipped_empty"] == len(texts)
    paths = faithfulness.write_report(payload, str(tmp_path))
    for path in paths.values():
        assert os.path.getsize(path) > 0
    with open(paths["faithfulness_json"]) as f:
        assert json.load(f)["reviews"] == payload["reviews"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--examples", "0"], "`--examples` must be >= 1. Received: examples=0"),
        (["--run", "/nonexistent"], "`--run` must be a folder written by"),
    ],
    ids=["examples", "run"],
)
def test_cli_errors(argv, message, capsys):
    try:
        status = faithfulness.main(argv)
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err


@pytest.mark.large  # the CLI's run per case (the tiny run's own report: the default tier)
@pytest.mark.parametrize("which, examples", [("tiny", 8), ("shipped", 30)], ids=["tiny", "shipped"])
def test_cli_writes_the_report_into_the_run_folder(which, examples, tmp_path, capsys, request):
    run = tmp_path / "run"  # a copy of the run folder, without its report
    source = request.getfixturevalue("tiny_run")[0] if which == "tiny" else SHIPPED
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("faithfulness.*"))
    assert faithfulness.main(["--run", str(run), "--examples", str(examples), "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    with open(run / "faithfulness.json") as f:
        payload = json.load(f)
    assert payload["source"]["examples"] == examples and payload["source"]["seed"] == 2
    assert payload["source"]["saved_model_max_abs_difference"] <= 1e-4
    for name in ("faithfulness.json", "faithfulness.md", "faithfulness.png"):
        assert str(run / name) in printed
    assert (run / "faithfulness.md").read_text().startswith("Comprehensiveness")
    # The run's model card now quotes this report, not the one it was written with.
    assert str(run / "README.md") in printed
    assert explain.markdown_table(payload) in (run / "README.md").read_text()
