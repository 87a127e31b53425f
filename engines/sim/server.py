"""The simulator's HTTP face: vLLM 0.33's OpenAI-compatible API over `SimEngine`.

`create_sim_app(config)` returns the aiohttp application; `running_sim(config)` starts one on a free
127.0.0.1 port for tests and the lab:

    async with running_sim(SimConfig(time_scale=50)) as sim:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x")

Beyond vLLM's routes the simulator adds ground truth: `GET /sim/requests/{request_id}` (true steps,
drafts, draft tokens, accepted tokens of one request), `GET /sim/requests`, `GET /sim/stats` (engine
clock and lag, and the write delay histogram: from a step landing to its chunks going to the socket),
and `POST /sim/time_scale` (the clock's speed from the next step on). ``?timeline=1``
on either request route adds each request's step timeline: ``emit_s`` (when each step that gave it
tokens landed, seconds since the first token's step), ``emit_tokens``, and for a stream ``sent_s`` (when
each chunk with new tokens was handed to the socket, same origin).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from specproxy.engines.profiles import CostProfile, load_profile
from specproxy.engines.sim.api_request import BadRequest, ParsedRequest, message_text, parse_request
from specproxy.engines.sim.api_response import ResponseShaper
from specproxy.engines.sim.config import SimConfig, SimConfigError
from specproxy.engines.sim.engine import RequestSpec, SeqTruth, Sequence, SimEngine
from specproxy.engines.sim.text import chat_prompt, completion_prompt, request_key

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"


def error_response(
    message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


@dataclass
class SimState:
    config: SimConfig
    profile: CostProfile
    engine: SimEngine
    registry: CollectorRegistry
    fault_rng: random.Random
    gate: asyncio.Semaphore | None
    created: int


STATE = web.AppKey("sim_state", SimState)


class _Waiter:
    """Wakes the handler when the engine has news for its sequence (set from the engine loop)."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()

    def __call__(self) -> None:
        if not self.future.done():
            self.future.set_result(None)

    async def wait(self) -> None:
        await self.future
        self.future = self.loop.create_future()


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    config = state.config
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(f"Invalid JSON body: {exc}")
    try:
        req = parse_request(config, request.headers, body, chat)
    except BadRequest as exc:
        return error_response(exc.message, exc.status, exc.err_type, exc.param)
    faults = config.faults
    if faults.error_rate and state.fault_rng.random() < faults.error_rate:
        return error_response(
            "Simulated engine failure (specproxy sim --error-rate).", 500, "InternalServerError"
        )
    drop_after: int | None = None
    if faults.drop_rate and state.fault_rng.random() < faults.drop_rate:
        drop_after = state.fault_rng.randint(1, 4)
    salt = "" if req.greedy else f"seed={req.seed}" if req.seed is not None else uuid.uuid4().hex
    specs = []
    for i in range(req.n):
        # Choices of one sampled request differ from each other (vLLM's n > 1 needs sampling).
        key = request_key(config.model, req.prompt.text, salt if i == 0 else f"{salt}#{i}")
        lossy = bool(faults.lossy_rate) and random.Random(key ^ 0x10557).random() < faults.lossy_rate
        specs.append(
            RequestSpec(
                request_id=req.base_id if req.n == 1 else f"{req.base_id}-{i}",
                prompt=req.prompt,
                category=req.category,
                key=key,
                max_tokens=req.max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                stop=req.stop,
                include_stop_str_in_output=req.include_stop_str,
                lossy=lossy,
            )
        )
    headers = {"X-Request-Id": req.base_id}
    if state.gate is not None:
        await state.gate.acquire()
    try:
        waiter = _Waiter(asyncio.get_running_loop())
        seqs = [state.engine.submit(spec) for spec in specs]
        for seq in seqs:
            seq.listener = waiter
        try:
            if req.stream:
                return await _stream(request, state, req, seqs, waiter, headers, drop_after)
            while not all(seq.finished for seq in seqs):
                await waiter.wait()
            if drop_after is not None and request.transport is not None:
                request.transport.close()
            if faults.stall_ms:
                await asyncio.sleep(faults.stall_ms / 1000)
            shaper = ResponseShaper(state.config, req, seqs)
            return web.Response(
                body=orjson.dumps(shaper.full_response()), content_type="application/json", headers=headers
            )
        finally:
            for seq in seqs:
                if not seq.finished:
                    state.engine.abort(seq)
    finally:
        if state.gate is not None:
            state.gate.release()


