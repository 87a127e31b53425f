"""Traffic logs in, replayable requests out: the input formats `specproxy replay` reads.

Every format becomes a list of :class:`ReplayItem` (an OpenAI request body, its endpoint, a category
and, for timed traces, an arrival offset). Formats, auto-detected from the first record:

    capture       specproxy capture JSONL (what `serve --capture` writes): {"body": {...}, "path": ...}
    openai-batch  OpenAI Batch API input JSONL: {"custom_id", "method", "url", "body"}
    vllm-custom   vLLM bench custom JSONL: {"prompt": "...", "output_tokens": 128}
    spec-bench    Spec-Bench question.jsonl: {"question_id", "category", "turns": [...]}
    sharegpt      ShareGPT JSON (an array, or JSONL) of {"conversations": [{"from", "value"}, ...]}
    mooncake      Mooncake trace JSONL: {"timestamp" (ms), "input_length", "output_length", "hash_ids"}
    azure         Azure LLM inference trace CSV: TIMESTAMP,ContextTokens,GeneratedTokens
    burstgpt      BurstGPT CSV: Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type

Traces without text (mooncake, azure, burstgpt) get synthesized prompts of the recorded token lengths
(:func:`synthesize_prompt`; one word is one token of the simulator, roughly 1.3 tokens of a real BPE
tokenizer) and ``max_tokens`` from the recorded output length. Mooncake's ``hash_ids`` name 512-token
blocks: equal ids give equal text, so requests that shared a prefix in production share it here.

A bad record raises :class:`FormatError` with ``file:line: what is wrong``; with ``on_error="skip"`` it
is counted in :attr:`ItemSet.skipped` instead.

Example::

    items = read_items("question.jsonl")            # format detected
    items.format, len(items.items), items.items[0].body["messages"]
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

Endpoint = Literal["chat", "completions"]
OnError = Literal["stop", "skip"]

FORMATS: tuple[str, ...] = (
    "capture",
    "openai-batch",
    "vllm-custom",
    "spec-bench",
    "sharegpt",
    "mooncake",
    "azure",
    "burstgpt",
)
# Mooncake's block size: each hash_id stands for this many prompt tokens.
MOONCAKE_BLOCK_TOKENS = 512
# ShareGPT and capture replies carry text, not token counts: about four characters per token.
CHARS_PER_TOKEN = 4
# The most tokens one record may ask for (prompt or output). A synthesized prompt holds one word per
# token, so this also bounds the memory one record of a token-count trace can take (~6 MB).
MAX_TOKENS_PER_RECORD = 1 << 20
# OpenAI bodies are a few levels deep (tool schemas a few dozen); the proxy's JSON encoder stops at
# 254, and Python's parser recurses once per level.
MAX_JSON_DEPTH = 128
# Format detection reads the first record whole, up to this size.
MAX_FIRST_RECORD_BYTES = 64 << 20


class FormatError(ValueError):
    """A traffic log that cannot be read; the message starts with ``file:line:`` where it can."""


@dataclass(frozen=True, slots=True)
class ReplayItem:
    """One request to replay: an OpenAI body (without ``model``/``stream``, which replay sets)."""

    item_id: str
    endpoint: Endpoint
    body: Mapping[str, Any]
    category: str | None = None
    # Seconds after the first record of a timed trace; None for logs without timestamps.
    arrival_s: float | None = None
    where: str = ""


@dataclass(slots=True)
class ItemSet:
    """What :func:`read_items` found: the items, the detected format and what was skipped."""

    format: str
    items: list[ReplayItem] = field(default_factory=list)
    skipped: int = 0
    first_skip: str | None = None


def _unknown_format_message(path: Path, why: str) -> str:
    return f"{path}: {why}; known formats: {', '.join(FORMATS)} (or name one with --format)"


# -- detection -----------------------------------------------------------------------------------


def detect_format(path: Path) -> str:
    """The format of a log, from its first non-blank record; FormatError when none fits."""
    first_line = _first_record(path)
    if first_line.startswith("["):
        return "sharegpt"
    if not first_line.startswith("{"):
        header = [h.strip().lower() for h in next(csv.reader([first_line]))]
        if {"timestamp", "contexttokens", "generatedtokens"} <= set(header):
            return "azure"
        if {"timestamp", "request tokens", "response tokens"} <= set(header):
            return "burstgpt"
        raise FormatError(_unknown_format_message(path, f"unrecognised first line {first_line[:80]!r}"))
    try:
        # Only its keys matter here; reading the records says what else is wrong with it, and where.
        obj = json.loads(first_line)
    except json.JSONDecodeError as exc:
        raise FormatError(_unknown_format_message(path, f"first line is not JSON ({exc.msg})")) from exc
    except (ValueError, RecursionError) as exc:
        raise FormatError(_unknown_format_message(path, f"first line is not JSON ({exc})")) from None
    if not isinstance(obj, dict):
        raise FormatError(_unknown_format_message(path, "first line is not a JSON object"))
    keys = set(obj)
    if "custom_id" in keys:
        return "openai-batch"
    if "hash_ids" in keys or {"input_length", "output_length"} <= keys:
        return "mooncake"
    if "turns" in keys:
        return "spec-bench"
    if "conversations" in keys:
        return "sharegpt"
    if "body" in keys:
        return "capture"
    if "prompt" in keys:
        return "vllm-custom"
    raise FormatError(_unknown_format_message(path, f"unrecognised record keys {sorted(keys)[:8]}"))


def _first_record(path: Path) -> str:
    """The first non-blank line, whole however long (a capture body can be megabytes), stripped."""
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(_bounded_lines(f, MAX_FIRST_RECORD_BYTES), 1):
                head = raw.removeprefix(b"\xef\xbb\xbf").strip()
                if not head:
                    continue
                if head.startswith(b"["):
                    return "["  # a JSON array (ShareGPT), often one line of hundreds of megabytes
                if len(raw) >= MAX_FIRST_RECORD_BYTES:
                    raise FormatError(
                        f"{path}:{line_no}: the first record is over {MAX_FIRST_RECORD_BYTES >> 20} MiB; "
                        "name the format with --format"
                    )
                try:
                    return raw.decode("utf-8-sig").strip()
                except UnicodeDecodeError as exc:
                    raise FormatError(
                        _unknown_format_message(path, f"line {line_no} is not UTF-8 text")
                    ) from exc
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    raise FormatError(_unknown_format_message(path, "the file is empty"))


def _bounded_lines(f: Any, limit: int) -> Iterator[bytes]:
    while line := f.readline(limit):
        yield line


# -- reading -------------------------------------------------------------------------------------


class _BadRecord(Exception):
    """Raised by a record parser; the reader adds `file:line:`."""


def read_items(
    path: str | Path,
    fmt: str = "auto",
    *,
    on_error: OnError = "stop",
    limit: int | None = None,
    seed: int = 0,
) -> ItemSet:
    """Read a traffic log into replay items (see the module docstring for the formats)."""
    p = Path(path)
    if not p.is_file():
        raise FormatError(f"{p}: no such file")
    name = detect_format(p) if fmt == "auto" else fmt
    if name not in FORMATS:
        raise FormatError(f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}")
    result = ItemSet(format=name)
    synth = PromptSynthesizer(seed)
    parse = _PARSERS[name]
    t0: float | None = None
    for line_no, raw in _records(p, name):
        where = f"{p}:{line_no}"
        try:
            produced = parse(raw, line_no, synth)
        except _BadRecord as exc:
            if on_error == "stop":
                raise FormatError(f"{where}: {exc}") from None
            result.skipped += 1
            result.first_skip = result.first_skip or f"{where}: {exc}"
            continue
        for item in produced:
            if item.arrival_s is not None:
                t0 = item.arrival_s if t0 is None else t0
                item = dataclasses.replace(item, arrival_s=item.arrival_s - t0)
            result.items.append(dataclasses.replace(item, where=where))
            if limit is not None and len(result.items) >= limit:
                return result
    if not result.items:
        if result.skipped:
            raise FormatError(
                f"{p}: every record was bad ({result.skipped} skipped; first: {result.first_skip})"
            )
        raise FormatError(_unknown_format_message(p, f"no {name} records in the file"))
    return result


def _records(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    """(line number, record) pairs: parsed JSON objects, CSV rows as dicts, or _BadRecord payloads."""
    if fmt in ("azure", "burstgpt"):
        yield from _csv_records(path)
        return
    if fmt == "sharegpt" and _first_record(path).startswith("["):
        yield from _json_array_records(path)
        return
    for line_no, line in _text_lines(path):
        if isinstance(line, _BadRecord):
            yield line_no, line
        elif line.strip():
            try:
                yield line_no, _json(line)
            except _BadRecord as exc:
                yield line_no, exc


def _text_lines(path: Path) -> Iterator[tuple[int, str | _BadRecord]]:
    """Numbered lines, each decoded on its own, so bad UTF-8 is a bad record with its line number."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                yield line_no, raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield (
                    line_no,
                    _BadRecord(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"),
                )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json(text: str) -> Any:
    """A JSON value with the checks replay needs: no NaN or Infinity, nesting within MAX_JSON_DEPTH."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise _BadRecord(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:
        raise _BadRecord(f"not valid JSON ({exc})") from None
    except RecursionError:
        raise _BadRecord(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    level = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [
            child
            for node in level
            if isinstance(node, dict | list)
            for child in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return
    raise _BadRecord(f"nested deeper than {MAX_JSON_DEPTH} levels (OpenAI bodies need a few dozen)")


def _json_array_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array with the line each starts on (for `file:line` errors)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = 1 + raw.count(b"\n", 0, exc.start)
        raise FormatError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    pos = text.index("[") + 1
    line = 1 + text.count("\n", 0, pos)
    while True:
        start = pos
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        line += text.count("\n", start, pos)
        if pos >= len(text):
            raise FormatError(f"{path}:{line}: the JSON array is not closed")
        if text[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise FormatError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
        except ValueError as exc:
            raise FormatError(f"{path}:{line}: not valid JSON ({exc})") from None
        except RecursionError:
            raise FormatError(f"{path}:{line}: nested deeper than {MAX_JSON_DEPTH} levels") from None
        try:
            _check_depth(obj)
        except _BadRecord as exc:
            yield line, exc
        else:
            yield line, obj
        line += text.count("\n", pos, end)
        pos = end


def _csv_records(path: Path) -> Iterator[tuple[int, Any]]:
    undecodable: list[tuple[int, _BadRecord]] = []

    def lines() -> Iterator[str]:
        for line_no, line in _text_lines(path):
            if isinstance(line, _BadRecord):
                undecodable.append((line_no, line))
                yield "\n"  # a blank line keeps the reader's line count; the record is reported below
            else:
                yield line

    reader = csv.reader(lines())
    names: list[str] | None = None
    while True:
        row: list[str] | _BadRecord | None
        try:
            row = next(reader)
        except StopIteration:
            row = None
        except csv.Error as exc:
            row = _BadRecord(f"not a CSV record ({exc})")
        yield from undecodable
        undecodable.clear()
        if row is None:
            return
        if isinstance(row, _BadRecord):
            yield reader.line_num, row
        elif names is None:
            names = [h.strip().lower() for h in row]
        elif not any(cell.strip() for cell in row):
            continue
        elif len(row) != len(names):
            yield reader.line_num, _BadRecord(f"expected {len(names)} columns, got {len(row)}")
        else:
            yield reader.line_num, dict(zip(names, (c.strip() for c in row), strict=True))


# -- one parser per format -----------------------------------------------------------------------

Parser = Callable[[Any, int, "PromptSynthesizer"], list[ReplayItem]]


def _object(raw: Any) -> dict[str, Any]:
    if isinstance(raw, _BadRecord):
        raise raw
    if not isinstance(raw, dict):
        raise _BadRecord(f"expected a JSON object, got {type(raw).__name__}")
    return raw


def _int_field(
    rec: Mapping[str, Any], key: str, *, minimum: int = 0, maximum: int = MAX_TOKENS_PER_RECORD
) -> int:
    value = rec.get(key)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _BadRecord(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _BadRecord(f"{key}: expected an integer, got {value!r}" if key in rec else f"{key} is missing")
    if value < minimum:
        raise _BadRecord(f"{key}: must be ≥ {minimum}, got {value}")
    if value > maximum:
        raise _BadRecord(f"{key}: must be ≤ {maximum}, got {_brief(value)}")
    return value


def _brief(value: int) -> str:
    digits = str(value)
    return digits if len(digits) <= 12 else f"{digits[:4]}… ({len(digits)} digits)"


def _finite(value: float, key: str) -> float:
    if not math.isfinite(value):
        raise _BadRecord(f"{key}: expected a finite number, got {value}")
    return value


# Body fields replay itself reads (for warm-up, the span and the identity check), with their bounds.
_BODY_INTS = {"max_tokens": (1, 2**31 - 1), "max_completion_tokens": (1, 2**31 - 1), "n": (1, 2**31 - 1)}


def _check_body(body: Mapping[str, Any]) -> None:
    """The fields of a recorded body that replay reads: integers and numbers in range, or absent."""
    for key, (low, high) in _BODY_INTS.items():
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise _BadRecord(f"body.{key}: expected an integer, got {value!r:.40}")
        if not low <= value <= high:
            raise _BadRecord(f"body.{key}: must be between {low} and {high}, got {_brief(value)}")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or abs(seed) >= 2**63):
        raise _BadRecord(f"body.seed: expected a 64-bit integer, got {seed!r:.40}")
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float)
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise _BadRecord(f"body.temperature: expected a finite number ≥ 0, got {temperature!r:.40}")


def _text_field(rec: Mapping[str, Any], key: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str) or not value:
        raise _BadRecord(f"{key}: expected a non-empty string" if key in rec else f"{key} is missing")
    return value


def _endpoint_of_body(body: Mapping[str, Any]) -> Endpoint:
    if "messages" in body:
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise _BadRecord("body.messages: expected a non-empty list")
        return "chat"
    if "prompt" in body:
        return "completions"
    raise _BadRecord("body has neither messages (chat) nor prompt (completions)")


def _endpoint_of_path(path: str, body: Mapping[str, Any]) -> Endpoint:
    if path.rstrip("/").endswith("/chat/completions"):
        endpoint: Endpoint = "chat"
    elif path.rstrip("/").endswith("/completions"):
        endpoint = "completions"
    else:
        raise _BadRecord(f"unsupported endpoint {path!r} (chat/completions or completions)")
    if _endpoint_of_body(body) != endpoint:
        raise _BadRecord(f"body does not match endpoint {path!r}")
    return endpoint


def _clean_body(body: Mapping[str, Any]) -> dict[str, Any]:
    # Replay decides model and streaming per arm; everything else is sent as recorded.
    return {k: v for k, v in body.items() if k not in ("model", "stream", "stream_options")}


def _parse_capture(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    rec = _object(raw)
    body = rec.get("body")
    if not isinstance(body, dict):
        raise _BadRecord("body: expected a JSON object")
    _check_body(body)
    path = rec.get("path") or rec.get("url") or rec.get("endpoint")
    endpoint = _endpoint_of_path(path, body) if isinstance(path, str) else _endpoint_of_body(body)
    arrival = _capture_time(rec)
    headers = rec.get("headers")
    headers = headers if isinstance(headers, dict) else {}
    category = rec.get("category") or {k.lower(): v for k, v in headers.items()}.get("x-specproxy-category")
    rid = rec.get("request_id") or f"capture-{line_no}"
    return [ReplayItem(str(rid), endpoint, _clean_body(body), _opt_str(category), arrival)]


def _capture_time(rec: Mapping[str, Any]) -> float | None:
    for key in ("arrival_unix_s", "t", "ts", "timestamp", "arrival", "time"):
        value = rec.get(key)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            return _finite(float(value), key)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                raise _BadRecord(f"{key}: not a timestamp: {value!r}") from None
    return None


def _opt_str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def _parse_openai_batch(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    rec = _object(raw)
    custom_id = rec.get("custom_id")
    if not isinstance(custom_id, str | int) or custom_id == "":
        raise _BadRecord("custom_id is missing")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise _BadRecord("body: expected a JSON object")
    _check_body(body)
    method = rec.get("method", "POST")
    if method != "POST":
        raise _BadRecord(f"method: only POST requests can be replayed, got {method!r}")
    url = rec.get("url")
    endpoint = _endpoint_of_path(url, body) if isinstance(url, str) else _endpoint_of_body(body)
    metadata = body.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    return [ReplayItem(str(custom_id), endpoint, _clean_body(body), _opt_str(metadata.get("category")))]


def _parse_vllm_custom(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    rec = _object(raw)
    prompt = _text_field(rec, "prompt")
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    if "output_tokens" in rec:
        body["max_tokens"] = _int_field(rec, "output_tokens", minimum=1)
    return [ReplayItem(f"line-{line_no}", "chat", body, _opt_str(rec.get("category")))]


def _parse_spec_bench(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    rec = _object(raw)
    turns = rec.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise _BadRecord("turns: expected a non-empty list of strings")
    qid = rec.get("question_id", f"line-{line_no}")
    category = _opt_str(rec.get("category"))
    # Later turns would need the model's own earlier answers; each turn is replayed as its own request.
    return [
        ReplayItem(
            f"{qid}" if i == 0 else f"{qid}-t{i + 1}",
            "chat",
            {"messages": [{"role": "user", "content": turn}]},
            category,
        )
        for i, turn in enumerate(turns)
    ]


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}


def _parse_sharegpt(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    rec = _object(raw)
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise _BadRecord("conversations: expected a non-empty list")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise _BadRecord(f'conversations[{i}]: expected {{"from": ..., "value": "..."}}')
        role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise _BadRecord(f"conversations[{i}].from: unknown speaker {turn.get('from')!r}")
        messages.append({"role": role, "content": turn["value"]})
    # As `vllm bench` does: the first user turn is the prompt, the reply's length the output length.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise _BadRecord("conversations: no human turn")
    body: dict[str, Any] = {"messages": messages[: first_user + 1]}
    reply = next((m for m in messages[first_user + 1 :] if m["role"] == "assistant"), None)
    if reply is not None:
        body["max_tokens"] = max(1, round(len(reply["content"]) / CHARS_PER_TOKEN))
    rid = rec.get("id", f"line-{line_no}")
    return [ReplayItem(str(rid), "chat", body, _opt_str(rec.get("category")))]


def _parse_mooncake(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    rec = _object(raw)
    ts_ms = _int_field(rec, "timestamp", maximum=2**53)
    n_in = _int_field(rec, "input_length", minimum=1)
    n_out = _int_field(rec, "output_length", minimum=1)
    hash_ids = rec.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise _BadRecord("hash_ids: expected a list of integers")
    prompt = synth.prompt(n_in, hash_ids, MOONCAKE_BLOCK_TOKENS, salt=line_no)
    return [
        ReplayItem(
            f"line-{line_no}",
            "completions",
            {"prompt": prompt, "max_tokens": n_out, "ignore_eos": True},
            None,
            ts_ms / 1000.0,
        )
    ]


def _csv_timestamp(value: str, key: str) -> float:
    try:
        return _finite(float(value), key)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise _BadRecord(f"{key}: not a timestamp: {value!r}") from None


def _synthesized(
    rec: Mapping[str, Any], line_no: int, synth: PromptSynthesizer, ts_key: str, in_key: str, out_key: str
) -> list[ReplayItem]:
    if isinstance(rec, _BadRecord):
        raise rec
    if ts_key not in rec:
        raise _BadRecord(f"no {ts_key} column")
    t = _csv_timestamp(rec[ts_key], ts_key)
    n_in = _int_field(rec, in_key, minimum=1)
    # A failed request in BurstGPT records 0 output tokens; it still made the server prefill.
    n_out = max(1, _int_field(rec, out_key))
    prompt = synth.prompt(n_in, [], MOONCAKE_BLOCK_TOKENS, salt=line_no)
    return [
        ReplayItem(
            f"line-{line_no}",
            "completions",
            {"prompt": prompt, "max_tokens": n_out, "ignore_eos": True},
            None,
            t,
        )
    ]


def _parse_azure(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    return _synthesized(raw, line_no, synth, "timestamp", "contexttokens", "generatedtokens")


def _parse_burstgpt(raw: Any, line_no: int, synth: PromptSynthesizer) -> list[ReplayItem]:
    return _synthesized(raw, line_no, synth, "timestamp", "request tokens", "response tokens")


_PARSERS: dict[str, Parser] = {
    "capture": _parse_capture,
    "openai-batch": _parse_openai_batch,
    "vllm-custom": _parse_vllm_custom,
    "spec-bench": _parse_spec_bench,
    "sharegpt": _parse_sharegpt,
    "mooncake": _parse_mooncake,
    "azure": _parse_azure,
    "burstgpt": _parse_burstgpt,
}


# -- synthesized prompts -------------------------------------------------------------------------

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but "
    "all were when we there can more if will one about up so out some would what time only other into "
    "its has than then them these two may first new any like our over such system data model value "
    "request server token cache batch queue memory latency stream result order table report number"
).split()


class PromptSynthesizer:
    """Deterministic filler text of a given length in words (≈ simulator tokens).

    Blocks named by the same hash id are the same text, so prefix sharing in a trace is kept; a prompt
    without hash ids gets a unique text seeded by ``salt``.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._blocks: dict[int, list[str]] = {}

    def _block(self, key: int, n: int) -> list[str]:
        cached = self._blocks.get(key)
        if cached is None or len(cached) < n:
            rng = random.Random(f"{self.seed}:{key}")
            cached = [rng.choice(_WORDS) for _ in range(n)]
            self._blocks[key] = cached
        return cached[:n]

    def prompt(self, n_tokens: int, hash_ids: list[int], block_tokens: int, salt: int) -> str:
        words: list[str] = []
        for h in hash_ids:
            if len(words) >= n_tokens:
                break
            words.extend(self._block(h, min(block_tokens, n_tokens - len(words))))
        if len(words) < n_tokens:
            rng = random.Random(f"{self.seed}:unique:{salt}")
            words.extend(rng.choice(_WORDS) for _ in range(n_tokens - len(words)))
        return " ".join(words)
