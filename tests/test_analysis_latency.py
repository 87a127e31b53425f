"""The latency figures per arm and level (TPOT, pooled ITL, stalls, E2E, queueing, tokens per chunk)
against independent computations from hand-built spans, through `analyze` and the `latency` view."""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from specproxy import schema
from specproxy.record import SpanRecord
from tests.spanfactory import ArmSpec, SyntheticRun, add_latency, make_run, write_db
from tests.support import run_cli as _cli

ARMS = [
    ArmSpec("baseline", "baseline", "none"),
    ArmSpec("eagle3", speedup=1.5, acceptance_rate=0.7),
]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SyntheticRun]:
    run = add_latency(make_run(ARMS, levels=(1, 16), n_per_level=80, seed=11), queue_arms=("eagle3",))
    return write_db(tmp_path_factory.mktemp("latency") / "spans.duckdb", [run]), run


def _expected(run: SyntheticRun) -> dict[tuple[str, str], dict[str, Any]]:
    groups: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in run.spans:
        if s.status == "ok":
            groups[(s.arm, str(s.concurrency_level))].append(s)
    out = {}
    for key, spans in groups.items():
        tpot = [s.tpot_s for s in spans if s.tpot_s is not None]
        gaps = [int(g) / 1e6 for s in spans if s.chunk_gaps_us for g in s.chunk_gaps_us.split(",")]
        sizes = [int(n) for s in spans if s.chunk_tokens for n in s.chunk_tokens.split(",")]
        queue = [s.queue_s for s in spans if s.queue_s is not None]
        e2e = [s.e2e_s for s in spans if s.e2e_s is not None]
        per_call = [s.completion_tokens / s.chunks for s in spans if s.chunks and s.completion_tokens]
        out[key] = {
            "calls": len(spans),
            "mean_tpot_s": float(np.mean(tpot)),
            "p50_tpot_s": float(np.percentile(tpot, 50)),
            "p99_tpot_s": float(np.percentile(tpot, 99)),
            "itl_gaps": len(gaps),
            "p50_itl_s": float(np.percentile(gaps, 50)),
            "p95_itl_s": float(np.percentile(gaps, 95)),
            "p99_itl_s": float(np.percentile(gaps, 99)),
            "max_stall_s": max(s.itl_max_s for s in spans if s.itl_max_s is not None),
            "p50_e2e_s": float(np.percentile(e2e, 50)),
            "p99_e2e_s": float(np.percentile(e2e, 99)),
            "queue_calls": len(queue),
            "p99_queue_s": float(np.percentile(queue, 99)) if queue else None,
            "tokens_per_chunk_basis": "chunks" if sizes else "per-call mean",
            "mean_tokens_per_chunk": float(np.mean(sizes)) if sizes else float(np.mean(per_call)),
            "p50_tokens_per_chunk": float(np.percentile(sizes, 50)) if sizes else None,
            "p99_tokens_per_chunk": float(np.percentile(sizes, 99)) if sizes else None,
        }
    return out


def test_json_latency_figures_match_an_independent_computation(synthetic: tuple[Path, SyntheticRun]) -> None:
    path, run = synthetic
    result = _cli("analyze", str(path), "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["runs"][0]["rows"]
    expected = _expected(run)
    assert len(rows) == len(expected) == 4
    for row in rows:
        want = expected[(row["arm"], row["level"])]
        got = row["latency"]
        for name, value in want.items():
            if isinstance(value, float):
                assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-9), (row["arm"], row["level"], name)
            else:
                assert got[name] == value, (row["arm"], row["level"], name)
    by_arm = {(r["arm"], r["level"]): r["latency"] for r in rows}
    # speculation sends bursts: the candidate's chunks hold more than one token on average
    assert by_arm[("eagle3", "1")]["mean_tokens_per_chunk"] > 1.5
    assert by_arm[("baseline", "1")]["tokens_per_chunk_basis"] == "per-call mean"
    assert by_arm[("baseline", "1")]["queue_calls"] == 0


def test_the_latency_view_on_two_hand_made_calls(tmp_path: Path) -> None:
    run = make_run([ArmSpec("baseline", "baseline", "none")], levels=(4,), n_per_level=2, seed=2)
    a, b = run.spans
    for s in (a, b):
        s.status, s.ttft_s, s.chunks = "ok", 0.1, None
    a.e2e_s, a.completion_tokens, a.chunk_gaps_us, a.chunk_tokens = 1.1, 11, "10000,20000", "1,4,6"
    b.e2e_s, b.completion_tokens, b.chunk_gaps_us, b.chunk_tokens = 0.5, 5, "30000,40000", "2,3"
    a.itl_max_s, b.itl_max_s = 0.020, 0.040
    a.tpot_s, b.tpot_s = 0.1, 0.1
    path = write_db(tmp_path / "two.duckdb", [run])
    with duckdb.connect(str(path), read_only=True) as con:
        rel = con.execute("SELECT * FROM latency")
        names = [d[0] for d in rel.description]
        (row,) = [dict(zip(names, r, strict=True)) for r in rel.fetchall()]
    assert row["itl_gaps"] == 4 and row["itl_calls"] == 2
    assert row["p50_itl_s"] == pytest.approx(0.025)  # between 20 and 30 ms
    assert row["p95_itl_s"] == pytest.approx(0.0385)  # 30 + 0.85 * 10 ms
    assert row["max_stall_s"] == pytest.approx(0.040)
    assert row["mean_tpot_s"] == pytest.approx(0.1)
    assert row["sized_chunks"] == 5 and row["mean_tokens_per_chunk"] == pytest.approx(16 / 5)
    assert row["p50_tokens_per_chunk"] == pytest.approx(3.0)
    assert row["p50_e2e_s"] == pytest.approx(0.8)
    assert row["queue_calls"] == 0 and row["p50_queue_s"] is None


