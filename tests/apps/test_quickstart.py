"""The README's two commands work in either order: the Quickstart's run, then the tests.

The run writes a new run folder (`runs/imdb_sdpa/`), never the committed model that the
documentation quotes, so the checks of the documentation still pass after it. (The other
order is every CI run: the tests on a fresh clone.)"""

import hashlib
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _digests(folder):
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.mark.large  # a whole app run (cut to 2 steps) and a pytest session of its own
def test_quickstart_then_the_checks_of_the_docs(tmp_path):
    checkout = tmp_path / "checkout"  # the README's commands run in a checkout of their own
    shutil.copytree(
        ROOT,
        checkout,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "runs",
            "site",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".ruff_cache",
            ".hypothesis",
            ".benchmarks",
            ".coverage*",
            "checkpoints",
            "logs",
        ),
    )
    shipped = _digests(checkout / "saved_models" / "imdb_sdpa")
    readme = (ROOT / "README.md").read_text()
    train, predict = re.search(
        r'^    pip install -e "\.\[dev\]" && (python -m apps\.train_sentiment.*)\n'
        r"    (python -m apps\.predict.*)$",
        readme,
        flags=re.M,
    ).groups()
    train = shlex.split(train)
    # The data where this machine has it; the run cut short, as a newcomer would to try it.
    where = train.index("--data_dir") + 1
    train[where] = os.environ.get("TFDS_DATA_DIR", str((ROOT / train[where]).resolve()))
    train += ["--epochs", "1", "--max_steps", "2", "--faithfulness_examples", "0"]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    result = subprocess.run(
        [sys.executable, *train[1:]],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (checkout / "runs" / "imdb_sdpa" / "metrics.json").is_file()
    assert str(checkout / "runs" / "imdb_sdpa" / "metrics.json") in result.stdout  # said where
    answered = subprocess.run(
        [sys.executable, *shlex.split(predict)[1:]],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert len(answered.stdout.splitlines()) == 2
    assert _digests(checkout / "saved_models" / "imdb_sdpa") == shipped  # the committed model

    # Then the tests: every check of the documentation against the committed files.
    checks = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-q",
            "tests/house/test_readme.py",
            "-k",
            "not example_runs and not builds_strictly",
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert checks.returncode == 0, checks.stdout[-4000:]
    assert " passed" in checks.stdout and "failed" not in checks.stdout
