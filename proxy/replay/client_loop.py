"""Inside one client process (:mod:`.clients`): the rounds the parent orders, each sent with the
replay's own :meth:`~specproxy.proxy.replay.driving.PhaseDriver.send`, every call that ends shipped
back to the parent in batches (one send per turn of the loop), and at the round's end what this
process measured of itself: its loop lag, its calls' decode times, its start lags.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import multiprocessing.connection
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from specproxy.proxy.health import LoopLagSampler
from specproxy.proxy.replay.clients import ClientReport, ClientSetup, RoundOrder, read_in_thread
from specproxy.proxy.replay.driving import PhaseDriver
from specproxy.proxy.replay.loadgen import LoadStats, closed_loop, open_loop
from specproxy.proxy.replay.planning import CallPlanner, ReplayCall
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import PairJoiner, RunRecorder
from specproxy.proxy.upstream.calls import CallResult, UpstreamState
from specproxy.proxy.upstream.wire import UpstreamClient
from specproxy.record import SpanRecord


class ShippingRecorder(RunRecorder):
    """Records nothing here: every call that ends goes to the parent, which records it as its own."""

    def __init__(self, run_id: str, conn: multiprocessing.connection.Connection) -> None:
        super().__init__(run_id, Path("unused.duckdb"), [], ReplayProgress([], enabled=False))
        self.conn = conn
        self.outbox: list[tuple[str, Any]] = []
        self.decode_s: list[float] = []

    def call(
        self, arm: str, result: CallResult, queued_s: float, joiner: PairJoiner | None, comparable: bool
    ) -> None:
        record = result.record
        if result.ok and record.ttft_s is not None and record.e2e_s is not None:
            self.decode_s.append(record.e2e_s - record.ttft_s)
        self._ship(("call", (arm, result, queued_s, comparable)))

    def emit(self, record: SpanRecord) -> None:
        self._ship(("emit", record))

    def _ship(self, item: tuple[str, Any]) -> None:
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self.outbox.append(item)

    def flush(self) -> None:
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.conn.send(("calls", batch))


class ClientDriver(PhaseDriver):
    """The replay's driver with the engine load the parent forwards instead of a scraper of its own."""

    engine_loads: dict[str, Any]

    def engine_load_of(self, arm: str) -> Any:
        return self.engine_loads.get(arm)


async def _round(
    driver: ClientDriver, recorder: ShippingRecorder, order: RoundOrder, index: int
) -> ClientReport:
    """One round's share: each arm's loop (closed, or open at the calls' offsets) over this process's
    calls, its own loop lag sampled."""
    arms = {a.name: a for a in driver.s.arms}
    recorder.decode_s = []
    stats: list[LoadStats]

    async def split(assigned: tuple[str, ReplayCall]) -> float | None:
        return await driver.send(arms[assigned[0]], assigned[1], routed_as="split", joiner=None)

    def drive(seq: Sequence[Any], send: Callable[[Any], Awaitable[float | None]]) -> Awaitable[LoadStats]:
        if order.offsets_s is not None:
            return open_loop(seq, order.offsets_s, send, deadline_s=order.deadline_s, stop=driver.stop)
        return closed_loop(seq, order.slots, send, deadline_s=order.deadline_s, stop=driver.stop)

    async with LoopLagSampler() as loop_lag:
        if order.assigned:
            stats = [await drive(order.assigned, split)]
        else:
            sends = (
                functools.partial(driver.send, arms[name], routed_as="replay", joiner=None)
                for name in order.arms
            )
            stats = list(await asyncio.gather(*(drive(order.calls, send) for send in sends)))
    return ClientReport(index, stats, loop_lag.lags_s, recorder.decode_s)


async def serve_rounds(conn: multiprocessing.connection.Connection, setup: ClientSetup, index: int) -> None:
    """Run the rounds the parent sends until it says close (or its pipe ends)."""
    inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def received(message: tuple[str, Any] | None) -> None:
        inbox.put_nowait(("close", None) if message is None else message)

    read_in_thread(conn, received)
    recorder = ShippingRecorder(setup.run_id, conn)
    planner = CallPlanner(setup.settings, setup.run_id, [])
    driver = ClientDriver(setup.settings, planner, recorder, recorder.progress, asyncio.Event())
    driver.engine_loads = {}
    driver.models = dict(setup.models)
    driver.state.engines.update(setup.engines)
    async with UpstreamClient() as client:
        driver.client = client
        # What exists now lives for the whole run: out of the collector's sight (see the runner's).
        gc.collect()
        gc.freeze()
        conn.send(("ready", None))
        running: asyncio.Task[ClientReport] | None = None
        order: RoundOrder | None = None
        while True:
            kind, payload = await inbox.get()
            if kind == "close":
                break
            if kind == "load":
                driver.engine_loads = payload
            elif kind == "cancel" and running is not None:
                running.cancel()
            elif kind == "learned":
                _learn(driver.state, *payload)
            elif kind == "round":
                order = payload  # held until "go", which every process gets at once
                conn.send(("held", None))
            elif kind == "go" and order is not None:
                running = asyncio.create_task(_round(driver, recorder, order, index))
                running.add_done_callback(functools.partial(_report, recorder, index))
                order = None


def _learn(
    state: UpstreamState, offsets: dict[tuple[str, str], int | None], merged_share: float | None
) -> None:
    """What the parent learnt of the arms' streams, where this process has not learnt it itself."""
    for key, offset in offsets.items():
        state.chunk_evidence.offsets.setdefault(key, offset)
    if state.merging.merged_share is None:
        state.merging.merged_share = merged_share


def _report(recorder: ShippingRecorder, index: int, task: asyncio.Task[ClientReport]) -> None:
    """A round's end: its calls first, then its report (a cancelled round reports what it measured)."""
    recorder.flush()
    if task.cancelled():
        report = ClientReport(index, [], [], list(recorder.decode_s))
    elif task.exception() is not None:
        recorder.conn.send(("error", f"{task.exception()}"))
        return
    else:
        report = task.result()
    recorder.conn.send(("done", report))
