"""The calibration fit (pure numpy) and the committed H200 profile. CPU only: torch is not needed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specproxy.engines.calibrate.fit import (
    Point,
    build_profile,
    fit_chain_drafter,
    fit_drafter,
    fit_forward,
    fit_nonnegative_relative,
    fit_prefill,
    profile_problems,
    read_points,
    write_points,
)
from specproxy.engines.calibrate.measure import main as calibrate_main
from specproxy.engines.profiles import PROFILE_DIR, load_profile

H200 = "h200-llama3.1-8b"
STACK = {
    "gpu": "Test GPU",
    "torch": "0.0",
    "dtype": "bfloat16",
    "cuda_graphs": True,
    "weight_bytes_read_per_step": 15_000_000_000,
}


def forward_time(
    t: int, kv: int, base: float = 4.2e-3, per_kv: float = 3.0e-8, per_t: float = 2.4e-5, knee: int = 128
) -> float:
    return base + per_kv * kv + per_t * max(t - knee, 0)


def synthetic_points(noise: float = 0.0, seed: int = 1) -> list[Point]:
    """A grid like the calibrator's, timed by known parameters (times x (1 + noise * N(0,1)))."""
    rng = np.random.default_rng(seed)

    def jitter(t: float) -> float:
        return t * (1.0 + noise * float(rng.standard_normal()))

    pts = [Point("copy", 0, 0, 0, 0, 0, 2e-3, 2e-3, 2e-3, 10, bytes=8_600_000_000)]
    for ctx in (512, 2048, 8192):
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            if b * ctx > 2**19:
                continue
            for q in (1, 2, 4, 8):
                t, kv = b * q, b * (ctx + q)
                y = jitter(forward_time(t, kv))
                pts.append(Point("target", b, q, ctx, t, kv, y, y, y, 10))
            y = jitter(forward_time(b, b * ctx, base=1.1e-3, per_kv=8e-9, per_t=4e-6, knee=64))
            pts.append(Point("draft_model", b, 1, ctx, b, b * (ctx + 1), y, y, y, 10))
            for k in (1, 3, 5):
                y = jitter(3.0e-4 + 1e-9 * b * ctx + 2e-6 * b * k)
                pts.append(Point("eagle3", b, k, ctx, b * (k + 1), b * ctx, y, y, y, 10))
    for chunk in (512, 1024, 2048, 4096, 8192):
        y = jitter(2e-3 + 2.7e-5 * chunk)
        pts.append(Point("prefill", 1, chunk, 0, chunk, chunk, y, y, y, 5))
    return pts


def test_forward_fit_recovers_known_parameters_and_knee() -> None:
    pts = [p for p in synthetic_points() if p.kind == "target"]
    fit = fit_forward([p.batched_tokens for p in pts], [p.kv_tokens for p in pts], [p.median_s for p in pts])
    assert fit.knee_batched_tokens == 128
    assert fit.base_s == pytest.approx(4.2e-3, rel=1e-6)
    assert fit.per_kv_token_s == pytest.approx(3.0e-8, rel=1e-6)
    assert fit.per_batched_token_s == pytest.approx(2.4e-5, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_err < 1e-9


def test_forward_fit_is_close_under_noise() -> None:
    pts = [p for p in synthetic_points(noise=0.02) if p.kind == "target"]
    fit = fit_forward([p.batched_tokens for p in pts], [p.kv_tokens for p in pts], [p.median_s for p in pts])
    assert fit.base_s == pytest.approx(4.2e-3, rel=0.05)
    assert fit.per_kv_token_s == pytest.approx(3.0e-8, rel=0.1)
    assert fit.per_batched_token_s == pytest.approx(2.4e-5, rel=0.05)
    assert 64 <= fit.knee_batched_tokens <= 256
    assert fit.max_rel_err < 0.1


def test_drafter_chain_and_prefill_fits_recover_parameters() -> None:
    pts = synthetic_points()
    ea = [p for p in pts if p.kind == "eagle3"]
    d = fit_drafter(
        [p.batch for p in ea],
        [p.query_tokens for p in ea],
        [p.kv_tokens for p in ea],
        [p.median_s for p in ea],
    )
    assert (d.base_s, d.per_kv_token_s, d.per_spec_token_s) == pytest.approx((3.0e-4, 1e-9, 2e-6), rel=1e-6)
    pre = [p for p in pts if p.kind == "prefill"]
    pf = fit_prefill([p.batched_tokens for p in pre], [p.median_s for p in pre])
    assert (pf.base_s, pf.per_token_s) == pytest.approx((2e-3, 2.7e-5), rel=1e-6)


def test_chain_form_captures_a_per_pass_cost_the_format_cannot() -> None:
    b = np.array([1, 1, 1, 64, 64, 64, 256, 256, 256])
    k = np.array([1, 3, 5] * 3)
    kv = b * 1024
    y = 5e-5 + k * (2.8e-4 + 1e-9 * kv + 1.2e-6 * b)
    chain = fit_chain_drafter(b.tolist(), k.tolist(), kv.tolist(), y.tolist())
    assert chain.per_step_s == pytest.approx(2.8e-4, rel=1e-6)
    assert chain.max_rel_err < 1e-9
    assert fit_drafter(b.tolist(), k.tolist(), kv.tolist(), y.tolist()).max_rel_err > 0.2


def test_nonnegative_fit_never_returns_a_negative_cost() -> None:
    # Times that fall with T would want a negative slope; the fit clamps it to zero instead.
    t = np.array([1.0, 2.0, 4.0, 8.0])
    y = np.array([5e-3, 4.9e-3, 4.8e-3, 4.6e-3])
    fit = fit_nonnegative_relative(np.column_stack([np.ones_like(t), t]), y)
    assert fit.coef[1] == 0.0 and fit.coef[0] > 0
    with pytest.raises(ValueError, match="positive"):
        fit_nonnegative_relative(np.column_stack([np.ones_like(t), t]), np.array([1.0, 0.0, 1.0, 1.0]))


def test_built_profile_follows_the_format_and_loads(tmp_path: Path) -> None:
    profile = build_profile(synthetic_points(noise=0.01), STACK, name="synthetic", date="2026-01-01")
    assert profile_problems(profile) == []
    assert set(profile["drafters"]) >= {"eagle3", "draft_model", "ngram", "suffix"}
    assert "prefill" in profile and profile["fit"]["r2"] > 0.99
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(profile))
    loaded = load_profile(str(path))
    assert loaded.target.knee_batched_tokens == profile["target"]["knee_batched_tokens"]
    assert loaded.supports("eagle3") and loaded.supports("draft_model")


