"""Replay's client processes (``--client-processes N``): a round's calls spread over N
processes, each with its own event loop and HTTP client, so that the load generator keeps up with
engines that stream faster than one Python process can read.

Each process sends its share of the round's calls through the same
:meth:`~specproxy.proxy.replay.driving.PhaseDriver.send` (and so
:func:`~specproxy.proxy.upstream.calls.call_arm`) as a one-process replay; every call's result
(span, output facts) comes back pickled through a pipe, and the parent records it exactly as it
records its own calls: greedy identity, totals and the one span store stay in the parent. The parent
keeps the round's scrapes and clock readings, the warm-ups and a pacer's trials, and forwards each
engine-load scrape to the processes (the load a call's span carries).

How a level of ``c`` slots is shared: process k of N gets ``c // N`` slots, one more for the first
``c % N``; call i of the round goes to the process owning slot ``i % c``, so each process's queue is
in the round's order and the call counts match its slots. An open loop's call i goes to process
``i % N`` at its own offset, every process starting its schedule at the same moment, and each
arm's stats are combined over the processes (:func:`round_stats`), so its rates are the arm's.
A process measures its own loop lag, decode times and start lags; its health rows are
``client K <check>`` (:func:`client_rows`), and the round's unprefixed loop-lag rows are those of
its worst process, so that a round fails if any process fell behind.

    pool = ClientPool(setup, 4)
    await pool.start()
    joiner = await pool.send_round(phase, calls, SharedLoad(level=16), recorder, draw)
    reports = await pool.run_round(recorder, joiner)   # recorder.call(...) for each call as it ends
    await pool.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import multiprocessing
import multiprocessing.connection
import signal
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.reduction import ForkingPickler
from types import MappingProxyType
from typing import Any

from specproxy.config import Arm
from specproxy.proxy.health import (
    EVENT_LOOP_LAG,
    EVENT_LOOP_LAG_SHARE,
    LOADGEN_START_LAG,
    THRESHOLDS,
    loop_lag_share,
    p99,
)
from specproxy.proxy.replay.loadgen import LoadStats
from specproxy.proxy.replay.planning import LoadPlan, Phase, ReplayCall, ReplayError, ReplaySettings, rotated
from specproxy.proxy.replay.recording import PairJoiner, RunRecorder
from specproxy.proxy.spans.sink import HealthRow
from specproxy.proxy.upstream.calls import CallResult, UpstreamState

# How long a process may take to start (spawn: a fresh interpreter importing the replay).
START_TIMEOUT_S = 120.0
# How long a cancelled round waits for its processes to report their cancelled calls.
CANCEL_TIMEOUT_S = 30.0


def _read_only(items: dict[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(items)


def _reduce_read_only(m: MappingProxyType[Any, Any]) -> tuple[Any, tuple[dict[Any, Any]]]:
    return _read_only, (dict(m),)


# The settings' arms (and scrapes) keep their mappings read-only (MappingProxyType), which pickle
# cannot copy: between the processes they travel as a dict and arrive read-only again.
ForkingPickler.register(MappingProxyType, _reduce_read_only)

# A call that ended: (arm name, its result, handed over → sent, its body comparable for identity).
Called = tuple[str, CallResult, float, bool]


@dataclass(frozen=True, slots=True)
class ClientSetup:
    """What every process needs, sent once: the settings (less what cannot be pickled or is not
    needed to send), the run, each arm's model and the engines the probe found."""

    settings: ReplaySettings
    run_id: str
    models: dict[str, str | None]
    engines: dict[str, str]


@dataclass(frozen=True, slots=True)
class SharedLoad:
    """How a round's calls are sent, for the processes to share: a closed loop at ``level`` slots
    per arm, or an open loop whose call i leaves at ``offsets_s[i]``; none starts after ``deadline_s``."""

    level: int | None = None
    offsets_s: Sequence[float] | None = None
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class RoundOrder:
    """One process's share of a round: ``slots`` per arm over ``calls`` (paired: to every arm of
    ``arms``, in that order) or over ``assigned`` (split: each call to its one arm); an open loop's
    share has each call's offset in ``offsets_s`` instead of slots."""

    phase: Phase
    slots: int
    deadline_s: float | None
    arms: tuple[str, ...]
    calls: list[ReplayCall] = field(default_factory=list)
    assigned: list[tuple[str, ReplayCall]] = field(default_factory=list)
    offsets_s: list[float] | None = None


