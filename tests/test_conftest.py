"""The suite's own scheduling under pytest-xdist (tests/conftest.py): the tests that share a
module fixture run on one worker, so the fixture is built once; the others spread out."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "-p", "no:cacheprovider", "-v", "test_grouping.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, BUILT_LOG=str(log)),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert len(log.read_text().split()) == 1, "the module fixture was built more than once"
    passed = [line.rstrip() for line in result.stdout.splitlines() if " PASSED " in line]
    grouped = [line for line in passed if "test_uses_the_fixture" in line]
    assert len(passed) == 10 and len(grouped) == 4
    assert all(line.endswith("@test_grouping") for line in grouped)
    assert not any("@" in line for line in passed if "test_on_its_own" in line)
