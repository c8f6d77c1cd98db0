import atexit
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA compiles hundreds of small programs in these tests, most of them run a few times: LLVM
# at -O1 compiles them sooner than at XLA's default -O2 (the full suite: 0.85x the CPU time).
# -O0 compiles sooner still (tests/test_chunked.py: 0.74x and 0.77x its -O1 time), but its
# code runs slower, and the deletion tests on the shipped model took 136 s against 58 s: the
# whole suite was no faster (955.6 s against 954.3 s). The HLO passes (fusion, layouts) and
# the numerics are XLA's own either way; speed is measured in benchmarks/, never here.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=1")
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


import zlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded_by_test_name(request):
    """Each test starts from random state of its own, whatever runs before it on its worker.

    Unseeded initializers draw from Keras's and NumPy's global state; under pytest-xdist the
    tests before one on its worker change from run to run, and with them its weights. Seeded
    by the test's name, a test computes the same numbers in every run."""
    import keras

    keras.utils.set_random_seed(zlib.crc32(request.node.nodeid.encode()) % (2**31))


# The module groups, slowest first: each is one unit of work for one worker, so the longest
# start first and the single tests fill the other worker around them. Seconds of one worker,
# from `pytest --durations` on 2 cores: distribute ~350 (three app runs, one of them two
# processes), app ~300 (two runs and an interrupted one), viewer ~110, serving ~90, the rest
# under a minute each. `--no-loadscope-reorder` (pyproject.toml) keeps this order; xdist's own
# reorder puts the groups with the most tests first, whatever they cost.
GROUPS_SLOWEST_FIRST = (
    "test_distribute", "test_app", "test_viewer", "test_serving", "test_math_verified",
    "test_faithfulness", "test_packaging",
)  # fmt: skip


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


def pytest_collection_modifyitems(config, items):
    """The groups run slowest first (`GROUPS_SLOWEST_FIRST`), then the single tests."""

    def rank(item):
        mark = item.get_closest_marker("xdist_group")
        group = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else None
        if group in GROUPS_SLOWEST_FIRST:
            return GROUPS_SLOWEST_FIRST.index(group)
        return len(GROUPS_SLOWEST_FIRST) + (group is None)

    items.sort(key=rank)  # stable: collection order within each rank
