"""Train one configuration of the sentiment app over several seeds and tabulate every one tried.

Usage:
    python -m apps.sweep default --seeds 0 1 2
    python -m apps.sweep lr3e-3 --seeds 0 1 2 -- --learning_rate 3e-3
    python -m apps.sweep --table_only
    python -m apps.sweep command --card saved_models/imdb_sdpa   # the seeds, in a model's card

Each seed runs `python -m apps.train_sentiment FLAGS --seed K` in its own process, into
`--runs/NAME/seedK/`, and its `metrics.json` is kept as
`saved_models/experiments/seeds/NAME/seedK.metrics.json`. A seed already recorded there is
not run again, so an interrupted sweep continues where it stopped. `{seed}` in a flag reads as
the seed (`--self_training_from runs/default/seed{seed}`: each seed's own teacher). The table,
`saved_models/experiments/seeds/README.md`, is written anew from every recorded file: for each
configuration, its flags, the seeds, and validation and test accuracy as mean ± std (sample
standard deviation) and min, plus the mean training time.

`--card MODEL` writes the recorded seeds of configuration NAME into a run's folder as
`seeds.json` (each seed's accuracy and minutes, and their mean ± std) and writes its model card
again with them; each seed must have trained the run's configuration.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS_FOLDER = os.path.join(ROOT, "saved_models", "experiments", "seeds")
RUNS = "/tmp/keras_sdpa_sweep"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m apps.sweep", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("name", nargs="?", help="the configuration's name (a folder name)")
    parser.add_argument("--seeds", type=int, nargs="+", help="the seeds to run (default: 0 1 2)")
    parser.add_argument("--runs", help=f"where the runs write (default: {RUNS})")
    parser.add_argument("--folder", default=SEEDS_FOLDER, help="where metrics.json files are kept")
    parser.add_argument("--table_only", action="store_true", help="only rewrite the table")
    parser.add_argument(
        "--card",
        metavar="MODEL",
        help="write NAME's recorded seeds into this run's folder (seeds.json) and model card",
    )
    parser.add_argument(
        "--compare", nargs="+", metavar="NAME", help="print these configurations seed by seed"
    )
    args, flags = parser.parse_known_args(argv)
    flags = [flag for flag in flags if flag != "--"]
    if args.card:
        _check_card(parser, args, flags)
    args.seeds = [0, 1, 2] if args.seeds is None else args.seeds
    args.runs = RUNS if args.runs is None else args.runs
    if args.compare:
        missing = [n for n in args.compare if not os.path.isdir(os.path.join(args.folder, n))]
        if missing:
            parser.error(f"`--compare` names configurations not in --folder. Received: {missing}")
        args.table_only = True
    if not args.table_only and not args.name:
        parser.error("a configuration `name` is required (or pass --table_only)")
    if args.name and (os.sep in args.name or args.name.startswith(".")):
        parser.error(f"`name` must be a plain folder name. Received: name={args.name!r}")
    if "--seed" in flags or "--output" in flags:
        parser.error("pass seeds with --seeds; the sweep chooses each run's --seed and --output")
    return args, flags


def _check_card(parser, args, flags):
    """`--card` reads configuration `name`'s recorded seeds, all of them, and runs nothing."""
    if not os.path.isfile(os.path.join(args.card, "metrics.json")):
        parser.error(f"`--card` must be a finished run's folder. Received: card={args.card!r}")
    if not args.name:
        parser.error("`--card` needs the configuration `name` whose seeds it writes")
    extra = [
        option
        for option, given in (
            ("--compare", args.compare),
            ("--table_only", args.table_only),
            ("--seeds", args.seeds is not None),
            ("--runs", args.runs is not None),
            ("training flags", flags),
        )
        if given
    ]
    if extra:
        parser.error(
            "`--card` writes every seed recorded for `name` and runs nothing, so it takes no "
            f"{', '.join(extra)}. Received: name={args.name!r}"
        )


def run_seeds(name, seeds, flags, runs, folder):
    """Runs every seed not yet recorded; returns the exit code of the first that failed, or 0."""
    for seed in seeds:
        kept = os.path.join(folder, name, f"seed{seed}.metrics.json")
        if os.path.exists(kept):
            print(f"{name} seed {seed}: recorded already ({kept})")
            continue
        output = os.path.join(runs, name, f"seed{seed}")
        shutil.rmtree(output, ignore_errors=True)
        command = [
            sys.executable,
            "-m",
            "apps.train_sentiment",
            *(flag.replace("{seed}", str(seed)) for flag in flags),
            "--seed",
            str(seed),
            "--output",
            output,
        ]
        print(f"{name} seed {seed}: {' '.join(command[1:])}", flush=True)
        code = subprocess.call(command, cwd=ROOT)
        if code != 0:
            print(f"{name} seed {seed}: the run exited {code}", file=sys.stderr)
            return code
        # Made only now: a configuration whose first seed failed leaves no empty folder behind,
        # which the table would list with no seeds.
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        shutil.copyfile(os.path.join(output, "metrics.json"), kept)
        print(f"{name} seed {seed}: kept {kept}")
    return 0


