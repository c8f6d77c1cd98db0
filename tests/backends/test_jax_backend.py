"""The library on Keras's JAX backend, from this TensorFlow session.

Keras picks its backend once per process, so these tests start processes with
`KERAS_BACKEND=jax`: some run the backend-neutral test files there (the same files the
TensorFlow sessions run), one proves that the library needs no TensorFlow there.
"""

import os
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import COMPILING_XLA_FLAGS
from on_backend import KERAS_AND_SWAP, LIBRARY, ON_BOTH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What does not run on JAX, and why.
NOT_ON_JAX = {
    "tests/swap/test_swap.py::test_a_tf_checkpoint_saves_and_restores_the_new_layers": (
        "TensorFlow's own checkpoint format"
    ),
    "tests/swap/test_swap.py::"
    "test_a_functional_graph_node_is_swapped_and_saves_as_this_layer[mha]": (
        "the stock twin fails: Keras 3.15's MultiHeadAttention on JAX cannot take a value "
        "size other than the key size (it reshapes its output to the key size)"
    ),
}

pytestmark = pytest.mark.xdist_group("jax")


def _jax_env(devices=1):
    """The environment of a JAX session on `devices` host devices. It compiles as the default
    tier does (LLVM's -O0, `tests/conftest.py`), in either tier: these sessions mostly
    compile."""
    flags = COMPILING_XLA_FLAGS
    if devices > 1:
        flags += f" --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _run(args, timeout):
    result = subprocess.run(
        args, cwd=ROOT, env=_jax_env(), capture_output=True, text=True, timeout=timeout
    )
    return result.returncode, result.stdout + result.stderr


