"""What the proxy asks an arm for beyond the client's request, and how it strips that again.

For span facts the proxy asks streams for the standard ``stream_options.include_usage``, vLLM arms
that speculate for ``continuous_usage_stats`` and arms with ``return_token_ids`` for token ids
(:func:`upstream_body`); :class:`Strip` says what of it the client did not ask for, and
:func:`strip_chunk` / :func:`strip_body` take it out of the answer, so the client gets what the
backend would have sent it. :data:`REJECTION_MARKERS` recognise a backend refusing the additions.

Example::

    data, strip = upstream_body(arm, body, with_extensions=True)
    action = strip_chunk(chunk_obj, strip)          # DROP, KEEP (as received) or CHANGED
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from specproxy.config import Arm

# Words in a 400/422 body that mean "this backend does not know vLLM's extensions".
REJECTION_MARKERS = (
    b"stream_options",
    b"continuous_usage_stats",
    b"return_token_ids",
    b"nrecognized",
    b"xtra",
    b"not permitted",
    b"unknown field",
)


@dataclass(slots=True)
class Strip:
    """What to remove from the upstream response because the proxy, not the client, asked for it."""

    usage: bool = False  # client did not ask include_usage: drop the usage-only chunk and null usages
    chunk_usage: bool = False  # client did not ask continuous stats: drop usage beside choices
    token_ids: bool = False  # client did not ask return_token_ids
    # vLLM sends `"token_ids": null` when not asked: the value goes back to null, the key stays.
    # Another backend's unasked ids are removed with their key.
    null_ids: bool = False
    added: bool = False  # the body sent upstream holds something the client did not send

    @property
    def any(self) -> bool:
        return self.usage or self.chunk_usage or self.token_ids


def upstream_body(
    arm: Arm, body: dict[str, Any], *, with_extensions: bool, with_usage: bool = True
) -> tuple[bytes, Strip]:
    """The body sent upstream and what must be stripped from its response for the client.

    ``with_usage``: ask a stream for the standard final usage even without vLLM's extensions."""
    strip = Strip()
    if not with_extensions:
        return _with_standard_usage(body, strip) if with_usage else orjson.dumps(body), strip
    out = dict(body)
    if body.get("stream"):
        opts = body.get("stream_options")
        client_opts = opts if isinstance(opts, dict) else {}
        strip.usage = not client_opts.get("include_usage")
        # Per-chunk usage (tokens per chunk) only where the stream's shape is measured: arms with
        # speculation. Other arms (the production baseline among them) only add the final usage
        # chunk, so their chunks reach the client byte for byte and cost the server nothing extra.
        continuous = arm.spec_method != "none" or bool(client_opts.get("continuous_usage_stats"))
        strip.chunk_usage = continuous and not client_opts.get("continuous_usage_stats")
        out["stream_options"] = {**client_opts, "include_usage": True, "continuous_usage_stats": continuous}
    if arm.return_token_ids:
        strip.token_ids = not body.get("return_token_ids")
        out["return_token_ids"] = True
    strip.added = out != body
    return orjson.dumps(out), strip


def _with_standard_usage(body: dict[str, Any], strip: Strip) -> bytes:
    """A stream's body asking for ``stream_options.include_usage`` (OpenAI's own option)."""
    opts = body.get("stream_options")
    client_opts = opts if isinstance(opts, dict) else {}
    if not body.get("stream") or client_opts.get("include_usage"):
        return orjson.dumps(body)
    strip.usage = strip.added = True
    return orjson.dumps({**body, "stream_options": {**client_opts, "include_usage": True}})


DROP, KEEP, CHANGED = 0, 1, 2


def strip_chunk(obj: dict[str, Any], strip: Strip, per_chunk_usage: bool = True) -> int:
    """Remove what the client did not ask for from one chunk: DROP the event, KEEP it as received, or
    send it CHANGED (re-serialised). ``per_chunk_usage``: the stream's first chunk carried a usage
    (continuous usage); without it a usage beside choices is the engine's own final count."""
    choices = obj.get("choices")
    changed = False
    if "usage" in obj:
        if not choices:
            if strip.usage:
                return DROP
        elif (strip.chunk_usage and per_chunk_usage) or (strip.usage and obj["usage"] is None):
            # A usage beside choices that the proxy did not cause stays: llama-server ends every
            # streamed /v1/completions with its usage there, asked or not.
            changed = _pop(obj, "usage")
    if strip.token_ids:
        unset = _null if strip.null_ids or _vllm_shaped(obj) else _pop
        changed = unset(obj, "prompt_token_ids") or changed
        for c in choices or ():
            changed = unset(c, "token_ids") or changed
            changed = unset(c, "prompt_token_ids") or changed
    return CHANGED if changed else KEEP


def _vllm_shaped(obj: dict[str, Any]) -> bool:
    # Fields only vLLM's response models have (ChatCompletionStreamResponse, CompletionResponse).
    return "kv_transfer_params" in obj or "prompt_text" in obj


def _null(d: dict[str, Any], key: str) -> bool:
    if d.get(key) is not None:
        d[key] = None
        return True
    return False


def _pop(d: dict[str, Any], key: str) -> bool:
    if key in d:
        del d[key]
        return True
    return False


def strip_body(body: bytes, strip: Strip) -> bytes:
    """A non-streaming response without the token ids the proxy added (unchanged when nothing to do)."""
    if not strip.token_ids:
        return body
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(obj, dict):
        return body
    strip_chunk(obj, Strip(token_ids=True, null_ids=strip.null_ids))
    return orjson.dumps(obj)