def read_configurations(folder):
    """`{name: [metrics, ...]}` for every configuration folder, seeds in order."""
    found = {}
    if not os.path.isdir(folder):
        return found
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        files = sorted(
            (f for f in os.listdir(path) if f.endswith(".metrics.json")),
            key=lambda f: int(f.removeprefix("seed").split(".")[0]),
        )
        found[name] = [json.load(open(os.path.join(path, f))) for f in files]
    return found


def summarize(values):
    """`(mean, sample std, min)` of a list of numbers (std 0 for one value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), std, min(values)


def _flags(metrics):
    words = shlex.split(metrics.get("command", ""))[3:]  # after `python -m apps.train_sentiment`
    shown, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word in ("--seed", "--output"):
            skip = True
            continue
        shown.append(word)
    return shlex.join(shown) or "(defaults)"


# Where a run read and wrote, and what it exported besides the model: not a configuration.
_NOT_CONFIGURATION = (
    "seed",
    "output",
    "data_dir",
    "verbose",
    "resume",
    "save_every",
    "inspect_examples",
    "faithfulness_examples",
)


def against_defaults(config, defaults):
    """The flags that turn today's defaults (`defaults`, a dict) into the configuration a run
    recorded (`config`), or "(today's defaults)". The recorded commands are relative to the
    defaults of their day; this column stays true when the defaults change. A value naming
    `seed<K>` of the run's own seed K reads `seed{seed}` (the sweep's `{seed}`)."""
    from .config import FIRST_DEFAULTS

    config = {**FIRST_DEFAULTS, **config}
    if not config.get("naive_bayes_alpha"):
        config["naive_bayes_folds"] = defaults.get("naive_bayes_folds")  # unused without ratios
    flags = []
    for name, default in defaults.items():
        if name in _NOT_CONFIGURATION or name not in config or config[name] == default:
            continue
        value = config[name]
        if isinstance(value, str) and config.get("seed") is not None:
            # A flag that named its seed's own folder reads as the sweep was given it.
            value = re.sub(rf"seed{config['seed']}(?!\d)", "seed{seed}", value)
        flags.append(f"--{name} {'none' if value is None else value}")
    return " ".join(flags) or "(today's defaults)"


def _pretraining_seconds(metrics):
    """What a run's pretrained encoder cost to make (0 without pretraining)."""
    return (metrics.get("pretraining") or {}).get("seconds", 0.0)