def _pytest_on_jax(files, at_least, *options, env=None, timeout=1200):
    """Runs pytest on `files` in a JAX process (their default cases); all must pass, none be
    skipped, and at least `at_least` run."""
    args = [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-W",
        "ignore::DeprecationWarning",
        "-m",
        "not large",
        *options,
    ]
    result = subprocess.run(
        args, cwd=ROOT, env=env or _jax_env(), capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= at_least and " skipped" not in output, output[-2000:]


def test_the_backend_neutral_tests_pass_on_jax():
    """The backend-neutral files (`ON_BOTH`), under JAX in its default float32 mode."""
    _pytest_on_jax(ON_BOTH, 64)


@pytest.mark.large  # a second run of Keras's suites and the swap tests, on JAX
def test_keras_suites_and_the_swap_pass_on_jax():
    """Keras's MHA and GQA suites on this layer, and the swap into keras-hub's models."""
    _pytest_on_jax(KERAS_AND_SWAP, 130, *(f"--deselect={test}" for test in NOT_ON_JAX))


@pytest.mark.large  # the swap's harness whole on JAX: fit, generate and .keras too
def test_the_swap_harness_passes_whole_on_jax():
    """The large checks of `tests/swap/test_swap_families.py`, `tests/swap/test_swap_kernels.py` and
    `tests/swap/test_swap_adapted.py` (their default cases run above)."""
    files = [
        "tests/swap/test_swap_families.py",
        "tests/swap/test_swap_kernels.py",
        "tests/swap/test_swap_adapted.py",
    ]
    _pytest_on_jax(files, 85, "--run-large", "-m", "large")


@pytest.mark.large  # a second run of the library's default cases, on JAX
@pytest.mark.xdist_group("jax_library")  # beside the other JAX runs, on the other worker
def test_the_library_tests_pass_on_jax():
    """The library's test files, on JAX with float64 enabled (`JAX_ENABLE_X64`): their
    references and finite differences compute in float64, which JAX otherwise rounds to
    float32. (`tests/backends/test_on_both_backends.py` runs in JAX's default float32 mode.)"""
    env = dict(_jax_env(), JAX_ENABLE_X64="1")
    _pytest_on_jax(LIBRARY, 360, env=env, timeout=3000)


@pytest.mark.large  # a JAX process on 8 simulated devices, about a minute on 2 cores
def test_the_ring_passes_on_8_devices():
    """Context parallelism (`tests/core/ring_on_8_devices.py`): the ring against the
    one-device core, its balance, its buffers, the layer and the refusals."""
    env = dict(_jax_env(devices=8), JAX_ENABLE_X64="1")  # float64 inputs stay float64
    _pytest_on_jax(["tests/core/ring_on_8_devices.py"], 41, env=env)


@pytest.mark.large  # three JAX processes with gloo collectives over localhost
def test_the_ring_across_two_processes_gives_the_one_process_numbers(tmp_path):
    """`tests/core/ring_processes.py`: causal attention and its gradients with the sequence over
    2 processes x 4 CPU devices (`keras.distribution.initialize`), against the same ring in
    one process of 8 devices: the same numbers."""
    script = os.path.join(ROOT, "tests", "core", "ring_processes.py")
    with socket.socket() as free:
        free.bind(("localhost", 0))
        address = f"localhost:{free.getsockname()[1]}"
    one = subprocess.run(
        [sys.executable, script, str(tmp_path / "one.npz"), "1", "0", address],
        env=_jax_env(devices=8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    runs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path / f"two{i}.npz"), "2", str(i), address],
            env=_jax_env(devices=4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for run in runs:
        output = run.communicate(timeout=300)[0]
        assert run.returncode == 0, output[-4000:]
        assert "8 devices, wrote" in output
    want = np.load(tmp_path / "one.npz")
    for i in range(2):
        got = np.load(tmp_path / f"two{i}.npz")
        for name in ("out", "dq", "dk", "dv"):
            np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)


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


MODEL = """
import keras
from keras_sdpa import ScaledDotProductAttention

def small_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 16))
    x = ScaledDotProductAttention(
        num_heads=4, key_dim=8, num_key_value_heads=2, score_mod=None, name="attention"
    )(inputs, inputs, use_causal_mask=True)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))
"""

SAVE_ON_JAX = (
    MODEL
    + """
import sys
import numpy as np
folder = sys.argv[1]
# The TensorFlow session's model, loaded here: the same outputs.
saved = np.load(folder + "/tf.npz")
loaded = keras.saving.load_model(folder + "/tf.keras")
np.testing.assert_allclose(np.asarray(loaded(saved["x"])), saved["y"], atol=1e-6)
# This backend's model, for the session to load.
model = small_model()
x = np.random.default_rng(1).normal(size=(3, 6, 16)).astype("float32")
model.save(folder + "/jax.keras")
np.savez(folder + "/jax.npz", x=x, y=np.asarray(model(x)))
print("saved on jax: ok")
"""
)


@pytest.mark.large  # two JAX processes; the default tier round-trips `.keras` on each backend
def test_keras_files_load_across_backends(tmp_path):
    """A `.keras` file saved here (TensorFlow) loads on JAX with the same outputs, and one
    saved on JAX loads here with its outputs."""
    import keras
    import numpy as np

    namespace = {}
    exec(MODEL, namespace)
    model = namespace["small_model"]()
    x = np.random.default_rng(0).normal(size=(3, 6, 16)).astype("float32")
    model.save(tmp_path / "tf.keras")
    np.savez(tmp_path / "tf.npz", x=x, y=np.asarray(model(x)))
    code, output = _run([sys.executable, "-c", SAVE_ON_JAX, str(tmp_path)], timeout=600)
    assert code == 0 and "saved on jax: ok" in output, output[-4000:]
    saved = np.load(tmp_path / "jax.npz")
    loaded = keras.saving.load_model(tmp_path / "jax.keras")
    np.testing.assert_allclose(np.asarray(loaded(saved["x"])), saved["y"], atol=1e-6)


DATA_PARALLEL = (
    MODEL
    + """
import jax
import numpy as np

assert len(jax.devices()) == 2, jax.devices()
rng = np.random.default_rng(2)
x, y = rng.normal(size=(32, 6, 16)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")

def losses(distribution):
    keras.distribution.set_distribution(distribution)
    model = small_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return history.history["loss"], model

one, _ = losses(None)
two, model = losses(keras.distribution.DataParallel(devices=jax.devices()))
kernel = model.get_layer("attention").query_dense.kernel.value
assert len(kernel.sharding.device_set) == 2, kernel.sharding  # replicated on both
print("losses", one, two)
np.testing.assert_allclose(two, one, rtol=1e-5)
assert two[-1] < two[0]
print("data parallel: ok")
"""
)


def test_data_parallel_on_two_devices_trains_as_one():
    """`keras.distribution.DataParallel` over two host devices: the same losses as one."""
    env = _jax_env(devices=2)
    result = subprocess.run(
        [sys.executable, "-c", DATA_PARALLEL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "data parallel: ok" in output, output[-4000:]


@pytest.mark.large  # the default tier trains on two devices in the test above
def test_the_backends_page_data_parallel_example_runs_on_jax():
    """docs/backends.md's `DataParallel` example (its one `py` block, which the TensorFlow
    session's docs test leaves alone), on two host devices."""
    page = open(os.path.join(ROOT, "docs", "backends.md")).read()
    (example,) = re.findall(r"```py\n(.*?)```", page, flags=re.S)
    assert "DataParallel" in example
    env = _jax_env(devices=2)
    script = example + "\nassert len(jax.devices()) == 2\nprint('example: ok')\n"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "example: ok" in output, output[-4000:]


def test_the_apps_refuse_another_backend_by_name():
    code, output = _run([sys.executable, "-c", "import apps.train_sentiment"], timeout=300)
    assert code != 0
    assert "apps are TensorFlow programs" in output and "KERAS_BACKEND='jax'" in output, output
