"""Each claim of the derivation, asserted from the measurements of `apps.math_verified`.

The app runs once, in `--quick` mode (20,000 samples per d_k, a 2-epoch training run).
Its bars are stated in standard errors of those samples (see the `check_*` docstrings),
and the tests below also show that each check fails when its claim does not hold.
"""

import copy
import json
import math
import re

import numpy as np
import pytest

from apps import math_report
from apps import math_verified as mv

# Under pytest-xdist, the tests that use `run` share one worker (tests/conftest.py).


# The math app's run (`--quick`, 40 s of one worker) is the large tier's.
LARGE = pytest.mark.large


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output = tmp_path_factory.mktemp("math")
    status = mv.main(["--quick", "--output", str(output)])
    metrics = json.loads((output / "metrics.json").read_text())
    return status, metrics, output


@LARGE
def test_app_writes_results_and_plots(run):
    status, metrics, output = run
    assert status == 0, metrics["holds"]
    table = (output / "results.md").read_text()
    for i, name in math_report.PLOTS:
        png = output / f"claim{i}_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(claim{i}_{name}.png)" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "claim |" not in line]
    assert len(rows) == 6 and all(row.rstrip().endswith("| yes |") for row in rows)
    assert metrics["config"]["quick"] and metrics["config"]["samples"] == 20_000


@LARGE
def test_claim_1_variance_of_dot_product_is_d_k(run):
    variance = run[1]["claims"]["1_variance"]
    for row in variance["rows"]:
        # SE = sqrt((2 d_k^2 + 6 d_k) / n): 1.3% of d_k at d_k = 4, 1.0% at 1024, n = 20,000.
        assert abs(row["variance"] - row["d_k"]) <= 5 * row["standard_error"], row
        assert row["standard_error"] == pytest.approx(
            math.sqrt((2 * row["d_k"] ** 2 + 6 * row["d_k"]) / 20_000)
        )
    assert abs(variance["slope"] - 1) <= 5 * variance["slope_standard_error"]
    assert mv.check_variance(variance)


@LARGE
def test_claim_2_scaling_restores_unit_variance(run):
    claims = run[1]["claims"]
    for row in claims["1_variance"]["rows"]:
        assert abs(row["scaled_variance"] - 1) <= 5 * row["scaled_standard_error"], row
    # The core's own default scale: spread of its log-weights over keys is 1.
    for row in claims["2_core_score_variance"]:
        assert abs(row["variance"] - 1) <= 5 * row["standard_error"], row
        assert row["standard_error"] < 0.06  # the bar is tight enough to mean something
    assert run[1]["holds"]["2_scaled_variance"]


@LARGE
def test_claim_3_unscaled_softmax_saturates(run):
    rows = run[1]["claims"]["3_saturation"]
    entropies = [r["unscaled"]["entropy"] for r in rows]
    assert entropies == sorted(entropies, reverse=True)
    assert rows[-1]["unscaled"]["max_weight"] > 0.8 and entropies[-1] < 0.5
    for row in rows:
        # Scaled scores ~ N(0, 1): entropy near log(128) - 1/2 = 4.35 nats at every d_k.
        assert row["scaled"]["entropy"] == pytest.approx(math.log(128) - 0.5, rel=0.1)
    assert mv.check_saturation(rows, 128)


@LARGE
def test_claim_4_unscaled_gradients_vanish(run):
    rows = run[1]["claims"]["3_saturation"]
    last = rows[-1]
    assert last["unscaled"]["jacobian_norm_median"] < 0.1 * last["scaled"]["jacobian_norm_median"]
    assert mv.check_gradients(rows)


def test_claim_4_differentiates_the_packages_own_attention(monkeypatch):
    """Claim 4's Jacobian comes from keras_sdpa's core and its backward pass, not tf.nn.softmax."""
    calls = []
    core = mv.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("bias") is not None)
        return core(*args, **kwargs)

    monkeypatch.setattr(mv, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(mv.tf.nn, "softmax", None)  # any use of it would fail
    scores = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32)
    norms = mv.softmax_jacobian_norms(mv.tf.constant(scores))
    assert calls == [True] * 5  # one pass through the core per Jacobian row
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = [np.linalg.norm(np.diag(r) - np.outer(r, r)) for r in p.reshape(-1, 5)]
    np.testing.assert_allclose(norms, want, atol=1e-6)


