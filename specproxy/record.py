"""The span record: one row per upstream call, the contract between proxy, replay and analysis.

A shadowed request gives one record per arm, all sharing ``request_id``. The proxy and replay build
records with :class:`SpanRecord`; the sink writes them as DuckDB rows (table ``requests``, columns in
:data:`COLUMNS`, in order) and, when OTLP export is configured, as OpenTelemetry spans (attribute
names in :data:`OTEL_ATTRIBUTE`).

Values come from clients and backends, so a record is made to fit its row before it is handed over:
:func:`fit_to_columns` turns an integer out of its column's range into None and a string that is not
valid UTF-8 into one that is, and says what it changed in ``notes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter
from typing import Any, Literal, get_args, get_type_hints

Status = Literal[
    "ok", "http_error", "upstream_error", "timeout", "client_cancelled", "proxy_shutdown", "dropped"
]
# Where a span's speculation figures came from: reported by the engine for the request (one value per
# engine format), estimated from the stream's shape (reliable or not), unknown for an arm that
# speculates without either, none for an arm that does not speculate. See proxy/upstream/acceptance.py.
SpecSource = Literal[
    "vllm_request_metrics",
    "sglang_request_metrics",
    "trtllm_request_metrics",
    "llamacpp_timings",
    "stream_shape",
    "stream_shape_unreliable",
    "unknown",
    "none",
]
REPORTED_SPEC_SOURCES: tuple[str, ...] = (
    "vllm_request_metrics",
    "sglang_request_metrics",
    "trtllm_request_metrics",
    "llamacpp_timings",
)
# Where completion_tokens came from; text_estimate is an estimate (see proxy/upstream/tokens.py).
TokensSource = Literal["usage", "tokenizer", "chunks", "text_estimate"]

# The stated error of a `text_estimate` count (proxy.upstream.tokens.estimate_tokens): on windows of
# 150 words of Markdown and Python, measured against SmolLM2's tokenizer by tests/bench/bench_tokens.py,
# the mean absolute error is 6-9 % and nine windows in ten are within this bound. Other languages,
# other vocabularies and very short outputs can be off by more: a figure built on an estimated count
# is not a measurement.
TEXT_ESTIMATE_ERROR = 0.25

RoutedAs = Literal["primary", "shadow", "split", "verify", "replay"]
Source = Literal["live", "replay"]
Endpoint = Literal["chat", "completions"]
STATUSES: tuple[Status, ...] = get_args(Status)


@dataclass(slots=True)
class SpanRecord:
    # identity
    run_id: str
    request_id: str
    arm: str
    arm_role: str
    backend_url: str
    trace_id: str = ""
    span_id: str = ""
    spec_method: str = "none"
    num_speculative_tokens: int | None = None
    # how it came
    source: Source = "live"
    routed_as: RoutedAs = "primary"
    category: str | None = None
    concurrency_level: int | None = None
    inflight_at_start: int | None = None
    # request
    endpoint: Endpoint = "chat"
    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    prompt_sha256: str | None = None
    prompt_tokens: int | None = None
    # timing; t_start is UTC (tz-aware datetime, microseconds) and t_start_ns the exact epoch ns
    t_start: datetime | None = None
    t_start_ns: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    decode_tok_s: float | None = None
    chunks: int | None = None
    # output
    completion_tokens: int | None = None
    finish_reason: str | None = None
    output_sha256: str | None = None
    output_text: str | None = None
    # speculation
    num_drafts: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_length: float | None = None
    spec_source: SpecSource = "none"
    # verification
    identical: bool | None = None
    first_divergence: int | None = None
    divergence_margin: float | None = None
    # outcome
    status: Status = "ok"
    http_status: int | None = None
    error: str | None = None
    # added in schema 7 (appended, so older files migrate by ALTER TABLE ADD COLUMN)
    round: int | None = None  # replay's round of this level (1-based); None for live traffic
    engine: str | None = None  # the engine that answered: vllm | sglang | trtllm | llamacpp | unknown
    tokens_source: TokensSource | None = None  # where completion_tokens came from
    queue_s: float | None = None  # engine-reported time queued before scheduling, where reported
    engine_running: float | None = None  # the arm's running-requests gauge at call start (last scrape)
    engine_waiting: float | None = None  # the arm's waiting-requests gauge at call start (last scrape)
    notes: str | None = None  # what had to change to store the record (a value out of range, bad UTF-8)
    # added in schema 9: the latency a user feels, per call (streamed calls; None where not measured)
    tpot_s: float | None = None  # vLLM's TPOT: (e2e - ttft) / (completion_tokens - 1)
    itl_p50_s: float | None = None  # inter-token latency: gaps between content chunks' arrivals
    itl_p95_s: float | None = None
    itl_p99_s: float | None = None
    itl_max_s: float | None = None  # the longest stall after the first token
    chunk_gaps_us: str | None = None  # each gap between content chunks, in microseconds, comma-separated
    chunk_tokens: str | None = None  # tokens in each content chunk, comma-separated, where known
    offered_rate: float | None = None  # an open-loop level's offered load (requests/s); None otherwise
    # added in schema 16: when the engine gauges above were read, as seconds before the call's start
    engine_load_age_s: float | None = None

    def as_row(self) -> tuple[Any, ...]:
        """Values in :data:`COLUMNS` order, for DuckDB inserts."""
        return tuple(getattr(self, name) for name in COLUMNS)


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SpanRecord))

# The integer columns that are BIGINT (int64) in the store; every other integer column is INTEGER (int32).
BIGINT_FIELDS = frozenset({"seed", "t_start_ns"})
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
# Columns the store declares NOT NULL: a value that cannot be stored becomes "" there, not NULL.
REQUIRED_FIELDS = frozenset({"run_id", "request_id", "arm", "arm_role", "status"})


def _fields_of_type() -> dict[type, tuple[str, ...]]:
    """Record fields by the Python type their column holds (int, float, bool, str), in COLUMNS order."""
    hints = get_type_hints(SpanRecord)
    kinds: dict[type, list[str]] = {int: [], float: [], bool: [], str: []}
    for name in COLUMNS:
        args = set(get_args(hints[name])) or {hints[name]}
        args.discard(type(None))
        if all(isinstance(a, str) for a in args) or args == {str}:  # a Literal's values, or str
            kinds[str].append(name)
        elif len(args) == 1 and (kind := next(iter(args))) in kinds:
            kinds[kind].append(name)
    return {kind: tuple(names) for kind, names in kinds.items()}


_BY_TYPE = _fields_of_type()
_KIND: dict[str, type] = {name: kind for kind, names in _BY_TYPE.items() for name in names}
# The check that every value fits runs as a few C-level passes over one tuple of the record's values,
# ordered INTEGER, BIGINT, DOUBLE, BOOLEAN, VARCHAR fields: its types, its integers' magnitudes, its text
# as one string. Only a record that fails it is looked at field by field.
_INT32_FIELDS = tuple(name for name in _BY_TYPE[int] if name not in BIGINT_FIELDS)
_INT64_FIELDS = tuple(name for name in _BY_TYPE[int] if name in BIGINT_FIELDS)
_CHECKED_FIELDS = (*_INT32_FIELDS, *_INT64_FIELDS, *_BY_TYPE[float], *_BY_TYPE[bool], *_BY_TYPE[str])
_CHECKED_VALUES = attrgetter(*_CHECKED_FIELDS)
_INT32_SLICE = slice(0, len(_INT32_FIELDS))
_INT64_SLICE = slice(len(_INT32_FIELDS), len(_INT32_FIELDS) + len(_INT64_FIELDS))
_STR_SLICE = slice(len(_CHECKED_FIELDS) - len(_BY_TYPE[str]), None)
_NONE = type(None)
_ALLOWED_TYPES = tuple(frozenset({_KIND[name], _NONE}) for name in _CHECKED_FIELDS)
_contains = frozenset.__contains__
# Type signatures (the types of a record's checked values, in order) already found to fit: records
# come in a few shapes (which fields are None), so the type check is usually one set lookup.
_FITTING_SIGNATURES: set[tuple[type, ...]] = set()
_MAX_SIGNATURES = 4096


def _fits(record: SpanRecord) -> bool:
    """True when every value already fits its column (the common case). Magnitudes are compared with
    the positive bound, so -2**31 takes the slow path, where it is found to fit."""
    values = _CHECKED_VALUES(record)
    signature = tuple(map(type, values))
    if signature not in _FITTING_SIGNATURES:
        if not all(map(_contains, _ALLOWED_TYPES, signature)):
            return False
        if len(_FITTING_SIGNATURES) < _MAX_SIGNATURES:
            _FITTING_SIGNATURES.add(signature)
    return (
        max(map(abs, filter(None, values[_INT32_SLICE])), default=0) <= _INT32[1]
        and max(map(abs, filter(None, values[_INT64_SLICE])), default=0) <= _INT64[1]
        and encodes_as_utf8("".join(filter(None, values[_STR_SLICE])))
    )


def encodes_as_utf8(text: str) -> bool:
    """Whether ``text`` can be stored as it is (it has no lone surrogate); an ASCII scan first, the
    common case, then an encode."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def fit_to_columns(record: SpanRecord) -> SpanRecord:
    """Make every value of ``record`` storable in its column, in place, and note each change in ``notes``.

    An integer outside its column's range (INTEGER: int32, BIGINT: int64) or a value of the wrong type
    becomes None (``""`` in a NOT NULL column); a string that is not valid UTF-8 (a lone surrogate, such
    as an undecodable header byte) gets U+FFFD in place of what cannot be encoded. Cheap when nothing
    needs fixing: the proxy calls it for every record.

    >>> r = fit_to_columns(SpanRecord("r", "q", "a", "baseline", "u", seed=2**64 - 1))
    >>> r.seed, r.notes
    (None, 'seed 18446744073709551615 is out of range for BIGINT: stored as NULL')
    """
    if _fits(record):
        return record
    notes: list[str] = []
    for name in COLUMNS:
        value, note = fitted(name, getattr(record, name))
        if note is not None:
            setattr(record, name, value)
            notes.append(note)
    if notes:
        record.notes = "; ".join([record.notes, *notes] if record.notes else notes)
    return record


