"""The mixed objective's losses (`apps/classifier/perturbation.py`): the KL divergence and the
entropy against NumPy, the adversarial and virtual adversarial perturbations against
finite-difference gradients, the embeddings' normalisation against NumPy, the training step
with every weight 0 against Keras's own, the flags' checks, and an interrupted run's resume."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import interrupt_at_step

from apps.classifier import embedding as embedding_lib
from apps.classifier import model as model_lib
from apps.classifier import perturbation as perturbation_lib
from apps.classifier.perturbation import Perturbation, PerturbedClassifier
from apps.training import batches as train_batches
from apps.training import build as train_build
from apps.training import train as train_sentiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Pairwise-distinct sizes, so that a swapped axis cannot pass: batch, length, width, vocabulary.
B, L, E, V = 3, 7, 8, 23


def kl_reference(a, b):
    """`KL(sigmoid(a) || sigmoid(b))` in float64, from the probabilities' logs."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    p = 1 / (1 + np.exp(-a))
    log_p, log_not_p = -np.logaddexp(0, -a), -np.logaddexp(0, a)
    log_q, log_not_q = -np.logaddexp(0, -b), -np.logaddexp(0, b)
    return p * (log_p - log_q) + (1 - p) * (log_not_p - log_not_q)


def entropy_reference(z):
    """`H(sigmoid(z)) = -p log p - (1 - p) log(1 - p)` in float64."""
    z = np.asarray(z, np.float64)
    p = 1 / (1 + np.exp(-z))
    return -p * -np.logaddexp(0, -z) - (1 - p) * -np.logaddexp(0, z)


def _ids(rng, batch=B, length=L, pad_from=(5, 7, 3)):
    """Token ids `(batch, length)` in `[2, V)`, row i padded from `pad_from[i]` on."""
    ids = rng.integers(2, V, (batch, length)).astype("int32")
    for row, start in enumerate(pad_from[:batch]):
        ids[row, start:] = 0
    return ids


def _classifier(ids, dropout=0.0, **kwargs):
    """A tiny classifier with word pairs and triples, its tables normalised by the row
    frequencies in `ids`."""
    keras.utils.set_random_seed(1)
    model, _ = model_lib.build_classifier(
        V,
        L,
        embed_dim=E,
        num_heads=2,
        key_dim=4,
        ff_dim=16,
        dropout=dropout,
        bigram_vocab_size=30,
        trigram_vocab_size=20,
        ngram_dim=6,
        pooling_values="embedding",
        normalize_embeddings=True,
        **kwargs,
    )
    embedding = model.get_layer("embedding")
    embedding.adapt_bigrams(ids)
    embedding.adapt_trigrams(ids)
    embedding.adapt_frequencies(ids)
    return model


