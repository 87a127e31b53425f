"""The transparency cases shared by tests/test_transparency.py and tests/bench/bench_tokens.py: each arm
option, each client option, and the openai SDK's model_dump() of every response with ids and
timestamps left out."""

from __future__ import annotations

import itertools
from typing import Any

import openai
import pytest

SPEC = {"method": "eagle3", "model": "draft", "num_speculative_tokens": 3}
PROMPT = "Summarise: the cache holds the batch; the server answers the request quickly."
_VOLATILE = ("id", "created")


def plain_dump(dump: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in dump.items() if k not in _VOLATILE}


# The fields that carry a stream's output piece by piece: joined chunks carry them run together.
_RUNNING_FIELDS = frozenset({"content", "text", "reasoning_content", "token_ids"})


def _join(a: Any, b: Any, key: str = "") -> Any:
    """Two chunks' fields as one chunk would carry them: output text and ids run on, the rest is b's."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _join(a.get(k), b.get(k), k) for k in a.keys() | b.keys()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 1 and isinstance(a[0], dict):
        return [_join(a[0], b[0])]  # the one choice of each chunk
    if key in _RUNNING_FIELDS and isinstance(a, str) and isinstance(b, str):
        return a + b
    if key in _RUNNING_FIELDS and isinstance(a, list) and isinstance(b, list):
        return a + b
    return a if b is None else b


def joined_chunks(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream with runs of one-choice chunks joined into one chunk.

    Where a stream is cut into chunks depends on when the server's writer woke: it sends what the
    engine produced meanwhile as one chunk (vLLM does; so does the simulator), and that differs between
    two calls on a busy machine. Joining every run makes two streams of the same tokens compare equal
    however they were cut; a usage-only chunk (no choices) stays apart, so where usage appears and
    what it says is still compared.
    """
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        prev = out[-1] if out else None
        if prev is not None and len(prev.get("choices") or ()) == 1 and len(chunk.get("choices") or ()) == 1:
            out[-1] = _join(prev, chunk)
        else:
            out.append(chunk)
    return out


async def sdk_responses(client: openai.AsyncOpenAI, model: str) -> list[Any]:
    """Every client option once, in a fixed order: the model_dump()s of each response or stream."""
    out: list[Any] = []
    for chat, stream, usage, ids in itertools.product(
        (True, False), (True, False), (True, False), (True, False)
    ):
        if usage and not stream:
            continue
        kw: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": 12}
        if stream:
            kw["stream"] = True
            if usage:
                kw["stream_options"] = {"include_usage": True}
        if ids:
            kw["extra_body"] = {"return_token_ids": True}
        if chat:
            resp = await client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
        else:
            resp = await client.completions.create(prompt=PROMPT, **kw)
        if stream:
            out.append(joined_chunks([plain_dump(c.model_dump()) async for c in resp]))
        else:
            out.append(plain_dump(resp.model_dump()))
    return out


ARM_OPTIONS = [
    pytest.param({"vllm_extensions": ext, "return_token_ids": rti, **spec}, id=f"{ext}-rti{rti}-{name}")
    for ext, rti, (name, spec) in itertools.product(
        ("auto", "off"), (True, False), (("plain", {}), ("eagle3", {"speculative": SPEC}))
    )
]
