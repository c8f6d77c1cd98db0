"""`apps.sweep`: its flags, its table against the numbers recomputed by hand, and a sweep that
continues where it stopped."""

import dataclasses
import json
import os
import shlex

import pytest

from apps.training import sweep


def _metrics(seed, validation, test, seconds, flags="--dropout 0.4", machine=None):
    from apps.training import config as train_config

    config = dataclasses.asdict(train_config.Config())
    return {
        "validation_accuracy": validation,
        "test_accuracy": test,
        "train_seconds": seconds,
        "config": {**config, "seed": seed, "dropout": 0.25, "output": "/tmp/x"},
        "command": f"python -m apps.train_sentiment {flags} --seed {seed} --output /tmp/x",
        "machine": machine or "AMD EPYC (family 26, model 2), 2 logical CPUs",
    }


def test_table_gives_mean_sample_std_and_min_per_configuration(tmp_path):
    folder = tmp_path / "seeds"
    for seed, (validation, test) in enumerate([(0.90, 0.89), (0.92, 0.905), (0.91, 0.9)]):
        (folder / "wide").mkdir(parents=True, exist_ok=True)
        (folder / "wide" / f"seed{seed}.metrics.json").write_text(
            json.dumps(_metrics(seed, validation, test, 60.0 * (seed + 1)))
        )
    (folder / "one").mkdir()
    (folder / "one" / "seed10.metrics.json").write_text(json.dumps(_metrics(10, 0.5, 0.25, 30)))
    xeon = "Intel(R) Xeon(R) Processor @ 2.10GHz (family 6, model 85), 2 logical CPUs"
    (folder / "one" / "seed11.metrics.json").write_text(
        json.dumps(_metrics(11, 0.5, 0.25, 30, machine=xeon))
    )
    table = open(sweep.write_table(str(folder))).read()
    # Validation 90, 92, 91: mean 91, sample std 1; test 89, 90.5, 90: mean 89.83, std 0.76.
    assert (
        "| `wide` | `--dropout 0.4` | `--dropout 0.25` | 0, 1, 2 | 91.00 ± 1.00 (min 90.00) | "
        "89.83 ± 0.76 (min 89.00) | 2.0 |"
    ) in table
    assert "| 2.0 | 0.0 | AMD EPYC (family 26, model 2) |" in table
    # Minutes on two CPUs: both named.
    assert (
        "| `one` | `--dropout 0.4` | `--dropout 0.25` | 10, 11 | 50.00 ± 0.00 (min 50.00) | 25"
        in table
    )
    assert (
        "| 0.5 | 0.0 | AMD EPYC (family 26, model 2); Intel(R) Xeon(R) Processor @ 2.10GHz "
        "(family 6, model 85) |"
    ) in table


def test_against_todays_defaults_rebuilds_every_recorded_configuration(tmp_path):
    """For every configuration in `saved_models/experiments/seeds/`, the table's flags against
    today's defaults, given to today's app, ask for what its runs recorded (a setting that
    predates its flag counts as what the flag's first default did)."""
    from apps.training import config as train_config
    from apps.training import train as train_sentiment

    # A teacher's folder was another machine's: a stand-in with the files the checks ask for.
    teacher = tmp_path / "teacher"
    (teacher / "saved_model").mkdir(parents=True)
    (teacher / "metrics.json").write_text("{}")
    (teacher / "vocabulary.txt").write_text("")

    defaults = dataclasses.asdict(train_config.Config())
    configurations = sweep.read_configurations(sweep.SEEDS_FOLDER)
    assert len(configurations) >= 10
    shown = set()
    for name, runs in configurations.items():
        flags = sweep.against_defaults(runs[0]["config"], defaults)
        shown.add(flags)
        recorded = {**train_config.FIRST_DEFAULTS, **runs[0]["config"]}
        argv = []  # as the sweep gives them to the app
        if flags != "(today's defaults)":
            argv = shlex.split(flags.replace("{seed}", str(recorded["seed"])))
        if recorded["self_training_from"]:
            argv[argv.index(recorded["self_training_from"])] = str(teacher)
            recorded["self_training_from"] = str(teacher)
        parsed = dataclasses.asdict(train_sentiment.parse_args(argv))
        for key, value in parsed.items():
            unused = key == "naive_bayes_folds" and not recorded["naive_bayes_alpha"]
            if key not in sweep._NOT_CONFIGURATION and not unused:
                assert value == recorded[key], (name, key, flags)
    assert "(today's defaults)" in shown  # the shipped configuration's seeds