def test_profile_problems_names_each_departure() -> None:
    profile = build_profile(synthetic_points(), STACK, name="synthetic")
    broken = json.loads(json.dumps(profile))
    del broken["target"]["base_s"]
    broken["drafters"]["eagle3"]["per_spec_token_s"] = -1.0
    broken["target"]["knee_batched_tokens"] = 1.5
    broken["step_overhead_s"] = math.nan
    problems = "\n".join(profile_problems(broken))
    for field in (
        "target.base_s",
        "drafters.eagle3.per_spec_token_s",
        "target.knee_batched_tokens",
        "step_overhead_s",
    ):
        assert field in problems


def test_points_round_trip_through_csv(tmp_path: Path) -> None:
    pts = synthetic_points(noise=0.01)
    write_points(tmp_path / "p.csv", pts)
    assert read_points(tmp_path / "p.csv") == pts


def test_committed_h200_profile_is_measured_valid_and_sane() -> None:
    raw = json.loads((PROFILE_DIR / f"{H200}.json").read_text())
    assert profile_problems(raw) == []
    assert "H200" in raw["hardware"]
    stack = json.loads((PROFILE_DIR / f"{H200}.stack.json").read_text())
    assert "H200" in stack["gpu"] and stack["torch"] and stack["driver"]
    profile = load_profile(H200)
    # One batch-1 decode step at 1k context: near the ~3.5 ms weight-read floor, far below the
    # 10 ms eager probe, and never under the floor itself.
    b1 = profile.target.time(1, 1024)
    assert 3.5e-3 < b1 < 8e-3
    # More work never costs less.
    assert profile.target.time(256 * 4, 256 * 2048) > profile.target.time(64, 64 * 2048) > b1
    assert profile.step_time(batched_tokens=1, kv_tokens=1024) == pytest.approx(b1 + raw["step_overhead_s"])


def test_committed_h200_profile_is_the_fit_of_its_points() -> None:
    points = read_points(PROFILE_DIR / f"{H200}.points.csv")
    stack = json.loads((PROFILE_DIR / f"{H200}.stack.json").read_text())
    committed = json.loads((PROFILE_DIR / f"{H200}.json").read_text())
    refit = build_profile(points, stack, name=H200, date=str(stack["date"])[:10])
    for section in ("target", "prefill"):
        for key, value in committed[section].items():
            assert refit[section][key] == pytest.approx(value, rel=1e-9), (section, key)
    for name, spec in committed["drafters"].items():
        for key, value in spec.items():
            assert refit["drafters"][name][key] == pytest.approx(value, rel=1e-9), (name, key)
    measured = {p.kind for p in points}
    assert {"copy", "target", "draft_model", "eagle3", "eagle", "prefill"} <= measured


def test_refit_cli_writes_the_profile_and_explains_missing_files(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(calibrate_main, ["--refit", "--out", str(tmp_path)])
    assert missing.exit_code != 0 and "--refit needs" in missing.output
    write_points(tmp_path / "syn.points.csv", synthetic_points())
    (tmp_path / "syn.stack.json").write_text(json.dumps(STACK))
    result = runner.invoke(calibrate_main, ["--refit", "--out", str(tmp_path), "--name", "syn"])
    assert result.exit_code == 0, result.output
    assert profile_problems(json.loads((tmp_path / "syn.json").read_text())) == []


def test_measuring_without_torch_is_a_sentence_not_a_traceback() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here")
    result = CliRunner().invoke(calibrate_main, ["--out", "unused"])
    assert result.exit_code != 0 and "needs PyTorch" in result.output
    assert not isinstance(result.exception, ImportError)