def fitted(name: str, value: Any) -> tuple[Any, str | None]:
    """``value`` as column ``name`` can store it, and a note when it had to change (else None)."""
    kind = _KIND.get(name)
    if kind is None or value is None and name not in REQUIRED_FIELDS:
        return value, None
    why: str
    if kind is int:
        low, high = _INT64 if name in BIGINT_FIELDS else _INT32
        if type(value) is not int:
            why = "is not an integer"
        elif low <= value <= high:
            return value, None
        else:
            why = f"is out of range for {'BIGINT' if name in BIGINT_FIELDS else 'INTEGER'}"
    elif kind is float:
        if type(value) is float:
            return value, None
        try:
            return float(value), None
        except (TypeError, ValueError, OverflowError):
            why = "is not a number"
    elif kind is bool:
        if type(value) is bool:
            return value, None
        why = "is not a boolean"
    elif type(value) is str:
        if encodes_as_utf8(value):
            return value, None
        return valid_utf8(value), f"{name} was not valid UTF-8: what could not be encoded is stored as U+FFFD"
    else:
        why = "is missing" if value is None else "is not text"
    if name in REQUIRED_FIELDS:
        return "", f"{name} {_shown(value)} {why}: stored as an empty string"
    return None, f"{name} {_shown(value)} {why}: stored as NULL"