@dataclass(slots=True)
class ClientReport:
    """What a process measured over its share of a round."""

    index: int
    stats: list[LoadStats]
    loop_lags_s: list[float]
    decode_s: list[float]

    def loop_share(self) -> float | None:
        return loop_lag_share(self.loop_lags_s, self.decode_s)


def slot_shares(level: int, processes: int) -> list[int]:
    """Slots per process: ``level // processes`` each, one more for the first ``level % processes``."""
    return [level // processes + (k < level % processes) for k in range(processes)]


def owner_of_calls(n_calls: int, level: int, processes: int) -> list[int]:
    """The process each call of a round goes to: the owner of slot ``i % level``, slots dealt out
    round-robin (slot s to process s % processes)."""
    return [(i % level) % processes for i in range(n_calls)]


def round_orders(
    phase: Phase,
    calls: Sequence[ReplayCall],
    load: SharedLoad,
    processes: int,
    arms: Sequence[Arm],
    assigned: Sequence[str] | None = None,
) -> list[RoundOrder | None]:
    """Each process's share of a round (None: nothing for it this round): a closed loop's by slot,
    an open loop's call i to process ``i % processes``, each call at its own offset.
    ``arms``: in the round's order; ``assigned``: split mode, the arm each call goes to."""
    names = tuple(a.name for a in arms)
    if load.offsets_s is None:
        assert load.level is not None
        owners = owner_of_calls(len(calls), load.level, processes)
        shares = slot_shares(load.level, processes)
    else:
        owners, shares = [i % processes for i in range(len(calls))], [1] * processes
    orders: list[RoundOrder | None] = []
    for k, slots in enumerate(shares):
        mine = [i for i, owner in enumerate(owners) if owner == k]
        offsets = None if load.offsets_s is None else [load.offsets_s[i] for i in mine]
        if not slots or (offsets is not None and not mine):
            orders.append(None)
            continue
        order = RoundOrder(phase, slots, load.deadline_s, names, offsets_s=offsets)
        if assigned is None:
            order.calls.extend(calls[i] for i in mine)
        else:
            order.assigned.extend((assigned[i], calls[i]) for i in mine)
        orders.append(order)
    return orders


def combined(parts: Sequence[LoadStats]) -> LoadStats:
    """One schedule's stats from its processes' parts: an open loop's rates are over all its calls."""

    def least(values: Sequence[float | None]) -> float | None:
        return min((v for v in values if v is not None), default=None)

    def most(values: Sequence[float | None]) -> float | None:
        return max((v for v in values if v is not None), default=None)

    return LoadStats(
        sent=sum(p.sent for p in parts),
        started_at=min(p.started_at for p in parts),
        ended_at=max(p.ended_at for p in parts),
        lag_s=[lag for p in parts for lag in p.lag_s],
        stopped=any(p.stopped for p in parts),
        first_due=least([p.first_due for p in parts]),
        last_due=most([p.last_due for p in parts]),
        first_sent=least([p.first_sent for p in parts]),
        last_sent=most([p.last_sent for p in parts]),
    )


def round_stats(reports: Sequence[ClientReport]) -> list[LoadStats]:
    """Each schedule's stats (each arm's in paired mode, the one of split mode) over every process:
    a process reports its schedules in the round's order of the arms."""
    schedules = max((len(r.stats) for r in reports), default=0)
    return [combined([rep.stats[j] for rep in reports if j < len(rep.stats)]) for j in range(schedules)]


def client_rows(
    run_id: str,
    phase: Phase,
    reports: Sequence[ClientReport],
    parent_lags_s: Sequence[float] = (),
    at: datetime | None = None,
) -> list[HealthRow]:
    """Each process's own loop-lag share, loop-lag P99 and start-lag P99, as ``client K <check>``
    rows with the usual thresholds; with reports, also the parent's loop-lag P99 (``client parent
    event_loop_lag_p99_s``, shown, never a gate: the parent stamps no chunk, but a late parent
    scrapes late and reads the pipes late)."""
    at = at or datetime.now(UTC)

    def row(who: str, check: str, value: float | None, limit: float | None) -> HealthRow:
        name = f"client {who} {check}"
        return HealthRow(run_id, None, phase.level, phase.round, name, value, limit, at, phase.offered_rate)

    rows = []
    for rep in reports:
        lags = [lag for st in rep.stats for lag in st.lag_s]
        for check, value in (
            (EVENT_LOOP_LAG_SHARE, rep.loop_share()),
            (EVENT_LOOP_LAG, p99(rep.loop_lags_s)),
            (LOADGEN_START_LAG, p99(lags)),
        ):
            if value is not None:
                rows.append(row(str(rep.index + 1), check, value, THRESHOLDS.get(check)))
    parent = p99(parent_lags_s)
    if reports and parent is not None:
        rows.append(row("parent", EVENT_LOOP_LAG, parent, None))
    return rows


def worst(reports: Sequence[ClientReport]) -> ClientReport | None:
    """The process whose loop lagged most against its calls' decode time."""
    return max(reports, key=lambda r: r.loop_share() or 0.0, default=None)


class _Client:
    """The parent's end of one process: its pipe, and the round it is running."""

    def __init__(self, index: int, process: Any, conn: multiprocessing.connection.Connection) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.ready: asyncio.Future[None] | None = None
        self.done: asyncio.Future[ClientReport] | None = None


class ClientPool:
    """N client processes for a run, started once; ``run_round`` gives each its share of a round."""

    def __init__(self, setup: ClientSetup, processes: int) -> None:
        self.setup = setup
        self.n = processes
        self._clients: list[_Client] = []
        self._recorder: RunRecorder | None = None
        self._joiner: PairJoiner | None = None
        self._running: list[_Client] = []  # the processes given a share of the next round

    async def start(self) -> None:
        """Start the processes (spawned: a fresh interpreter each) and wait until each has its client."""
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        for k in range(self.n):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=child_main, args=(child_end, self.setup, k), name=f"specproxy-client-{k + 1}"
            )
            proc.start()
            child_end.close()
            client = _Client(k, proc, parent_end)
            client.ready = loop.create_future()
            self._clients.append(client)
            read_in_thread(parent_end, functools.partial(self._received, client))
        ready = [c.ready for c in self._clients if c.ready is not None]
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.gather(*ready)
        except TimeoutError:
            raise ReplayError(f"the client processes did not start within {START_TIMEOUT_S:g} s") from None

    def push_engine_load(self, load: dict[str, Any]) -> None:
        """The latest scrape's engine load, for the spans of the calls each process starts next."""
        for c in self._clients:
            try:
                c.conn.send(("load", dict(load)))
            except OSError:
                pass  # an exited process: its round fails with that (see _received)

    async def send_round(
        self,
        phase: Phase,
        calls: Sequence[ReplayCall],
        load: SharedLoad,
        recorder: RunRecorder,
        draw: Callable[[], Arm],
        state: UpstreamState,
    ) -> PairJoiner | None:
        """Give each process its share of the next round and wait until each holds it;
        it starts with :meth:`run_round`. (A share can take a while to pickle and read: a round with
        a duration carries every call it might send, and no process should start before the
        others.) Returns the joiner of the pairs the calls come back to (paired mode, several
        arms). ``draw``: split mode's seeded draw of an arm, made call by call as one process does.
        ``state``: what this process learnt of the arms' streams (the warm-ups': one token per chunk,
        merged chunks), for a process that has not learnt it yet, as one process would know it."""
        learned = (dict(state.chunk_evidence.offsets), state.merging.merged_share)
        settings = self.setup.settings
        arms = rotated(settings.arms, phase.round)
        assigned = None if settings.mode == "paired" else [draw().name for _ in calls]
        orders = round_orders(phase, calls, load, self.n, arms, assigned)
        loop = asyncio.get_running_loop()
        self._running = []
        for client, order in zip(self._clients, orders, strict=True):
            if order is not None:
                client.done, client.ready = loop.create_future(), loop.create_future()
                self._tell(client, ("learned", learned))
                self._tell(client, ("round", order))
                self._running.append(client)
        await asyncio.gather(*(c.ready for c in self._running if c.ready is not None))
        return PairJoiner(len(arms), recorder.emit) if len(arms) > 1 and assigned is None else None

    async def run_round(self, recorder: RunRecorder, joiner: PairJoiner | None) -> list[ClientReport]:
        """Start the round sent by :meth:`send_round` in every process at once and wait for all
        reports; every call that ends is recorded by ``recorder`` as it comes back (paired: through
        ``joiner``), as if sent here; so is a span kept without a result (a call cancelled mid-way).
        Cancelled: every process cancels its calls in flight, reports them, and the cancellation
        goes on."""
        self._recorder, self._joiner = recorder, joiner
        running, self._running = self._running, []
        for c in running:
            self._tell(c, ("go", None))
        futures = [c.done for c in running if c.done is not None]
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            for c in running:
                c.conn.send(("cancel", None))
            await asyncio.shield(asyncio.wait(futures, timeout=CANCEL_TIMEOUT_S))
            raise
        return [f.result() for f in futures]

    @property
    def pids(self) -> list[int]:
        """The processes' ids, in order."""
        return [c.process.pid for c in self._clients]

    def _tell(self, client: _Client, message: tuple[str, Any]) -> None:
        try:
            client.conn.send(message)
        except OSError:
            client.process.join(5.0)
            code = client.process.exitcode
            raise ReplayError(f"client process {client.index + 1} exited (code {code})") from None

    def _received(self, client: _Client, message: tuple[str, Any] | None) -> None:
        """What the process sent: calls, spans, its report, or that it failed (None: it exited)."""
        if message is None:
            self._fail(client, f"client process {client.index + 1} exited (code {client.process.exitcode})")
            return
        kind, payload = message
        if kind == "calls":
            self._record(payload)
        elif kind == "done":
            _settle(client.done, payload)
        elif kind in ("ready", "held"):
            _settle(client.ready, None)
        elif kind == "error":
            self._fail(client, f"client process {client.index + 1} failed: {payload}")

    def _record(self, batch: list[tuple[str, Any]]) -> None:
        recorder = self._recorder
        if recorder is None or not recorder.recording:
            return  # the run has ended: a call that ends after that is not counted
        for kind, payload in batch:
            if kind == "call":
                arm, result, queued_s, comparable = payload
                recorder.call(arm, result, queued_s, self._joiner, comparable)
            else:
                recorder.emit(payload)

    def _fail(self, client: _Client, why: str) -> None:
        for fut in (client.ready, client.done):
            if fut is not None and not fut.done():
                fut.set_exception(ReplayError(why))

    async def close(self) -> None:
        """Ask every process to end, wait for it (off the loop), then close the pipes."""
        for c in self._clients:
            try:
                c.conn.send(("close", None))
            except (OSError, ValueError):
                pass
        for c in self._clients:
            await asyncio.to_thread(c.process.join, 10.0)
            if c.process.is_alive():
                c.process.terminate()
                await asyncio.to_thread(c.process.join, 5.0)
            c.conn.close()
        self._clients = []


