"""The library on Keras's JAX backend, from this TensorFlow session.

Keras picks its backend once per process, so these tests start processes with
`KERAS_BACKEND=jax`: one runs the backend-neutral test files again (the same tests the
session runs on TensorFlow), one proves that the library needs no TensorFlow there.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The test files written on keras.ops and NumPy, which hold on both backends.
BOTH_BACKENDS = ["tests/test_on_both_backends.py", "tests/test_keras_suites.py"]

pytestmark = pytest.mark.xdist_group("jax")


def _jax_env():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _run(args, timeout):
    result = subprocess.run(
        args, cwd=ROOT, env=_jax_env(), capture_output=True, text=True, timeout=timeout
    )
    return result.returncode, result.stdout + result.stderr


def test_the_backend_neutral_tests_pass_on_jax(request):
    """`tests/test_on_both_backends.py` and Keras's MHA and GQA suites, under JAX."""
    args = [sys.executable, "-m", "pytest", *BOTH_BACKENDS, "-q", "-n", "0", "-p",
            "no:cacheprovider", "-o", "addopts=", "-W", "ignore::DeprecationWarning"]
    if request.config.getoption("--run-large"):
        args.append("--run-large")
    code, output = _run(args, timeout=1200)
    assert code == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= 40 and " skipped" not in output, output[-2000:]


NO_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = None  # `import tensorflow` raises from here on
import keras
import numpy as np
import keras_sdpa
import jax

assert keras.backend.backend() == "jax"
x = np.random.default_rng(0).normal(size=(2, 6, 16)).astype("float32")
layer = keras_sdpa.ScaledDotProductAttention(num_heads=4, key_dim=8, num_key_value_heads=2)
layer(x, x)
weights = [v.value for v in layer.trainable_variables]

def loss(weights, x):
    out, _ = layer.stateless_call(weights, [], x, x, use_causal_mask=True)
    return (out ** 2).sum()

grads = jax.jit(jax.grad(loss))(weights, x)
assert all(np.isfinite(np.asarray(g)).all() for g in grads)
assert any(np.abs(np.asarray(g)).sum() > 0 for g in grads)
for path in ("dense", "chunked", "decode"):
    q = x.reshape(2, 6, 4, 4)
    keras_sdpa.scaled_dot_product_attention(q, q, q, implementation=path)
print("no tensorflow: ok")
"""


def test_the_library_needs_no_tensorflow_on_jax():
    """Import, a forward and a backward pass of the layer, and each path of the core, in a
    process where `import tensorflow` fails."""
    code, output = _run([sys.executable, "-c", textwrap.dedent(NO_TENSORFLOW)], timeout=600)
    assert code == 0 and "no tensorflow: ok" in output, output[-4000:]
