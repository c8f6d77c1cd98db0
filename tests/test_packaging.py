"""The wheel a `pip install keras-sdpa` would get: what it puts on the path, and that it runs."""

import glob
import os
import subprocess
import sys
import zipfile

import pytest

# Under pytest-xdist, the tests that use this module's module fixtures share one worker
# (tests/conftest.py), so each fixture is built once.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w", str(folder)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = glob.glob(str(folder / "*.whl"))
    return path


def test_wheel_installs_two_packages_of_its_own(wheel):
    """No top-level `apps`: the apps install as `keras_sdpa_apps`, and the scripts use it."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"keras_sdpa", "keras_sdpa_apps"}
    assert "keras_sdpa_apps/predict.py" in names and "keras_sdpa_apps/inspection/page.py" in names
    targets = [line.split("=")[1].strip() for line in scripts.splitlines() if "=" in line]
    assert targets and all(t.startswith("keras_sdpa_apps.") for t in targets), targets


def test_installed_apps_import_each_other_under_their_new_name(wheel, tmp_path):
    """Installed from the wheel alone (no checkout on the path), the predictor runs."""
    target = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         wheel],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    script = (
        "import sys\n"
        "from keras_sdpa_apps import predict\n"
        f"code = predict.main(['--model', {os.path.join(ROOT, 'saved_models', 'imdb_sdpa')!r},"
        " '--xla_cache', '', 'A wonderful, moving film.'])\n"
        "assert 'apps' not in sys.modules and 'keras_sdpa' not in sys.modules\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
        cwd=str(tmp_path), env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("positive")
