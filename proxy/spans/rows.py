"""The rows of the span store's side tables, ``backend_metrics`` (the metrics scraper's) and ``health``
(replay's checks of the measurement), and the epoch arithmetic their timestamps need."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np

from specproxy.proxy.spans.table import column_array, epoch_us_to_timestamptz, insert_columns

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class BackendMetricRow(NamedTuple):
    """One row of table ``backend_metrics``: one scraped series of one arm at one moment."""

    run_id: str | None
    arm: str
    scraped_at: datetime  # tz-aware UTC
    phase: str  # 'periodic', or replay's 'c=16:before' / 'c=16:after'
    name: str  # e.g. vllm:spec_decode_num_drafts_total
    labels_json: str  # sorted JSON of the labels, `engine` included
    value: float


class HealthRow(NamedTuple):
    """One row of table ``health``: one check of the measurement itself at one level and round."""

    run_id: str
    arm: str | None  # None: a check of the client side (load generator, event loop, proxy)
    concurrency_level: int | None
    round: int | None
    check_name: str  # engine_clock_lag | event_loop_lag_share | ...: proxy/health.py
    value: float | None
    threshold: float | None  # the limit applied; above it the level is not trusted
    measured_at: datetime  # tz-aware UTC
    offered_rate: float | None = None  # an open-loop level's offered load (requests/s); None otherwise


def epoch_us(t: datetime) -> int:
    t = t if t.tzinfo else t.replace(tzinfo=UTC)
    d = t - _EPOCH
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


def epoch_ns(t: datetime) -> int:
    # Integer arithmetic: a float timestamp would lose the microseconds.
    return epoch_us(t) * 1_000


def insert_backend_metrics(conn: Any, rows: Sequence[BackendMetricRow]) -> None:
    columns = {
        "run_id": column_array([r.run_id for r in rows], "VARCHAR"),
        "arm": column_array([r.arm for r in rows], "VARCHAR"),
        "phase": column_array([r.phase for r in rows], "VARCHAR"),
        "name": column_array([r.name for r in rows], "VARCHAR"),
        "labels_json": column_array([r.labels_json for r in rows], "VARCHAR"),
        "value": column_array([float(r.value) for r in rows], "DOUBLE"),
        "_scraped_us": (np.array([epoch_us(r.scraped_at) for r in rows], dtype=np.int64), None),
    }
    insert_columns(conn, "backend_metrics", columns, {"scraped_at": epoch_us_to_timestamptz("_scraped_us")})
