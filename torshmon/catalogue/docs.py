"""The metric catalogue as Markdown (``docs/metrics.md``), generated from ``metrics.py``.

Regenerate after changing a metric: ``python -m torshmon.catalogue.docs docs/metrics.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torshmon.catalogue.metrics import EXPORTERS, METRICS, MetricSpec

_INTRO = """\
# Metrics

Every metric torshmon exports, with its type, labels and HELP text. This page is
generated from `torshmon/catalogue/metrics.py`; do not edit it by hand
(`python -m torshmon.catalogue.docs docs/metrics.md`).

The aggregator serves job-level metrics on `/metrics` (default port 9470), each
agent node-level ones (default port 9465). A name both export means the same in
both; Prometheus drops the agent's copy where the aggregator has one (see
[prometheus-grafana.md](prometheus-grafana.md)). Names follow Prometheus
conventions: prefix `torshmon_`, base units (`_seconds`, `_bytes`, `_ratio` in
0..1), `_total` for counters; histograms expose `_bucket`, `_sum` and `_count`.
"""


def _labels(labels: tuple[str, ...] | None) -> str:
    if labels is None:
        return "—"
    return ", ".join(f"`{label}`" for label in labels) or "(none)"


def _row(spec: MetricSpec) -> str:
    help_text = spec.help.replace("|", "\\|")
    unit = spec.unit or "—"
    return (
        f"| `{spec.name}` | {spec.kind} | {unit} | {_labels(spec.agent)} | "
        f"{_labels(spec.aggregator)} | {help_text} |"
    )


def render_metrics_markdown() -> str:
    """The whole page, one table row per metric in catalogue order."""
    header = "| name | type | unit | " + " | ".join(f"{e} labels" for e in EXPORTERS) + " | help |"
    lines = [_INTRO, header, "|---|---|---|---|---|---|"]
    lines.extend(_row(spec) for spec in METRICS.values())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the rendering to the path given (default docs/metrics.md); exit status."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "docs/metrics.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_metrics_markdown(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