@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0], ids=["small", "unit", "saturated"])
def test_kl_and_entropy_match_numpy(scale):
    """Both from the log-odds, in float32, at 1e-5 of float64 NumPy from the probabilities;
    the KL is 0 between equal predictions, and the cross-entropy is Keras's."""
    rng = np.random.default_rng(0)
    a = (scale * rng.normal(size=64)).astype("float32")
    b = (scale * rng.normal(size=64)).astype("float32")
    kl = perturbation_lib.binary_kl(a, b).numpy()
    np.testing.assert_allclose(kl, kl_reference(a, b), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(perturbation_lib.binary_kl(a, a).numpy(), 0.0)
    entropy = perturbation_lib.binary_entropy(a).numpy()
    np.testing.assert_allclose(entropy, entropy_reference(a), rtol=1e-5, atol=1e-5)
    labels = (rng.random(64) > 0.5).astype("float32")
    keras_loss = keras.losses.binary_crossentropy(labels[:, None], a[:, None], from_logits=True)
    np.testing.assert_allclose(
        perturbation_lib.binary_cross_entropy(labels, a).numpy(), keras_loss.numpy(), atol=1e-5
    )


def test_scaled_per_review_gives_each_review_the_norm_in_its_own_direction():
    """Each review's `(L, E)` slice to norm epsilon, its direction kept, tiny gradients too
    (their squares underflow float32), a zero review left 0."""
    rng = np.random.default_rng(1)
    v = rng.normal(size=(4, L, E)).astype("float32")
    v[1] *= 1e-25  # squared: 1e-50, below float32's smallest number
    v[2] = 0.0
    v[3] *= 1e6
    r = perturbation_lib.scaled_per_review(tf.constant(v), 2.5).numpy()
    norms = np.sqrt(np.sum(np.float64(r) ** 2, axis=(1, 2)))
    np.testing.assert_allclose(norms[[0, 1, 3]], 2.5, rtol=1e-6)
    np.testing.assert_array_equal(r[2], 0.0)
    for row in (0, 1, 3):
        unit = np.float64(v[row]) / np.sqrt(np.sum(np.float64(v[row]) ** 2))
        np.testing.assert_allclose(r[row] / 2.5, unit, atol=1e-6)


def _finite_difference_gradient(f, x, h):
    """`d f / d x` `(B, L, E)` of `f(x)` (a float64 scalar of `(B, L, E)`), central."""
    gradient = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        step = np.zeros_like(x)
        step[index] = h
        gradient[index] = (f(x + step) - f(x - step)) / (2 * h)
    return gradient


def _unit_per_review(v):
    return v / np.sqrt(np.sum(v**2, axis=(1, 2), keepdims=True))


def test_adversarial_direction_is_the_finite_difference_gradients_at_epsilon():
    """`r_adv` of the mean cross-entropy: each review's slice has norm epsilon and points where
    a central finite difference of the loss (float64, every coordinate) does; 0 on padding.
    The model's adversarial loss is the cross-entropy at the embeddings plus that `r_adv`."""
    rng = np.random.default_rng(2)
    ids = _ids(rng)
    labels = np.array([1.0, 0.0, 1.0])
    with train_build.dtype_policy("float64"):
        model = PerturbedClassifier.around(_classifier(ids), Perturbation(1.0, epsilon=0.7))
        model.compile("sgd", "binary_crossentropy")
    x = np.asarray(model.get_layer("embedding")(ids))  # (B, L, E) float64
    mask = ids != 0

    def loss_of(embedded):
        z = model_lib.log_odds_from_embeddings(model, embedded, mask, training=True)
        return tf.reduce_mean(perturbation_lib.binary_cross_entropy(labels, z))

    @tf.function
    def direction(embedded):
        gradient = tf.gradients(loss_of(embedded), embedded)[0]
        return perturbation_lib.adversarial_direction(gradient, 0.7)

    r = direction(tf.constant(x)).numpy()
    gradient = _finite_difference_gradient(lambda v: float(loss_of(tf.constant(v))), x, 1e-6)
    want = 0.7 * _unit_per_review(gradient)
    np.testing.assert_allclose(np.sqrt(np.sum(r**2, axis=(1, 2))), 0.7, rtol=1e-9)
    np.testing.assert_allclose(r, want, atol=1e-6)
    np.testing.assert_array_equal(r[~mask], 0.0)
    _, losses = tf.function(model.mixed_objective)(ids, labels)
    np.testing.assert_allclose(
        float(losses["adversarial_loss"]), float(loss_of(tf.constant(x + want))), rtol=1e-8
    )


def test_virtual_adversarial_direction_is_one_power_iteration():
    """`r_vadv`: the finite-difference gradient of `d -> sum KL(p(x) || p(x + d))` at
    `d = xi u / ||u||` (`u` the given direction on the tokens), each review's at norm epsilon."""
    rng = np.random.default_rng(3)
    ids = _ids(rng)
    with train_build.dtype_policy("float64"):
        model = _classifier(ids)
    x = np.asarray(model.get_layer("embedding")(ids))  # (B, L, E) float64
    mask = ids != 0
    u = rng.normal(size=x.shape)
    xi, epsilon = 0.1, 1.3

    def log_odds_of(embedded):
        return model_lib.log_odds_from_embeddings(model, embedded, mask)

    clean = log_odds_of(tf.constant(x))

    @tf.function
    def direction(embedded, u):
        return perturbation_lib.virtual_adversarial_direction(
            log_odds_of, embedded, mask, clean, u, epsilon, xi
        )

    r = direction(tf.constant(x), tf.constant(u)).numpy()

    def kl_at(d):
        return np.sum(kl_reference(clean.numpy(), log_odds_of(tf.constant(x + d)).numpy()))

    d = xi * _unit_per_review(u * mask[:, :, None])
    gradient = _finite_difference_gradient(lambda v: kl_at(v), d, 1e-6)
    np.testing.assert_allclose(np.sqrt(np.sum(r**2, axis=(1, 2))), epsilon, rtol=1e-9)
    np.testing.assert_allclose(r / epsilon, _unit_per_review(gradient), atol=1e-5)
    np.testing.assert_array_equal(r[~mask], 0.0)


def test_embeddings_are_normalised_by_their_rows_frequencies():
    """The word, pair and triple tables, each normalised to frequency-weighted mean 0 and
    variance 1 per feature, looked up and summed with the positions, as NumPy computes it."""
    rng = np.random.default_rng(4)
    ids = _ids(rng, batch=40, pad_from=rng.integers(1, L + 1, 40))
    layer = embedding_lib.TokenAndPositionEmbedding(
        V, L, E, bigram_vocab_size=30, trigram_vocab_size=20, normalize_embeddings=True
    )
    layer.build(ids.shape)
    layer.adapt_bigrams(ids)
    layer.adapt_trigrams(ids)
    layer.adapt_frequencies(ids)
    pairs = np.asarray(layer.bigram_lookup(embedding_lib.bigram_keys(ids, V)))
    triples = np.asarray(layer.trigram_lookup(embedding_lib.trigram_keys(ids, V)))
    want = np.asarray(layer.position_embedding.embeddings)[None, :, :]  # (1, L, E)
    for table, indices in (
        (layer.token_embedding, ids),
        (layer.bigram_embedding, pairs),
        (layer.trigram_embedding, triples),
    ):
        rows = np.asarray(table.embeddings, np.float64)
        counts = np.bincount(indices.reshape(-1), minlength=len(rows)).astype(np.float64)
        counts[0] = 0.0  # padding, or no n-gram there
        f = counts / counts.sum()
        mean = f @ rows
        variance = f @ (rows - mean) ** 2
        normalised = (rows - mean) / np.sqrt(variance + 1e-6)
        np.testing.assert_allclose(f @ normalised, 0.0, atol=1e-9)
        np.testing.assert_allclose(f @ normalised**2, variance / (variance + 1e-6), rtol=1e-9)
        want = want + normalised[indices]
    np.testing.assert_allclose(np.asarray(layer(ids)), want, atol=1e-5)


def _compiled(model, optimizer="adam"):
    model.compile(optimizer, "binary_crossentropy", metrics=["accuracy"])
    return model


def test_with_every_weight_0_the_step_is_keras_own():
    """A `PerturbedClassifier` of no perturbation and the plain classifier, from the same
    weights, on the same batch: the same loss, the same accuracy and the same weights after the
    step (Keras's own `train_step` on the compiled `binary_crossentropy`). Plain gradient
    descent: Adam would scale the rounding noise of a gradient that is 0 in exact arithmetic
    (the attention's key bias) up to a step of its own."""
    rng = np.random.default_rng(5)
    ids, labels = _ids(rng), np.array([1.0, 0.0, 1.0], "float32")
    plain = _compiled(_classifier(ids), keras.optimizers.SGD(0.5))
    perturbed = PerturbedClassifier.around(_classifier(ids), Perturbation())
    perturbed = _compiled(perturbed, keras.optimizers.SGD(0.5))
    perturbed.set_weights(plain.get_weights())
    want = plain.train_on_batch(ids, labels, return_dict=True)
    got = perturbed.train_on_batch(ids, labels, return_dict=True)
    assert set(got) == {"loss", "accuracy"}
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    assert got["accuracy"] == want["accuracy"]
    for a, b in zip(plain.get_weights(), perturbed.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_step_descends_the_likelihood_plus_the_weighted_entropy():
    """One step of gradient descent on the likelihood plus the weighted entropy (no random
    direction: the step is a function of the batch), against a `tf.GradientTape`'s gradient
    of the same sum, written out here."""
    rng = np.random.default_rng(9)
    ids, labels = _ids(rng), np.array([1.0, 0.0, 1.0], "float32")
    unlabeled = _ids(rng, batch=2, length=5, pad_from=(4, 5))
    model = PerturbedClassifier.around(_classifier(ids), Perturbation(entropy_weight=0.7))
    model = _compiled(model, keras.optimizers.SGD(0.5))
    before = [w.numpy() for w in model.trainable_weights]
    with tf.GradientTape() as tape:
        z = model_lib.log_odds_from_embeddings(
            model, model.get_layer("embedding")(ids), ids != 0, training=True
        )
        u = model_lib.log_odds_from_embeddings(
            model, model.get_layer("embedding")(unlabeled), unlabeled != 0
        )
        likelihood = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, z))
        p = tf.sigmoid(u)
        entropy = tf.reduce_mean(-p * tf.math.log(p) - (1 - p) * tf.math.log(1 - p))
        total = likelihood + 0.7 * entropy
    gradients = tape.gradient(total, model.trainable_weights)
    batch = tf.data.Dataset.from_tensors((ids, labels, unlabeled))
    logs = model.fit(batch, epochs=1, verbose=0).history
    np.testing.assert_allclose(logs["loss"][0], float(total), rtol=1e-6)
    np.testing.assert_allclose(logs["entropy"][0], float(entropy), rtol=1e-6)
    for w, b, g in zip(model.trainable_weights, before, gradients, strict=True):
        np.testing.assert_allclose(w.numpy(), b - 0.5 * tf.convert_to_tensor(g), atol=1e-6)


