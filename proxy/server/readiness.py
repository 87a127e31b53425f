"""Whether the proxy can serve now (``GET /ready``), as a load balancer's readiness probe asks.

``/health`` answers as long as the process runs (liveness: restart it when that fails). ``/ready``
answers 503 with the reasons while the proxy could only fail its clients or lose their spans:

- the baseline is unreachable: its ``/health`` is probed on each ``/ready`` (one short GET; refused,
  timed out or a 5xx), so the answer turns within one probe period of the baseline going away or
  coming back. In split mode every arm with weight serves clients, but the baseline is the one a
  shadow deployment depends on, and the one a split deployment verifies against;
- the span store cannot be written: the writer failed rows since the previous probe and wrote none,
  or its queue is full (spans are being dropped);
- the proxy is shutting down.

Example::

    readiness = Readiness(exp.baseline, session, sink_counts=lambda: SinkCounts(written, failed, depth, size))
    problems = await readiness.problems()      # []: ready
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import aiohttp

from specproxy.config import Arm
from specproxy.proxy.upstream.stacks import arm_auth

# One probe of the baseline must answer well within a readiness probe's own timeout (Kubernetes: 1 s).
PROBE_TIMEOUT_S = 0.8


class SinkCounts(NamedTuple):
    """The span writer's counters at one moment."""

    written: int
    failed: int
    queue_depth: int
    queue_size: int


def span_store_problem(before: SinkCounts | None, now: SinkCounts) -> str | None:
    """Why the span store is not taking spans now (None: it is), from two readings of its counters.

    >>> span_store_problem(SinkCounts(10, 0, 0, 100), SinkCounts(10, 3, 0, 100))
    'the span store failed to write 3 spans since the last check and wrote none (see the log)'
    >>> span_store_problem(SinkCounts(10, 0, 0, 100), SinkCounts(12, 3, 0, 100)) is None
    True
    """
    if now.queue_depth >= now.queue_size:
        return f"the span queue is full ({now.queue_depth} spans): new spans are dropped"
    if before is not None and now.failed > before.failed and now.written == before.written:
        failed = now.failed - before.failed
        return (
            f"the span store failed to write {failed} spans since the last check and wrote none (see the log)"
        )
    return None


class Readiness:
    """The checks behind ``GET /ready``; ``sink_counts`` is None while no span store is open."""

    def __init__(
        self,
        baseline: Arm,
        session: aiohttp.ClientSession,
        sink_counts: Callable[[], SinkCounts | None],
    ) -> None:
        self.baseline = baseline
        self.session = session
        self.sink_counts = sink_counts
        self._last: SinkCounts | None = None

    async def problems(self) -> list[str]:
        """Every reason the proxy is not ready, in words ([]: ready)."""
        found: list[str] = []
        counts = self.sink_counts()
        if counts is None:
            found.append("the span store is not open")
        else:
            problem = span_store_problem(self._last, counts)
            self._last = counts
            if problem is not None:
                found.append(problem)
        baseline = await self._probe_baseline()
        if baseline is not None:
            found.append(baseline)
        return found

    async def _probe_baseline(self) -> str | None:
        arm = self.baseline
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with self.session.get(f"{arm.url}/health", headers=arm_auth(arm), timeout=timeout) as resp:
                await resp.read()
                if resp.status >= 500:
                    return f"baseline {arm.name} answered /health with HTTP {resp.status}"
                return None  # (a server without /health answers 404: it is up)
        except TimeoutError:
            return f"baseline {arm.name} did not answer /health within {PROBE_TIMEOUT_S:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return f"baseline {arm.name} is unreachable: {exc.__class__.__name__}: {exc}"
