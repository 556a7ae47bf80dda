"""OpenTelemetry export: spans for training steps, alerts and tuning decisions.

With an OTLP endpoint configured (setting ``otlp_endpoint`` or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``) spans go there over OTLP/HTTP through a batch
processor; without one nothing is exported and recording costs nothing. Tests pass
their own span processor (e.g. the SDK's in-memory exporter behind a simple
processor). Telemetry never breaks the aggregator: export failures are the SDK's
to log, and recording errors are logged once and dropped.

One span per step of each job's rank 0 (start and end from the probe's clock),
with the forward/backward/optimizer phases as children; a step of rank 0 stands
for the job's step because DDP keeps ranks in lockstep.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode, set_span_in_context

if TYPE_CHECKING:
    from torshmon.aggregator.core.alert import Alert
    from torshmon.aggregator.core.stored import Stored

log = logging.getLogger(__name__)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL under ``endpoint``: ``/v1/traces`` added to its path (not
    after its query, which may hold an API key)."""
    parts = urlsplit(endpoint)
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/traces"):
        path += "/v1/traces"
    return urlunsplit(parts._replace(path=path))


class Tracing:
    """The aggregator's tracer provider; inert unless an endpoint or processor is given."""

    def __init__(
        self,
        endpoint: str | None,
        *,
        service_instance: str = "",
        processor: SpanProcessor | None = None,
    ) -> None:
        self.enabled = endpoint is not None or processor is not None
        self._failed = False
        self.provider: TracerProvider | None = None
        if not self.enabled:
            return
        resource = Resource.create(
            {"service.name": "torshmon-aggregator", "service.instance.id": service_instance}
        )
        self.provider = TracerProvider(resource=resource)
        if processor is not None:
            self.provider.add_span_processor(processor)
        if endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)))
            )
        self.tracer = self.provider.get_tracer("torshmon.aggregator")

    def record_steps(self, stored: Stored) -> None:
        """A span per step of rank 0 in ``stored``, with its phases as children."""
        if not self.enabled:
            return
        try:
            for batch, node in stored.batches:
                if batch.rank != 0:
                    continue
                for step in batch.steps:
                    end = step.end_unix_ns
                    start = end - int(step.duration_s * 1e9)
                    span = self.tracer.start_span(
                        "train.step",
                        start_time=start,
                        attributes={
                            "torshmon.job": batch.job,
                            "torshmon.rank": batch.rank,
                            "torshmon.node": node,
                            "torshmon.step": step.step,
                            "torshmon.comm_wait_s": step.comm_wait_s,
                            "torshmon.compute_s": step.compute_s,
                            "torshmon.communication_time_ratio": step.communication_time_ratio,
                            "torshmon.config_version": step.config_version,
                        },
                    )
                    ctx = set_span_in_context(span)
                    t = start
                    for name in ("forward_s", "backward_s", "optimizer_s"):
                        phase = getattr(step, name)
                        if phase is None:
                            continue
                        child = self.tracer.start_span(
                            f"train.{name[:-2]}", context=ctx, start_time=t
                        )
                        t += int(phase * 1e9)
                        child.end(end_time=min(t, end))
                    if step.loss_nonfinite:
                        span.set_status(Status(StatusCode.ERROR, "non-finite loss"))
                    span.end(end_time=end)
        except Exception:
            self._fail("step spans")

    def record_alert(self, alert: Alert) -> None:
        """A zero-length span per alert transition."""
        if not self.enabled:
            return
        try:
            attributes: dict[str, str | float] = {
                f"torshmon.label.{k}": v for k, v in alert.labels.items()
            }
            attributes["torshmon.alert.state"] = alert.state
            if alert.value is not None:
                attributes["torshmon.alert.value"] = alert.value
            with self.tracer.start_as_current_span(f"alert.{alert.state}", attributes=attributes):
                pass
        except Exception:
            self._fail("alert spans")

    def record_decision(self, name: str, attributes: dict[str, str | float | int]) -> None:
        """A span for a tuning decision (trial started, kept, rolled back, ...)."""
        if not self.enabled:
            return
        try:
            with self.tracer.start_as_current_span(f"tune.{name}", attributes=attributes):
                pass
        except Exception:
            self._fail("tuning spans")

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()

    def _fail(self, what: str) -> None:
        if not self._failed:
            self._failed = True
            log.exception("recording %s failed; telemetry continues without them", what)
