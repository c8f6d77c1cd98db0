import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA compiles hundreds of small programs in these tests, most of them run a few times, so
# LLVM's optimization level is set per tier (`pytest_configure`, below). The default tier is
# mostly compiling: at -O0 (against -O1) the core's four test files took 85 s against 103 s on
# two workers, and the session's tiny training run 62 s against 78 s. The large tier runs the
# shipped model on real reviews, where -O0's slower code costs more than it saves (the
# deletion tests there took 136 s against 58 s), so it keeps -O1 (the full suite at -O1: 0.85x
# the CPU time of XLA's default -O2), except in the JAX sessions it starts to run test files
# (`tests/backends/test_jax_backend.py`), which are mostly compiling. The HLO passes (fusion,
# layouts) and the numerics are XLA's own at every level; speed is measured in benchmarks/,
# never here.
# Under pytest-xdist each worker computes on one thread: the two workers fill the two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
# One XLA compilation cache for the whole session (TensorFlow's persistent cache, as
# `apps.predict --xla_cache` uses it): the app's runs in the workers and in the processes the
# tests start compile the same programs. The controller makes the folder before the workers
# start, and they inherit it; it is removed when the session ends. Measured: the suite 466 s
# -> 433 s, 13.3 -> 12.3 CPU-minutes.
if "KERAS_SDPA_TEST_XLA_CACHE" not in os.environ:
    os.environ["KERAS_SDPA_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="keras_sdpa_xla_")
    atexit.register(shutil.rmtree, os.environ["KERAS_SDPA_TEST_XLA_CACHE"], ignore_errors=True)
if "tf_xla_persistent_cache_directory" not in os.environ.get("TF_XLA_FLAGS", ""):
    os.environ["TF_XLA_FLAGS"] = (
        os.environ.get("TF_XLA_FLAGS", "")
        + f" --tf_xla_persistent_cache_directory={os.environ['KERAS_SDPA_TEST_XLA_CACHE']}"
    ).strip()

# The app's tests read IMDB through TFDS. On the project's machines it is prepared at
# ../shared/data/tensorflow_datasets (no network); elsewhere TFDS downloads it.
_SHARED_TFDS = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data", "tensorflow_datasets"
)
if "TFDS_DATA_DIR" not in os.environ and os.path.isdir(_SHARED_TFDS):
    os.environ["TFDS_DATA_DIR"] = os.path.abspath(_SHARED_TFDS)


import fnmatch  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

# Two tiers, keras-hub's way. `python -m pytest` (the README's "the tests") runs the default
# tier: every module's tests, one case per feature, path and dtype against its independent
# reference. `python -m pytest --run-large -m large` runs the large tier: whole app processes
# (interrupt and resume, two replicas and two workers, the Quickstart's run, the shipped model
# on real reviews, the wheel, the math app) and the exhaustive grids (every mod on every path,
# every shape combination, hypothesis's random cases). CI (`.ci/run`) runs both. The markers
# `large` and `default_cases` are declared in pyproject.toml.
LARGE_REASON = "a large test: run the large tier with `python -m pytest --run-large -m large`"


def pytest_addoption(parser):
    parser.addoption(
        "--run-large",
        action="store_true",
        default=False,
        help="also run the tests marked `large` (whole app processes, exhaustive grids)",
    )


# XLA's flags in the tiers (`pytest_configure`): LLVM's -O0 where the tests mostly compile, -O1
# where they also run real work. Every JAX session of `tests/backends/test_jax_backend.py` takes the
# first, in either tier (one of the harness's `fit` tests on JAX took 20 s against 27 s at -O1,
# two alternating pairs), whatever `XLA_FLAGS` pytest was given (the workers inherit the
# tier's flags, so a worker cannot tell them from a user's). The model-parallel runs
# (`tests/swap/test_model_parallel.py`) keep XLA's defaults, as a user's programs do.
COMPILING_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
RUNNING_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"


