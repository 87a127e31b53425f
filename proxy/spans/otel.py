"""Span rows as OpenTelemetry spans, for OTLP export (loaded only when spans are exported).

Needs the OpenTelemetry SDK, which comes with the ``otlp`` extra (``pip install 'specproxy[otlp]'``);
the span store itself does not use it.

- :func:`otel_span` builds the finished OTel span of a row of ``requests``: name ``"{operation}
  {model}"``, kind CLIENT, the row's trace and span id, the client's span as parent, start
  ``t_start_ns``, end ``t_start_ns + e2e_s``, ERROR status unless ``ok``, and every other non-null
  field as an attribute named by :data:`~specproxy.record.OTEL_ATTRIBUTE` (GenAI semantic conventions
  where they exist, e.g. ``gen_ai.request.model``, ``gen_ai.usage.output_tokens``; ``specproxy.*``
  otherwise).
- :class:`SpanExport` hands such spans to OTel span processors (the OTLP exporter's
  ``BatchSpanProcessor``, which exports on its own thread, or any a caller adds).
- :func:`otlp_processor` builds the OTLP/HTTP (protobuf) exporter's processor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue

from specproxy.proxy.spans.trace import TraceParent
from specproxy.record import COLUMNS, OTEL_ATTRIBUTE

# Row fields carried by the span itself rather than by attributes.
_SPAN_FIELDS = frozenset({"trace_id", "span_id", "t_start", "t_start_ns"})
# (row index, attribute name) for every field that travels as an attribute.
_ATTRIBUTES: tuple[tuple[int, str], ...] = tuple(
    (i, OTEL_ATTRIBUTE[name]) for i, name in enumerate(COLUMNS) if name not in _SPAN_FIELDS
)
_AT = {name: i for i, name in enumerate(COLUMNS)}
# Semantic conventions make finish reasons a string array; the record holds one reason.
_FINISH_REASONS = OTEL_ATTRIBUTE["finish_reason"]
OPERATION_ATTRIBUTE = "gen_ai.operation.name"
_OPERATION = {"chat": "chat", "completions": "text_completion"}
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def span_name(endpoint: str, model: str | None) -> str:
    """GenAI convention: ``"{operation} {model}"``, e.g. ``"chat meta-llama/Llama-3.1-8B-Instruct"``."""
    operation = _OPERATION.get(endpoint, endpoint)
    return f"{operation} {model}" if model else operation


def span_attributes(row: Sequence[Any]) -> dict[str, AttributeValue]:
    """A row's fields as OTel attributes; None fields are left out (OTel has no null attribute value)."""
    endpoint = row[_AT["endpoint"]]
    attrs: dict[str, AttributeValue] = {OPERATION_ATTRIBUTE: _OPERATION.get(endpoint, endpoint)}
    for index, key in _ATTRIBUTES:
        value = row[index]
        if value is not None:
            attrs[key] = value
    reason = attrs.get(_FINISH_REASONS)
    if reason is not None:
        attrs[_FINISH_REASONS] = (str(reason),)
    return attrs


def otel_span(row: Sequence[Any], parent: TraceParent | None, resource: Resource) -> ReadableSpan:
    """The finished OTel span of a row (its ids must be valid: the sink makes sure they are)."""
    start = int(row[_AT["t_start_ns"]])
    e2e = row[_AT["e2e_s"]]
    end = start + round(e2e * 1e9) if isinstance(e2e, float) and e2e > 0 else start
    status = row[_AT["status"]]
    context = SpanContext(
        trace_id=int(row[_AT["trace_id"]], 16),
        span_id=int(row[_AT["span_id"]], 16),
        is_remote=False,
        trace_flags=_SAMPLED,
    )
    remote = (
        SpanContext(int(parent.trace_id, 16), int(parent.span_id, 16), True, TraceFlags(parent.flags))
        if parent is not None
        else None
    )
    return ReadableSpan(
        name=span_name(row[_AT["endpoint"]], row[_AT["model"]]),
        context=context,
        parent=remote,
        resource=resource,
        attributes=span_attributes(row),
        kind=SpanKind.CLIENT,
        status=Status(StatusCode.UNSET)
        if status == "ok"
        else Status(StatusCode.ERROR, row[_AT["error"]] or status),
        start_time=start,
        end_time=end,
    )


class SpanExport:
    """Span processors that see every row the sink writes, as a finished OTel span.

    :meth:`export` runs on the sink's writer thread after each batch; a ``BatchSpanProcessor`` only
    queues there, and exports on its own thread.
    """

    def __init__(self, service_name: str | None = None) -> None:
        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "specproxy"
        self.resource = Resource.create({"service.name": name})
        self._processors: list[SpanProcessor] = []
        self._lock = threading.Lock()

    def add(self, processor: SpanProcessor) -> None:
        with self._lock:
            self._processors = [*self._processors, processor]

    def export(self, rows: Sequence[Sequence[Any]], parents: Sequence[TraceParent | None]) -> None:
        processors = self._processors
        for row, parent in zip(rows, parents, strict=True):
            span = otel_span(row, parent, self.resource)
            for processor in processors:
                processor.on_end(span)

    def shutdown(self, timeout_s: float) -> None:
        """Flush every processor (an OTLP exporter sends what it holds) and shut it down."""
        for processor in self._processors:
            processor.force_flush(int(timeout_s * 1000))
            processor.shutdown()


def otlp_processor(url: str | None) -> BatchSpanProcessor:
    """The OTLP/HTTP exporter's batch processor; ``url`` None: the exporter reads ``OTEL_*`` itself.

    Raises ImportError when the exporter package is not installed.
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=url) if url else OTLPSpanExporter())