def test_a_recorded_seed_is_not_run_again(tmp_path, monkeypatch):
    folder, runs = tmp_path / "seeds", tmp_path / "runs"
    (folder / "cfg").mkdir(parents=True)
    (folder / "cfg" / "seed0.metrics.json").write_text(json.dumps(_metrics(0, 0.9, 0.9, 1)))
    commands = []

    def train(command, cwd):  # stands in for the app's process: writes what it would
        commands.append(command)
        output = command[command.index("--output") + 1]
        os.makedirs(output)
        seed = int(command[command.index("--seed") + 1])
        with open(os.path.join(output, "metrics.json"), "w") as f:
            json.dump(_metrics(seed, 0.8, 0.8, 1), f)
        return 0

    monkeypatch.setattr(sweep.subprocess, "call", train)
    code = sweep.main(
        [
            "cfg",
            "--seeds",
            "0",
            "1",
            "--runs",
            str(runs),
            "--folder",
            str(folder),
            "--",
            "--dropout",
            "0.4",
            "--self_training_from",
            "teachers/seed{seed}",  # each seed's own
        ]
    )
    assert code == 0
    assert len(commands) == 1 and commands[0][-4:] == [
        "--seed",
        "1",
        "--output",
        str(runs / "cfg" / "seed1"),
    ]
    assert commands[0][3:7] == ["--dropout", "0.4", "--self_training_from", "teachers/seed1"]
    assert (folder / "cfg" / "seed1.metrics.json").exists()


def test_a_first_seed_that_fails_leaves_no_configuration_folder(tmp_path, monkeypatch):
    folder, runs = tmp_path / "seeds", tmp_path / "runs"
    folder.mkdir()
    monkeypatch.setattr(sweep.subprocess, "call", lambda command, cwd: 130)  # Ctrl-C
    code = sweep.main(["cfg", "--seeds", "0", "--runs", str(runs), "--folder", str(folder)])
    assert code == 130
    assert not (folder / "cfg").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "a configuration `name` is required"),
        (["a/b"], "Received: name='a/b'"),
        (["cfg", "--", "--seed", "3"], "pass seeds with --seeds"),
    ],
    ids=["no_name", "path", "seed_flag"],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_flag_naming_its_seeds_folder_reads_as_the_sweep_was_given_it():
    defaults = {"seed": 0, "self_training_from": None, "epochs": 2}
    config = {"seed": 2, "self_training_from": "runs/default/seed2", "epochs": 1}
    assert sweep.against_defaults(config, defaults) == (
        "--self_training_from runs/default/seed{seed} --epochs 1"
    )
    config = {"seed": 1, "self_training_from": "runs/seed12", "epochs": 2}  # not seed 1's
    assert sweep.against_defaults(config, defaults) == "--self_training_from runs/seed12"


