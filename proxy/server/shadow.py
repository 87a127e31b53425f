"""Copies of a request sent alongside the one that serves the client: shadow and verify calls.

:class:`ShadowDispatcher` launches each copy as its own task on its own upstream client with its own
timeouts, so a slow or dead arm cannot delay, alter or fail the client's response. Each arm has a bound
on copies in flight (``max_shadow_inflight``); over it the copy is not sent and its span says
``dropped``. Every copy's span is emitted exactly once, when the copy ends (also when it is cancelled
at shutdown, then with status ``proxy_shutdown``).

:class:`IdentityPair` joins a candidate's output with the baseline's output of the same request: the
side that finishes first waits (in a background task, never in the client's path) for the other.

Example::

    pair = IdentityPair(comparable=True, on_check=metrics.observe_identity)
    dispatcher.send(Copy(candidate, "shadow"), body, make_record, endpoint="chat", pair=pair)
    ...                                   # the primary call to the baseline
    pair.set_baseline(primary_result)     # always, also on failure (None)
    await dispatcher.close(grace_s=30)    # at shutdown: wait, then cancel what is left
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

from specproxy.proxy.identity import compare
from specproxy.proxy.server.routing import Copy
from specproxy.proxy.spans.trace import TraceParent
from specproxy.proxy.upstream.calls import CallResult, UpstreamState, UpstreamTimeout, call_arm
from specproxy.proxy.upstream.sse import Endpoint
from specproxy.proxy.upstream.wire import UpstreamClient
from specproxy.record import SpanRecord

log = logging.getLogger(__name__)


class IdentityPair:
    """The baseline's outcome for one request, awaited by the candidates that compare against it."""

    __slots__ = ("comparable", "_baseline", "_on_check")

    def __init__(self, comparable: bool, on_check: Callable[[str, bool], None] | None = None) -> None:
        self.comparable = comparable
        self._baseline: asyncio.Future[CallResult | None] = asyncio.get_running_loop().create_future()
        self._on_check = on_check

    def set_baseline(self, result: CallResult | None) -> None:
        """The baseline call ended (None: it did not give a usable output). Later calls are ignored."""
        if not self._baseline.done():
            self._baseline.set_result(result if result is not None and result.ok else None)

    async def check(self, candidate: CallResult) -> None:
        """Fill the candidate's identity fields once the baseline is known (no-op if not comparable)."""
        if not self.comparable or not candidate.ok:
            return
        baseline = await self._baseline
        if baseline is None:
            return
        ident = compare(baseline.tap, candidate.tap)
        rec = candidate.record
        rec.identical, rec.first_divergence, rec.divergence_margin = ident
        if self._on_check is not None and ident.identical is not None:
            self._on_check(rec.arm, ident.identical)


class ShadowDispatcher:
    """Sends copies (shadow and verify calls) in tracked background tasks, bounded per arm."""

    def __init__(
        self,
        client: UpstreamClient,
        *,
        timeout: UpstreamTimeout,
        state: UpstreamState,
        emit: Callable[[SpanRecord, TraceParent | None], None],
        capture_output: bool = False,
        on_queue: Callable[[str, float], None] | None = None,
        later: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """``on_queue(arm, seconds)``: each sent copy's wait from being handed over to its upstream send;
        ``later``: where an ended copy's figures and ``emit`` run (None: at once; the proxy's
        :class:`~specproxy.proxy.server.after_calls.AfterCalls`, off the path of the requests that follow)."""
        self.client = client
        self.later = later
        self.on_queue = on_queue
        self.timeout = timeout
        self.state = state
        self.emit = emit
        self.capture_output = capture_output
        self.inflight: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background coroutine that shutdown waits for (and cancels after the grace period)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def send(
        self,
        copy: Copy,
        body: dict[str, Any],
        make_record: Callable[[], SpanRecord],
        *,
        endpoint: Endpoint,
        pair: IdentityPair | None,
        parent: TraceParent | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        """Start one copy; False (and a ``dropped`` span) when the arm is at its bound or we are closing.
        ``make_record``: the copy's span, made in the copy's own task (not in the client's path);
        ``parent``: the trace context the copy's span belongs under (the client's traceparent);
        ``headers``: the client's end-to-end headers, sent on as they are to the primary."""
        arm = copy.arm
        n = self.inflight.get(arm.name, 0)
        if n >= arm.max_shadow_inflight or self._closing:
            record = make_record()
            record.status = "dropped"
            record.error = "shutting down" if self._closing else f"over max_shadow_inflight ({n})"
            record.t_start_ns = time.time_ns()
            record.t_start = datetime.fromtimestamp(record.t_start_ns / 1e9, UTC)
            if pair is not None and arm.role == "baseline":
                pair.set_baseline(None)
            self.emit(record, parent)
            return False
        self.inflight[arm.name] = n + 1
        self.spawn(self._run(copy, body, make_record, endpoint, pair, parent, headers, time.perf_counter()))
        return True

    async def _run(
        self,
        copy: Copy,
        body: dict[str, Any],
        make_record: Callable[[], SpanRecord],
        endpoint: Endpoint,
        pair: IdentityPair | None,
        parent: TraceParent | None,
        headers: Mapping[str, str] | None,
        handed_over: float,
    ) -> None:
        record = make_record()
        is_baseline = copy.arm.role == "baseline"
        result: CallResult | None = None
        try:
            result = await call_arm(
                self.client,
                copy.arm,
                body,
                endpoint=endpoint,
                record=record,
                timeout=self.timeout,
                headers=headers,
                state=self.state,
                capture_output=self.capture_output,
                later=self.later,
            )
            if self.on_queue is not None:
                self.on_queue(copy.arm.name, result.t_send - handed_over)
            if pair is not None:
                if is_baseline:
                    pair.set_baseline(result)
                else:
                    await pair.check(result)
        except asyncio.CancelledError:
            if result is None and record.status == "client_cancelled":  # cancelled mid-call, by the proxy
                record.status, record.error = "proxy_shutdown", "cut by the proxy's shutdown (shadow copy)"
            raise
        except Exception:
            # call_arm never raises for upstream trouble; this is a bug, and it must not go unseen.
            log.exception("shadow call to %s failed", copy.arm.name)
            record.status, record.error = "upstream_error", "internal error in specproxy"
        finally:
            if pair is not None and is_baseline:
                pair.set_baseline(None)
            self.inflight[copy.arm.name] -= 1
            if self.later is None:
                self.emit(record, parent)
            else:
                self.later(functools.partial(self.emit, record, parent))

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def settle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the copies running now to end; returns how many still run."""
        if not self._tasks:
            return 0
        _, still = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return len(still)

    async def close(self, grace_s: float) -> None:
        """Stop sending copies, give running ones ``grace_s`` to finish, then cancel the rest."""
        self._closing = True
        if self._tasks:
            _, still = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in still:
                task.cancel()
            if still:
                log.warning(
                    "cancelled %d shadow calls still running after the %.0fs grace period",
                    len(still),
                    grace_s,
                )
                await asyncio.gather(*still, return_exceptions=True)