def test_mixed_objective_is_the_likelihood_plus_the_weighted_losses():
    """The total is the weighted sum; the likelihood is the compiled loss of the model's own
    output, the entropy NumPy's of its prediction on the unlabelled reviews, the worst
    perturbation raises the loss, and the KL is positive; `fit` logs each part, and validation
    none of them."""
    rng = np.random.default_rng(6)
    ids, labels = _ids(rng), np.array([1.0, 0.0, 1.0], "float32")
    unlabeled = _ids(rng, batch=2, length=5, pad_from=(4, 5))
    weights = Perturbation(0.5, 2.0, 0.25, epsilon=1.0)
    model = _compiled(PerturbedClassifier.around(_classifier(ids), weights))
    _, losses = tf.function(model.mixed_objective)(ids, labels, unlabeled)
    losses = {name: float(value) for name, value in losses.items()}
    assert set(losses) == {"loss", "likelihood", *perturbation_lib.PARTS.values()}
    total = losses["likelihood"] + sum(
        weight * losses[name] for name, weight in weights.weighted.items()
    )
    np.testing.assert_allclose(losses["loss"], total, rtol=1e-6)
    compiled = model.compute_loss(y=labels, y_pred=model(ids))
    np.testing.assert_allclose(losses["likelihood"], float(compiled), rtol=1e-5)
    probability = np.float64(model.predict(unlabeled, verbose=0)[:, 0])
    z = np.log(probability) - np.log1p(-probability)
    np.testing.assert_allclose(losses["entropy"], entropy_reference(z).mean(), rtol=1e-5)
    assert losses["adversarial_loss"] > losses["likelihood"]
    assert losses["virtual_adversarial_loss"] > 0
    data = tf.data.Dataset.from_tensors((ids, labels, unlabeled)).repeat()
    history = model.fit(data, epochs=1, steps_per_epoch=2, validation_data=(ids, labels), verbose=0)
    assert set(history.history) == {
        "loss",
        "accuracy",
        "val_loss",
        "val_accuracy",
        *perturbation_lib.PARTS.values(),
    }