def test_a_cards_seeds_are_the_runs_configurations_recomputed_by_hand(tmp_path):
    """`--card`: seeds.json and the model card's table, against NumPy's mean and sample std;
    a seed recorded before a flag existed reads it at its first default; a seed of another
    configuration is refused by the flag's name."""
    import numpy as np

    from apps.training import config as train_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "saved_models", "imdb_sdpa", "metrics.json")) as f:
        shipped = json.load(f)
    model = tmp_path / "model"
    model.mkdir()
    (model / "metrics.json").write_text(json.dumps(shipped))
    figures = [(0.91, 0.905, 200.0), (0.915, 0.9, 260.0), (0.90, 0.91, 230.0)]
    (tmp_path / "seeds" / "cmd").mkdir(parents=True)
    for seed, (validation, test, seconds) in enumerate(figures):
        config = {**shipped["config"], "seed": seed, "output": f"/tmp/runs/seed{seed}"}
        if seed == 1:
            config.pop("word_dropout")  # recorded before the flag existed
        run = dict(shipped, validation_accuracy=validation, test_accuracy=test, config=config)
        run["stage_seconds"] = {
            "data": 30.0,
            "pretraining": None,
            "fine_tuning": seconds,
            "report": 45.0,
        }
        (tmp_path / "seeds" / "cmd" / f"seed{seed}.metrics.json").write_text(json.dumps(run))
    assert train_config.FIRST_DEFAULTS["word_dropout"] == shipped["config"]["word_dropout"]
    code = sweep.main(["cmd", "--folder", str(tmp_path / "seeds"), "--card", str(model)])
    assert code == 0
    report = json.loads((model / "seeds.json").read_text())
    tests = 100 * np.array([test for _, test, _ in figures])
    assert report["test_accuracy"]["mean"] == pytest.approx(tests.mean())
    assert report["test_accuracy"]["std"] == pytest.approx(tests.std(ddof=1))
    minutes = [(30 + seconds + 45) / 60 for _, _, seconds in figures]
    assert [row["minutes"] for row in report["seeds"]] == pytest.approx(minutes)
    card = " ".join((model / "README.md").read_text().split())
    assert f"test **{tests.mean():.2f} ± {tests.std(ddof=1):.2f}%** (min 90.00%)" in card
    assert "| 1 | 91.50% | 90.00% | 5.6 |" in card
    # Another configuration's seeds.
    other = dict(run, config={**run["config"], "dropout": 0.1})
    (tmp_path / "seeds" / "other").mkdir()
    (tmp_path / "seeds" / "other" / "seed2.metrics.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"Seed 2 of 'other' .*: --dropout differ"):
        sweep.seeds_report(str(tmp_path / "seeds"), "other", str(model))
    before = (model / "seeds.json").read_text()
    code = sweep.main(["other", "--folder", str(tmp_path / "seeds"), "--card", str(model)])
    assert code == 2 and (model / "seeds.json").read_text() == before  # nothing written


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seeds", "0", "1"], "takes no --seeds."),
        (["--seeds=0"], "takes no --seeds."),
        (["--runs", "/tmp/r"], "takes no --runs."),
        (["--table_only"], "takes no --table_only."),
        (["--compare", "default"], "takes no --compare."),
        (["--", "--dropout", "0.9"], "takes no training flags."),
    ],
    ids=["seeds", "seeds_equals", "runs", "table_only", "compare", "flags"],
)
def test_a_card_runs_nothing_and_reads_every_seed(extra, message, capsys):
    model = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "saved_models", "imdb_sdpa"
    )
    with pytest.raises(SystemExit):
        sweep.parse_args(["command_family26", "--card", model, *extra])
    assert message in capsys.readouterr().err


def test_a_card_needs_a_finished_run_and_a_configuration(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["command_family26", "--card", str(tmp_path)])
    assert f"Received: card={str(tmp_path)!r}" in capsys.readouterr().err
    model = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "saved_models", "imdb_sdpa"
    )
    with pytest.raises(SystemExit):
        sweep.parse_args(["--card", model])
    assert "`--card` needs the configuration `name`" in capsys.readouterr().err


def test_a_cards_seeds_outside_the_checkout_are_named_by_their_whole_path(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shipped = os.path.join(root, "saved_models", "imdb_sdpa")
    (tmp_path / "cmd").mkdir()
    with open(os.path.join(shipped, "metrics.json")) as f:
        run = json.load(f)
    (tmp_path / "cmd" / "seed0.metrics.json").write_text(json.dumps(run))
    report = sweep.seeds_report(str(tmp_path), "cmd", shipped)
    assert report["files"] == str(tmp_path / "cmd")
    inside = sweep.seeds_report(sweep.SEEDS_FOLDER, "command_family26", shipped)
    assert inside["files"] == os.path.join(
        "saved_models", "experiments", "seeds", "command_family26"
    )
    # A seed recorded before runs wrote their stages.
    del run["stage_seconds"]
    (tmp_path / "cmd" / "seed0.metrics.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match="must record their `stage_seconds`"):
        sweep.seeds_report(str(tmp_path), "cmd", shipped)
