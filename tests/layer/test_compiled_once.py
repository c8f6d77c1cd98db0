"""Compiled once: a step compiled by XLA that calls the layer or the core compiles on its first
call and reuses that program for new values of the same shapes.

`tests/compile_counts.py` runs each scenario (a Keras model compiled with `jit_compile=True` on
every path and argument that reaches the core, the user's own compiled step, the core's gradient
in a caller's compiled step, a cached decoding step, a swapped keras-hub block) for five steps
of new random values, and counts the backend's own compilations: TensorFlow's log of each
cluster it compiles, JAX's `jax.monitoring` events. Each backend runs in a process of its own.

Before the fix, the core was a nested `tf.function(jit_compile=True)`; its gradient took the
forward's intermediates (permutations, shapes) as arguments that XLA must know at compile time,
so XLA made the caller's inputs compile-time constants and compiled again for each new batch
(every TensorFlow scenario but the forward-only `cached` read `[1, 1, 1, 1, 1]`).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "compile_counts.py")
# The default tier: Keras's compiled step on the dense and chunked paths, the user's own step,
# the core's gradient and a cached step; the large tier: every other argument that reaches the
# core (masks, bias, dropout, scores, mods, captured tensors) and a swapped keras-hub block.
GROUPS = {
    "main": ["fit_dense", "fit_chunked", "custom_step", "core_dense", "cached"],
    "more": [
        *(f"fit_{name}" for name in ("causal", "mask", "bias", "dropout", "scores", "mods")),
        "fit_captured",
        "core_chunked",
        "keras_hub_block",
    ],
}


def _counts(backend, scenarios):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu")
    env.pop("PYTEST_XDIST_WORKER", None)
    # A program loaded from the tests' persistent XLA cache would not be compiled at all:
    # the first step's compilation is what proves that the counter counts.
    env["TF_XLA_FLAGS"] = ""
    result = subprocess.run(
        [sys.executable, SCRIPT, *scenarios],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.default_cases("*-main")
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_compiled_step_compiles_on_its_first_call_only(backend, group):
    counts = _counts(backend, GROUPS[group])
    assert sorted(counts) == sorted(GROUPS[group])
    # Each first step compiles (the counter sees compilations), and no later step does.
    not_counted = [name for name, steps in counts.items() if steps[0] < 1]
    recompiled = {name: steps for name, steps in counts.items() if sum(steps[1:])}
    assert not not_counted, f"no compilation counted on the first step: {not_counted}"
    assert not recompiled, f"compiled again on new values of the same shapes: {recompiled}"


def test_every_scenario_is_in_a_group():
    listed = subprocess.run(
        [sys.executable, SCRIPT, "--list"],
        cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert sorted(sum(GROUPS.values(), [])) == sorted(json.loads(listed.splitlines()[-1]))