def pytest_configure(config):
    # Before any test module imports TensorFlow; the workers and the processes the tests start
    # inherit it (the JAX sessions get theirs from `tests/backends/test_jax_backend.py`).
    # Both tiers generate XLA's fused loops with its older emitters, which compile faster than
    # its MLIR fusion emitters: test_ops, test_mods and test_chunked on one worker took 0.80x,
    # 0.96x and 0.86x the time in three alternating pairs, and the default tier with coverage
    # 289 s against 475 s (with two smaller changes). What a user's programs run, XLA's own
    # defaults (no XLA_FLAGS), is tested too:
    # `test_the_core_is_right_under_xlas_default_flags` (large) runs the core's default cases
    # under them.
    os.environ.setdefault(
        "XLA_FLAGS", RUNNING_XLA_FLAGS if config.getoption("--run-large") else COMPILING_XLA_FLAGS
    )


@pytest.fixture(autouse=True)
def _seeded_by_test_name(request):
    """Each test starts from random state of its own, whatever runs before it on its worker.

    Unseeded initializers draw from Keras's and NumPy's global state; under pytest-xdist the
    tests before one on its worker change from run to run, and with them its weights. Seeded
    by the test's name (its file's and its own, not the room's folder, so that a file keeps
    its numbers when it moves), a test computes the same numbers in every run. (A session whose
    tests never import Keras, as test_conftest's own, does not pay for importing it here.)"""
    import random

    import numpy as np

    path, _, test = request.node.nodeid.partition("::")
    name = f"tests/{os.path.basename(path)}::{test}"  # as when the tests lay in one folder
    seed = zlib.crc32(name.encode()) % (2**31)
    if "keras" in sys.modules:
        sys.modules["keras"].utils.set_random_seed(seed)  # Python's, NumPy's, TF's and Keras's
    else:
        random.seed(seed)
        np.random.seed(seed)


# The module groups, slowest first: each is one unit of work for one worker, so the longest
# start first and the single tests fill the other worker around them. In the large tier
# jax's group is ~650 s of one worker (Keras's suites, the swap and the swap's whole harness
# again, on JAX), distribute's ~200 s (three app runs, one of them two processes) and
# jax_library's ~120 s (the library's test files again, on JAX); in
# the default tier app's group trains the session's tiny run (~60 s) and reads it back, and
# the other groups take under a minute each. `--no-loadscope-reorder` (pyproject.toml) keeps
# this order; xdist's own reorder puts the groups with the most tests first, whatever they cost.
GROUPS_SLOWEST_FIRST = (
    "test_distribute",
    "test_app",
    "jax",  # after the first two only because test_app's trains the tiny run others wait on
    "jax_library",
    "test_viewer",
    "test_serving",
    "test_math_verified",
    "test_faithfulness",
    "test_packaging",
)


def pytest_itemcollected(item):
    """Under `--dist loadgroup`, a test shares a worker with its module's expensive fixtures
    only if it uses one of them.

    A test that uses a module-scoped fixture defined in its own module (a trained run, a
    built export, a browser) gets `xdist_group(<module>)`, so that fixture is built once, on
    one worker. Every other test is distributed on its own, so that one worker does not also
    carry the module's quick tests behind its slow fixtures. A test that reaches such a
    fixture only through `request.getfixturevalue` carries the group mark itself.

    The mark is set as each test is collected, before any `pytest_collection_modifyitems`:
    xdist reads the marks in its own. (Under pytest 9.2 xdist 3.8 groups nothing at all,
    pytest-dev/pytest-xdist#1386, so the `dev` extra keeps pytest below 9.2.)"""
    if item.get_closest_marker("xdist_group") or not hasattr(item, "_fixtureinfo"):
        return
    module = item.module.__name__
    for name in item.fixturenames:
        definitions = item._fixtureinfo.name2fixturedefs.get(name)
        if not definitions:
            continue
        definition = definitions[-1]
        if definition.scope == "module" and definition.func.__module__ == module:
            item.add_marker(pytest.mark.xdist_group(module.rsplit(".", 1)[-1]))
            return