def comparison(folder, names):
    """A markdown table of configurations `names` seed by seed: validation and test accuracy
    (%) of each seed they share, then mean ± sample std, from their `metrics.json` files."""
    runs = {
        name: {m["config"]["seed"]: m for m in read_configurations(folder)[name]} for name in names
    }
    seeds = sorted(set.intersection(*(set(by_seed) for by_seed in runs.values())))
    head = "| seed | " + " | ".join(f"`{name}` validation | `{name}` test" for name in names)
    lines = [head + " |", "|---" * (1 + 2 * len(names)) + "|"]
    for seed in seeds:
        cells = [
            f"{100 * runs[name][seed][key]:.2f}%"
            for name in names
            for key in ("validation_accuracy", "test_accuracy")
        ]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    cells = []
    for name in names:
        for key in ("validation_accuracy", "test_accuracy"):
            mean, std, _ = summarize([100 * runs[name][seed][key] for seed in seeds])
            cells.append(f"{mean:.2f} ± {std:.2f}%")
    lines.append("| mean ± std | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cpus(runs):
    """The CPUs `runs` trained on, as their `machine` names them, without the core count."""
    return "; ".join(sorted({m.get("machine", "not recorded").rsplit(", ", 1)[0] for m in runs}))


def write_table(folder):
    import dataclasses

    from .config import Config

    defaults = dataclasses.asdict(Config())
    rows = []
    for name, runs in read_configurations(folder).items():
        if not runs:
            continue
        validation = summarize([100 * m["validation_accuracy"] for m in runs])
        test = summarize([100 * m["test_accuracy"] for m in runs])
        minutes = statistics.fmean(m["train_seconds"] for m in runs) / 60
        pretraining = statistics.fmean(_pretraining_seconds(m) for m in runs) / 60
        seeds = ", ".join(str(m["config"]["seed"]) for m in runs)
        rows.append(
            f"| `{name}` | `{_flags(runs[0])}` | `{against_defaults(runs[0]['config'], defaults)}` "
            f"| {seeds} | "
            f"{validation[0]:.2f} ± {validation[1]:.2f} (min {validation[2]:.2f}) | "
            f"{test[0]:.2f} ± {test[1]:.2f} (min {test[2]:.2f}) | {minutes:.1f} "
            f"| {pretraining:.1f} | {_cpus(runs)} |"
        )
    lines = [
        "# Configurations of the training app, over seeds",
        "",
        "Written by `python -m apps.sweep` from the `metrics.json` files in the folders beside",
        "this one (one per seed). Accuracy in percent: mean ± sample std (min). Configurations",
        "are chosen on validation; test is reported, never used to choose. `flags` is the command",
        "each configuration ran with, on the defaults of its day; `against today's defaults` is",
        "the same configuration as flags on `python -m apps.train_sentiment` today. Minutes",
        "compare only on one CPU (`CPU`, as each run's `machine` names it; two AMD EPYCs",
        "differ threefold here, and the files written before 2026-12-07 name no family).",
        "",
        "| configuration | flags | against today's defaults | seeds | validation | test "
        "| train minutes | pretraining minutes | CPU |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _configuration(config):
    """A run's configuration: its recorded flags, with the ones added since at their first
    defaults, less where it read and wrote."""
    from .config import FIRST_DEFAULTS

    config = {**FIRST_DEFAULTS, **config}
    return {k: v for k, v in config.items() if k not in _NOT_CONFIGURATION}


def seeds_report(folder, name, model):
    """`seeds.json` for the run in `model`: configuration `name`'s recorded seeds, each of which
    trained the run's own configuration (a ValueError names the flags that differ)."""
    from ..inspection import model_card

    runs = read_configurations(folder).get(name)
    if not runs:
        raise ValueError(f"No seeds are recorded for `name` in {folder}. Received: name={name!r}")
    with open(os.path.join(model, "metrics.json")) as f:
        own = _configuration(json.load(f)["config"])
    for run in runs:
        theirs = _configuration(run["config"])
        differing = sorted(k for k in own.keys() | theirs.keys() if own.get(k) != theirs.get(k))
        if differing:
            raise ValueError(
                f"Seed {run['config']['seed']} of {name!r} trained another configuration than "
                f"{model}: {', '.join(f'--{k}' for k in differing)} differ. Received: name={name!r}"
            )

    def stats(values):
        mean, std, least = summarize(values)
        return {"mean": mean, "std": std, "min": least}

    if any("stage_seconds" not in run for run in runs):
        raise ValueError(
            f"The seeds of {name!r} must record their `stage_seconds` (runs since 2026-12-05 "
            f"do). Received: name={name!r}"
        )
    rows = [
        {
            "seed": run["config"]["seed"],
            "validation_accuracy": run["validation_accuracy"],
            "test_accuracy": run["test_accuracy"],
            "minutes": model_card.command_minutes(run["stage_seconds"]),
            "machine": run.get("machine"),
            "git_commit": run.get("git_commit"),
        }
        for run in runs
    ]
    files = os.path.abspath(os.path.join(folder, name))
    if files.startswith(ROOT + os.sep):
        files = os.path.relpath(files, ROOT)
    return {
        "configuration": name,
        "files": files,
        "seeds": rows,
        **{
            key: stats([100 * row[key] for row in rows])
            for key in ("validation_accuracy", "test_accuracy")
        },
    }


def write_card(folder, name, model):
    """Writes `seeds.json` into `model` and its model card again; returns the paths."""
    from ..files import write_json_atomic
    from ..inspection import model_card

    report = seeds_report(folder, name, model)
    path = write_json_atomic(os.path.join(model, "seeds.json"), report)
    with open(os.path.join(model, "metrics.json")) as f:
        metrics = json.load(f)
    card = model_card.write_model_card(metrics, os.path.join(model, "README.md"))
    return path, card


def main(argv=None):
    args, flags = parse_args(argv)
    if args.compare:
        print(comparison(args.folder, args.compare))
        return 0
    if args.card:
        try:
            for path in write_card(args.folder, args.name, args.card):
                print(f"Wrote {path}")
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    code = 0
    if not args.table_only:
        code = run_seeds(args.name, args.seeds, flags, args.runs, args.folder)
    print(f"Wrote {write_table(args.folder)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