def test_the_adversarial_pass_perturbs_the_likelihood_pass_dropped_embeddings(monkeypatch):
    """With dropout on, the embedding's dropout runs once a step: the adversarial pass adds
    `r` to the embeddings the likelihood's gradient was taken at (Miyato et al.), not to a new
    draw. A spy counts the embedding dropout's calls in one objective."""
    rng = np.random.default_rng(8)
    ids, labels = _ids(rng), np.array([1.0, 0.0, 1.0], "float32")
    model = _compiled(
        PerturbedClassifier.around(_classifier(ids, dropout=0.5), Perturbation(1.0, epsilon=1.0))
    )
    layer = model.get_layer("embedding_dropout")
    calls, call = [], layer.call
    monkeypatch.setattr(layer, "call", lambda *a, **k: calls.append(1) or call(*a, **k))
    _, losses = tf.function(model.mixed_objective)(ids, labels)
    assert len(calls) == 1
    assert np.isfinite(float(losses["adversarial_loss"]))


def test_an_overflowed_gradient_gives_no_perturbation_rather_than_nan():
    """Mixed float16: a gradient that overflowed the loss scale (the optimizer skips that
    step) leaves its review unperturbed where it is not finite, and the logs finite."""
    v = np.ones((2, L, E), "float32")
    v[0, 0, 0] = np.inf
    v[1, 1, 1] = np.nan
    r = perturbation_lib.scaled_per_review(tf.constant(v), 1.0).numpy()
    assert np.isfinite(r).all()
    assert r[0, 0, 0] == 0.0 and r[1, 1, 1] == 0.0
    np.testing.assert_allclose(np.sqrt(np.sum(np.float64(r) ** 2, axis=(1, 2))), 1.0, rtol=1e-6)


