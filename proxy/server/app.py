"""The proxy's aiohttp application: ``create_app(settings)`` is its front door.

Endpoints::

    POST /v1/chat/completions, /v1/completions   served by one arm (the baseline in shadow mode, an arm
                                                 chosen by weight in split mode), streaming or not;
                                                 copies go to other arms (shadow / verify)
    GET  /v1/models                              the baseline's
    GET  /health                                 the proxy's own liveness
    GET  /ready                                  readiness: 503 with the reasons while the baseline is
                                                 unreachable or spans cannot be written (server.readiness)
    GET  /metrics                                the proxy's Prometheus metrics (server.metrics)
    POST /specproxy/scrape                       scrape every arm's /metrics now, under the phase
                                                 given ({"phase": "c=16 r1/3:before"}): how
                                                 ``replay --target`` brackets each level, so the
                                                 engines' counters come out per level; with the
                                                 level and round, the level-round's health too

Long-lived resources are made and closed in ``cleanup_ctx`` (in this order, closed in reverse): the
span sink (DuckDB writer thread; the run's row with each arm's stack), the upstream clients
(:mod:`.wire`: one for calls that serve clients, one for copies, so a slow shadow arm cannot take
connections the client path needs) with the shadow dispatcher, the metrics scraper, the capture writer
and the finished calls' queued bookkeeping (:mod:`.after_calls`). At shutdown the server stops accepting
and lets in-flight requests finish (``shutdown_grace_s``), their bookkeeping runs, copies still running
get the rest of the grace period, then the sink writes every accepted span and closes.

Example::

    settings = ProxySettings(experiment=load_experiment("exp.toml"), db="spans.duckdb")
    web.run_app(create_app(settings), port=8000, handler_cancellation=True)
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from specproxy.config import Arm, Experiment, experiment_json
from specproxy.proxy.health import read_sim_clocks
from specproxy.proxy.identity import is_comparable
from specproxy.proxy.server.after_calls import AfterCalls
from specproxy.proxy.server.capture import CaptureWriter
from specproxy.proxy.server.client_relay import ClientRelay
from specproxy.proxy.server.errors import (
    Handler,
    json_http_exceptions,
    openai_error,
    openai_errors,
)
from specproxy.proxy.server.headers import request_headers_for_arms, response_headers_for_client
from specproxy.proxy.server.health import PhaseKey, ServeHealth
from specproxy.proxy.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specproxy.proxy.server.metrics import METRICS, ProxyMetrics
from specproxy.proxy.server.readiness import Readiness, SinkCounts
from specproxy.proxy.server.routing import ArmRouter, Copy
from specproxy.proxy.server.shadow import IdentityPair, ShadowDispatcher
from specproxy.proxy.server.shutdown import ProxyCut, ShutdownCutter
from specproxy.proxy.server.validate import ClientRequest, Rejected, expect_handler, read_request
from specproxy.proxy.spans.sink import DEFAULT_MEMORY_LIMIT, SpanSink
from specproxy.proxy.spans.trace import TRACEPARENT_HEADER, TraceParent, client_trace_context, new_trace_id
from specproxy.proxy.upstream.calls import (
    REQUEST_ID_HEADER,
    CallResult,
    UpstreamState,
    UpstreamTimeout,
    call_arm,
    call_record,
    describe_request,
)
from specproxy.proxy.upstream.scrape import EngineLoad, MetricsScraper
from specproxy.proxy.upstream.sse import CompletionTap, Endpoint
from specproxy.proxy.upstream.stacks import arm_auth, arm_stacks
from specproxy.proxy.upstream.wire import UpstreamClient
from specproxy.record import RoutedAs, SpanRecord

log = logging.getLogger(__name__)

ARM_HEADER = "X-Specproxy-Arm"
SERVE_FLUSH_INTERVAL_S = 2.0
# Live traffic writes a few hundred spans a second: checkpoint the span store's WAL often (every ~8k
# spans) so the proxy's memory is flat, not climbing until the 64 MB bulk-ingest threshold.
SERVE_CHECKPOINT_THRESHOLD = "4MB"


@dataclass(frozen=True)
class ProxySettings:
    """Everything ``create_app`` needs; the CLI builds it from options and the experiment file."""

    experiment: Experiment
    db: str | None = None  # None: the experiment's db
    run_id: str = ""  # "": a new one
    capture: str | None = None
    capture_responses: bool = False
    api_key: str | None = None  # SPECPROXY_API_KEY: clients must send it as a bearer token
    scrape_metrics: bool = True
    worker_index: int | None = None
    db_memory_limit: str = DEFAULT_MEMORY_LIMIT  # DuckDB memory_limit of the span writer's connection


@dataclass
class ProxyState:
    settings: ProxySettings
    run_id: str
    router: ArmRouter
    upstream: UpstreamState
    metrics: ProxyMetrics
    primary_timeout: UpstreamTimeout
    shadow_timeout: UpstreamTimeout
    sink: SpanSink | None = None
    session: aiohttp.ClientSession | None = None  # GET /v1/models
    client: UpstreamClient | None = None  # completions that serve clients
    dispatcher: ShadowDispatcher | None = None
    capture: CaptureWriter | None = None
    health: ServeHealth | None = None
    shutdown_started: float | None = None
    # arm name → its running/waiting gauges at the latest /metrics scrape (kept by the scraper)
    engine_load: dict[str, EngineLoad] = field(default_factory=dict)
    scraper: MetricsScraper | None = None  # None: --no-scrape
    readiness: Readiness | None = None
    cutter: ShutdownCutter = field(default_factory=ShutdownCutter)  # primary calls, cut at grace's end
    after_calls: AfterCalls = field(default_factory=AfterCalls)  # finished calls' bookkeeping, queued

    def finish(self, record: SpanRecord, parent: TraceParent | None = None) -> None:
        """A call is over: count it and hand its span to the sink (never blocks); ``parent``: the
        client's trace context (its ``traceparent``), if it sent one."""
        self.metrics.observe_call(record)
        if self.health is not None:
            self.health.ended(record)
        if self.sink is not None:
            self.sink.emit(record, parent)