async def _stream(
    request: web.Request,
    state: SimState,
    req: ParsedRequest,
    seqs: list[Sequence],
    waiter: _Waiter,
    headers: dict[str, str],
    drop_after: int | None,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    shaper = ResponseShaper(state.config, req, seqs)
    stall_s = state.config.faults.stall_ms / 1000
    sent = [0] * len(seqs)
    done = [False] * len(seqs)
    chunks = 0
    try:
        while True:
            await waiter.wait()
            data = b""
            fresh: list[SeqTruth] = []
            for i, seq in enumerate(seqs):
                end = seq.n_out
                if done[i] or (end <= sent[i] and not seq.finished):
                    continue
                if 0 < sent[i] and end - sent[i] < req.stream_interval and not seq.finished:
                    continue  # stream_interval: batch tokens; the first and the last chunk go at once
                if sent[i] == 0 and req.chat:
                    data += shaper.first_chunk(i)
                # A finished sequence with nothing new (aborted, stop string) still gets its finish chunk.
                data += shaper.delta_chunk(i, sent[i], end)
                if end > sent[i]:
                    fresh.append(seq.truth)
                sent[i] = end
                done[i] = seq.finished
            if not data:
                continue
            handed = time.monotonic()
            for truth in fresh:
                truth.sent_times.append(handed)
                # From the step that gave these tokens landing to their chunk going to the socket.
                state.engine.write_delays.add(handed - truth.emit_times[-1])
            chunks += 1
            finished = all(done)
            tail = b""
            if finished:
                tail = (shaper.usage_chunk() if req.include_usage else b"") + b"data: [DONE]\n\n"
            cut = drop_after is not None and chunks >= drop_after
            pause = bool(stall_s) and chunks == 1
            if cut or pause:
                # Faults strike mid-stream: after this chunk, before the end of the stream.
                await resp.write(data)
                if cut:
                    for seq in seqs:
                        state.engine.abort(seq)
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                await asyncio.sleep(stall_s)
                if not tail:
                    continue  # what the engine produced meanwhile goes out as one merged chunk
                await resp.write(tail)
            else:
                await resp.write(data + tail)
            if finished:
                break
    except (ConnectionResetError, asyncio.CancelledError):
        for seq in seqs:
            state.engine.abort(seq)
        raise
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    card = {
        "id": config.served_name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": state.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VLLM_VERSION})


async def load(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    return web.json_response({"server_load": len(engine.core.running) + len(engine.core.waiting)})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = state.engine.core.metrics.render(state.registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def tokenize_route(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(f"Invalid JSON body: {exc}")
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        ids = chat_prompt(
            [
                {"role": str(m.get("role", "user")), "content": message_text(m.get("content"))}
                for m in body["messages"]
                if isinstance(m, dict)
            ]
        ).token_ids
    elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
        ids = completion_prompt(body["prompt"]).token_ids
    else:
        return error_response("tokenize needs 'prompt' (a string) or 'messages'.")
    return web.json_response(
        {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids, "token_strs": None}
    )


async def sim_request(request: web.Request) -> web.Response:
    """Ground truth of one request, by its X-Request-Id or response id (chatcmpl-/cmpl- prefix optional)."""
    truths = request.app[STATE].engine.core.truths
    rid = request.match_info["request_id"]
    for candidate in (rid, rid.removeprefix("chatcmpl-"), rid.removeprefix("cmpl-")):
        truth = truths.get(candidate)
        if truth is not None:
            return web.json_response(_truth_json(truth, request), dumps=_dumps)
    return error_response(f"no request '{rid}' in the simulator's history", 404, "NotFoundError")


async def sim_requests(request: web.Request) -> web.Response:
    truths = request.app[STATE].engine.core.truths
    limit = int(request.query.get("limit", "1000"))
    items = list(truths.values())[-limit:]
    return web.json_response({"requests": [_truth_json(t, request) for t in items]}, dumps=_dumps)


def _truth_json(truth: SeqTruth, request: web.Request) -> dict[str, Any]:
    """A request's truth; with ``?timeline=1`` also its step timeline (when each step gave it tokens)."""
    out = truth.as_dict()
    if request.query.get("timeline") in ("1", "true"):
        out.update(truth.timeline())
    return out


async def sim_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    body = {
        **state.engine.stats(),
        "profile": state.profile.name,
        "method": config.method,
        "num_speculative_tokens": config.speculative.num_speculative_tokens if config.speculative else 0,
        "model": config.served_name,
    }
    return web.json_response(body, dumps=_dumps)


async def sim_time_scale(request: web.Request) -> web.Response:
    """``POST {"time_scale": X}``: the engine runs X times faster than the profile's clock from its next
    step on. The lab slows the simulators down for a level this machine cannot keep up with."""
    engine = request.app[STATE].engine
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(f"Invalid JSON body: {exc}")
    value = body.get("time_scale") if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return error_response(f"time_scale must be a number > 0, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        return error_response(f"time_scale must be a number > 0, got {value!r}")
    engine.time_scale = float(value)
    return web.json_response(engine.stats(), dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


@web.middleware
async def _internal_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unexpected exception becomes vLLM's 500 JSON, never aiohttp's text page."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        # The client left (aiohttp's ClientConnectionResetError is one; the handler has aborted its
        # sequences): nobody to answer, nothing wrong to log. aiohttp drops this response quietly.
        return web.Response(status=499)
    except Exception as exc:
        log.exception("simulator error on %s", request.path)
        return error_response(f"Internal simulator error: {exc!r}", 500, "InternalServerError")


def create_sim_app(config: SimConfig, profile: CostProfile | None = None) -> web.Application:
    """The simulator as an aiohttp application (the engine starts and stops with the app)."""
    profile = profile or load_profile(config.profile)
    method = config.method
    if method is not None and not profile.supports(method):
        raise SimConfigError(f"cost profile '{profile.name}' has no drafter cost for method '{method}'")
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_internal_errors])
    engine = SimEngine(config, profile)
    gate = asyncio.Semaphore(config.faults.max_concurrency) if config.faults.max_concurrency else None
    app[STATE] = SimState(
        config=config,
        profile=profile,
        engine=engine,
        registry=engine.core.metrics.registry(),
        fault_rng=random.Random(config.seed ^ 0xFA17),
        gate=gate,
        created=int(time.time()),
    )

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_get("/sim/requests", sim_requests)
    app.router.add_get("/sim/requests/{request_id}", sim_request)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_post("/sim/time_scale", sim_time_scale)
    return app


@dataclass
class RunningSim:
    """A simulator serving on 127.0.0.1 (from `running_sim`)."""

    url: str
    port: int
    app: web.Application

    @property
    def engine(self) -> SimEngine:
        return self.app[STATE].engine


@asynccontextmanager
async def running_sim(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[RunningSim]:
    """Serve a simulator in this event loop for the duration of the block (port 0: a free one)."""
    app = create_sim_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        addresses = runner.addresses
        bound = int(addresses[0][1]) if addresses else port
        yield RunningSim(url=f"http://{host}:{bound}", port=bound, app=app)
    finally:
        await runner.cleanup()


__all__ = ["RunningSim", "create_sim_app", "running_sim"]
