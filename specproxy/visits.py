"""How long an arm spent at a level: the time every rate (`agg tok/s`, goodput per second) divides by.

A benchmark client divides its output tokens by its run's duration, first request to last response.
An arm's calls at a level are one such run per visit, so the time at the level is the visits' spans
summed, never first start to last end across the idle time between them:

- a replay round is one visit (its first start to its last end; a replay level's calls from before
  rounds were recorded are one round, as the analysis counts them);
- in serve's traffic (level 'live') a visit is a stretch of calls in which no pause with nothing in
  flight lasts over :data:`IDLE_GAP_S`: a shorter one is the traffic's own (a client's turnaround, a
  load generator's gap between arrivals), a longer one idle time between visits (two benchmark runs,
  a quiet night).

Calls not sent (status 'dropped', a shadow copy the proxy let go) count nothing. Rounds are a GROUP BY;
only serve's traffic needs its calls' order (a window), so a replay store pays no sort for it.
"""

from __future__ import annotations

IDLE_GAP_S = 10.0


def visits_sql(source: str, keys: str = "run_id, arm, level") -> str:
    """A query giving ``keys`` (level among them) and ``busy_s`` (the time at the level, module
    docstring) from ``source``, a table or parenthesised query with ``keys``, round, status, start_s
    and end_s.

    >>> "GROUP BY ALL" in visits_sql("calls")
    True
    """
    sent = f"(SELECT {keys}, round, start_s, end_s FROM {source} WHERE status <> 'dropped')"
    order = f"PARTITION BY {keys} ORDER BY start_s, end_s ROWS BETWEEN UNBOUNDED PRECEDING AND"
    return f"""
    SELECT {keys}, sum(hi - lo) AS busy_s FROM (
        SELECT {keys}, coalesce(round, 0) AS visit, min(start_s) AS lo, max(end_s) AS hi
        FROM {sent} WHERE round IS NOT NULL OR level <> 'live' GROUP BY ALL
        UNION ALL
        SELECT {keys}, -1 - visit, min(start_s), max(end_s) FROM (
            SELECT *, sum(CAST(coalesce(start_s - covered > {IDLE_GAP_S!r}, false) AS INTEGER))
                          OVER ({order} CURRENT ROW) AS visit
            FROM (SELECT *, max(end_s) OVER ({order} 1 PRECEDING) AS covered
                  FROM {sent} WHERE round IS NULL AND level = 'live')
        ) GROUP BY ALL
    ) GROUP BY ALL"""
