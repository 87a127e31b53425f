"""Small OpenAI/vLLM-shaped test backends (aiohttp), for tests and benchmarks that need a real socket.

:func:`make_backend_app` serves /v1/chat/completions, /v1/completions (streaming and not, in vLLM
0.33's wire format: continuous usage, ``return_token_ids``, ``metrics.speculative_decoding``,
logprobs), /v1/models, /version, /health and /metrics. Outputs are deterministic: token i of a prompt
is a function of the prompt and i, so two backends agree unless one is told to diverge.
:class:`BackendConfig` sets timing (TTFT, gap between chunks), tokens per chunk (a speculative arm
sends several), failures, non-vLLM behaviour, and a gate that holds every generation until a test opens
it. :class:`BackendStats` counts what happened (requests, completions, cancellations seen when the client
went away) and keeps received headers.

Example::

    async with running_backend(BackendConfig(ttft_s=0.02, itl_s=0.01, tokens=64)) as b:
        url = b.url          # http://127.0.0.1:PORT
        b.stats.requests

Command line (used by tests/bench): ``python -m tests.backends --port 8001 --ttft-ms 20 --itl-ms 10``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict


@dataclass
class BackendConfig:
    ttft_s: float = 0.0
    itl_s: float = 0.0  # gap between content chunks
    tokens: int = 8  # default output length when max_tokens is absent (max_tokens caps it)
    tokens_per_chunk: int = 1  # > 1 looks like a speculative arm (accepted drafts + bonus)
    model: str = "test-model"
    vllm: bool = True  # honour stream_options/return_token_ids; False: llama.cpp-like (no usage)
    reject_extensions: bool = False  # 400 on stream_options / return_token_ids, like api.openai.com
    spec_metrics: bool = False  # attach metrics.speculative_decoding (k = tokens_per_chunk - 1)
    diverge_at: int | None = None  # token index from which this backend's output differs
    # "http500" | "http429" | "reset" (after 2 chunks) | "stall" (silent after 2 chunks) | "hang" | "garbage"
    # | "echo400" (a 400 quoting the request, like vLLM's validation errors) | "endless_event" (after 2
    # chunks, 20 MB of one `data:` event without its end, then silence)
    fail: str | None = None
    fail_requests: int = 0  # with fail: only the first this many requests fail (0: every one)
    # Added to every /v1/ response (an engine's own headers: Cache-Control, X-*, Retry-After with a 429).
    response_headers: tuple[tuple[str, str], ...] = ()
    health_status: int = 200  # what /health answers (vLLM: 500 once its engine has died)
    gate: asyncio.Event | None = None  # when given, generation waits for it (a backend slow until told)
    eof_gate: asyncio.Event | None = None  # when given, the body ends after [DONE] only once it is set
    # Answer with these instead of generating: streaming, each is one event's data (then [DONE]);
    # not streaming, the last is the whole body. A broken or hostile backend.
    script: tuple[bytes, ...] = ()
    content_type: str | None = None  # override the answer's Content-Type
    version: str = "0.33.0"
    # Answer as llama.cpp's llama-server does: one token per chunk; `timings` on the last chat chunk
    # (the usage-only chunk when include_usage was asked for); streamed completions end with a chunk
    # holding `usage` next to `choices`; JSON content types carry `charset=utf-8`. With spec_metrics,
    # `timings` reports draft_n / draft_n_accepted.
    llama_server: bool = False


@dataclass
class BackendStats:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0  # generations stopped because the client (the proxy) went away
    active: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[CIMultiDict[str]] = field(default_factory=list)
    keep_requests: bool = True
    metrics_reads: int = 0  # GET /metrics answered


CONFIG = web.AppKey("config", BackendConfig)
STATS = web.AppKey("stats", BackendStats)


def token_ids_for(prompt_key: bytes, n: int, diverge_at: int | None = None) -> list[int]:
    seed = int.from_bytes(hashlib.sha256(prompt_key).digest()[:4], "big")
    ids = [(seed + 7919 * i) % 50000 + 100 for i in range(n)]
    if diverge_at is not None:
        ids = [t if i < diverge_at else t + 1 for i, t in enumerate(ids)]
    return ids


def token_text(tid: int) -> str:
    return f" w{tid}"


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def _completion(request: web.Request) -> web.StreamResponse:
    cfg, stats = request.app[CONFIG], request.app[STATS]
    chat = request.path.endswith("/chat/completions")
    stats.requests += 1
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _error(400, "invalid JSON")
    if stats.keep_requests:
        stats.bodies.append(body)
        stats.headers.append(CIMultiDict(request.headers))
    opts = body.get("stream_options")
    known = {"include_usage", "continuous_usage_stats"}
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= known):
        return _error(400, "stream_options: Extra inputs are not permitted")  # like vLLM
    if cfg.reject_extensions:
        for key in ("stream_options", "return_token_ids"):
            if key in body:
                return _error(400, f"Unrecognized request argument supplied: {key}")
    failing = cfg.fail if not cfg.fail_requests or stats.requests <= cfg.fail_requests else None
    if failing == "http500":
        return _error(500, "backend exploded", "InternalServerError")
    if failing == "echo400":  # like vLLM's validation errors: the input quoted, long values cut
        quoted = repr(body.get("messages") or body.get("prompt"))
        quoted = quoted if len(quoted) <= 50 else quoted[:25] + "..." + quoted[-24:]
        return _error(400, f"1 validation error for Request: Input should be valid [input_value={quoted}]")
    if failing == "http429":
        return _error(429, "rate limited", "RateLimitError")
    invalid = _invalid(body, chat)
    if invalid is not None:
        return _error(400, invalid)
    stats.active += 1
    try:
        if cfg.script:
            return await _scripted(request, cfg, bool(body.get("stream")))
        return await _generate(request, cfg, stats, body, chat)
    except (asyncio.CancelledError, ConnectionError):
        stats.cancelled += 1
        raise
    finally:
        stats.active -= 1


MAX_MODEL_LEN = 131072  # (Llama 3.1)


def _invalid(body: dict[str, Any], chat: bool) -> str | None:
    """What vLLM's request validation would refuse (400) among what this backend reads."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    if max_tokens and not (
        isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 1 <= max_tokens <= MAX_MODEL_LEN
    ):
        return f"max_tokens must be an integer from 1 to {MAX_MODEL_LEN}"
    if chat and not isinstance(body.get("messages"), list):
        return "messages: Input should be a valid list"
    if not chat and not isinstance(body.get("prompt"), str | list):
        return "prompt: Input should be a valid string or list"
    try:
        _logprobs_n(body, chat)
    except (TypeError, ValueError, OverflowError):
        return "logprobs / top_logprobs must be integers"
    if not isinstance(body.get("stream_options") or {}, dict):
        return "stream_options: Input should be a valid dictionary"
    return None


