"""The wheel a `pip install keras-sdpa` would get: what it puts on the path, and that it runs."""

import glob
import importlib
import os
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w", str(folder)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = glob.glob(str(folder / "*.whl"))
    return path


@pytest.mark.large  # builds the wheel and installs it
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


@pytest.mark.large  # builds the wheel and installs it
def test_installed_apps_import_each_other_under_their_new_name(wheel, tmp_path):
    """Installed from the wheel alone (no checkout on the path), the predictor runs."""
    target = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), wheel],
        capture_output=True,
        text=True,
        timeout=600,
    )
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
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("positive")


def test_every_command_the_docs_show_is_a_module_with_a_main():
    """`python -m apps.<name>` in the README, the pages and the runs' READMEs, and every
    console script, name a module that has a `main`, and every `apps.…` path they name in
    backquotes exists: the commands and the names survive the apps' regrouping."""
    pages = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "apps", "README.md")]
    pages += glob.glob(os.path.join(ROOT, "docs", "*.md"))
    pages += glob.glob(os.path.join(ROOT, "saved_models", "**", "README.md"), recursive=True)
    commands, names = set(), set()
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        commands |= set(re.findall(r"python -m (apps(?:\.\w+)+)", text))
        names |= set(re.findall(r"`(apps(?:\.\w+)+)`", text))
    for name in sorted(names):  # the longest importable module, then its attributes
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attribute in parts[cut:]:
            assert hasattr(found, attribute), f"{name} (named in the docs) does not exist"
            found = getattr(found, attribute)
    assert {"apps.train_sentiment", "apps.predict", "apps.faithfulness", "apps.viewer"} <= commands
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n", f.read(), re.S).group(1)
    for line in scripts.splitlines():
        if "=" in line:
            target = line.split("=", 1)[1].strip().strip('"')
            module, function = target.split(":")
            assert function == "main", line
            commands.add(module.replace("keras_sdpa_apps", "apps", 1))
    for name in sorted(commands):
        module = importlib.import_module(name)
        assert callable(getattr(module, "main", None)), name
