"""The metric catalogue as Markdown (``docs/metrics.md``), generated from ``metrics.py``.

Regenerate after changing a metric: ``python -m torshmon.catalogue.docs docs/metrics.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torshmon.catalogue.metrics import METRICS, MetricSpec

_INTRO = """\
# Metrics

Every metric torshmon exports, with its type, labels and HELP text. This page is
generated from `torshmon/catalogue/metrics.py`; do not edit it by hand
(`python -m torshmon.catalogue.docs docs/metrics.md`).

The aggregator serves job-level metrics on `/metrics` (default port 9470), each
agent node-level ones (default port 9465). Every series has one exporter: the
agent exports its node and the training processes on it (RSS, CPU time,
`torshmon_rank_info`), the aggregator every training series. Scrape both with no
relabelling and a sum counts each series once. The one name both export is
`torshmon_build_info`, which describes the daemon itself (label `daemon`).

Join training series to node and GPU exporters through `torshmon_rank_info`, e.g.
`torshmon_steps_total * on (job, rank) group_left (node, gpu) torshmon_rank_info`.
For a share of time over any window divide rates of the `_seconds_total`
counters: `rate(torshmon_comm_wait_seconds_total[5m]) /
rate(torshmon_step_seconds_total[5m])`.

A job's series carry `run` too: the launch they are of (its run id; no label where the
probes sent none). Only live runs have series: a run's go when its ranks fall silent, as
a finished job's do. A job relaunched under the same name while the last launch still
runs has both runs' series, each judged and alerted on its own, until the older one
ends. Sum or join by `job` alone to follow a job across its launches.

Labels in *italics* are optional: the collective histogram and byte counter carry
`rank` only with the aggregator's `collective_metrics_per_rank` setting (see
[configuration.md](configuration.md)). Names follow Prometheus conventions:
prefix `torshmon_`, base units (`_seconds`, `_bytes`, `_ratio` in 0..1), `_total`
for counters; histograms expose `_bucket`, `_sum` and `_count`.
"""


def _labels(spec: MetricSpec) -> str:
    names = [f"`{label}`" for label in spec.labels]
    names += [f"*`{label}`*" for label in spec.optional_labels]
    return ", ".join(names) or "(none)"


def _row(spec: MetricSpec) -> str:
    help_text = spec.help.replace("|", "\\|")
    unit = spec.unit or "—"
    return (
        f"| `{spec.name}` | {spec.kind} | {unit} | {spec.exporter} | {_labels(spec)} | "
        f"{help_text} |"
    )


def render_metrics_markdown() -> str:
    """The whole page, one table row per metric in catalogue order."""
    header = "| name | type | unit | exported by | labels | help |"
    lines = [_INTRO, header, "|---|---|---|---|---|---|"]
    lines.extend(_row(spec) for spec in METRICS.values())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the rendering to the path given (default docs/metrics.md); exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m torshmon.catalogue.docs",
        description="Write the metrics catalogue as a Markdown page.",
    )
    parser.add_argument("path", nargs="?", default="docs/metrics.md", type=Path)
    path: Path = parser.parse_args(argv).path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_metrics_markdown(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