def pytest_collection_finish(session):
    """Everything the test modules imported (TensorFlow, JAX, Keras, keras-hub: about 500,000
    objects) leaves the garbage collector's view (`gc.freeze()`), so that a full collection
    walks only what the tests made since. Keras runs one each time a layer deletes a variable
    (`Layer.__delattr__`: 15 in a tiny BERT's `quantize("int8")`, 4.4 s against 0.03 s frozen),
    and Python runs its own. The swap's harness on JAX took 226 s against 324 s.

    Frozen objects are never collected (a cycle through one stays), and `gc.get_referrers`,
    the swap's scan for other models that hold a layer, does not see them: no Keras layer may
    exist yet (a test module that built one as it is imported would hide it from the scan)."""
    gc.collect()
    if "keras" in sys.modules:
        layer = sys.modules["keras"].layers.Layer
        built = [obj for obj in gc.get_objects() if isinstance(obj, layer)]
        if built:
            raise pytest.UsageError(
                "a test module built Keras layers as it was imported; build them in a test "
                f"or a fixture (the session freezes what collection made). Received: {built[:3]}"
            )
    gc.freeze()


# Tests that reach the tiny run by `request.getfixturevalue` (it is not in their fixturenames).
LATE = (
    "test_length_buckets_give_the_full_length_result",
    "test_saved_model_holds_each_graph_once",
    "test_predict_reads_a_file_and_answers_in_input_order",
    "test_cli_writes_the_report_into_the_run_folder",
)


@pytest.hookimpl(tryfirst=True)  # before `-m large` selects on the marks set here
def pytest_collection_modifyitems(config, items):
    """A grid's cases outside its `default_cases` become large; large tests are skipped unless
    `--run-large`; the groups run slowest first (`GROUPS_SLOWEST_FIRST`), then the single
    tests."""
    # A pattern that names no case is a typo that would send the grid away; checked when the
    # whole suite is collected (a node id on the command line collects one case).
    partial = any("::" in arg for arg in config.args)
    unmatched = {}
    for item in items:
        kept = item.get_closest_marker("default_cases")
        if kept is None:
            continue
        test = f"{item.module.__name__}::{item.originalname}"
        unmatched.setdefault(test, set(kept.args))
        case = item.callspec.id if hasattr(item, "callspec") else ""
        matched = {pattern for pattern in kept.args if fnmatch.fnmatchcase(case, pattern)}
        unmatched[test] -= matched
        if not matched:
            item.add_marker(pytest.mark.large)
    for test, patterns in unmatched.items():
        if patterns and not partial:
            raise pytest.UsageError(f"default_cases of {test}: no case matches {sorted(patterns)}")
    if not config.getoption("--run-large"):
        skip = pytest.mark.skip(reason=LARGE_REASON)
        for item in items:
            if item.get_closest_marker("large"):
                item.add_marker(skip)

    # A test of what only TensorFlow has runs in the TensorFlow session alone: on another
    # backend it is deselected (not skipped: a skip would hide a test that should run).
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    tensorflow_only = []
    for item in items:
        mark = item.get_closest_marker("tensorflow_only")
        if mark is None:
            continue
        if not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: tensorflow_only needs its reason")
        if backend != "tensorflow":
            tensorflow_only.append(item)
    if tensorflow_only:
        config.hook.pytest_deselected(items=tensorflow_only)
        left_out = {id(item) for item in tensorflow_only}
        items[:] = [item for item in items if id(item) not in left_out]

    # `benchmarks/tiers.py` times the tiers before it writes the file that one test reads: it
    # names that test in this variable, which the sessions the tests start inherit (the
    # Quickstart's check of the docs is one). Never set in CI.
    unwritten = os.environ.get("KERAS_SDPA_DESELECT", "").split()
    if unwritten:
        left_out = [item for item in items if item.nodeid in unwritten]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.nodeid not in unwritten]

    def rank(item):
        mark = item.get_closest_marker("xdist_group")
        group = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
        if group in GROUPS_SLOWEST_FIRST[:2]:  # test_app's group trains the tiny run
            return GROUPS_SLOWEST_FIRST.index(group)
        if "tiny_run" in getattr(item, "fixturenames", ()) or item.originalname in LATE:
            # Last: by then the tiny run is trained, and no worker waits on its lock.
            return len(GROUPS_SLOWEST_FIRST) + 2
        if group in GROUPS_SLOWEST_FIRST:
            return GROUPS_SLOWEST_FIRST.index(group)
        return len(GROUPS_SLOWEST_FIRST) + (group is None)

    items.sort(key=rank)  # stable: collection order within each rank


