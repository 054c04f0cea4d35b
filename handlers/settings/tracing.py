"""Trace export settings: the Go scheduler's variables with its defaults, and the standard
``OTEL_*`` ones (docs/operations.md, "Tracing").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from handlers.settings.reader import ConfigError, EnvReader

TRACE_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
                  "parentbased_always_off", "parentbased_traceidratio")
#: the path an OTLP/HTTP collector takes traces on
OTLP_TRACES_PATH = "/v1/traces"


def trace_endpoint_url(endpoint: str, *, insecure: bool, name: str = "OTEL_EXPORTER_OTLP_ENDPOINT",
                       signal_url: bool = False) -> str:
    """The OTLP/HTTP traces URL of an endpoint given as the Go version took it.

    ``host:port`` (the Go form) gets ``http://`` when ``insecure`` (OTEL_EXPORTER_OTLP_INSECURE,
    true by default), ``https://`` otherwise; a URL keeps its scheme. ``/v1/traces`` is added to
    the path unless it already ends so, or ``signal_url`` says the URL is the traces URL itself
    (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Raises ``ConfigError`` naming ``name``.
    """
    text = endpoint.strip()
    if "://" not in text:
        text = ("http://" if insecure else "https://") + text
    scheme, _, rest = text.partition("://")
    if scheme.lower() not in ("http", "https"):
        raise ConfigError(f"{name}: {endpoint!r}: OTLP/HTTP needs an http:// or https:// URL "
                          "(or host:port)")
    host, slash, path = rest.partition("/")
    if not host or host.startswith(":"):
        raise ConfigError(f"{name}: {endpoint!r} names no host")
    path = slash + path
    if not signal_url and not path.rstrip("/").endswith(OTLP_TRACES_PATH):
        path = path.rstrip("/") + OTLP_TRACES_PATH
    return f"{scheme.lower()}://{host}{path or '/'}"


def trace_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The tracing fields of ``Settings`` from the Go variables and the standard ``OTEL_*``
    ones; raises ``ConfigError`` naming the variable."""
    r = EnvReader(env)
    insecure = r.flag("OTEL_EXPORTER_OTLP_INSECURE", True)
    endpoint = ""
    if r.flag("OTEL_SDK_DISABLED", False):
        endpoint = ""
    elif r.raw("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") is not None:
        endpoint = trace_endpoint_url(r.text("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
                                      insecure=insecure, signal_url=True,
                                      name="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    else:
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "JAEGER_ENDPOINT"):  # Go's order
            value = r.raw(name)
            if value is not None:
                endpoint = trace_endpoint_url(value, insecure=insecure, name=name)
                break
    sampler = r.text("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
    if sampler not in TRACE_SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER: {sampler!r} is not one of "
                          f"{', '.join(TRACE_SAMPLERS)}")
    ratio = 1.0
    if sampler.endswith("traceidratio"):
        ratio = r.number("OTEL_TRACES_SAMPLER_ARG", 1.0, minimum=0.0, maximum=1.0)
    return {
        "trace_endpoint": endpoint,
        "trace_service_name": r.text("OTEL_SERVICE_NAME", "persys-scheduler"),
        "trace_sampler": sampler,
        "trace_sampler_ratio": ratio,
        "trace_reconcile_nodes": r.integer("SCHEDULER_TRACE_RECONCILE_NODES", 10, minimum=0,
                                           maximum=100_000),
    }