def test_analyze_prints_the_latency_table_only_when_asked(synthetic: tuple[Path, SyntheticRun]) -> None:
    path, run = synthetic
    plain = _cli("analyze", str(path))
    assert plain.returncode == 0, plain.stderr
    assert "ITL ms" not in plain.stdout
    table = _cli("analyze", str(path), "--latency")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("latency (ok calls"))
    header = lines[start + 1]
    assert "TPOT ms mean/P50/P99" in header and "ITL ms P50/P95/P99" in header
    want = _expected(run)[("eagle3", "16")]
    line = next(ln for ln in lines[start + 3 :] if ln.startswith("c=16") and " eagle3 " in ln)
    # TPOT and ITL to the last printed digit (milliseconds, one decimal)
    tpot = " / ".join(f"{want[k] * 1000:.1f}" for k in ("mean_tpot_s", "p50_tpot_s", "p99_tpot_s"))
    itl = " / ".join(f"{want[k] * 1000:.1f}" for k in ("p50_itl_s", "p95_itl_s", "p99_itl_s"))
    assert tpot in line and itl in line
    assert f"{want['mean_tokens_per_chunk']:.2f} (" in line
    base = next(ln for ln in lines[start + 3 :] if ln.startswith("c=16") and " baseline " in ln)
    assert "per call" in base and "~" in base


def test_csv_carries_the_latency_columns(synthetic: tuple[Path, SyntheticRun]) -> None:
    path, run = synthetic
    result = _cli("analyze", str(path), "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = [r for r in csv.DictReader(io.StringIO(result.stdout)) if not r["category"]]
    want = _expected(run)
    for r in rows:
        assert float(r["p99_itl_s"]) == pytest.approx(want[(r["arm"], r["level"])]["p99_itl_s"], rel=1e-9)
        assert r["tokens_per_chunk_basis"] == want[(r["arm"], r["level"])]["tokens_per_chunk_basis"]


def _svg_titled(html: str, title: str) -> str:
    start = html.index(f'aria-label="{title}"')
    return html[start : html.index("</svg>", start)]


def test_the_report_shows_an_itl_cdf_per_arm_at_the_operating_point(
    synthetic: tuple[Path, SyntheticRun], tmp_path: Path
) -> None:
    path, run = synthetic
    out = tmp_path / "report.html"
    result = _cli("report", str(path), "-o", str(out), "--at-concurrency", "16")
    assert result.returncode == 0, result.stderr
    html = out.read_text(encoding="utf-8")
    svg = _svg_titled(html, "Inter-token latency CDF at c=16")
    assert "gap between content chunks (ms)" in svg and "fraction of gaps" in svg
    assert svg.count("<polyline") == 2 and ">baseline<" in svg and ">eagle3<" in svg
    assert "At c=16, the operating point" in html
    want = _expected(run)[("eagle3", "16")]
    assert f"eagle3: P50 {want['p50_itl_s'] * 1000:.1f} ms, P99 {want['p99_itl_s'] * 1000:.1f} ms" in html
    assert "TPOT ms mean/P50/P99" in html  # the latency table
    # without an operating point: the lowest reliable level, said so
    assumed = tmp_path / "assumed.html"
    assert _cli("report", str(path), "-o", str(assumed)).returncode == 0
    text = assumed.read_text(encoding="utf-8")
    assert "Inter-token latency CDF at c=1" in text and "no operating point given" in text


def test_a_level_with_more_gaps_than_parsed_pools_a_stated_sample_of_its_calls(tmp_path: Path) -> None:
    run = make_run([ArmSpec("baseline", "baseline", "none")], levels=(8,), n_per_level=2000, seed=4)
    path = write_db(tmp_path / "big.duckdb", [run])
    with duckdb.connect(str(path)) as con:
        # 300 gaps of 10.000-29.999 ms per call: ~3.6 MB of lists, over the level's parsing budget
        con.execute(
            "UPDATE requests SET chunk_gaps_us = array_to_string(list_transform(range(300), "
            "lambda i: CAST(10000 + hash(request_id, i) % 20000 AS VARCHAR)), ','), "
            "itl_max_s = 0.03 WHERE status = 'ok'"
        )
        rel = con.execute("SELECT * FROM latency")
        names = [d[0] for d in rel.description]
        (row,) = [dict(zip(names, r, strict=True)) for r in rel.fetchall()]
        total_bytes = con.execute(
            "SELECT sum(length(chunk_gaps_us)) FROM requests WHERE status = 'ok'"
        ).fetchone()
    assert total_bytes is not None
    share = schema.LATENCY_SAMPLE_BYTES / total_bytes[0]
    assert 0.2 < share < 0.8 and row["sample_share"] == pytest.approx(share)
    kept = row["itl_calls"] / row["gap_calls"]
    assert abs(kept - share) < 4 * (share * (1 - share) / row["gap_calls"]) ** 0.5  # a uniform sample
    assert row["itl_gaps"] == 300 * row["itl_calls"]
    # the gaps are uniform on [10, 30) ms: the sample's percentiles are where the population's are
    assert row["p50_itl_s"] == pytest.approx(0.020, abs=0.0003)
    assert row["p99_itl_s"] == pytest.approx(0.0298, abs=0.0003)
    assert row["max_stall_s"] == pytest.approx(0.03)  # from every call, not the sample
