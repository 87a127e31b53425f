"""Whether and where spans are exported over OTLP (the ``OTEL_*`` variables and ``otlp_endpoint``),
and the OTel side (:mod:`.otel`), imported only when export is asked for: it needs the ``otlp`` extra."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, NamedTuple

from specproxy.proxy.spans.store import SpanSinkError

if TYPE_CHECKING:
    from specproxy.proxy.spans.otel import SpanExport

# The sink's logger: what goes wrong with its export is the sink's to say.
log = logging.getLogger("specproxy.proxy.spans.sink")

OTLP_EXTRA_HINT = "pip install 'specproxy[otlp]'"


class OtlpTarget(NamedTuple):
    """Where OTLP export goes: ``url`` (…/v1/traces), or None for the exporter's own ``OTEL_*`` settings;
    ``why``: what configured it, for messages."""

    url: str | None
    why: str


def otlp_target(endpoint: str | None) -> OtlpTarget | None:
    """Whether to export spans over OTLP/HTTP (protobuf), and where; None for no export.

    - ``endpoint`` given (the experiment's ``otlp_endpoint``, or ``--otlp-endpoint``): export there. A
      base URL such as ``http://collector:4318`` gets ``/v1/traces`` appended, as the OTel spec does for
      ``OTEL_EXPORTER_OTLP_ENDPOINT``; a URL already ending in ``/v1/traces`` is used as it is.
    - otherwise ``OTEL_TRACES_EXPORTER`` containing ``otlp`` turns it on; ``none`` (or any value without
      ``otlp``) keeps it off;
    - otherwise, a set ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns it on;
    - ``OTEL_SDK_DISABLED=true`` turns it off whatever else says.
    Headers, timeout, compression and certificates come from the standard ``OTEL_EXPORTER_OTLP_*``
    variables, read by the exporter itself. Only the http/protobuf protocol is supported.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if endpoint:
        url = endpoint.rstrip("/")
        return OtlpTarget(
            url if url.endswith("/v1/traces") else url + "/v1/traces", f"otlp_endpoint {endpoint}"
        )
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if chosen:
        if "otlp" not in {c.strip() for c in chosen.split(",")}:
            return None
        return OtlpTarget(None, "OTEL_TRACES_EXPORTER=otlp")
    return OtlpTarget(None, "OTEL_EXPORTER_OTLP_ENDPOINT") if env_endpoint else None


def span_export(service_name: str | None, wanted: str) -> SpanExport:
    """The OTel side, imported only now: it needs the SDK (the ``otlp`` extra). ``wanted``: what asks
    for it, for the message."""
    try:
        from specproxy.proxy.spans.otel import SpanExport
    except ImportError as exc:
        raise not_installed(wanted, exc) from exc
    return SpanExport(service_name)


def not_installed(wanted: str, exc: ImportError) -> SpanSinkError:
    return SpanSinkError(
        f"{wanted}, but the OpenTelemetry SDK or its OTLP exporter is not installed "
        f"({exc.name or exc}): install them with {OTLP_EXTRA_HINT}"
    )


def warn_about_protocol() -> None:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    )
    if protocol and protocol != "http/protobuf":
        log.warning("OTLP protocol %r is not supported; exporting spans with http/protobuf instead", protocol)


def otlp_export(target: OtlpTarget, service_name: str | None) -> SpanExport:
    """The OTel side with the OTLP exporter for ``target`` added; SpanSinkError when the ``otlp`` extra
    is not installed."""
    wanted = f"{target.why} asks for OTLP export of spans"
    export = span_export(service_name, wanted)
    try:
        from specproxy.proxy.spans.otel import otlp_processor

        export.add(otlp_processor(target.url))
    except ImportError as exc:
        raise not_installed(wanted, exc) from exc
    warn_about_protocol()
    return export
