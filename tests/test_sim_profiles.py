"""Cost profiles: the file format, the step-time formula, and the shape it must give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specproxy.engines.profiles import ProfileError, load_profile, profile_names


def test_h100_profile_matches_the_specdecode_bench_fit() -> None:
    assert "h100-llama3.1-8b" in profile_names()
    p = load_profile("h100-llama3.1-8b")
    assert p.source and p.model == "meta-llama/Llama-3.1-8B-Instruct"
    # batch 1 at 1k context: overhead + 5.886e-3 + 3.926e-8 * 1024 + 2.101e-5 * 1 (~7.2 ms, ~140 tok/s)
    expected = 1.207e-3 + 5.886e-3 + 3.926e-8 * 1024 + 2.101e-5
    assert p.step_time(1, 1024) == pytest.approx(expected)
    # batch 64 at 1k context each ~ 11 ms
    assert p.step_time(64, 64 * 1024) == pytest.approx(0.0111, rel=0.05)


def test_verifying_k_plus_1_is_nearly_free_at_batch_1_and_costly_at_batch_64() -> None:
    p = load_profile("h100-llama3.1-8b")
    one = p.step_time(4, 1024, method="eagle3", drafting_requests=1, k=3) / p.step_time(1, 1024)
    many = p.step_time(64 * 4, 64 * 1024, method="eagle3", drafting_requests=64, k=3) / p.step_time(
        64, 64 * 1024
    )
    assert one < 1.35 < many
    draft_model = p.step_time(4, 1024, method="draft_model", drafting_requests=1, k=3)
    assert draft_model > p.step_time(4, 1024, method="eagle3", drafting_requests=1, k=3)
    ngram = p.step_time(5, 1024, method="ngram", drafting_requests=1, k=4)
    assert ngram == pytest.approx(
        p.step_time(5, 1024) + 0.005875 * (p.step_time(5, 1024) - p.step_overhead_s)
    )


def test_load_by_path_knee_and_prefill(tmp_path: Path) -> None:
    raw = {
        "name": "custom",
        "step_overhead_s": 0.001,
        "target": {
            "base_s": 0.004,
            "per_kv_token_s": 0.0,
            "per_batched_token_s": 1e-5,
            "knee_batched_tokens": 64,
        },
        "drafters": {"eagle": {"base_s": 0.001, "per_kv_token_s": 0, "per_spec_token_s": 0}},
        "prefill": {"base_s": 0.002, "per_token_s": 1e-6},
    }
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(raw))
    p = load_profile(str(path))
    assert p.step_time(64, 0) == pytest.approx(0.005)  # flat below the knee
    assert p.step_time(164, 0) == pytest.approx(0.005 + 100e-5)
    assert p.step_time(1100, 0, prefill_tokens=1000) == pytest.approx(0.005 + 36e-5 + 0.002 + 1000e-6)
    assert p.supports("eagle3") and not p.supports("draft_model")


def test_bad_profiles_raise_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="known profiles"):
        load_profile("missing-gpu")
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x"}')
    with pytest.raises(ProfileError, match="profile format"):
        load_profile(str(broken))
