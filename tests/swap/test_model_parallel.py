"""A kernel-swapped Gemma and Llama under `keras.distribution.ModelParallel`, on 8 simulated CPU
devices (JAX), with keras-hub's own layout maps: the one-device stock model's greedy tokens and
`fit` losses, the projections sharded as the map says (tests/model_parallel.py, one process
per family). Large tier: each builds, generates and fits twice, in a fresh JAX process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


def model_parallel(name):
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "model_parallel.py"), name],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.large
@pytest.mark.parametrize(
    "name, attention", [("gemma", "CachedGemmaAttention"), ("llama", "LlamaAttention")]
)
def test_a_swapped_decoder_under_model_parallel_generates_and_fits_as_on_one_device(
    name, attention
):
    result = model_parallel(name)
    assert result["devices"] == 8
    assert result["kernels"] == [attention] * 2
    assert result["core_calls"] > 0, "the core did not run"
    tokens, losses = result["one_device"]
    sharded_tokens, sharded_losses = result["model_parallel"]
    np.testing.assert_array_equal(sharded_tokens, tokens)
    assert abs(losses[1] - losses[0]) > 1e-3, losses  # the first step changed the model
    np.testing.assert_allclose(sharded_losses, losses, rtol=1e-5)
    placements = result["placements"]
    projections = [path for path in placements if "attention" in path and "kernel" in path]
    assert len(projections) >= 2 * 4, sorted(placements)  # query, key, value, output per layer
    for path, (asked, placed) in placements.items():
        assert placed == asked, path
    assert any("model" in asked for asked, _ in placements.values())