def valid_utf8(text: str) -> str:
    """``text`` with every lone surrogate replaced: bytes smuggled in by ``surrogateescape`` (an
    undecodable header byte) become U+FFFD; a surrogate pair becomes the character it encodes."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates outside surrogateescape's range: a pair is joined again
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _shown(value: object) -> str:
    """A value for a note: short, and never the expensive (or refused) decimal of a huge integer."""
    if type(value) is int and value.bit_length() > 128:
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# OpenTelemetry attribute name for each record field: GenAI semantic conventions where one exists,
# `specproxy.*` otherwise.
OTEL_ATTRIBUTE: dict[str, str] = {name: f"specproxy.{name}" for name in COLUMNS} | {
    "model": "gen_ai.request.model",
    "temperature": "gen_ai.request.temperature",
    "max_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "completion_tokens": "gen_ai.usage.output_tokens",
    "finish_reason": "gen_ai.response.finish_reasons",
    "backend_url": "server.address",
    "http_status": "http.response.status_code",
    "error": "error.type",
}


def decode_tok_s(
    completion_tokens: int | None, t_first_token: float | None, t_last_token: float | None
) -> float | None:
    """The per-request decode speed: (completion_tokens − 1) / (t_last − t_first).

    None when it is not defined (fewer than two tokens, or all tokens arrived in one chunk).
    """
    if completion_tokens is None or completion_tokens < 2 or t_first_token is None or t_last_token is None:
        return None
    dt = t_last_token - t_first_token
    if dt <= 0:
        return None
    return (completion_tokens - 1) / dt