STATE = web.AppKey("specproxy_state", ProxyState)


async def _completion(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    arrival = time.time()
    st = request.app[STATE]
    exp = st.settings.experiment
    try:
        checked = await read_request(
            request, max_body_bytes=exp.max_body_bytes, body_timeout_s=exp.client_body_timeout_s
        )
    except Rejected as exc:
        return _refusal(st, exc)
    handed_over = time.perf_counter()
    # One trace per client request: the client's (W3C traceparent) when it sent one, else a new one.
    # Every call the request makes (primary, shadow, verify) is a span of it with its own span id.
    parent = client_trace_context(request.headers) if TRACEPARENT_HEADER in request.headers else None
    trace_id = parent.trace_id if parent is not None else new_trace_id()
    comparable = is_comparable(checked.body)
    plan = st.router.plan(checked.body, request.headers, comparable=comparable)
    primary = plan.primary
    to_arms = request_headers_for_arms(request.headers.items())
    pair: IdentityPair | None = None
    if plan.copies:
        pair = IdentityPair(comparable, st.metrics.observe_identity) if comparable else None
        _send_copies(st, plan.copies, checked, to_arms, endpoint, trace_id, pair, parent)
    # (its request fields are read from the body when the call is over: call_arm(describe=True))
    record = _new_span(st, primary, plan.primary_routed_as, checked, endpoint, trace_id, described=False)
    relay = ClientRelay(request, {REQUEST_ID_HEADER: checked.request_id, ARM_HEADER: primary.name})
    result: CallResult | None = None
    tap = CompletionTap(endpoint)
    try:
        result = await _call_primary(st, primary, checked.body, to_arms, endpoint, record, relay, tap)
        if st.health is not None:
            st.health.queued(primary.name, result.t_send - handed_over)
        return await relay.finish(result)
    except ProxyCut:  # the shutdown grace ran out (the span says proxy_shutdown)
        result = CallResult(record=record, tap=tap, relay_started=relay.response is not None)
        return await relay.finish(result)
    except Exception:
        if relay.response is None:
            raise  # nothing sent yet: the error middleware answers
        # A bug once the stream is under way: another response cannot be sent inside this one, so
        # end the stream the way an upstream failure mid-stream ends it.
        log.exception("internal error while relaying request %s from %s", checked.request_id, primary.name)
        record.status, record.error = "upstream_error", "internal error in specproxy"
        result = CallResult(record=record, tap=tap, relay_started=True)
        return await relay.finish(result)
    except asyncio.CancelledError:
        if result is None and tap.relayed_done is not None:
            # The client left after the final event reached it: the call is complete (call_arm kept the
            # record's status), and its output still counts for identity and capture.
            result = CallResult(
                record=record, tap=tap, http_status=record.http_status, relay_started=True, client_gone=True
            )
        raise
    finally:
        # The client has its answer (or is gone): what is left waits for the requests that follow.
        st.after_calls.add(functools.partial(_after_primary, st, primary, record, result, pair, parent))
        if st.capture is not None:
            st.after_calls.add(
                functools.partial(_capture_request, st.capture, request, checked, arrival, record, result)
            )


async def _call_primary(
    st: ProxyState,
    primary: Arm,
    body: dict[str, Any],
    headers: CIMultiDict[str],
    endpoint: Endpoint,
    record: SpanRecord,
    relay: ClientRelay,
    tap: CompletionTap,
) -> CallResult:
    """The call that serves the client, relayed to it as it arrives."""
    assert st.client is not None
    call = call_arm(
        st.client,
        primary,
        body,
        endpoint=endpoint,
        record=record,
        relay=relay,
        headers=headers,
        timeout=st.primary_timeout,
        state=st.upstream,
        capture_output=st.capture is not None,
        tap=tap,
        describe=True,
        later=st.after_calls.add,
    )
    return await st.cutter.run(call, record)


def _capture_request(
    capture: CaptureWriter,
    request: web.Request,
    checked: ClientRequest,
    arrival: float,
    record: SpanRecord,
    result: CallResult | None,
) -> None:
    """The client's request and its outcome for the capture file (``serve --capture``)."""
    capture.add(
        arrival_unix_s=arrival,
        request_id=checked.request_id,
        path=request.path,
        category=checked.category,
        body=checked.body,
        status=record.status,
        response_text=result.text if result is not None else None,
    )


def _refusal(st: ProxyState, exc: Rejected) -> web.Response:
    """The OpenAI-shaped answer to a request that failed the checks, counted."""
    st.metrics.client_error(exc.status)
    refusal = openai_error(exc.status, exc.message)
    if exc.close:
        refusal.force_close()
    return refusal


def _new_span(
    st: ProxyState,
    arm: Arm,
    routed_as: RoutedAs,
    checked: ClientRequest,
    endpoint: Endpoint,
    trace_id: str,
    *,
    described: bool = True,
) -> SpanRecord:
    """The span of one call the client's request makes to ``arm``, labelled with its load phase.
    ``described``: with the request fields read from the body (False: the call fills them)."""
    record = call_record(
        st.run_id,
        checked.request_id,
        arm,
        endpoint=endpoint,
        trace_id=trace_id,
        routed_as=routed_as,
        category=checked.category,
        concurrency_level=checked.concurrency_level,
        # only a gauge read within the last two scrape intervals: an older one is no longer this load
        engine_load=st.scraper.fresh_load(arm.name) if st.scraper is not None else None,
        offered_rate=checked.offered_rate,
    )
    record.round = checked.round
    if described:
        describe_request(record, checked.body)
    return record


def _send_copies(
    st: ProxyState,
    copies: tuple[Copy, ...],
    checked: ClientRequest,
    headers: CIMultiDict[str],
    endpoint: Endpoint,
    trace_id: str,
    pair: IdentityPair | None,
    parent: TraceParent | None,
) -> None:
    """Hand the shadow and verify copies to the dispatcher, which sends them in the background (and
    makes their spans there: the client's call goes out first)."""
    dispatcher = st.dispatcher
    assert dispatcher is not None
    for copy in copies:
        make_record = functools.partial(_new_span, st, copy.arm, copy.routed_as, checked, endpoint, trace_id)
        dispatcher.send(
            copy, checked.body, make_record, endpoint=endpoint, pair=pair, parent=parent, headers=headers
        )


def _after_primary(
    st: ProxyState,
    primary: Arm,
    record: SpanRecord,
    result: CallResult | None,
    pair: IdentityPair | None,
    parent: TraceParent | None,
) -> None:
    if pair is None:
        st.finish(record, parent)
    elif primary.role == "baseline":
        pair.set_baseline(result)
        st.finish(record, parent)
    elif result is None:
        st.finish(record, parent)
    else:
        # A candidate served the client (split mode) and a verify copy went to the baseline: compare
        # when that copy ends, in the background; the client's response is already complete.
        assert st.dispatcher is not None
        st.dispatcher.spawn(_check_then_finish(st, pair, result, parent))


async def _check_then_finish(
    st: ProxyState, pair: IdentityPair, result: CallResult, parent: TraceParent | None
) -> None:
    try:
        await pair.check(result)
    finally:
        st.finish(result.record, parent)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completions")


async def models(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    arm = st.settings.experiment.baseline
    assert st.session is not None
    try:
        headers = request_headers_for_arms(request.headers.items())
        headers.update(arm_auth(arm))
        headers["Accept-Encoding"] = "identity"  # (the body is passed on as it came, not decoded)
        async with st.session.get(
            f"{arm.url}/v1/models", headers=headers, timeout=st.primary_timeout.client_timeout()
        ) as resp:
            payload = await resp.read()
            return web.Response(
                status=resp.status, body=payload, headers=response_headers_for_client(resp.headers.items())
            )
    except TimeoutError:
        return openai_error(504, f"baseline {arm.name} did not answer GET /v1/models in time")
    except (aiohttp.ClientError, OSError) as exc:
        return openai_error(502, f"baseline {arm.name} is unreachable: {exc.__class__.__name__}: {exc}")


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"status": "ok", "run_id": st.run_id, "mode": st.settings.experiment.mode})