def test_a_saved_perturbed_classifier_loads_with_its_perturbation(tmp_path):
    rng = np.random.default_rng(7)
    ids = _ids(rng)
    weights = Perturbation(adversarial_weight=1.5, epsilon=2.0, seed=4)
    model = _compiled(PerturbedClassifier.around(_classifier(ids), weights))
    model.optimizer.build(model.trainable_variables)  # as the app builds it before it trains
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, PerturbedClassifier) and loaded.perturbation == weights
    assert set(loaded.part_trackers) == {"adversarial_loss"}
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0))


def test_each_training_batch_has_its_unlabelled_batch_from_the_same_step():
    """`with_unlabeled`: the labelled stream's batches with the unlabelled stream's beside
    them, and from step k the pairs an uninterrupted stream has from k."""
    rng = np.random.default_rng(8)
    ids, labels = rng.integers(1, 50, (40, 12)).astype("int32"), np.arange(40.0)
    unlabeled = rng.integers(1, 50, (30, 9)).astype("int32")

    def pairs(start, steps):
        stream = train_batches.training_stream(ids, labels, 4, seed=3, start_step=start)
        zipped = train_batches.with_unlabeled(stream, unlabeled, 4, seed=3, start_step=start)
        return [tuple(t.numpy() for t in batch) for batch in zipped.take(steps)]

    whole = pairs(0, 20)
    alone = train_batches.training_stream(unlabeled, np.zeros(30), 4, seed=3)
    for (x, y, u), (v, _) in zip(whole, alone.take(20), strict=True):
        assert x.shape[0] == y.shape[0] == u.shape[0] == 4
        np.testing.assert_array_equal(u, v.numpy())
    for start in (7, 13):  # inside the first pass over the unlabelled reviews, and after it
        for a, b in zip(whole[start:], pairs(start, 20 - start), strict=True):
            for u, v in zip(a, b, strict=True):
                np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--adversarial_weight", "-1"], "adversarial_weight=-1.0"),
        (["--virtual_adversarial_weight", "nan"], "virtual_adversarial_weight=nan"),
        (["--entropy_weight", "inf"], "entropy_weight=inf"),
        (["--perturbation_epsilon", "0"], "perturbation_epsilon=0.0"),
        (
            ["--entropy_weight", "0.1", "--vocabulary_source", "train"],
            "entropy_weight=0.1, vocabulary_source='train'",
        ),
        (
            ["--adversarial_weight", "1", "--pretrain_steps", "10"],
            "adversarial_weight=1.0, pretrain_steps=10",
        ),
        (
            ["--virtual_adversarial_weight", "1", "--mixed_precision", "mixed_bfloat16"],
            "virtual_adversarial_weight=1.0, mixed_precision='mixed_bfloat16'",
        ),
    ],
    ids=["negative", "nan", "inf", "epsilon", "no_unlabelled", "pretraining", "bfloat16"],
)
def test_perturbation_flags_are_checked(flags, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_sentiment.main([*flags, "--output", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and f"`{flags[0]}`" in err


# A tiny run of the mixed objective on real IMDB reviews, with the unlabelled ones.
MIXED_RUN = [
    "--epochs",
    "2",
    "--max_steps",
    "4",
    "--batch_size",
    "16",
    "--sequence_length",
    "64",
    "--vocab_size",
    "2000",
    "--embed_dim",
    "16",
    "--key_dim",
    "8",
    "--ff_dim",
    "32",
    "--bigram_vocab_size",
    "2000",
    "--trigram_vocab_size",
    "1000",
    "--adversarial_weight",
    "1",
    "--virtual_adversarial_weight",
    "1",
    "--entropy_weight",
    "0.5",
    "--save_every",
    "1",
    "--inspect_examples",
    "0",
    "--faithfulness_examples",
    "0",
    "--verbose",
    "0",
]


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.large  # three app runs on all of IMDB's reviews, two of them processes
def test_an_interrupted_mixed_objective_run_resumes_to_the_same_weights(tmp_path):
    """SIGINT mid-epoch, then --resume: the same weights and validation losses as the same run
    uninterrupted (the unlabelled batches, the random directions and the dropout draws all
    resume where they were)."""
    whole = tmp_path / "whole"
    assert train_sentiment.main([*MIXED_RUN, "--output", str(whole)]) == 0
    output = tmp_path / "resumed"
    command = [sys.executable, "-m", "apps.train_sentiment", *MIXED_RUN, "--output", str(output)]
    state = output / "checkpoints" / "state.json"
    interrupt_at_step(command, state, _env(), ROOT, deadline=600)
    interrupted_at = json.loads(state.read_text())["step"]
    assert 2 <= interrupted_at < 8
    resumed = subprocess.run(
        [*command, "--resume"], capture_output=True, env=_env(), cwd=ROOT, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert f"step {interrupted_at}".encode() in resumed.stdout
    metrics = [json.loads((folder / "metrics.json").read_text()) for folder in (whole, output)]
    history = [[row["val_loss"] for row in each["history"]] for each in metrics]
    np.testing.assert_allclose(history[1], history[0], atol=1e-5)
    for name in perturbation_lib.PARTS.values():
        assert all(row[name] > 0 for row in metrics[1]["history"]), name
    models = [keras.saving.load_model(folder / "model.keras") for folder in (whole, output)]
    assert all(isinstance(model, PerturbedClassifier) for model in models)
    for a, b in zip(models[0].get_weights(), models[1].get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
