"""Chat and completions request bodies, validated the way vLLM 0.33 validates them."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.text import (
    CATEGORIES,
    Prompt,
    chat_prompt,
    completion_prompt,
    id_text,
    infer_category,
)

CATEGORY_HEADER = "X-Specproxy-Category"
MAX_TOP_LOGPROBS = 20
MAX_N = 256  # choices of one request, without --max-num-seqs (vLLM's default max_num_seqs)


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


def _n_field(config: SimConfig, body: dict[str, Any]) -> int:
    """``n``, at least 1 (vLLM's rule) and at most one batch of sequences (the simulator's: each choice
    is a sequence the engine holds, and a request of 2**31 would hold the process's memory)."""
    n = _int_field(body, "n", 1)
    if n is None:
        return 1  # (n: null, as OpenAI clients may send)
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.", param="n")
    limit = config.max_num_seqs or MAX_N
    if n > limit:
        raise BadRequest(
            f"n must be at most {limit} (the most sequences the engine runs at once), got {n}.", param="n"
        )
    return n


def message_text(content: Any) -> str:
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


_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _check_tools(body: dict[str, Any]) -> None:
    """vLLM 0.33's checks of ``tools`` / ``tool_choice`` (ChatCompletionRequest.check_tool_usage).

    A server started without ``--enable-auto-tool-choice`` still accepts ``tool_choice: "auto"`` and
    answers with a plain chat completion (no tool calls are parsed), which is what the simulator does.
    """
    tools = body.get("tools")
    if tools == []:
        raise BadRequest(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        names = {(t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)}
        if not isinstance(name, str) or name not in names:
            raise BadRequest(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param="tool_choice",
            )
    elif choice not in ("auto", "required"):
        raise BadRequest(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
            '"required" are supported.',
            param="tool_choice",
        )


def _check_response_format(body: dict[str, Any]) -> None:
    """vLLM 0.33's checks of ``response_format`` (ChatCompletionRequest.validate_response_format).

    The simulator's text does not follow a schema; it only answers the requests vLLM refuses."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _RESPONSE_FORMATS:
        raise BadRequest(
            f"response_format.type must be one of {', '.join(_RESPONSE_FORMATS)}, got {kind!r}.",
            param="response_format",
        )
    if kind == "json_schema" and fmt.get("json_schema") is None:
        raise BadRequest(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            param="response_format",
        )


def _check_model(config: SimConfig, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model not in (config.served_name, config.model):
        raise BadRequest(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
        )


def _chat_prompt(body: dict[str, Any]) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of messages.", param="messages")
    norm = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise BadRequest("each message must be an object with a 'role'.", param="messages")
        norm.append({"role": str(message["role"]), "content": message_text(message.get("content"))})
    return chat_prompt(norm)


def _completion_prompt(body: dict[str, Any]) -> Prompt:
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
    return completion_prompt(raw_prompt)


def _sampling(config: SimConfig, body: dict[str, Any]) -> tuple[bool, int]:
    """(greedy, n) from ``temperature`` and ``n``."""
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
        raise BadRequest(f"temperature must be non-negative, got {temperature}.", param="temperature")
    # Unset temperature means the model's generation config (Llama-3.1: 0.6), i.e. sampling, as in vLLM.
    greedy = temperature is not None and float(temperature) < 1e-5
    n = _n_field(config, body)
    if n > 1 and greedy:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.", param="n")
    return greedy, n


def _token_limits(config: SimConfig, body: dict[str, Any], chat: bool, prompt: Prompt) -> tuple[int, int]:
    """(max_tokens, min_tokens): an unset maximum is what the context has left after the prompt."""
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
    return max_tokens, min_tokens


def _stream_options(body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(stream, stream_options), the options empty when none were sent."""
    stream = bool(body.get("stream", False))
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    stream_options = stream_options or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object.", param="stream_options")
    return stream, stream_options


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop_raw = body.get("stop") or []
    if isinstance(stop_raw, str):
        return (stop_raw,)
    if isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        return tuple(s for s in stop_raw if s)
    raise BadRequest("stop must be a string or a list of strings.", param="stop")


def _stream_interval(body: dict[str, Any]) -> int:
    stream_interval = _int_field(body, "stream_interval", None) or 1
    if stream_interval < 1:
        raise BadRequest(
            f"stream_interval must be at least 1, got {stream_interval}.", param="stream_interval"
        )
    return stream_interval


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """None when off; chat: the ``top_logprobs`` count; completions: ``logprobs``."""
    if not chat:
        lp = _int_field(body, "logprobs", None)
        if lp is not None and (lp < 0 or lp > MAX_TOP_LOGPROBS):
            raise BadRequest(
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}.", param="logprobs"
            )
        return lp
    top = _int_field(body, "top_logprobs", 0) or 0
    if top < 0 or top > MAX_TOP_LOGPROBS:
        raise BadRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}.", param="top_logprobs"
        )
    if body.get("logprobs"):
        return top
    if top:
        raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    return None


def _check_speculative(config: SimConfig, body: dict[str, Any]) -> None:
    """The sampling parameters vLLM refuses when the server runs speculative decoding."""
    if config.speculative is not None:
        if body.get("min_p"):
            raise BadRequest("min_p is not supported with speculative decoding.", param="min_p")
        if body.get("logit_bias"):
            raise BadRequest("logit_bias is not supported with speculative decoding.", param="logit_bias")


def _category(headers: Mapping[str, str], body: dict[str, Any], prompt: Prompt) -> str:
    """The traffic category: the header, then the body's metadata, else inferred from the prompt."""
    category = headers.get(CATEGORY_HEADER)
    if category is None:
        metadata = body.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("category"), str):
            category = metadata["category"]
        elif isinstance(body.get("specproxy_category"), str):
            category = body["specproxy_category"]
    if category not in CATEGORIES:
        category = infer_category(prompt.text)
    return category


def parse_request(config: SimConfig, headers: Mapping[str, str], body: Any, chat: bool) -> ParsedRequest:
    """Validate a chat or completions body as vLLM does; raises `BadRequest` with vLLM's wording.

    The checks run in vLLM's order, so a body with several faults gets the same first error."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    _check_model(config, body)
    prompt = _chat_prompt(body) if chat else _completion_prompt(body)
    greedy, n = _sampling(config, body)
    max_tokens, min_tokens = _token_limits(config, body, chat, prompt)
    stream, stream_options = _stream_options(body)
    stop = _stop(body)
    seed = _int_field(body, "seed", None)
    stream_interval = _stream_interval(body)
    logprobs = _logprobs(body, chat)
    if chat:
        _check_tools(body)
        _check_response_format(body)
    _check_speculative(config, body)
    base_id = headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
    return ParsedRequest(
        chat=chat,
        base_id=str(base_id),
        prompt=prompt,
        category=_category(headers, body, prompt),
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
        n=n,
        stream_interval=stream_interval,
    )