async def ready(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.shutdown_started is not None:
        problems = ["shutting down"]
    else:
        assert st.readiness is not None
        problems = await st.readiness.problems()
    answer = {"status": "not ready" if problems else "ready", "run_id": st.run_id, "reasons": problems}
    return web.json_response(answer, status=503 if problems else 200)


def _sink_counts(st: ProxyState) -> SinkCounts | None:
    sink = st.sink
    if sink is None:
        return None
    return SinkCounts(sink.written, sink.failed, sink.queue_depth, st.settings.experiment.span_queue_size)


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.after_calls.drain()  # (every call that has ended counts)
    body = st.metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


# A phase a client may name: a replay level's label (c=16, r=4, with a round: c=16 r2/3; timed x10)
# and which end of it, as replay names its own scrapes (the acceptance view pairs them up).
_PHASE = re.compile(r"[A-Za-z0-9=.,/ x_-]{1,80}:(before|after)")
# At a level's end its shadow copies may still be running after the client's calls have ended: the
# scrape waits this long for them, so that their tokens count in the level they belong to.
SETTLE_BEFORE_SCRAPE_S = 60.0


async def scrape_phase(request: web.Request) -> web.Response:
    """Scrape every arm's /metrics now, recorded under the phase the client names: the counters at a
    level's start and end, which periodic scrapes cannot place (they see every level at once). At an
    end (``:after``) the copies still running are waited for first (``copies_running``: those that
    outlasted the wait, whose tokens fall in the next window). With the phase's ``level`` (or
    ``offered_rate``) and ``round`` the proxy also keeps the level-round's health (its own loop lag and
    queueing, each simulator arm's clock lag) and returns the rows at its end (``health``)."""
    st = request.app[STATE]
    try:
        body = await request.json()
    except ValueError:
        return openai_error(400, 'expected a JSON body {"phase": "c=16:before"}')
    phase = body.get("phase") if isinstance(body, dict) else None
    if not isinstance(phase, str) or not _PHASE.fullmatch(phase):
        return openai_error(
            400,
            f"phase must be a level's label and :before or :after (e.g. 'c=16 r1/3:before'), got {phase!r}",
        )
    key = _phase_key(body)
    if isinstance(key, str):
        return openai_error(400, key)
    if st.scraper is None:
        return openai_error(
            409, "this proxy does not scrape its arms' /metrics (it was started with --no-scrape)"
        )
    label, end = phase.rsplit(":", 1)
    st.after_calls.drain()  # (every call that has ended counts in the phase it ended in)
    if key is not None and end == "before":
        await _begin_phase_health(st, label, key)
    running = 0
    if end == "after" and st.dispatcher is not None:
        running = await st.dispatcher.settle(SETTLE_BEFORE_SCRAPE_S)
        st.after_calls.drain()
    snapshots = await st.scraper.scrape_once(phase)
    arms = {name: {"ok": snap.ok, "error": snap.error} for name, snap in snapshots.items()}
    answer = {"run_id": st.run_id, "phase": phase, "arms": arms, "copies_running": running}
    if key is not None and end == "after":
        answer["health"] = await _end_phase_health(st, label)
    return web.json_response(answer)


def _phase_key(body: dict[str, Any]) -> PhaseKey | str | None:
    """The level-round a scrape's body names (None: it names none), or what is wrong with it."""
    if not any(k in body for k in ("level", "round", "offered_rate")):
        return None
    level, round_, rate = body.get("level"), body.get("round"), body.get("offered_rate")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if level is not None and not count(level):
        return f"level must be a concurrency ≥ 1 or null, got {level!r}"
    if not isinstance(round_, int) or not count(round_):
        return f"round must be an integer ≥ 1, got {round_!r}"
    if rate is not None and not (isinstance(rate, int | float) and not isinstance(rate, bool) and rate > 0):
        return f"offered_rate must be a number > 0 or null, got {rate!r}"
    return PhaseKey(level, round_, None if rate is None else float(rate))


async def _begin_phase_health(st: ProxyState, label: str, key: PhaseKey) -> None:
    if st.health is not None and st.session is not None:
        clocks = await read_sim_clocks(st.session, st.settings.experiment.arms)
        await st.health.begin_phase(label, key, clocks)


async def _end_phase_health(st: ProxyState, label: str) -> list[dict[str, Any]]:
    if st.health is None or st.session is None:
        return []
    rows = await st.health.end_phase(label, await read_sim_clocks(st.session, st.settings.experiment.arms))
    return [{"arm": r.arm, "check": r.check_name, "value": r.value, "threshold": r.threshold} for r in rows]


def _auth_middleware(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(("/v1/", "/specproxy/")):
            # The header's bytes as they came (aiohttp keeps undecodable ones as surrogates): a key
            # that is not UTF-8 is a wrong key, not an error.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                request.app[STATE].metrics.client_error(401)
                return openai_error(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' "
                    "with the key in SPECPROXY_API_KEY",
                    code="invalid_api_key",
                )
        return await handler(request)

    return require_api_key


def create_app(settings: ProxySettings) -> web.Application:
    """The proxy as an aiohttp application (run it with ``handler_cancellation=True`` so a client that
    disconnects cancels its upstream call)."""
    exp = settings.experiment
    upstream = UpstreamState()
    arm_urls = {a.name: a.url for a in exp.arms}
    state = ProxyState(
        settings=settings,
        run_id=settings.run_id or uuid.uuid4().hex,
        router=ArmRouter(exp),
        upstream=upstream,
        metrics=ProxyMetrics(upstream.inflight, arm_urls),
        primary_timeout=UpstreamTimeout(
            connect=exp.upstream_connect_timeout_s, read=exp.upstream_read_timeout_s, total=None
        ),
        shadow_timeout=UpstreamTimeout(
            connect=exp.upstream_connect_timeout_s,
            read=exp.upstream_read_timeout_s,
            total=exp.shadow_timeout_s,
        ),
    )
    middlewares: list[Any] = [openai_errors]
    if settings.api_key:
        middlewares.append(_auth_middleware(settings.api_key))
    app = web.Application(client_max_size=exp.max_body_bytes, middlewares=middlewares)
    app[STATE] = state
    app[METRICS] = state.metrics
    expect = expect_handler(exp.max_body_bytes)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect)
    app.router.add_post("/v1/completions", completions, expect_handler=expect)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/specproxy/scrape", scrape_phase)
    app.cleanup_ctx.append(_span_store)
    app.cleanup_ctx.append(_health)
    app.cleanup_ctx.append(_sessions)
    app.cleanup_ctx.append(_scraper)
    app.cleanup_ctx.append(_capture)
    app.cleanup_ctx.append(state.after_calls.cleanup_ctx)  # (closed first: it feeds everything above)
    app.on_shutdown.append(_mark_shutdown)
    app.on_response_prepare.append(json_http_exceptions)
    return app


async def _span_store(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    s = st.settings
    exp = s.experiment
    # Batches every 2 s rather than the sink's 0.5 s: each INSERT has a fixed cost (~10 ms of CPU that
    # the relay shares), and nobody reads the file while serve holds it (DuckDB: one process per file).
    sink = SpanSink(
        s.db or exp.db,
        queue_size=exp.span_queue_size,
        otlp_endpoint=exp.otlp_endpoint,
        memory_limit=s.db_memory_limit,
        flush_interval_s=SERVE_FLUSH_INTERVAL_S,
        checkpoint_threshold=SERVE_CHECKPOINT_THRESHOLD,
    )
    await asyncio.to_thread(sink.start)
    st.sink = sink
    st.metrics.watch_sink(lambda: (sink.queue_depth, sink.dropped, sink.written))
    try:
        async with aiohttp.ClientSession() as probe:
            stacks = await arm_stacks(probe, exp, engines=st.upstream.engines)
        sink.begin_run(
            st.run_id,
            name=exp.name,
            mode=exp.mode,
            source="live",
            config_json=experiment_json(exp),
            stacks_json=stacks,
        )
        yield
    finally:
        try:
            sink.end_run(st.run_id)
        finally:
            await asyncio.to_thread(sink.close)
            if sink.dropped:
                log.warning("%d spans were dropped (queue full or unwritable; see the log)", sink.dropped)


async def _health(app: web.Application) -> AsyncIterator[None]:
    """The proxy's own health rows (loop lag, queueing) every few seconds, and the rest at shutdown:
    closed after the copies have finished, before the span store."""
    st = app[STATE]
    assert st.sink is not None
    inflight = st.upstream.inflight
    health = st.health = ServeHealth(st.run_id, st.sink, busy=lambda: any(inflight.values()))
    task = asyncio.create_task(health.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await health.close_phases()
        await health.flush()


async def _sessions(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    # Generations can be long: no total timeout here (each call sets connect/read limits itself).
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=300)
    no_cap = aiohttp.ClientTimeout(total=None)
    session = aiohttp.ClientSession(connector=connector, timeout=no_cap)
    client, shadow_client = UpstreamClient(), UpstreamClient()
    st.session, st.client = session, client
    st.readiness = Readiness(st.settings.experiment.baseline, session, lambda: _sink_counts(st))
    st.dispatcher = ShadowDispatcher(
        shadow_client,
        timeout=st.shadow_timeout,
        state=st.upstream,
        emit=st.finish,
        capture_output=st.settings.capture is not None,
        on_queue=st.health.queued if st.health is not None else None,
        later=st.after_calls.add,
    )
    try:
        yield
    finally:
        grace = st.settings.experiment.shutdown_grace_s
        if st.shutdown_started is not None:
            grace = max(1.0, grace - (time.monotonic() - st.shutdown_started))
        await st.dispatcher.close(grace)
        await session.close()
        await client.close()
        await shadow_client.close()


async def _scraper(app: web.Application) -> AsyncIterator[None]:
    """Each arm's /metrics into backend_metrics every scrape_interval_s, and once more at shutdown; and
    whenever a client asks (POST /specproxy/scrape). Of several workers only the first scrapes
    periodically into the store (they would all write the same arms' samples); the others read just
    the arms' load gauges on the same interval, for their own calls' spans. Each answers a client's
    request."""
    st = app[STATE]
    if not st.settings.scrape_metrics:
        yield
        return
    exp = st.settings.experiment
    periodic = st.settings.worker_index in (None, 0)
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper(
            exp.arms,
            st.sink,
            session,
            run_id=st.run_id,
            interval_s=exp.scrape_interval_s,
            engine_load=st.engine_load,
        )
        st.scraper = scraper
        task = asyncio.create_task(scraper.run() if periodic else scraper.run_gauges())
        try:
            yield
        finally:
            st.scraper = None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if periodic:
                await scraper.scrape_once("periodic")  # the run's last counters, for deltas over the run


async def _capture(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    if st.settings.capture is None:
        yield
        return
    writer = CaptureWriter(st.settings.capture, with_responses=st.settings.capture_responses)
    writer.start()
    st.capture = writer
    try:
        yield
    finally:
        await writer.close()


async def _mark_shutdown(app: web.Application) -> None:
    st = app[STATE]
    st.shutdown_started = time.monotonic()
    st.cutter.start(st.settings.experiment.shutdown_grace_s)
