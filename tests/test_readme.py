"""The README's Python examples run as written."""

import json
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})


ROOT = README.parent


def _percent(value):
    return f"{100 * value:.2f}%"


def test_readme_results_are_the_committed_metrics():
    """Every accuracy the READMEs quote is the one the app wrote to a metrics.json."""
    metrics = json.loads((ROOT / "saved_models/imdb_sdpa/metrics.json").read_text())
    text = README.read_text()
    assert f"**{_percent(metrics['test_accuracy'])}**" in text
    assert _percent(metrics["validation_accuracy"]) in text
    card = (ROOT / "saved_models/imdb_sdpa/README.md").read_text()
    assert f"{_percent(metrics['test_accuracy'])}" in card


def test_experiment_table_matches_its_metrics_files():
    folder = ROOT / "saved_models/experiments"
    table = (folder / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([\d.]+%) \| ([\d.]+%) \|$", table, flags=re.M)
    assert len(rows) == len(list(folder.glob("*.metrics.json"))) >= 1
    for name, validation, test in rows:
        metrics = json.loads((folder / name).read_text())
        assert validation == _percent(metrics["validation_accuracy"])
        assert test == _percent(metrics["test_accuracy"])
