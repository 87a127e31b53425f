"""W3C trace context (``traceparent``): the ids that put a request's calls in one trace.

The proxy gives every client request one trace (the client's own, when it sent a ``traceparent``) and
every upstream call a span of it, and tells each arm its span in a ``traceparent`` header, so an
engine's own tracing nests under the proxy's call. Parsing and formatting the header is all the proxy
needs of OpenTelemetry on its hot path; the SDK is loaded only when spans are exported
(:mod:`specproxy.proxy.spans.otel`).

>>> parent = client_trace_context({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
>>> parent
TraceParent(trace_id='0af7651916cd43dd8448eb211c80319c', span_id='b7ad6b7169203331', flags=1)
>>> traceparent(parent.trace_id, "00f067aa0ba902b7")
'00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from specproxy.proxy.spans.random_ids import random_hex

TRACEPARENT_HEADER = "traceparent"

# version-trace_id-parent_id-flags, lowercase hex; a later version may append fields after a "-".
_TRACEPARENT = re.compile(
    r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^ \t]*)?[ \t]*", re.ASCII
)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


class TraceParent(NamedTuple):
    """A remote span the proxy's spans belong under: its trace and span id (hex) and trace flags."""

    trace_id: str
    span_id: str
    flags: int


def parse_traceparent(value: str) -> TraceParent | None:
    """The span a ``traceparent`` header names; None when the value is not a valid one (the W3C
    rules: version ``ff`` is invalid, version ``00`` has exactly four fields, ids are not all zero)."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def client_trace_context(headers: Mapping[str, str]) -> TraceParent | None:
    """The trace context a client sent (its ``traceparent``); None if absent or invalid."""
    value = headers.get(TRACEPARENT_HEADER)
    return parse_traceparent(value) if value is not None else None


def traceparent(trace_id: str, span_id: str) -> str:
    """The ``traceparent`` value naming a (sampled) span: what an arm's own tracing parents under."""
    return f"00-{trace_id}-{span_id}-01"


def new_trace_id() -> str:
    """A random W3C trace id (32 hex digits, never all zero)."""
    return random_hex(16).replace(_ZERO_TRACE, "0" * 31 + "1")


def new_span_id() -> str:
    """A random W3C span id (16 hex digits, never all zero)."""
    return random_hex(8).replace(_ZERO_SPAN, "0" * 15 + "1")


def is_trace_id(text: str) -> bool:
    """Whether ``text`` is a valid trace id: 32 lowercase hex digits, not all zero."""
    return len(text) == 32 and text != _ZERO_TRACE and _is_hex(text)


def is_span_id(text: str) -> bool:
    """Whether ``text`` is a valid span id: 16 lowercase hex digits, not all zero."""
    return len(text) == 16 and text != _ZERO_SPAN and _is_hex(text)


def _is_hex(text: str) -> bool:
    return text.isascii() and not text.strip("0123456789abcdef")
