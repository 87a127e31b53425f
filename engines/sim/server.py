"""The simulator's HTTP face: vLLM 0.33's OpenAI-compatible API over `SimEngine`.

`create_sim_app(config)` returns the aiohttp application; `running_sim(config)` starts one on a free
127.0.0.1 port for tests and the lab:

    async with running_sim(SimConfig(time_scale=50)) as sim:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x")

Beyond vLLM's routes the simulator adds ground truth: `GET /sim/requests/{request_id}` (true steps,
drafts, draft tokens, accepted tokens of one request), `GET /sim/requests`, and `GET /sim/stats`
(engine clock and lag).
"""

from __future__ import annotations

import asyncio
import logging
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
from specproxy.engines.sim.config import SimConfig, SimConfigError
from specproxy.engines.sim.engine import RequestSpec, Sequence, SimEngine
from specproxy.engines.sim.text import (
    CATEGORIES,
    Prompt,
    chat_prompt,
    completion_prompt,
    id_text,
    infer_category,
    request_key,
)

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
CATEGORY_HEADER = "X-Specproxy-Category"
MAX_TOP_LOGPROBS = 20


class BadRequest(Exception):
    """A request vLLM would answer with 400 (or `status`), in its error shape."""

    def __init__(
        self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


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


@dataclass
class ParsedRequest:
    """The fields of a chat or completions request the simulator acts on."""

    chat: bool
    base_id: str
    prompt: Prompt
    category: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    logprobs: int | None  # None: off; chat: top_logprobs count; completions: `logprobs`
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop: tuple[str, ...]
    include_stop_str: bool
    greedy: bool
    seed: int | None
    n: int = 1
    stream_interval: int = 1


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name} must be an integer, got {value!r}.", param=name)
    return value


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    raise BadRequest("message content must be a string or a list of content parts.", param="messages")


def parse_request(state: SimState, request: web.Request, body: Any, chat: bool) -> ParsedRequest:
    config = state.config
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model not in (config.served_name, config.model):
        raise BadRequest(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
        )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of messages.", param="messages")
        norm = []
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise BadRequest("each message must be an object with a 'role'.", param="messages")
            norm.append({"role": str(message["role"]), "content": _message_text(message.get("content"))})
        prompt = chat_prompt(norm)
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list) and len(raw_prompt) == 1 and isinstance(raw_prompt[0], str):
            raw_prompt = raw_prompt[0]
        if isinstance(raw_prompt, list) and raw_prompt and all(isinstance(t, int) for t in raw_prompt):
            raw_prompt = "".join(id_text(t) or f" <{t}>" for t in raw_prompt)
        if not isinstance(raw_prompt, str):
            raise BadRequest(
                "prompt must be a string, a list with one string, or a list of token ids "
                "(the simulator takes one prompt per request).",
                param="prompt",
            )
        prompt = completion_prompt(raw_prompt)

    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
        raise BadRequest(f"temperature must be non-negative, got {temperature}.", param="temperature")
    # Unset temperature means the model's generation config (Llama-3.1: 0.6), i.e. sampling, as in vLLM.
    greedy = temperature is not None and float(temperature) < 1e-5
    n = _int_field(body, "n", 1)
    if n is not None and n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.", param="n")
    if n is not None and n > 1 and greedy:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.", param="n")
    max_tokens = _int_field(body, "max_completion_tokens", None) if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    limit = config.max_model_len - len(prompt.token_ids)
    if limit < 1:
        raise BadRequest(
            f"This model's maximum context length is {config.max_model_len} tokens. However, your "
            f"request has {len(prompt.token_ids)} input tokens.",
            param="messages",
        )
    if max_tokens is None or max_tokens > limit:
        if max_tokens is not None:
            raise BadRequest(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {config.max_model_len} tokens and your request has "
                f"{len(prompt.token_ids)} input tokens.",
                param="max_tokens",
            )
        max_tokens = limit
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    stream = bool(body.get("stream", False))
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    stream_options = stream_options or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object.", param="stream_options")
    stop_raw = body.get("stop") or []
    if isinstance(stop_raw, str):
        stop: tuple[str, ...] = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(s for s in stop_raw if s)
    else:
        raise BadRequest("stop must be a string or a list of strings.", param="stop")
    seed = _int_field(body, "seed", None)
    stream_interval = _int_field(body, "stream_interval", None) or 1
    if stream_interval < 1:
        raise BadRequest(
            f"stream_interval must be at least 1, got {stream_interval}.", param="stream_interval"
        )
    logprobs: int | None = None
    if chat:
        top = _int_field(body, "top_logprobs", 0) or 0
        if top < 0 or top > MAX_TOP_LOGPROBS:
            raise BadRequest(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}.", param="top_logprobs"
            )
        if body.get("logprobs"):
            logprobs = top
        elif top:
            raise BadRequest(
                "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
            )
    else:
        lp = _int_field(body, "logprobs", None)
        if lp is not None:
            if lp < 0 or lp > MAX_TOP_LOGPROBS:
                raise BadRequest(
                    f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}.", param="logprobs"
                )
            logprobs = lp
    if config.speculative is not None:
        if body.get("min_p"):
            raise BadRequest("min_p is not supported with speculative decoding.", param="min_p")
        if body.get("logit_bias"):
            raise BadRequest("logit_bias is not supported with speculative decoding.", param="logit_bias")

    base_id = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
    category = request.headers.get(CATEGORY_HEADER)
    if category is None:
        metadata = body.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("category"), str):
            category = metadata["category"]
        elif isinstance(body.get("specproxy_category"), str):
            category = body["specproxy_category"]
    if category not in CATEGORIES:
        category = infer_category(prompt.text)
    return ParsedRequest(
        chat=chat,
        base_id=str(base_id),
        prompt=prompt,
        category=category,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        continuous_usage=bool(
            stream_options.get("include_usage") and stream_options.get("continuous_usage_stats")
        ),
        return_token_ids=bool(body.get("return_token_ids")),
        logprobs=logprobs,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop=stop,
        include_stop_str=bool(body.get("include_stop_str_in_output", False)),
        greedy=greedy,
        seed=seed,
        n=n or 1,
        stream_interval=stream_interval,
    )