@asynccontextmanager
async def client_pool(
    settings: ReplaySettings, run_id: str, models: Mapping[str, str | None], engines: Mapping[str, str]
) -> AsyncIterator[ClientPool | None]:
    """The run's client processes, started (None with ``client_processes`` 1), closed after."""
    if settings.client_processes <= 1:
        yield None
        return
    # What a process needs to send calls: not the callbacks (pacer, decider, the plan's), which stay here.
    light = dataclasses.replace(
        settings,
        pacer=None,
        decider=None,
        judged_peak=None,
        load=LoadPlan(),
        experiment=None,
        show_progress=False,
    )
    pool = ClientPool(ClientSetup(light, run_id, dict(models), dict(engines)), settings.client_processes)
    try:
        await pool.start()
        yield pool
    finally:
        await pool.close()


def read_in_thread(
    conn: multiprocessing.connection.Connection, on_message: Callable[[tuple[str, Any] | None], None]
) -> threading.Thread:
    """Read ``conn`` in a thread of its own (blocking reads: the loop's own readers would turn the
    pipe non-blocking, and a message can span many reads), each message handed to ``on_message`` on
    the running loop, then None when the other end has closed."""
    loop = asyncio.get_running_loop()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the loop has closed: nobody is left to tell
                return
            if message is None:
                return

    thread = threading.Thread(target=read, name="specproxy-client-pipe", daemon=True)
    thread.start()
    return thread


def _settle(fut: asyncio.Future[Any] | None, value: Any) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """On uvloop where it is installed, as the parent's ``specproxy replay`` runs."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def child_main(conn: multiprocessing.connection.Connection, setup: ClientSetup, index: int) -> None:
    """A client process: Ctrl-C is the parent's to handle (it cancels the rounds), so ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from specproxy.proxy.replay.client_loop import serve_rounds

    try:
        _run(serve_rounds(conn, setup, index))
    except Exception as exc:  # said to the parent as a sentence: it fails the run with it
        try:
            conn.send(("error", f"{exc.__class__.__name__}: {exc}"))
        except OSError:
            pass
    finally:
        conn.close()
        gc.collect()