async def _scripted(request: web.Request, cfg: BackendConfig, stream: bool) -> web.StreamResponse:
    if not stream:
        return web.Response(body=cfg.script[-1], content_type=cfg.content_type or "application/json")
    resp = web.StreamResponse(headers={"Content-Type": cfg.content_type or "text/event-stream"})
    await resp.prepare(request)
    for data in (*cfg.script, b"[DONE]"):
        await resp.write(b"data: " + data + b"\n\n")
    await resp.write_eof()
    return resp


async def _generate(
    request: web.Request, cfg: BackendConfig, stats: BackendStats, body: dict[str, Any], chat: bool
) -> web.StreamResponse:
    prompt_part = body.get("messages") if chat else body.get("prompt")
    prompt_key = orjson.dumps(prompt_part, option=orjson.OPT_SORT_KEYS)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    n = int(max_tokens) if max_tokens else cfg.tokens
    ids = token_ids_for(prompt_key, n, cfg.diverge_at)
    prompt_tokens = len(prompt_key) // 4 + 1
    finish = "length"
    want_ids = cfg.vllm and not cfg.llama_server and bool(body.get("return_token_ids"))
    opts = body.get("stream_options") or {}
    usage_final = (cfg.vllm or cfg.llama_server) and bool(opts.get("include_usage"))
    usage_cont = usage_final and bool(opts.get("continuous_usage_stats"))
    lp_n = _logprobs_n(body, chat)
    k = max(cfg.tokens_per_chunk - 1, 0)
    per_chunk = 1 if cfg.llama_server else cfg.tokens_per_chunk
    steps = [ids[i : i + per_chunk] for i in range(0, len(ids), per_chunk)]
    if steps and cfg.tokens_per_chunk > 1 and not cfg.llama_server:
        steps = [ids[:1]] + [
            ids[1 + i : 1 + i + cfg.tokens_per_chunk] for i in range(0, len(ids) - 1, cfg.tokens_per_chunk)
        ]
    spec = None
    if cfg.spec_metrics and k:
        spec_steps = max(len(steps) - 1, 0)
        accepted = sum(len(s) - 1 for s in steps[1:])
        spec = {
            "mean_acceptance_length": 1 + accepted / spec_steps if spec_steps else 1.0,
            "draft_acceptance_rate": accepted / (spec_steps * k) if spec_steps else 0.0,
            "acceptance_histogram": [],
            "num_spec_steps": spec_steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": spec_steps * k,
            "num_spec_tokens": k,
        }
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.headers.get('X-Request-Id', 'x')}"
    created = int(time.time())
    model = body.get("model") or cfg.model

    stream: web.StreamResponse | None = None
    if body.get("stream"):
        # Like vLLM (uvicorn sends a StreamingResponse's headers at once): the headers leave before the
        # first token, so a proxy's work on them is not on the time to first token.
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        writer = await stream.prepare(request)
        assert writer is not None
        writer.send_headers()
    if cfg.gate is not None:
        await cfg.gate.wait()
    if cfg.ttft_s:
        await asyncio.sleep(cfg.ttft_s)
    if cfg.fail == "hang":
        await asyncio.sleep(3600)

    if stream is None:
        text = "".join(token_text(t) for t in ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if lp_n:
            choice["logprobs"] = _logprobs(ids, lp_n, chat)
        if want_ids:
            choice["token_ids"] = ids
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(ids),
                "total_tokens": prompt_tokens + len(ids),
            },
        }
        if spec and not cfg.llama_server:
            out["metrics"] = {"speculative_decoding": spec}
        if cfg.llama_server:
            out["timings"] = _llama_timings(cfg, len(ids))
            out["system_fingerprint"] = "b1234-abcdef0"
        stats.completed += 1
        if cfg.fail == "garbage":
            return web.Response(body=b"<html>not json", content_type="application/json")
        if cfg.llama_server:
            return web.Response(body=orjson.dumps(out), headers={"Content-Type": JSON_UTF8})
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    resp = stream
    obj_name = "chat.completion.chunk" if chat else "text_completion"
    done = 0

    def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        c: dict[str, Any] = {
            "id": rid,
            "object": obj_name,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage_cont:
            c["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
            }
        if extra:
            c.update(extra)
        return b"data: " + orjson.dumps(c) + b"\n\n"

    if chat:
        first: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        head = chunk([first], {"prompt_token_ids": [1, 2, 3]} if want_ids else None)
        await resp.write(head)
    for si, step in enumerate(steps):
        if si and cfg.itl_s:
            await asyncio.sleep(cfg.itl_s)
        if cfg.fail == "reset" and si == 2:
            assert request.transport is not None
            request.transport.close()
            return resp
        if cfg.fail == "stall" and si == 2:
            await asyncio.sleep(3600)
        if cfg.fail == "endless_event" and si == 2:  # 20 MB of one event that never ends
            try:
                await resp.write(b"data: ")
                for _ in range(320):
                    await resp.write(b"x" * 65536)
            except ConnectionError:  # the proxy cut the stream (its event cap): expected, no traceback
                stats.cancelled += 1
                return resp
            await asyncio.sleep(3600)
        done += len(step)
        text = "".join(token_text(t) for t in step)
        last = si == len(steps) - 1
        c: dict[str, Any] = {"index": 0}
        if chat:
            c["delta"] = {"content": text}
        else:
            c["text"] = text
        c["logprobs"] = _logprobs(step, lp_n, chat) if lp_n else None
        c["finish_reason"] = finish if last and not cfg.llama_server else None
        if want_ids:
            c["token_ids"] = step
        await resp.write(chunk([c]))
    if cfg.llama_server:
        tail = _llama_stream_tail(cfg, chat, usage_final, finish, done, prompt_tokens)
        for piece in tail:
            piece.update({"id": rid, "object": obj_name, "created": created, "model": model})
            await resp.write(b"data: " + orjson.dumps(piece) + b"\n\n")
    elif usage_final:
        final: dict[str, Any] = {
            "id": rid,
            "object": obj_name,
            "created": created,
            "model": model,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
            },
        }
        if spec:
            final["metrics"] = {"speculative_decoding": spec}
        await resp.write(b"data: " + orjson.dumps(final) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    stats.completed += 1
    if cfg.eof_gate is not None:
        await cfg.eof_gate.wait()
    await resp.write_eof()
    return resp


JSON_UTF8 = "application/json; charset=utf-8"


def _llama_timings(cfg: BackendConfig, predicted: int) -> dict[str, Any]:
    timings: dict[str, Any] = {"prompt_n": 5, "prompt_ms": 1.5, "predicted_n": predicted, "predicted_ms": 9.0}
    if cfg.spec_metrics:
        timings["draft_n"] = 2 * predicted
        timings["draft_n_accepted"] = predicted // 2
    return timings


def _llama_stream_tail(
    cfg: BackendConfig, chat: bool, include_usage: bool, finish: str, done: int, prompt_tokens: int
) -> list[dict[str, Any]]:
    """The chunks llama-server ends a stream with (tools/server/server-task.cpp)."""
    usage = {"completion_tokens": done, "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + done}
    if not chat:  # to_json_oaicompat: one final chunk, usage always next to choices
        choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": finish}
        return [{"choices": [choice], "usage": usage, "timings": _llama_timings(cfg, done)}]
    tail: list[dict[str, Any]] = [{"choices": [{"finish_reason": finish, "index": 0, "delta": {}}]}]
    if include_usage:
        tail.append({"choices": [], "usage": usage})
    tail[-1]["timings"] = _llama_timings(cfg, done)
    return tail


def _logprobs_n(body: dict[str, Any], chat: bool) -> int:
    if chat:
        return int(body.get("top_logprobs") or 2) if body.get("logprobs") else 0
    lp = body.get("logprobs")
    return int(lp) if isinstance(lp, int) and not isinstance(lp, bool) and lp > 0 else 0


def _logprobs(ids: list[int], n: int, chat: bool) -> dict[str, Any]:
    # The chosen token is top-1; the margin to top-2 is 0.05 for odd ids (a near tie), 2.0 for even.
    def tops(t: int) -> list[tuple[str, float]]:
        second = -0.05 if t % 2 else -2.0
        return [(token_text(t), 0.0), (token_text(t + 1), second)][: max(n, 1)]

    if chat:
        return {
            "content": [
                {
                    "token": token_text(t),
                    "logprob": 0.0,
                    "bytes": None,
                    "top_logprobs": [{"token": a, "logprob": b, "bytes": None} for a, b in tops(t)],
                }
                for t in ids
            ]
        }
    return {
        "tokens": [token_text(t) for t in ids],
        "token_logprobs": [0.0] * len(ids),
        "top_logprobs": [dict(tops(t)) for t in ids],
        "text_offset": [0] * len(ids),
    }


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    data = {
        "object": "list",
        # Not "vllm": this fake leaves out fields vLLM always sends ("token_ids": null), so the proxy
        # must not take it for vLLM; it learns what it can from the answers.
        "data": [{"id": cfg.model, "object": "model", "owned_by": "test", "max_model_len": 8192}],
    }
    return web.json_response(data)


async def _version(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    if not cfg.vllm:
        raise web.HTTPNotFound()
    return web.json_response({"version": cfg.version})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="", status=request.app[CONFIG].health_status)


async def _metrics(request: web.Request) -> web.Response:
    stats = request.app[STATS]
    stats.metrics_reads += 1
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="test-model"}} {stats.active}\n'
        # Not a vLLM series (scrapers keep vllm:* only): lets a test in another process wait for answers.
        "# TYPE test_backend_completed counter\n"
        f"test_backend_completed_total {stats.completed}\n"
    )
    return web.Response(text=text, content_type="text/plain")