# One tiny training run for the whole session: 6 steps of pretraining, then 2 epochs of 6 steps
# on real IMDB reviews, cut to 96 tokens, so that batches run at the length buckets 64 and 96,
# with word pairs and triples, the attention export and the deletion tests. The tests that need
# "a trained model and its SavedModel" (the app, serving, the predictor, the faithfulness
# CLI) read this one run.
TINY_RUN = [
    "--epochs",
    "2",
    "--max_steps",
    "6",
    "--batch_size",
    "32",
    "--sequence_length",
    "96",
    "--vocab_size",
    "3000",
    "--embed_dim",
    "16",
    "--key_dim",
    "8",
    "--ff_dim",
    "32",
    "--bigram_vocab_size",
    "20000",
    "--trigram_vocab_size",
    "5000",
    "--vocabulary_source",
    "train",  # with the unlabelled reviews: a large test of test_app
    "--save_every",
    "2",
    "--inspect_examples",
    "6",
    "--faithfulness_examples",
    "24",
    "--pretrain_steps",
    "6",
    "--predicted_words",
    "1000",  # pretrains on train's reviews
    "--verbose",
    "0",
]


def keras_model_of_run(output, metrics):
    """A run folder's `model.keras` through Keras's own loader, and its vectorizer."""
    import keras

    from apps.classifier import data

    model = keras.saving.load_model(os.path.join(output, "model.keras"))
    vectorizer = data.make_vectorizer(
        metrics["config"]["vocab_size"],
        metrics["config"]["sequence_length"],
        vocabulary=os.path.join(output, "vocabulary.txt"),
    )
    return model, vectorizer


def interrupt_at_step(command, state, env, cwd, deadline=300, poll=0.05):
    """Starts the app's `command`, sends it SIGINT once its checkpoint `state` (a state.json)
    records step 2, and returns the process's stderr (bytes): the interrupt-and-resume tests'
    first half. Fails if the run ends first or does not exit as interrupted (130)."""
    import signal
    import subprocess
    import time

    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd
    )
    try:
        end = time.time() + deadline
        while time.time() < end and process.poll() is None:
            if os.path.exists(state):
                with open(state) as f:
                    if json.load(f)["step"] >= 2:
                        break
            time.sleep(poll)
        assert process.poll() is None, "the run ended before it could be interrupted"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr.decode()[-3000:]
    return stderr


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """`(output folder, metrics)` of `TINY_RUN`, trained once per session.

    Under pytest-xdist the workers share the session's base temporary folder: the first to
    take the file lock trains, the other waits and reads the finished run. `tiny_run.done`,
    written after the app returned, says the run is whole."""
    from apps.training import train

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    output = shared / "tiny_run" / "imdb"
    with FileLock(str(shared / "tiny_run.lock")):
        done = shared / "tiny_run.done"
        if not done.exists():
            shutil.rmtree(output, ignore_errors=True)  # a run another worker left unfinished
            code = train.main([*TINY_RUN, "--output", str(output)])
            assert code == 0, f"the session's tiny run failed with status {code}"
            done.write_text(str(output))
    metrics = json.loads((output / "metrics.json").read_text())
    return str(output), metrics
