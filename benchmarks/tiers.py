"""What each test tier costs on this machine, as `.ci/run` runs them: the figures that
`docs/development.md` quotes (tests/house/test_readme.py checks the quotes against this file).

Runs, one after the other, in this checkout:

- the default tier as the README gives it, `python -m pytest`: its wall time, what passed and
  was skipped;
- the default tier as `.ci/run` runs it, `python -m pytest --cov --cov-report=` (with the line
  coverage CI prints): its wall time, and its coverage of `keras_sdpa/` and `apps/`;
- the large tier, `python -m pytest --run-large -m large`: its wall time and what passed;
- the collection of both tiers, to count the tests in each.

It stops at the first tier that fails.

Usage:
    python benchmarks/tiers.py                      # writes benchmarks/tiers.json
    python benchmarks/tiers.py --output /tmp/tiers.json
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import cpu_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The check of docs/development.md's quote of this script's file: it cannot pass before the
# file is written, so the timed runs leave it out, and so do the sessions they start (the
# Quickstart's check of the docs), through tests/conftest.py's KERAS_SDPA_DESELECT. It is
# collected and counted all the same.
OWN_CHECK = "tests/house/test_readme.py::test_development_page_quotes_the_tiers_as_measured"


def _pytest(*args):
    """Runs pytest with `args` here; returns its wall seconds and its summary counts."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    env = {**os.environ, "KERAS_SDPA_DESELECT": OWN_CHECK}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    if result.returncode != 0:
        failures = re.findall(r"^(?:FAILED|ERROR) .*$", result.stdout, flags=re.M)
        first = result.stdout.find("= FAILURES =")
        sys.exit(
            f"pytest {' '.join(args)} failed ({result.returncode}): {summary}\n"
            + "\n".join(failures)
            + "\n"
            + result.stdout[first : first + 6000]
        )
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|deselected)", summary)}
    print(f"  {seconds:.0f} s: {summary}", flush=True)
    return seconds, counts


def _collected(*args):
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
            "--collect-only",
            "-q",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(re.search(r"(\d+)(?:/\d+)? tests? collected", result.stdout)[1])


def _coverage(package):
    result = subprocess.run(
        [sys.executable, "-m", "coverage", "report", f"--include=*/{package}/*", "--format=total"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(result.stdout.strip())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "tiers.json"))
    args = parser.parse_args(argv)
    default_seconds, default = _pytest()
    covered_seconds, _ = _pytest("--cov", "--cov-report=")
    coverage = {package: _coverage(package) for package in ("keras_sdpa", "apps")}
    large_seconds, large = _pytest("--run-large", "-m", "large")
    record = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "default": {
            "command": "python -m pytest",
            "seconds": round(default_seconds),
            "passed": default.get("passed", 0),
            "skipped": default.get("skipped", 0),
            "collected": _collected("-m", "not large"),
            "seconds_with_coverage": round(covered_seconds),
            "coverage_percent": coverage,
        },
        "large": {
            "command": "python -m pytest --run-large -m large",
            "seconds": round(large_seconds),
            "passed": large.get("passed", 0),
            "collected": _collected("--run-large", "-m", "large"),
        },
        "collected": _collected(),
    }
    with open(args.output, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    print(f"Wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
