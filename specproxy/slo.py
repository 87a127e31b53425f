"""Latency SLOs as input: ``ttft_p95=500ms,itl_p99=80ms,e2e_p95=20s`` on the command line, or the
``[slo]`` table of the experiment file; shared by the config, the lab and the analysis.

A target names a metric, a percentile and a threshold:

=========  ==========================================================  ==============================
metric     per call                                                    span column
=========  ==========================================================  ==============================
ttft       time to the first content chunk                             ``ttft_s``
tpot       (e2e − ttft) / (tokens − 1), vLLM's time per output token   ``tpot_s``
itl        the call's own inter-token latency at the target's          ``itl_p50_s``, ``itl_p95_s``,
           percentile (p50, p95, p99; the next one up in between;      ``itl_p99_s``, ``itl_max_s``
           the largest gap above p99)
e2e        the whole call                                              ``e2e_s``
=========  ==========================================================  ==============================

Percentiles are ``p50`` to ``p99.9``; thresholds take ``ms`` or ``s``.

>>> parse_slo("ttft_p95=500ms,e2e_p99=20s").describe()
'ttft_p95 ≤ 500 ms, e2e_p99 ≤ 20 s'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2e")
_COLUMN = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}
# The per-call ITL percentiles the span record keeps, and the column of each.
_ITL_COLUMNS = ((50.0, "itl_p50_s"), (95.0, "itl_p95_s"), (99.0, "itl_p99_s"))
_NAME = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>\d+(?:\.\d+)?)$")
_VALUE = re.compile(r"^(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s)$")
MIN_PERCENTILE, MAX_PERCENTILE = 50.0, 99.9


class SloError(ValueError):
    """An SLO that cannot be read; the message names the bad part."""


@dataclass(frozen=True)
class SloTarget:
    """One target: the ``percentile`` of ``metric`` over a level's calls must be ≤ ``threshold_s``."""

    metric: str
    percentile: float
    threshold_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile:g}"

    @property
    def column(self) -> str:
        """The span column a call is checked on (for ITL, the call's own percentile at or above)."""
        if self.metric != "itl":
            return _COLUMN[self.metric]
        return next((col for pct, col in _ITL_COLUMNS if self.percentile <= pct), "itl_max_s")

    def describe(self) -> str:
        return f"{self.name} ≤ {format_seconds(self.threshold_s)}"


@dataclass(frozen=True)
class Slo:
    """Every target a call must meet (any subset of the metrics, one target per metric)."""

    targets: tuple[SloTarget, ...]

    def describe(self) -> str:
        return ", ".join(t.describe() for t in self.targets)


def format_seconds(seconds: float) -> str:
    """500 ms, 1.5 s: milliseconds below a second."""
    if seconds < 1.0:
        return f"{seconds * 1000:g} ms"
    return f"{seconds:g} s"


def parse_target(name: str, value: str) -> SloTarget:
    """One ``name=value`` pair, e.g. ``("ttft_p95", "500ms")``."""
    match = _NAME.match(name.strip().lower())
    if match is None:
        raise SloError(
            f"{name!r}: expected METRIC_pPERCENTILE, e.g. ttft_p95 (metrics: {', '.join(METRICS)})"
        )
    metric, pct = match["metric"], float(match["pct"])
    if metric not in METRICS:
        raise SloError(f"{name!r}: unknown metric {metric!r} (one of {', '.join(METRICS)})")
    if not MIN_PERCENTILE <= pct <= MAX_PERCENTILE:
        raise SloError(f"{name!r}: percentile p{pct:g} is outside p50..p99.9")
    number = _VALUE.match(value.strip().lower())
    if number is None:
        raise SloError(f"{name}={value!r}: expected a duration with a unit, e.g. 500ms or 2s")
    seconds = float(number["number"]) / (1000.0 if number["unit"] == "ms" else 1.0)
    if seconds <= 0:
        raise SloError(f"{name}={value!r}: the threshold must be above zero")
    return SloTarget(metric, pct, seconds)


def _targets(pairs: list[tuple[str, str]]) -> Slo:
    targets: list[SloTarget] = []
    for name, value in pairs:
        target = parse_target(name, value)
        if any(t.metric == target.metric for t in targets):
            raise SloError(f"{name!r}: {target.metric} has two targets; give one per metric")
        targets.append(target)
    if not targets:
        raise SloError("no targets; give e.g. ttft_p95=500ms,itl_p99=80ms")
    return Slo(tuple(targets))


def parse_slo(text: str) -> Slo:
    """``ttft_p95=500ms,itl_p99=80ms`` → :class:`Slo`; :class:`SloError` naming the bad part."""
    pairs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise SloError(f"{part!r}: expected NAME=VALUE, e.g. ttft_p95=500ms")
        pairs.append((name, value))
    return _targets(pairs)


def slo_from_table(table: Mapping[str, Any]) -> Slo:
    """The experiment file's ``[slo]`` table (``ttft_p95 = "500ms"``): a bare number is refused, since
    its unit would be a guess."""
    pairs = []
    for name, value in table.items():
        if not isinstance(value, str):
            raise SloError(f'{name}: must be a duration with a unit, such as "500ms" or "20s", got {value!r}')
        pairs.append((name, value))
    return _targets(pairs)


def slo_from_json(value: Any) -> Slo | None:
    """An SLO as a run's recorded experiment holds it (``{"targets": [...]}``); None when absent or
    not readable (an older or hand-written file)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("targets"), list):
        return None
    try:
        targets = tuple(
            SloTarget(str(t["metric"]), float(t["percentile"]), float(t["threshold_s"]))
            for t in value["targets"]
            if str(t["metric"]) in METRICS
        )
    except (KeyError, TypeError, ValueError):
        return None
    return Slo(targets) if targets else None