def make_backend_app(cfg: BackendConfig | None = None) -> web.Application:
    app = web.Application()
    app[CONFIG] = cfg or BackendConfig()
    app[STATS] = BackendStats()
    app.router.add_post("/v1/chat/completions", _completion)
    app.router.add_post("/v1/completions", _completion)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.on_response_prepare.append(_own_headers)
    return app


async def _own_headers(request: web.Request, response: web.StreamResponse) -> None:
    if request.path.startswith("/v1/"):
        extra = request.app[CONFIG].response_headers
        for name, _ in extra:
            response.headers.popall(name, None)  # (they replace the backend's own, Cache-Control among them)
        for name, value in extra:
            response.headers.add(name, value)


@dataclass
class RunningBackend:
    url: str
    port: int
    config: BackendConfig
    stats: BackendStats


@asynccontextmanager
async def serving_app(app: web.Application, port: int = 0, **runner_options: Any) -> AsyncIterator[int]:
    """Serve any aiohttp ``app`` on 127.0.0.1 (a free port unless given) for the duration of the block;
    yields the port. ``runner_options`` go to its ``web.AppRunner``."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    server = site._server
    assert server is not None
    real_port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
    try:
        yield real_port
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running_backend(cfg: BackendConfig | None = None, port: int = 0) -> AsyncIterator[RunningBackend]:
    """Serve a backend on 127.0.0.1 (a free port unless given) for the duration of the block."""
    app = make_backend_app(cfg)
    async with serving_app(app, port, handler_cancellation=True, access_log=None) as real_port:
        yield RunningBackend(f"http://127.0.0.1:{real_port}", real_port, app[CONFIG], app[STATS])


def main() -> None:
    ap = argparse.ArgumentParser(description="A vLLM-shaped test backend.")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--diverge-at", type=int, default=None)
    args = ap.parse_args()
    cfg = BackendConfig(
        ttft_s=args.ttft_ms / 1000,
        itl_s=args.itl_ms / 1000,
        tokens=args.tokens,
        tokens_per_chunk=args.tokens_per_chunk,
        diverge_at=args.diverge_at,
    )
    app = make_backend_app(cfg)
    app[STATS].keep_requests = False
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
