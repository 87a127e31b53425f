"""Open-loop request-rate sweeps: `replay --rates` against simulators, levels named by their rate in
the analysis (ordered by load, judged at a rate), `lab --rates`, and mistakes as sentences."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import duckdb
import pytest
from click.testing import CliRunner

from specproxy.analysis import analyze_text
from specproxy.analysis.verdicts.rows import Settings
from specproxy.cli import main
from specproxy.config import Arm
from specproxy.lab.plan import QUICK, default_rates, estimated_capacity
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.runner import WARMUP_MAX_TOKENS, LoadPlan, ReplaySettings, run_replay
from specproxy.proxy.replay.workload import mixed_workload
from specproxy.schema import level_sql, rate_label
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy, spans
from tests.spanfactory import ArmSpec, health_row, make_run, write_db
from tests.support import chat_items, run_cli, simulators
from tests.support import query_rows as rows

ROOT = Path(__file__).resolve().parents[1]
# A lab's or a replay's test on a loaded shared machine takes minutes: pytest-timeout's hang guard
# for them (each command's deadline is what the test has left: tests/processes.py).
RUN_TIMEOUT_S = 600
cli = run_cli


@pytest.fixture
def sim_arms(tmp_path: Path) -> Iterator[Path]:
    """Two simulators in their own processes (plain and eagle3, at the profile's clock) and an
    experiment file naming them."""
    with simulators(base=["--time-scale", "1"], eagle3=["--time-scale", "1", "--method", "eagle3"]) as urls:
        cfg = tmp_path / "exp.toml"
        cfg.write_text(
            f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{urls["base"]}"\n\n'
            f'[[arms]]\nname = "eagle3"\nurl = "{urls["eagle3"]}"\n'
            'speculative = { method = "eagle3", num_speculative_tokens = 3, '
            'model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" }\n'
        )
        yield cfg


def write_log(path: Path, n: int) -> Path:
    lines = [json.dumps({"prompt": f"tell me about topic {i}", "output_tokens": 12}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_rate_sweep_in_rounds_then_analysed_at_a_rate(tmp_path: Path, sim_arms: Path) -> None:
    db = tmp_path / "spans.duckdb"
    res = cli(
        "replay",
        str(write_log(tmp_path / "log.jsonl", 6)),
        "--config",
        str(sim_arms),
        "--rates",
        "40,10,20",
        "--rounds",
        "2",
        "--db",
        str(db),
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert "open-loop start lag p99" in res.stderr
    assert re.search(r"^  r=10 +achieved [0-9.]+ req/s at the slowest round", res.stderr, re.M), res.stderr
    # every item once per rate level and round to each arm; an open-loop level has no concurrency
    spans = rows(
        db,
        "SELECT arm, offered_rate, round, count(*), count(concurrency_level), min(status) FROM requests "
        "GROUP BY ALL ORDER BY ALL",
    )
    assert spans == [
        (arm, rate, k, 6, 0, "ok")
        for arm in ("base", "eagle3")
        for rate in (10.0, 20.0, 40.0)
        for k in (1, 2)
    ]
    # each level-round records the open loop's health: start lag, achieved rate and its shortfall
    health = rows(
        db,
        "SELECT offered_rate, round, list(check_name ORDER BY check_name), count(concurrency_level) "
        "FROM health WHERE arm IS NULL GROUP BY ALL ORDER BY ALL",
    )
    checks = [
        "event_loop_lag_p99_s",
        "event_loop_lag_share",
        "loadgen_start_lag_p99_s",
        "open_loop_achieved_rate",
        "open_loop_rate_shortfall",
        "proxy_queue_p99_s",
    ]
    assert health == [(rate, k, checks, 0) for rate in (10.0, 20.0, 40.0) for k in (1, 2)]
    achieved = rows(db, "SELECT offered_rate, value FROM health WHERE check_name = 'open_loop_achieved_rate'")
    assert all(value > 0 for _, value in achieved)
    phases = {p for (p,) in rows(db, "SELECT DISTINCT phase FROM backend_metrics")}
    assert {
        f"{rate_label(r)} r{k}/2:{w}" for r in (10, 20, 40) for k in (1, 2) for w in ("before", "after")
    } <= (phases)

    out = cli("analyze", str(db), "--format", "json", "--at-rate", "20", "--peak-rate", "40")
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["runs"][0]
    # levels ordered by load, not in the order they ran
    assert [r["level"] for r in run["rows"] if r["arm"] == "base"] == ["r=10", "r=20", "r=40"]
    assert {r["offered_rate"] for r in run["rows"]} == {10.0, 20.0, 40.0}
    assert all(r["rounds"] == 2 for r in run["rows"])
    assert run["at_rate"] == 20.0 and run["peak_rate"] == 40.0 and run["at_concurrency"] is None
    assert run["operating_point"] == "operating point r=20 (command line); peak r=40 (command line)"
    eagle3 = next(a for a in run["arms"] if a["arm"] == "eagle3")
    # the eagle3 simulator decodes faster per user at every rate this machine kept up with; on a
    # machine too busy for any, the deploy verdict is UNRELIABLE and names no operating point
    reliable = [r for r in run["rows"] if r["arm"] == "eagle3" and r["reliable"]]
    assert all(r["decode_speedup"]["point"] > 1.2 for r in reliable), reliable
    if reliable:
        assert eagle3["deploy"]["at_rate"] == 20.0
        assert "at the operating point (r=20" in eagle3["deploy"]["text"]
    else:
        assert eagle3["deploy"]["verdict"] == "UNRELIABLE"


def test_analysis_names_rate_levels_and_gates_them(tmp_path: Path) -> None:
    arms = [
        ArmSpec("base", role="baseline", spec_method="none"),
        ArmSpec("eagle3", speedup=1.5, speedup_by_level={8: 0.8}),
    ]
    health = [
        health_row(
            "run-1", None, "open_loop_rate_shortfall", 0.2, threshold=0.05, round_=1, offered_rate=8.0
        ),
        health_row(
            "run-1", None, "open_loop_rate_shortfall", 0.0, threshold=0.05, round_=1, offered_rate=2.0
        ),
    ]
    run = make_run(arms, levels=(8, 0.5, 2), open_loop=True, rounds=2, health=health)
    db = write_db(tmp_path / "s.duckdb", [run])
    doc = json.loads(analyze_text([db], fmt="json", settings=Settings(at_rate=0.5, peak_rate=2.0)))["runs"][0]
    assert [r["level"] for r in doc["rows"] if r["arm"] == "eagle3"] == ["r=0.5", "r=2", "r=8"]
    # the top of the sweep, whatever its health (the deploy verdict's peak here is the one given)
    assert doc["unreliable_levels"] == ["r=8"] and doc["peak_level"] == "r=8"
    r8 = next(r for r in doc["rows"] if r["arm"] == "eagle3" and r["level"] == "r=8")
    assert r8["verdict"] == "UNRELIABLE" and "open_loop_rate_shortfall 20.0% > 5.0%" in r8["reason"]
    eagle3 = next(a for a in doc["arms"] if a["arm"] == "eagle3")
    assert eagle3["crossover_text"] == "WIN at every tested level (up to r=2)"
    assert eagle3["deploy"]["verdict"] == "WIN" and eagle3["deploy"]["peak_rate"] == 2.0
    # a concurrency operating point does not apply to a sweep of rates, and the run says so
    other = json.loads(analyze_text([db], fmt="json", settings=Settings(at_concurrency=4)))["runs"][0]
    assert other["operating_point"].endswith(
        "--at-concurrency/--peak-concurrency ignored: this run's levels are request rates"
    )
    assert other["at_concurrency"] is None and other["at_rate"] is None
    # the table and the acceptance view name the level the same way
    table = analyze_text([db], fmt="table")
    assert re.search(r"^r=0\.5\s+eagle3\s", table, re.M) and "peak: not given" in table
    acc = rows(db, "SELECT DISTINCT level FROM acceptance ORDER BY level")
    assert acc == [("r=0.5",), ("r=2",), ("r=8",)]


def test_rate_labels_agree_between_python_and_sql() -> None:
    rates = [2.0, 0.5, 0.1, 12.5, 1e-05, 1234567.0, 1 / 3]
    one_row = "(SELECT NULL::INTEGER AS concurrency_level, CAST(? AS DOUBLE) AS offered_rate) t"
    with duckdb.connect() as conn:
        got = [
            conn.execute(f"SELECT {level_sql('t')} FROM {one_row}", [r]).fetchone()[0]  # type: ignore[index]
            for r in rates
        ]
    assert got == [rate_label(r) for r in rates]
    assert rate_label(2.0) == "r=2" and rate_label(0.5) == "r=0.5"


def test_default_rates_span_the_baseline_capacity() -> None:
    items = mixed_workload(100, seed=0, max_tokens_scale=QUICK.max_tokens_scale)
    top = max(QUICK.levels)
    full_speed = estimated_capacity("h100-llama3.1-8b", 1.0, items, top, None)
    assert 50 < full_speed < 1000  # an H100 serving an 8B model at batch 256: some hundred requests/s
    assert estimated_capacity("h100-llama3.1-8b", 0.25, items, top, None) == pytest.approx(full_speed / 4)
    rates = default_rates(full_speed, QUICK.rate_shares)
    assert len(rates) == len(QUICK.rate_shares) and list(rates) == sorted(rates)
    assert rates[-1] == pytest.approx(full_speed, rel=0.05) and rates[0] < full_speed / 16
    # a rate level's arrivals per round: at least its share of --items, at most the top level's round
    assert QUICK.arrivals_per_round(0.01) == -(-QUICK.min_items_per_level // QUICK.rounds)
    assert QUICK.arrivals_per_round(1e6) == top  # one wave of the top level, not its longer rounds


@pytest.mark.parametrize(
    "args, message",
    [
        (["replay", "L", "--target", "http://x", "--rates", "0,2"], "rates must be finite numbers > 0"),
        (
            ["replay", "L", "--target", "http://x", "--rates", "1,fast"],
            "comma-separated list of numbers (requests/s)",
        ),
        (["replay", "L", "--target", "http://x", "--rates", "2,2"], "each rate once"),
        (["replay", "L", "--target", "http://x", "--rates", "1,inf"], "rates must be finite numbers > 0"),
        (["replay", "L", "--target", "http://x", "--rate", "2", "--rates", "1,2"], "not both"),
        (["replay", "L", "--target", "http://x", "--rates", "1,2", "--timed"], "choose one"),
        (["lab", "--concurrency", "1,4", "--rates", "1,2"], "two different sweeps"),
        (["lab", "--at-rate", "2"], "give --rates too"),
        (["lab", "--rates", "1,2", "--at-rate", "4", "--peak-rate", "2"], "must be ≥ --at-rate"),
        (["lab", "--rates", "auto", "--config", "C"], "with --config give the rates"),
        (["analyze", "x.duckdb", "--at-rate", "0"], "--at-rate"),
    ],
)
def test_rate_mistakes_are_sentences(tmp_path: Path, args: list[str], message: str) -> None:
    log = write_log(tmp_path / "l.jsonl", 1)
    cfg = tmp_path / "exp.toml"
    cfg.write_text('[[arms]]\nname = "base"\nrole = "baseline"\nurl = "http://127.0.0.1:9"\n')
    args = [str(log) if a == "L" else str(cfg) if a == "C" else a for a in args]
    res = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "o")] if args[0] == "lab" else args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.stderr


def small_rate_lab(out: Path, rates: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A quick lab of simulated arms (no replica) at the open-loop ``rates``, 4 items and 2 rounds a
    level, the simulators at time scale 2, writing to ``out``."""
    return cli(
        "lab",
        "--no-progress",
        "--quick",
        "--rates",
        rates,
        "--items",
        "4",
        "--rounds",
        "2",
        "--deciding-rounds",
        "0",
        "--time-scale",
        "2",
        "--no-replica",
        *args,
        "--out",
        str(out),
    )


@dataclass(frozen=True)
class RateLab:
    """A finished :func:`small_rate_lab`: its command's result and its output folder."""

    res: subprocess.CompletedProcess[str]
    out: Path


@pytest.fixture(scope="module")
def rate_lab(tmp_path_factory: pytest.TempPathFactory) -> RateLab:
    """One small rate lab that the tests below read (a lab of four arms is ~20 s of arrivals whatever
    the machine): rates 4 and 2, the operating point at r=2, an E2E SLO every arm holds, the peak at
    2 req/s and a GPU price. The counts below are the planned rounds': extra rounds off, since a busy
    machine would add some."""
    out = tmp_path_factory.mktemp("rate-lab") / "lab"
    res = small_rate_lab(
        out,
        "4,2",
        "--extra-rounds",
        "0",
        "--at-rate",
        "2",
        "--slo",
        "e2e_p95=120s",
        "--peak-rate",
        "2",
        "--gpu-hour-usd",
        "2",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return RateLab(res, out)


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_small_lab_sweeps_rates(rate_lab: RateLab) -> None:
    res, out = rate_lab.res, rate_lab.out
    assert "sweep open-loop rates 4,2 req/s in paired mode, 2 rounds per level" in res.stderr
    # the verdict table's rows (the SLO table after it has rows of the same shape)
    table = res.stdout.split("\nby category")[0]
    levels = re.findall(r"^(r=\d+)\s+(\w+)\s+\d+/\d+\s", table, re.M)
    assert levels == [
        (lv, arm) for lv in ("r=2", "r=4") for arm in ("baseline", "draft_model", "eagle3", "ngram")
    ]
    assert re.search(r"simulator clock lag by level .*: r=2 [0-9.]+% \(\w+\), r=4 [0-9.]+%", res.stderr)
    assert "operating point r=2 (experiment file)" in res.stdout
    assert (
        "a rate level r=R loaded the simulators as R / 2 req/s would on the h100-llama3.1-8b clock"
        in res.stderr
    )
    db = out / "specproxy.duckdb"
    # 4 s of arrivals a round (quick): 8 at r=2, 16 at r=4; never fewer than 2 (4 items over 2 rounds)
    counts = rows(
        db,
        "SELECT offered_rate, round, count(*) FROM requests WHERE arm = 'eagle3' GROUP BY ALL ORDER BY ALL",
    )
    assert counts == [(2.0, 1, 8), (2.0, 2, 8), (4.0, 1, 16), (4.0, 2, 16)]
    config = json.loads(rows(db, "SELECT config_json FROM runs")[0][0])
    assert config["at_rate"] == 2.0 and config["at_concurrency"] is None
    assert (out / "report.html").read_text(encoding="utf-8").count("offered rate (req/s)") >= 2


async def test_a_rate_sweep_through_the_proxy_labels_its_spans_with_each_rate(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(tokens=3)) as base,
        running_proxy(tmp_path / "proxy", [{"name": "base", "role": "baseline", "url": base.url}]) as p,
        aiohttp.ClientSession() as session,
    ):
        load = LoadPlan(kind="rate", rates=(100.0, 50.0), warmup=0)
        result = await run_replay(p.replay_settings(tmp_path / "replay.duckdb", load), chat_items(4))
        assert result.per_arm["target"].ok == 8
        header = "X-Specproxy-Offered-Rate"
        for bad in ("fast", "0", "-2", "nan", "inf"):
            body = {"messages": [{"role": "user", "content": "x"}]}
            async with session.post(p.url + "/v1/chat/completions", json=body, headers={header: bad}) as r:
                assert r.status == 400 and header in (await r.json())["error"]["message"], bad
        assert all(header not in h for h in base.stats.headers)  # the proxy's own, never passed on
    labelled = sorted((r["offered_rate"], r["concurrency_level"]) for r in spans(p.db))
    assert labelled == [(50.0, None)] * 4 + [(100.0, None)] * 4


def slo_of(db: Path, *args: str) -> dict[str, Any]:
    res = cli("analyze", str(db), "--format", "json", *args)
    assert res.returncode == 0, res.stdout + res.stderr
    section: dict[str, Any] = json.loads(res.stdout)["runs"][0]["slo"]
    return section


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_a_rate_sweep_at_an_slo_has_its_capacity_in_requests_per_second(rate_lab: RateLab) -> None:
    res = rate_lab.res
    db = rate_lab.out / "specproxy.duckdb"
    slo = slo_of(db)
    assert slo["axis"] == "rate" and slo["source"] == "run's experiment"
    assert slo["peak"] == {"load": 2.0, "axis": "rate", "source": "run's experiment"}
    arms = {a["arm"]: a for a in slo["arms"]}
    assert set(arms) == {"baseline", "ngram", "draft_model", "eagle3"}
    # a busy machine may leave a rate level unreliable: the capacity is over the reliable ones
    reliable: dict[str, list[float]] = {name: [] for name in arms}
    for lv in slo["levels"]:
        if lv["reliable"]:
            reliable[lv["arm"]].append(lv["load"])
    for name, arm in arms.items():
        if not reliable[name]:
            assert arm["capacity"] is None and "no reliable level" in arm["headline"]
            continue
        # every arm holds a 120 s E2E target at every reliable rate: capacity ≥ the top one, in req/s
        capacity = arm["capacity"]
        assert capacity["loads"] == sorted(reliable[name])
        assert capacity["crossing"]["state"] == "every"
        assert capacity["crossing"]["load"] == max(reliable[name])
        assert f"capacity ≥ {max(reliable[name]):g} req/s" in arm["headline"], arm["headline"]
        assert f"capacity ≥ {max(reliable[name]):g} req/s" in res.stdout
    # the fleet is sized for the peak rate, each arm on one GPU at $2 an hour
    fleet = {f["arm"]: f for f in slo["fleet"]}
    assert set(fleet) == set(arms)
    for name, row in fleet.items():
        assert row["gpus_per_replica"] == 1
        if reliable[name]:
            assert row["replicas"] >= 1 and row["cost_per_hour"] == 2.0 * row["gpus"]
    assert "fleet at peak 2 req/s (run's experiment), $2.00 per GPU-hour:" in res.stdout
    # the same store at an SLO no call meets: no capacity measured, the lowest rate named in req/s
    strict = slo_of(db, "--slo", "e2e_p95=1ms")
    assert strict["source"] != "run's experiment"
    for arm in strict["arms"]:
        if arm["capacity"] is not None:
            assert arm["capacity"]["crossing"]["state"] == "none"
            assert arm["capacity"]["crossing"]["load"] is None
            lowest = f"at every tested level (lowest {min(arm['capacity']['loads']):g} req/s)"
            assert f"{lowest}: no capacity measured" in arm["headline"], arm["headline"]
            assert arm["ratio"] is None or arm["ratio"]["point"] is None


@pytest.mark.parametrize("warm_fresh", [True, False])
async def test_a_lab_plan_warms_each_prompt_once_before_it_is_measured(
    tmp_path: Path, warm_fresh: bool
) -> None:
    """An engine's prefix cache would serve a prompt cold only in the first round that sends it; the
    lab's plan sends every prompt once, unrecorded, before the level that first measures it."""
    async with (
        running_backend(BackendConfig(tokens=3)) as base,
        running_backend(BackendConfig(tokens=3)) as cand,
    ):
        items = [
            ReplayItem(f"q{i}", "chat", {"messages": [{"role": "user", "content": f"q {i}"}]})
            for i in range(4)
        ]
        arms = (Arm(name="base", url=base.url, role="baseline"), Arm(name="cand", url=cand.url))
        plan = LoadPlan(
            kind="rate",
            rates=(100.0, 200.0),
            items_per_rate=lambda rate: 2 if rate < 150 else 4,
            rounds=2,
            warmup=0,
            warm_fresh_prompts=warm_fresh,
        )
        settings = ReplaySettings(arms=arms, db_path=tmp_path / "r.duckdb", show_progress=False, load=plan)
        result = await run_replay(settings, items)
        assert result.per_arm["cand"].ok == 2 * 2 + 2 * 4
    for backend in (base, cand):
        sent = [
            (b["messages"][0]["content"], b.get("max_tokens") == WARMUP_MAX_TOKENS)
            for b in backend.stats.bodies
        ]
        warm = [prompt for prompt, is_warm in sent if is_warm]
        if not warm_fresh:
            assert warm == []
            continue
        # q0 and q1 before the first rate, q2 and q3 (new at the second) before it; each prompt's first
        # call is its warm-up
        assert warm == ["q 0", "q 1", "q 2", "q 3"]
        first = {prompt: is_warm for prompt, is_warm in reversed(sent)}
        assert all(first.values())
        assert sent[:2] == [("q 0", True), ("q 1", True)]
