"""The tiny causal LM of `apps.generate`: cached greedy decoding equals greedy decoding by full
recomputation, and the exported `generate` signature gives the same tokens without this package."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from apps import generate as app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    keras.utils.set_random_seed(0)
    model = app.TinyLM(max_length=48)
    # A corpus of its own: trained on the README, the rows' text changed with every edit of it
    # (and once all three rows wrote the same spaces).
    corpus = b"".join(f"{i} squared is {i * i}; {i} cubed is {i**3}. ".encode() for i in range(300))
    inputs, targets = app.byte_windows(corpus, 32, 128, 0)
    model.compile(
        keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(inputs, targets, batch_size=32, epochs=1, verbose=0)
    path = app.export_generate(model, str(tmp_path_factory.mktemp("tiny_lm") / "saved_model"))
    return model, inputs[:3, :8], path


def recomputed(model, prompt, num_new):
    """Greedy decoding without a cache: the whole sequence again for every new token."""
    tokens = np.asarray(prompt)
    for _ in range(num_new):
        logits = model(tf.constant(tokens)).numpy()  # (B, T, 256)
        tokens = np.concatenate([tokens, logits[:, -1].argmax(-1)[:, None]], axis=1)
    return tokens


def test_cached_greedy_decoding_equals_full_recomputation(trained):
    model, prompt, _ = trained
    got = app.generate(model, tf.constant(prompt), tf.constant(12)).numpy()
    want = recomputed(model, prompt, 12)
    np.testing.assert_array_equal(got, want)
    assert len(set(map(tuple, got[:, 8:]))) > 1  # the rows generate different text


@pytest.mark.large  # a process without this package
def test_the_generate_signature_serves_without_this_package(trained, tmp_path):
    model, prompt, path = trained
    np.save(tmp_path / "prompt.npy", prompt)
    script = (
        "import sys, numpy as np, tensorflow as tf\n"
        "generate = tf.saved_model.load(sys.argv[1]).signatures['generate']\n"
        "prompt = tf.constant(np.load(sys.argv[2]), tf.int32)\n"
        "tokens = generate(prompt=prompt, num_new=tf.constant(12))['tokens']\n"
        "assert 'keras_sdpa' not in sys.modules\n"
        "np.save(sys.argv[3], tokens.numpy())\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            path,
            str(tmp_path / "prompt.npy"),
            str(tmp_path / "out.npy"),
        ],
        capture_output=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), recomputed(model, prompt, 12))


@pytest.mark.large  # a training run of its own
def test_cli_trains_generates_and_says_where_it_wrote(tmp_path, capsys):
    output = tmp_path / "tiny_lm"
    assert (
        app.main(
            [
                "--steps",
                "2",
                "--num_new",
                "5",
                "--output",
                str(output),
                "--text",
                f"{ROOT}/README.md",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"SavedModel with a `generate` signature: {output}" in printed
    assert (output / "saved_model.pb").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "0"], "--steps must be at least 1. Received: 0"),
        (["--text", "no/such/file"], "--text must be a file. Received: no/such/file"),
        (["--num_new", "0"], "--num_new must be at least 1. Received: 0"),
        (["--prompt", ""], "--prompt must hold at least one byte. Received: ''"),
        (["--num_new", "119"], "--prompt's 10 bytes plus --num_new must be at most 128"),
    ],
)
def test_cli_rejects_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        app.main(argv)
    assert match in capsys.readouterr().err


def test_lengths_past_the_model_are_refused(trained):
    """Past `max_length` the positions' embedding has no row and the cache no room; `num_new`
    below 1 has nothing to generate. Refused eagerly, and by the exported signature."""
    model, prompt, path = trained  # max_length 48, prompts of 8
    for num_new in (0, 41):
        with pytest.raises(ValueError, match=rf"max_length=48. Received: num_new={num_new}"):
            app.generate(model, tf.constant(prompt), num_new)
    app.generate(model, tf.constant(prompt[:1]), 40)
    with pytest.raises(
        ValueError,
        match=r"`prompt` must hold at least one token. Received: "
        r"prompt.shape=\(3, 0\)",
    ):
        app.generate(model, tf.constant(prompt[:, :0]), 5)
    generate = tf.saved_model.load(path).signatures["generate"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 48"):
        generate(prompt=tf.constant(prompt, tf.int32), num_new=tf.constant(41))