class ResponseShaper:
    """Builds vLLM's JSON for one request (one sequence per choice): stream chunks or the whole response."""

    def __init__(self, state: SimState, req: ParsedRequest, seqs: list[Sequence]) -> None:
        self.req = req
        self.seqs = seqs
        self.state = state
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        self.id = prefix + req.base_id
        self.created = int(time.time())
        self.model = state.config.served_name
        self.prompt_tokens = seqs[0].prompt_len
        self.prompt_ids = list(seqs[0].spec.prompt.token_ids)
        self.text_offsets = [0] * len(seqs)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def _chat_logprobs(self, i: int, start: int, end: int) -> dict[str, Any]:
        target = self.seqs[i].target
        top = self.req.logprobs or 0
        content = []
        for pos in range(start, end):
            chosen, alts = target.logprobs(pos, max(top, 1))
            piece = target.pieces[pos]
            content.append(
                {
                    "token": piece,
                    "logprob": chosen,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode())} for _, p, lp in alts[:top]
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, i: int, start: int, end: int) -> dict[str, Any]:
        target = self.seqs[i].target
        top = self.req.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        for pos in range(start, end):
            chosen, alts = target.logprobs(pos, max(top, 1))
            piece = target.pieces[pos]
            tokens.append(piece)
            token_lps.append(chosen)
            tops.append({p: lp for _, p, lp in alts[: max(top, 1)]} if top else None)
            offsets.append(self.text_offsets[i])
            self.text_offsets[i] += len(piece)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def _metrics(self, streaming: bool) -> dict[str, Any] | None:
        level = self.state.config.per_request_spec_decode_metrics
        # vLLM reports per-request speculation only for single-sequence requests.
        if level == "none" or self.state.config.speculative is None or len(self.seqs) != 1:
            return None
        spec = self.seqs[0].truth.spec_decoding_metrics(detailed=level == "detailed")
        if streaming:
            return {"speculative_decoding": spec}
        return {
            "time_to_first_token_ms": None,
            "generation_time_ms": None,
            "queue_time_ms": None,
            "mean_itl_ms": None,
            "tokens_per_second": None,
            "speculative_decoding": spec,
        }

    def first_chunk(self, i: int) -> bytes:
        """Chat only: the role chunk vLLM sends for each choice when the first output arrives."""
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": self.prompt_ids if self.req.return_token_ids else None,
            "prompt_text": None,
        }
        if self.req.continuous_usage:
            chunk["usage"] = self.usage(0)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def delta_chunk(self, i: int, start: int, end: int) -> bytes:
        seq, req = self.seqs[i], self.req
        done = seq.finished and end >= seq.n_out
        text = seq.output_text(start, end)
        token_ids = seq.output_ids(start, end) if req.return_token_ids else None
        finish = seq.finish_reason if done else None
        chunk: dict[str, Any]
        if req.chat:
            logprobs = self._chat_logprobs(i, start, end) if req.logprobs is not None else None
            choice: dict[str, Any] = {
                "index": i,
                "delta": {"content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
                "token_ids": token_ids,
            }
            if done:
                choice["stop_reason"] = seq.stop_reason
            chunk = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "kv_transfer_params": None,
            }
        else:
            logprobs = self._completion_logprobs(i, start, end) if req.logprobs is not None else None
            choice = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": seq.stop_reason if done else None,
                "token_ids": token_ids,
            }
            if start == 0:
                choice["prompt_token_ids"] = self.prompt_ids if req.return_token_ids else None
            chunk = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "kv_transfer_params": None,
            }
        if req.continuous_usage:
            chunk["usage"] = self.usage(end)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def usage_chunk(self) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(sum(s.n_out for s in self.seqs)),
        }
        metrics = self._metrics(streaming=True)
        if metrics is not None:
            chunk["metrics"] = metrics
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _chat_choice(self, i: int) -> dict[str, Any]:
        seq, req = self.seqs[i], self.req
        message: dict[str, Any] = {
            "role": "assistant",
            "content": seq.output_text(),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning": None,
        }
        return {
            "index": i,
            "message": message,
            "logprobs": self._chat_logprobs(i, 0, seq.n_out) if req.logprobs is not None else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": seq.output_ids() if req.return_token_ids else None,
        }

    def _completion_choice(self, i: int) -> dict[str, Any]:
        seq, req = self.seqs[i], self.req
        return {
            "index": i,
            "text": seq.output_text(),
            "logprobs": self._completion_logprobs(i, 0, seq.n_out) if req.logprobs is not None else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": seq.output_ids() if req.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": self.prompt_ids if req.return_token_ids else None,
        }

    def full_response(self) -> dict[str, Any]:
        req = self.req
        usage = {**self.usage(sum(s.n_out for s in self.seqs)), "prompt_tokens_details": None}
        body: dict[str, Any]
        if req.chat:
            body = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._chat_choice(i) for i in range(len(self.seqs))],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": self.prompt_ids if req.return_token_ids else None,
                "kv_transfer_params": None,
            }
        else:
            body = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._completion_choice(i) for i in range(len(self.seqs))],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
            }
        metrics = self._metrics(streaming=False)
        if metrics is not None:
            body["metrics"] = metrics
        return body


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
        req = parse_request(state, request, body, chat)
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
            shaper = ResponseShaper(state, req, seqs)
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
    shaper = ResponseShaper(state, req, seqs)
    stall_s = state.config.faults.stall_ms / 1000
    sent = [0] * len(seqs)
    done = [False] * len(seqs)
    chunks = 0
    try:
        while True:
            await waiter.wait()
            data = b""
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
                sent[i] = end
                done[i] = seq.finished
            if not data:
                continue
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
                {"role": str(m.get("role", "user")), "content": _message_text(m.get("content"))}
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
            return web.json_response(truth.as_dict(), dumps=_dumps)
    return error_response(f"no request '{rid}' in the simulator's history", 404, "NotFoundError")


async def sim_requests(request: web.Request) -> web.Response:
    truths = request.app[STATE].engine.core.truths
    limit = int(request.query.get("limit", "1000"))
    items = list(truths.values())[-limit:]
    return web.json_response({"requests": [t.as_dict() for t in items]}, dumps=_dumps)


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
    except (asyncio.CancelledError, ConnectionResetError):
        raise
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