def test_claim_4_jacobian_norm_matches_closed_form():
    """The autodiff Jacobian norm against ||diag(p) - p p^T||_F from NumPy softmax."""
    d_k, length, rows = 64, 16, 32
    measured = mv.measure_saturation([d_k], length, rows, seed=3)[0]
    q, k = (t.numpy().astype(np.float64) for t in mv._queries_and_keys(d_k, length, rows, 3))
    scores = np.einsum("btnh,bsnh->bts", q, k).reshape(-1, length)  # (B * T, S), unscaled
    for name, scale in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(d_k))):
        p = np.exp(scores * scale - (scores * scale).max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        jacobian = np.einsum("ij,jk->ijk", p, np.eye(length)) - np.einsum("ij,ik->ijk", p, p)
        norms = np.linalg.norm(jacobian, axis=(1, 2))
        assert measured[name]["jacobian_norm"] == pytest.approx(norms.mean(), rel=1e-4)
        assert measured[name]["jacobian_norm_median"] == pytest.approx(np.median(norms), rel=1e-4)
        assert measured[name]["max_weight"] == pytest.approx(p.max(-1).mean(), rel=1e-4)


@LARGE
def test_claim_5_unscaled_training_suffers(run):
    training = run[1]["claims"]["5_training"]
    scaled, unscaled = training["scaled"], training["unscaled"]
    assert training["key_dim"] == 512
    assert scaled["steps_to_95"] is not None
    assert unscaled["steps_to_95"] is None or unscaled["steps_to_95"] >= 2 * scaled["steps_to_95"]
    assert scaled["final_val_loss"] < unscaled["final_val_loss"]
    # Same data, same seed, same initial weights: the runs start from one point.
    assert scaled["steps"][0] == unscaled["steps"][0] == 0
    assert abs(scaled["val_accuracy"][0] - unscaled["val_accuracy"][0]) < 0.1
    assert mv.check_training(training)


@LARGE
def test_claim_6_rows_are_distributions_and_output_is_weighted_sum(run):
    weighted = run[1]["claims"]["6_weighted_sum"]
    assert weighted["min_weight"] >= 0
    assert weighted["max_row_sum_error"] <= 1e-5
    assert weighted["max_weight_error"] <= 1e-5  # A from W_Q, W_K against what it returned
    assert weighted["max_masked_weight"] == 0 and weighted["fully_masked_row_sum"] == 0
    assert weighted["max_output_error"] <= 1e-5 * max(1.0, weighted["output_scale"])
    assert mv.check_weighted_sum(weighted)


@LARGE
def test_checks_fail_when_a_claim_breaks(run):
    """Each check rejects a measurement that contradicts its claim."""
    claims = run[1]["claims"]

    variance = copy.deepcopy(claims["1_variance"])
    variance["rows"][-1]["variance"] *= 1.08  # 8%: beyond 5 SE at n = 20,000
    assert not mv.check_variance(variance)
    scaled = copy.deepcopy(claims["1_variance"])
    scaled["rows"][0]["scaled_variance"] = 2.0  # Var(q . k / d_k**0.25) at d_k = 4
    assert not mv.check_scaled_variance(scaled)
    core = copy.deepcopy(claims["2_core_score_variance"])
    core[2]["variance"] = 1.2
    assert not mv.check_core_score_variance(core)

    swapped = [
        {"d_k": r["d_k"], "scaled": r["unscaled"], "unscaled": r["scaled"]}
        for r in claims["3_saturation"]
    ]
    assert not mv.check_saturation(swapped, 128)
    assert not mv.check_gradients(swapped)

    training = copy.deepcopy(claims["5_training"])
    training["scaled"], training["unscaled"] = training["unscaled"], training["scaled"]
    assert not mv.check_training(training)

    weighted = dict(claims["6_weighted_sum"], max_row_sum_error=1e-3)
    assert not mv.check_weighted_sum(weighted)
    weighted = dict(claims["6_weighted_sum"], max_masked_weight=1e-9)
    assert not mv.check_weighted_sum(weighted)
    weighted = dict(claims["6_weighted_sum"], max_weight_error=1e-3)
    assert not mv.check_weighted_sum(weighted)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--samples", "1"], "`--samples` must be at least 2. Received: samples=1"),
        (["--train_epochs", "0"], "`--train_epochs` must be positive. Received: train_epochs=0"),
        (["--key_dims", "8"], r"`--key_dims` needs at least two positive sizes.*\[8\]"),
        (["--learning_rate", "-1"], "learning_rate=-1.0"),
    ],
)
def test_bad_flags_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mv.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_quick_keeps_explicit_flags():
    config = mv.parse_args(["--quick", "--samples", "5000"])
    assert config.samples == 5000 and config.train_epochs == mv._QUICK["train_epochs"]
    assert mv.parse_args([]).samples == 100_000
