"""The suite's own machinery (tests/conftest.py): the two tiers, and the scheduling under
pytest-xdist (the tests that share a module fixture run on one worker, so the fixture is built
once; the others spread out)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODULE = """
import os
import pytest


@pytest.fixture(scope="module")
def built():
    with open(os.environ["BUILT_LOG"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    return os.environ["PYTEST_XDIST_WORKER"]


@pytest.mark.parametrize("index", range(4))
def test_uses_the_fixture(built, index):
    assert built == os.environ["PYTEST_XDIST_WORKER"]


@pytest.mark.parametrize("index", range(6))
def test_on_its_own(index, request):
    assert request.node.get_closest_marker("xdist_group") is None
"""


@pytest.mark.large  # a pytest session of its own, on two workers
def test_tests_sharing_a_module_fixture_build_it_once_on_two_workers(tmp_path):
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_grouping.py").write_text(MODULE)
    log = tmp_path / "built.log"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "--no-loadscope-reorder",
            "-p",
            "no:cacheprovider",
            "-v",
            "test_grouping.py",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, BUILT_LOG=str(log)),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert len(log.read_text().split()) == 1, "the module fixture was built more than once"
    passed = [line.rstrip() for line in result.stdout.splitlines() if " PASSED " in line]
    grouped = [line for line in passed if "test_uses_the_fixture" in line]
    assert len(passed) == 10 and len(grouped) == 4
    assert all(line.endswith("@test_grouping") for line in grouped)
    assert not any("@" in line for line in passed if "test_on_its_own" in line)


TIERS = """
import pytest


@pytest.mark.default_cases({patterns})
@pytest.mark.parametrize("case", ["dense", "chunked", "decode"])
def test_grid(case):
    pass


@pytest.mark.large
def test_heavy():
    pass


def test_plain():
    pass
"""


def _session(folder, *args):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "no:hypothesispytest",
            "-o",
            "addopts=",
            "-rs",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
    )


def test_two_tiers_split_a_grid_and_skip_large_tests_unless_asked(tmp_path):
    """`default_cases` keeps the named cases in the default tier and makes the rest large; a
    large test is skipped with a reason that names `--run-large`, and `--run-large -m large`
    runs exactly what the default tier skipped; a pattern that names no case is an error."""
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_tiers.py").write_text(TIERS.format(patterns='"dense", "deco*"'))
    default = _session(tmp_path, "-v", "test_tiers.py")
    assert default.returncode == 0, default.stdout[-3000:]
    ran = {line.split()[0] for line in default.stdout.splitlines() if " PASSED" in line}
    assert ran == {
        "test_tiers.py::test_grid[dense]",
        "test_tiers.py::test_grid[decode]",
        "test_tiers.py::test_plain",
    }
    assert "3 passed, 2 skipped" in default.stdout
    assert default.stdout.count("run the large tier with `python -m pytest --run-large -m large`")
    large = _session(tmp_path, "-v", "--run-large", "-m", "large", "test_tiers.py")
    assert large.returncode == 0, large.stdout[-3000:]
    ran = {line.split()[0] for line in large.stdout.splitlines() if " PASSED" in line}
    assert ran == {"test_tiers.py::test_grid[chunked]", "test_tiers.py::test_heavy"}
    assert "2 passed, 3 deselected" in large.stdout

    (tmp_path / "test_tiers.py").write_text(TIERS.format(patterns='"dense", "flash"'))
    typo = _session(tmp_path, "--collect-only", "test_tiers.py")
    assert typo.returncode != 0
    assert "default_cases of test_tiers::test_grid: no case matches ['flash']" in typo.stderr
    # One case named on the command line collects only it: no pattern is checked then.
    one = _session(tmp_path, "--collect-only", "test_tiers.py::test_grid[chunked]")
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]


@pytest.mark.large  # a session that imports Keras
def test_a_layer_built_as_a_test_module_is_imported_stops_the_session(tmp_path):
    """What collection made is frozen out of the garbage collector's view, and with it out of
    the swap's scan for other holders of a layer: a test module that builds a Keras layer as
    it is imported is refused, naming it; built in the test, it runs."""
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    module = "import keras\n{}\n\ndef test_it():\n    {}\n"
    built_early = "LAYER = keras.layers.Dense(1, name='built_early')"
    (tmp_path / "test_early.py").write_text(module.format(built_early, "assert LAYER"))
    early = _session(tmp_path, "test_early.py")
    assert early.returncode == pytest.ExitCode.USAGE_ERROR, early.stdout[-2000:]
    assert "a test module built Keras layers as it was imported" in early.stderr
    assert "built_early" in early.stderr
    (tmp_path / "test_early.py").write_text(module.format("", "assert keras.layers.Dense(1)"))
    late = _session(tmp_path, "test_early.py")
    assert late.returncode == 0, late.stdout[-2000:] + late.stderr[-2000:]


@pytest.mark.large  # the core's default cases again, compiled as a user's programs are
def test_the_core_is_right_under_xlas_default_flags(tmp_path):
    """The tiers compile with flags that compile faster (`pytest_configure`); a user's
    programs compile with XLA's defaults (no `XLA_FLAGS`). The default-tier cases of the files
    of the core's three paths (`test_ops`: the dense path, every mask kind, causal, dtype,
    gradients and dropout; `test_chunked`: the chunked path against the dense one and NumPy;
    `test_decode`) pass under those too, in a session with an XLA cache of its own:
    TensorFlow's persistent cache does not key its programs by the flags. The files of the
    features built on these paths (`test_core_features`, `test_mods`, `test_cache`; the mods'
    and the cache's took 105 s and 43 s more of one worker here) run at the tiers' flags
    only."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTEST_ADDOPTS", "KERAS_SDPA_DESELECT")
    }
    env.update(XLA_FLAGS="", TF_XLA_FLAGS="", KERAS_SDPA_TEST_XLA_CACHE=str(tmp_path / "xla"))
    (tmp_path / "xla").mkdir()
    files = ["tests/core/test_ops.py", "tests/core/test_chunked.py", "tests/core/test_decode.py"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-o",
            "addopts=",
            "-q",
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 130, result.stdout[-2000:]
    assert "failed" not in result.stdout
    assert list((tmp_path / "xla").rglob("*.pb")), "nothing compiled into the session's own cache"


def test_what_the_test_modules_imported_is_frozen_before_the_first_test():
    """`pytest_collection_finish` froze the objects of the imports (this module's globals
    among them; Keras's too, where a test module imported it, but a test run before this one
    may import it later): a full collection then walks only what the tests made since."""
    import gc

    made_now = [[]]
    gc.collect()
    tracked = {id(obj) for obj in gc.get_objects()}
    assert id(made_now) in tracked
    assert id(globals()) not in tracked and id(MODULE_OBJECTS) not in tracked


MODULE_OBJECTS = [[], {}]  # made as the module is imported, at collection
