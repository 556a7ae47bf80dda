"""Writes torshmon's Grafana dashboards (Grafana 10+ JSON) into this folder.

The panels are built with Grafana's own SDK, grafana-foundation-sdk (a build-time
tool in the ``dev`` extra: neither torshmon nor Grafana needs it at run time). The six
dashboards share their variables (data source, job, node, rank), panel defaults and
layout, so they are generated here rather than edited by hand::

    python dashboards/build.py            # rewrite the JSON files
    python dashboards/build.py --check    # exit 1 if a file is out of date

Each panel's PromQL is written once, in its definition under "the dashboards" below.
Every query reads metrics named in ``torshmon.catalogue.metrics`` (checked when the
files are written) from Prometheus scraping the aggregator (job-level series) and
the agents (node and agent-health series); see deploy/prometheus.yml.
``$__rate_interval`` is Grafana's, so the same panel works for any scrape interval.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

try:
    from grafana_foundation_sdk.builders import bargauge, prometheus, statetimeline
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dashboard_builders
    from grafana_foundation_sdk.builders import heatmap as heatmap_builders
    from grafana_foundation_sdk.builders import stat as stat_builders
    from grafana_foundation_sdk.builders import table as table_builders
    from grafana_foundation_sdk.builders import timeseries as timeseries_builders
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as common_models
    from grafana_foundation_sdk.models import dashboard as dashboard_models
    from grafana_foundation_sdk.models import heatmap as heatmap_models
    from grafana_foundation_sdk.models import prometheus as prometheus_models
except ImportError as exc:  # a build-time tool, in the dev extra
    raise SystemExit(
        f"dashboards/build.py needs grafana-foundation-sdk (pip install -e '.[dev]'): {exc}"
    ) from None

from torshmon.catalogue.metrics import METRICS

HERE: Final = Path(__file__).resolve().parent
#: The data source the provisioning in grafana/ creates (a variable, so that the
#: dashboards also import into a Grafana whose Prometheus has another uid).
DATASOURCE_UID: Final = "torshmon-prometheus"
DATASOURCE: Final = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG: Final = "torshmon"

# Label selectors shared by the panels.
JOB: Final = 'job="$job"'
RANKS: Final = 'job="$job", rank=~"$rank"'
#: The ranks chosen, and the job-level series (no rank label: step time's anomaly).
RANKS_OR_JOB: Final = 'job="$job", rank=~"$rank|"'
NODES: Final = 'node=~"$node"'
RATE: Final = "$__rate_interval"
METRIC_NAME: Final = re.compile(r"\btorshmon_[a-z0-9_]+")

Thresholds = tuple[tuple[str, float | None], ...]
PanelBuilder = (
    timeseries_builders.Panel
    | stat_builders.Panel
    | statetimeline.Panel
    | table_builders.Panel
    | bargauge.Panel
    | heatmap_builders.Panel
)
T = TypeVar("T")
P = TypeVar("P", bound=PanelBuilder)


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target: its expression and legend (``{{label}}`` templates)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[PanelBuilder, ...]


@dataclass(frozen=True, slots=True)
class Dashboard:
    """One dashboard file: ``<slug>.json`` with uid ``torshmon-<slug>``."""

    slug: str
    title: str
    description: str
    rows: tuple[Row, ...]
    extra_variables: tuple[cogbuilder.Builder[Any], ...] = ()

    @property
    def uid(self) -> str:
        return f"torshmon-{self.slug}"

    @property
    def filename(self) -> str:
        return f"{self.slug}.json"


# -- what the SDK's Grafana 10.1 models lack ---------------------------------------------


@dataclass(frozen=True, slots=True)
class _Extended:
    """A built SDK object plus JSON fields its model has no attribute for."""

    model: Any
    fields: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {**self.model.to_json(), **self.fields}


@dataclass(slots=True)
class Extended(cogbuilder.Builder[T], Generic[T]):
    """An SDK builder whose result carries extra JSON fields: a Prometheus annotation's
    ``titleFormat``/``textFormat``/``step`` and a query variable's ``definition`` (the
    text Grafana shows in the variables list)."""

    builder: cogbuilder.Builder[T]
    fields: dict[str, Any] = field(default_factory=dict)

    def build(self) -> T:
        return _Extended(self.builder.build(), self.fields)  # type: ignore[return-value]


# -- panel shorthands ---------------------------------------------------------------------


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def _target(query: Query, ref_id: str, *, instant: bool, fmt: str = "") -> prometheus.Dataquery:
    target = (
        prometheus.Dataquery()
        .datasource(DATASOURCE)
        .ref_id(ref_id)
        .expr(query.expr)
        .legend_format(query.legend or "__auto")
        .editor_mode(prometheus_models.QueryEditorMode.CODE)
    )
    target = target.instant() if instant else target.range()
    if fmt:
        target = target.format(prometheus_models.PromQueryFormat(fmt))
    return target


def _thresholds(steps: Thresholds) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps(
            [dashboard_models.Threshold(value=v, color=c) for c, v in steps or (("green", None),)]
        )
    )


def _panel(
    panel: P,
    title: str,
    queries: Sequence[Query],
    *,
    description: str = "",
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    min_value: float | None = None,
    max_value: float | None = None,
    thresholds: Thresholds = (),
    instant: bool = False,
    fmt: str = "",
) -> P:
    """What every panel has: title, data source, queries A, B, ..., unit, size, thresholds."""
    if not 1 <= width <= 24:
        raise ValueError(f"panel {title!r} width {width} is not 1..24")
    built: Any = (
        panel.title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(
            [
                _target(query, chr(ord("A") + index), instant=instant, fmt=fmt)
                for index, query in enumerate(queries)
            ]
        )
        .unit(unit)
        .span(width)
        .height(height)
        .thresholds(_thresholds(thresholds))
        .mappings([])
    )
    if min_value is not None:
        built = built.min(min_value)
    if max_value is not None:
        built = built.max(max_value)
    return built  # type: ignore[no-any-return]


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common_models.LegendDisplayMode.LIST)
        .placement(common_models.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def _last_value() -> common_builders.ReduceDataOptions:
    return common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def _palette() -> dashboard_builders.FieldColor:
    return dashboard_builders.FieldColor().mode(dashboard_models.FieldColorModeId.PALETTE_CLASSIC)


def timeseries(
    title: str,
    *queries: Query,
    stack: bool = False,
    threshold_lines: bool = False,
    **options: Any,
) -> timeseries_builders.Panel:
    lines = "line" if threshold_lines else "off"
    return (
        _panel(timeseries_builders.Panel(), title, queries, **options)
        .color_scheme(_palette())
        .draw_style(common_models.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(30 if stack else 10)
        .show_points(common_models.VisibilityMode.NEVER)
        .span_nulls(False)
        .stacking(
            common_builders.StackingConfig()
            .mode(common_models.StackingMode.NORMAL if stack else common_models.StackingMode.NONE)
            .group("A")
        )
        .thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(
                common_models.GraphTresholdsStyleMode(lines)  # sic: the SDK's spelling
            )
        )
        .legend(_legend())
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common_models.TooltipDisplayMode.MULTI)
            .sort(common_models.SortOrder.DESCENDING)
        )
    )


def stat(
    title: str, *queries: Query, stat_text: str = "auto", **options: Any
) -> stat_builders.Panel:
    """A current value with its sparkline (a range query reduced to its last value)."""
    options.setdefault("width", 4)
    options.setdefault("height", 4)
    return (
        _panel(stat_builders.Panel(), title, queries, **options)
        .color_scheme(
            dashboard_builders.FieldColor().mode(dashboard_models.FieldColorModeId.THRESHOLDS)
        )
        .reduce_options(_last_value())
        .color_mode(common_models.BigValueColorMode.VALUE)
        .graph_mode(common_models.BigValueGraphMode.AREA)
        .justify_mode(common_models.BigValueJustifyMode.AUTO)
        .orientation(common_models.VizOrientation.AUTO)
        .text_mode(common_models.BigValueTextMode(stat_text))
    )


def timeline(title: str, *queries: Query, **options: Any) -> statetimeline.Panel:
    """Whether a 0/1 series is set over time ("yes" in red)."""
    return (
        _panel(
            statetimeline.Panel(),
            title,
            queries,
            thresholds=(("transparent", None), ("red", 1)),
            **options,
        )
        .color_scheme(
            dashboard_builders.FieldColor().mode(dashboard_models.FieldColorModeId.THRESHOLDS)
        )
        .mappings(
            [
                dashboard_models.ValueMap(
                    options={
                        "0": dashboard_models.ValueMappingResult(text="no"),
                        "1": dashboard_models.ValueMappingResult(text="yes"),
                    }
                )
            ]
        )
        .fill_opacity(70)
        .line_width(0)
        .legend(_legend())
        .tooltip(common_builders.VizTooltipOptions().mode(common_models.TooltipDisplayMode.SINGLE))
        .show_value(common_models.VisibilityMode.NEVER)
        .merge_values(True)
        .row_height(0.9)
        .align_value(common_models.TimelineValueAlignment.LEFT)
    )


def table(
    title: str, *queries: Query, transformations: Iterable[dict[str, Any]] = (), **options: Any
) -> table_builders.Panel:
    """Instant queries as table rows; ``transformations`` as Grafana names them."""
    return (
        _panel(table_builders.Panel(), title, queries, instant=True, fmt="table", **options)
        .color_scheme(_palette())
        .transformations(
            [
                dashboard_models.DataTransformerConfig(id_val=t["id"], options=t["options"])
                for t in transformations
            ]
        )
        .show_header(True)
        .cell_height(common_models.TableCellHeight.SM)
        .footer(common_builders.TableFooterOptions().show(False).reducer([]))
    )


def bars(title: str, *queries: Query, **options: Any) -> bargauge.Panel:
    """The current value of each series as a horizontal bar."""
    return (
        _panel(bargauge.Panel(), title, queries, instant=True, **options)
        .color_scheme(_palette())
        .reduce_options(_last_value())
        .display_mode(common_models.BarGaugeDisplayMode.GRADIENT)
        .orientation(common_models.VizOrientation.HORIZONTAL)
        .show_unfilled(True)
    )


def heatmap(title: str, expr: str, **options: Any) -> heatmap_builders.Panel:
    """A Prometheus histogram's buckets (``le``) over time, as Prometheus computed them."""
    return (
        _panel(heatmap_builders.Panel(), title, (Query(expr, "{{le}}"),), fmt="heatmap", **options)
        .color_scheme(_palette())
        .calculate(False)
        .cell_gap(1)
        .color(
            heatmap_builders.HeatmapColorOptions()
            .mode(heatmap_models.HeatmapColorMode.SCHEME)
            .scheme("Spectral")
            .steps(64)
            .exponent(0.5)
        )
        .y_axis(
            heatmap_builders.YAxisConfig()
            .unit("s")
            .axis_placement(common_models.AxisPlacement.LEFT)
        )
        .rows_frame(
            heatmap_builders.RowsHeatmapOptions().layout(common_models.HeatmapCellLayout.AUTO)
        )
        .show_legend()
        .show_tooltip()
        .hide_y_histogram()
    )


def mean_step(selector: str, by: str = "") -> str:
    """Mean step time from the step histogram (every step weighs the same)."""
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (rate(torshmon_step_duration_seconds_sum{{{selector}}}[{RATE}]))"
        f" / sum{group} (rate(torshmon_step_duration_seconds_count{{{selector}}}[{RATE}]))"
    )


def per_step(metric: str, selector: str, by: str = "") -> str:
    """Seconds of ``metric`` (compute, comm_wait) per step over the rate window: its
    ``_seconds_total`` counter over the step counter, so any window gives a true mean."""
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (rate(torshmon_{metric}_seconds_total{{{selector}}}[{RATE}]))"
        f" / sum{group} (rate(torshmon_steps_total{{{selector}}}[{RATE}]))"
    )


def step_quantile(quantile: float) -> str:
    return (
        f"histogram_quantile({quantile}, sum by (le) "
        f"(rate(torshmon_step_duration_seconds_bucket{{{RANKS}}}[{RATE}])))"
    )


OK_WARN_BAD_UP = (("green", None), ("orange", 0.3), ("red", 0.5))
RED_BELOW_07 = (("red", None), ("green", 0.7))


# -- the dashboards -----------------------------------------------------------------------


def job_overview() -> Dashboard:
    headline = Row(
        "Job $job",
        (
            stat(
                "Throughput",
                q(f"sum(torshmon_throughput_samples_per_second{{{RANKS}}})"),
                unit="short",
                description="Samples per second of the whole job: the ranks' latest steps summed.",
            ),
            stat("Mean step time", q(mean_step(RANKS)), unit="s"),
            stat(
                "Communication share",
                q(f"avg(torshmon_communication_time_ratio{{{RANKS}}})"),
                unit="percentunit",
                thresholds=OK_WARN_BAD_UP,
                description="Share of each step spent waiting for communication, mean over "
                "ranks. Above 30% is a bottleneck, above 50% a critical one.",
            ),
            stat(
                "Training efficiency",
                q(f"avg(torshmon_training_efficiency_ratio{{{RANKS}}})"),
                unit="percentunit",
                thresholds=RED_BELOW_07,
                description="Compute time over step time, mean over ranks; below 70% the "
                "job spends too much time waiting.",
            ),
            stat("Ranks reporting", q(f"count(torshmon_steps_total{{{JOB}}})"), unit="none"),
            stat(
                "Steps per second",
                q(f"avg(rate(torshmon_steps_total{{{RANKS}}}[{RATE}]))"),
                unit="none",
            ),
        ),
    )
    training = Row(
        "Throughput and step time",
        (
            timeseries(
                "Throughput",
                q(f"sum(torshmon_throughput_samples_per_second{{{RANKS}}})", "job"),
                q(f"torshmon_throughput_samples_per_second{{{RANKS}}}", "rank {{rank}}"),
                unit="short",
                description="Samples per second, the job's and each rank's.",
            ),
            timeseries(
                "Step time",
                q(step_quantile(0.5), "p50"),
                q(step_quantile(0.9), "p90"),
                q(step_quantile(0.99), "p99"),
                q(mean_step(RANKS), "mean"),
                unit="s",
                description="Quantiles of the step-time histogram over the selected ranks.",
            ),
            timeseries(
                "Communication share of step time",
                q(f"torshmon_communication_time_ratio{{{RANKS}}}", "rank {{rank}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=OK_WARN_BAD_UP,
                threshold_lines=True,
                description="Time each step waited for communication over its duration. "
                "Lines at 30% (high) and 50% (critical) are the bottleneck report's.",
            ),
            timeseries(
                "Training efficiency",
                q(f"torshmon_training_efficiency_ratio{{{RANKS}}}", "rank {{rank}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=RED_BELOW_07,
                threshold_lines=True,
                description="Compute time over step time per rank (line: 70%).",
            ),
            timeseries(
                "Compute and communication wait",
                q(per_step("compute", RANKS), "compute"),
                q(per_step("comm_wait", RANKS), "communication wait"),
                unit="s",
                stack=True,
                description="A step split into compute and communication wait, mean over "
                "the selected ranks' steps in the window.",
            ),
            timeseries(
                "Loss",
                q(f"torshmon_loss{{{RANKS}}}", "rank {{rank}}"),
                description="Latest training loss per rank.",
            ),
        ),
    )
    nodes = Row(
        "Nodes",
        (
            timeseries(
                "CPU utilisation",
                q(f"torshmon_cpu_utilization_ratio{{{NODES}}}", "{{node}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                width=8,
            ),
            timeseries(
                "Memory utilisation",
                q(f"torshmon_memory_utilization_ratio{{{NODES}}}", "{{node}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=(("green", None), ("red", 0.9)),
                threshold_lines=True,
                width=8,
                description="Used over total memory; the High Memory Usage alert fires "
                "above 90% (line).",
            ),
            timeseries(
                "I/O wait",
                q(f"torshmon_node_cpu_iowait_ratio{{{NODES}}}", "{{node}}"),
                unit="percentunit",
                min_value=0,
                thresholds=(("green", None), ("orange", 0.1)),
                threshold_lines=True,
                width=8,
                description="CPU time waiting for I/O; above 10% the input pipeline is "
                "likely the bottleneck.",
            ),
            timeseries(
                "GPU utilisation",
                q(f"torshmon_gpu_utilization_ratio{{{NODES}}}", "{{node}} gpu {{gpu}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=RED_BELOW_07,
                threshold_lines=True,
                width=8,
                description="NVML busy time per GPU (empty on nodes without NVIDIA GPUs).",
            ),
            timeseries(
                "Network",
                q(
                    f"sum by (node) (rate(torshmon_network_receive_bytes_total{{{NODES}}}"
                    f"[{RATE}]))",
                    "{{node}} received",
                ),
                q(
                    f"sum by (node) (rate(torshmon_network_transmit_bytes_total{{{NODES}}}"
                    f"[{RATE}]))",
                    "{{node}} sent",
                ),
                unit="Bps",
                width=8,
            ),
            timeseries(
                "Rank memory (RSS)",
                q(
                    f"torshmon_rank_memory_rss_bytes{{{RANKS}, {NODES}}}",
                    "rank {{rank}} on {{node}}",
                ),
                unit="bytes",
                width=8,
                description="Resident memory of each training process; steady growth "
                "is what the Memory Leak alert looks for.",
            ),
        ),
    )
    return Dashboard(
        "job-overview",
        "torshmon / Job overview",
        "Throughput, step time, communication share and efficiency of one training job.",
        (headline, training, nodes),
    )


def ranks() -> Dashboard:
    compute = Row(
        "Stragglers",
        (
            timeseries(
                "Compute time per rank",
                q(per_step("compute", RANKS, "rank"), "rank {{rank}}"),
                unit="s",
                description="Per step, over the window: step time minus communication "
                "wait. This is the straggler signal: a slow rank computes longer, while its "
                "collectives look fastest (it arrives last and waits least).",
            ),
            timeseries(
                "Compute time relative to the job's median",
                q(
                    f"({per_step('compute', RANKS, 'job, rank')}) / on (job) group_left () "
                    f"quantile by (job) (0.5, {per_step('compute', JOB, 'job, rank')})",
                    "rank {{rank}}",
                ),
                unit="none",
                thresholds=(("green", None), ("orange", 1.5)),
                threshold_lines=True,
                description="1 is the median rank; a straggler stands out above it.",
            ),
            timeseries(
                "Communication wait per rank",
                q(per_step("comm_wait", RANKS, "rank"), "rank {{rank}}"),
                unit="s",
                description="The ranks that wait longest are waiting for the straggler.",
            ),
            timeline(
                "Straggler detected",
                q(f"max by (rank) (torshmon_straggler_active{{{RANKS}}})", "rank {{rank}}"),
                description="While the aggregator's detector (robust z-score of compute "
                "time across ranks, with persistence) flags the rank.",
            ),
            timeseries(
                "Straggler score",
                q(f"torshmon_straggler_score{{{RANKS}}}", "rank {{rank}}"),
                unit="none",
                description="The detector's statistic for a flagged rank.",
            ),
            bars(
                "Mean step time per rank",
                q(mean_step(RANKS, "rank"), "rank {{rank}}"),
                unit="s",
            ),
        ),
    )
    health = Row(
        "Per-rank health",
        (
            timeseries(
                "Steps per second",
                q(f"rate(torshmon_steps_total{{{RANKS}}}[{RATE}])", "rank {{rank}}"),
                unit="none",
                width=8,
            ),
            timeseries(
                "Throughput per rank",
                q(f"torshmon_throughput_samples_per_second{{{RANKS}}}", "rank {{rank}}"),
                width=8,
            ),
            timeseries(
                "Oldest collective in flight",
                q(
                    f"max by (rank) (torshmon_inflight_oldest_age_seconds{{{RANKS}}})",
                    "rank {{rank}}",
                ),
                unit="s",
                width=8,
                description="Age of the oldest collective each rank is inside (0: none). "
                "In a hang the rank that never joined stays at 0 while its peers grow.",
            ),
            timeseries(
                "Communication config version",
                q(f"torshmon_config_version{{{RANKS}}}", "rank {{rank}}"),
                unit="none",
                width=8,
                description="Every rank must run the same version: configs change on all "
                "ranks at the same step.",
            ),
            timeseries(
                "Records dropped by the probe",
                q(
                    f"rate(torshmon_probe_dropped_records_total{{{RANKS}}}[{RATE}])",
                    "rank {{rank}}",
                ),
                unit="none",
                width=8,
                description="Step records per second the probe had to drop (no or slow "
                "agent); training itself is never blocked.",
            ),
            timeseries(
                "Rank memory (RSS)",
                q(f"torshmon_rank_memory_rss_bytes{{{RANKS}}}", "rank {{rank}}"),
                unit="bytes",
                width=8,
            ),
            table(
                "Ranks now",
                q(f"max by (rank) (torshmon_steps_total{{{RANKS}}})"),
                q(per_step("compute", RANKS, "rank")),
                q(per_step("comm_wait", RANKS, "rank")),
                q(f"max by (rank) (torshmon_communication_time_ratio{{{RANKS}}})"),
                q(f"max by (rank) (torshmon_config_version{{{RANKS}}})"),
                width=24,
                transformations=(
                    {"id": "merge", "options": {}},
                    {
                        "id": "organize",
                        "options": {
                            "excludeByName": {"Time": True},
                            "renameByName": {
                                "Value #A": "steps",
                                "Value #B": "compute (s)",
                                "Value #C": "comm wait (s)",
                                "Value #D": "comm share",
                                "Value #E": "config version",
                            },
                        },
                    },
                ),
            ),
        ),
    )
    return Dashboard(
        "ranks",
        "torshmon / Per-rank comparison",
        "Every rank side by side: the straggler view.",
        (compute, health),
    )


def collectives() -> Dashboard:
    # The histogram and byte counters are per job (no rank label) unless the aggregator
    # runs with collective_metrics_per_rank; bus bandwidth is per rank.
    sel = f'{JOB}, op=~"$op"'
    rank_sel = f'{RANKS}, op=~"$op"'
    op_variable = _query_variable(
        "op",
        "Collective",
        f"label_values(torshmon_collective_duration_seconds_count{{{JOB}}}, op)",
        multi=True,
    )
    latency = Row(
        "Latency",
        (
            heatmap(
                "Collective duration (all ops)",
                f"sum by (le) (rate(torshmon_collective_duration_seconds_bucket{{{sel}}}[{RATE}]))",
                description="How many collectives took how long, per second.",
            ),
            timeseries(
                "Duration p50 / p99 by op",
                q(
                    f"histogram_quantile(0.5, sum by (le, op) "
                    f"(rate(torshmon_collective_duration_seconds_bucket{{{sel}}}[{RATE}])))",
                    "{{op}} p50",
                ),
                q(
                    f"histogram_quantile(0.99, sum by (le, op) "
                    f"(rate(torshmon_collective_duration_seconds_bucket{{{sel}}}[{RATE}])))",
                    "{{op}} p99",
                ),
                unit="s",
            ),
            timeseries(
                "Calls per second by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_duration_seconds_count{{{sel}}}"
                    f"[{RATE}]))",
                    "{{op}}",
                ),
                unit="none",
            ),
            timeseries(
                "Communication wait per rank",
                q(
                    f"sum by (rank) (rate(torshmon_comm_wait_seconds_total{{{RANKS}}}[{RATE}]))",
                    "rank {{rank}}",
                ),
                unit="percentunit",
                description="Seconds each rank waits on communication per second of wall "
                "time. The straggler waits the least: its peers wait for it inside the call.",
            ),
        ),
    )
    bandwidth = Row(
        "Bandwidth and size",
        (
            timeseries(
                "Bus bandwidth by op",
                q(
                    f"avg by (op) (torshmon_collective_busbw_bytes_per_second{{{rank_sel}}})",
                    "{{op}}",
                ),
                unit="Bps",
                description="nccl-tests bus bandwidth of the latest step, mean over ranks: "
                "comparable across ops and world sizes, and with the link's speed.",
            ),
            timeseries(
                "Bus bandwidth per rank",
                q(
                    f"torshmon_collective_busbw_bytes_per_second{{{rank_sel}}}",
                    "rank {{rank}} {{op}} ({{pg}})",
                ),
                unit="Bps",
            ),
            timeseries(
                "Algorithm bandwidth by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_bytes_total{{{sel}}}[{RATE}]))"
                    f" / sum by (op) (rate(torshmon_collective_duration_seconds_sum{{{sel}}}"
                    f"[{RATE}]))",
                    "{{op}}",
                ),
                unit="Bps",
                description="Message bytes over time inside the call (nccl-tests algbw).",
            ),
            timeseries(
                "Mean message size by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_bytes_total{{{sel}}}[{RATE}]))"
                    f" / sum by (op) (rate(torshmon_collective_duration_seconds_count{{{sel}}}"
                    f"[{RATE}]))",
                    "{{op}}",
                ),
                unit="bytes",
                description="Bytes per call (nccl-tests message size). Small messages are "
                "latency-bound: larger DDP buckets raise it.",
            ),
            timeseries(
                "Collective bytes per second by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_bytes_total{{{sel}}}[{RATE}]))",
                    "{{op}}",
                ),
                unit="Bps",
            ),
        ),
    )
    links = Row(
        "Network links (latest link check)",
        (
            timeseries(
                "Link bandwidth per rank",
                q(f"torshmon_link_bandwidth_bytes_per_second{{{RANKS}}} * 8", "rank {{rank}}"),
                unit="bps",
                description="Each rank's best pair in the job's latest link check (run when "
                "communication looks slow). A rank far below the others has the slow link.",
            ),
            timeseries(
                "Link bandwidth per node pair",
                q(
                    f"torshmon_node_link_bandwidth_bytes_per_second{{{JOB}}} * 8",
                    "{{src_node}}-{{dst_node}}",
                ),
                unit="bps",
                description="Between nodes, when nodes run several ranks: a node whose pairs "
                "all read low has the slow link. src = dst: the best pair inside the node "
                "(another fabric: loopback, shared memory, NVLink).",
            ),
        ),
    )
    return Dashboard(
        "collectives",
        "torshmon / Collectives",
        "Latency histograms, bus bandwidth and message sizes of torch.distributed "
        "collectives, by op, and the bandwidth the latest link check measured. DDP's "
        "bucket all-reduces appear here while a gradient codec runs or when the probe is "
        "attached with bucket_timing=True.",
        (latency, bandwidth, links),
        extra_variables=(op_variable,),
    )


def ddp() -> Dashboard:
    now = Row(
        "Configuration in force",
        (
            stat(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})"),
                unit="bytes",
                width=6,
            ),
            stat(
                "Gradient codec",
                q(f"torshmon_codec_info{{{JOB}}} == 1", "{{codec}}"),
                stat_text="name",
                width=6,
            ),
            stat(
                "Config version",
                q(f"max(torshmon_config_version{{{RANKS}}})"),
                unit="none",
                width=6,
            ),
            stat(
                "Communication share",
                q(f"avg(torshmon_communication_time_ratio{{{RANKS}}})"),
                unit="percentunit",
                thresholds=OK_WARN_BAD_UP,
                width=6,
            ),
        ),
    )
    buckets = Row(
        "Buckets",
        (
            timeseries(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})", "bucket cap"),
                unit="bytes",
                description="DDP's gradient bucket cap; the autotuner changes it on every "
                "rank at the same step.",
            ),
            timeseries(
                "Step time and communication wait",
                q(mean_step(RANKS), "mean step"),
                q(per_step("comm_wait", RANKS), "communication wait"),
                unit="s",
                description="Per step, mean over ranks: what a bucket or codec change is "
                "meant to improve.",
            ),
        ),
    )
    compression = Row(
        "Compression",
        (
            timeline(
                "Codec in force",
                q(f"torshmon_codec_info{{{JOB}}}", "{{codec}}"),
                width=24,
                height=5,
            ),
            timeseries(
                "Compression ratio",
                q(f"torshmon_compression_ratio{{{RANKS}}}", "{{codec}} rank {{rank}}"),
                unit="percentunit",
                min_value=0,
                width=8,
                description="Wire bytes over gradient bytes (100%: uncompressed).",
            ),
            timeseries(
                "Codec relative error",
                q(
                    f"torshmon_compression_relative_error{{{RANKS}}}",
                    "{{codec}} rank {{rank}}",
                ),
                unit="percentunit",
                width=8,
                description="||g - decode(encode(g))|| / ||g|| on sampled steps; the "
                "autotuner's guardrail.",
            ),
            timeseries(
                "Gradient bytes on the wire",
                q(
                    f"sum by (codec) (rate(torshmon_compression_wire_bytes_total{{{RANKS}}}"
                    f"[{RATE}]))",
                    "{{codec}}",
                ),
                unit="Bps",
                width=8,
            ),
        ),
    )
    return Dashboard(
        "ddp",
        "torshmon / DDP buckets and compression",
        "DDP bucket cap, gradient codec, compression ratio and error.",
        (now, buckets, compression),
    )


def autotuner() -> Dashboard:
    state = Row(
        "Tuner",
        (
            stat(
                "State",
                q(f"torshmon_tuner_state{{{JOB}}} == 1", "{{state}}"),
                stat_text="name",
                width=6,
            ),
            stat(
                "Best score",
                q(f"max(torshmon_tuner_best_score{{{JOB}}})"),
                unit="short",
                width=6,
                description="Throughput (samples/s) of the best config tried so far.",
            ),
            stat(
                "Trials",
                q(f"sum(torshmon_tuner_trials_total{{{JOB}}})"),
                unit="none",
                width=6,
            ),
            stat(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})"),
                unit="bytes",
                width=6,
            ),
            timeline(
                "Tuner state",
                q(f"torshmon_tuner_state{{{JOB}}}", "{{state}}"),
                width=24,
                height=5,
            ),
        ),
    )
    trials = Row(
        "Trials",
        (
            timeseries(
                "Best score and throughput",
                q(f"max(torshmon_tuner_best_score{{{JOB}}})", "best score"),
                q(f"sum(torshmon_throughput_samples_per_second{{{RANKS}}})", "throughput now"),
                unit="short",
                description="Samples/s: the best trial so far against what the job does now.",
            ),
            timeseries(
                "Trials by decision",
                q(
                    f"sum by (decision) (increase(torshmon_tuner_trials_total{{{JOB}}}[{RATE}]))",
                    "{{decision}}",
                ),
                unit="none",
                stack=True,
                description="Every trial, decision and rollback is also in SQL: "
                'torshmon query "SELECT * FROM tuning_trials".',
            ),
            bars(
                "Trials so far by decision",
                q(f"sum by (decision) (torshmon_tuner_trials_total{{{JOB}}})", "{{decision}}"),
                unit="none",
            ),
            timeseries(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})", "bucket cap"),
                unit="bytes",
            ),
            timeline(
                "Codec in force",
                q(f"torshmon_codec_info{{{JOB}}}", "{{codec}}"),
                width=24,
                height=5,
            ),
        ),
    )
    return Dashboard(
        "autotuner",
        "torshmon / Autotuner",
        "The autotuner's state, trials and score, and the DDP config it steers.",
        (state, trials),
    )


def alerts() -> Dashboard:
    firing = Row(
        "Alerts",
        (
            table(
                "Alerts pending and firing",
                q(f"ALERTS{{{JOB}}}"),
                width=24,
                transformations=(
                    {
                        "id": "organize",
                        "options": {
                            "excludeByName": {"Time": True, "Value": True, "__name__": True},
                        },
                    },
                ),
                description="From Prometheus evaluating torshmon's exported rules "
                "(deploy/torshmon-rules.yml); the same conditions the aggregator notifies on.",
            ),
            timeseries(
                "torshmon alerts by rule and state",
                q("sum by (alertname, state) (torshmon_alerts)", "{{alertname}} ({{state}})"),
                unit="none",
                description="Alert instances the aggregator holds pending or firing.",
            ),
            timeseries(
                "Non-finite losses",
                q(
                    f"sum by (rank) (increase(torshmon_nonfinite_loss_total{{{RANKS}}}[{RATE}]))",
                    "rank {{rank}}",
                ),
                unit="none",
                description="Steps whose loss was NaN or infinite: the model diverged.",
            ),
        ),
    )
    detectors = Row(
        "Detectors",
        (
            timeline(
                "Stragglers",
                q(f"max by (rank) (torshmon_straggler_active{{{RANKS}}})", "rank {{rank}}"),
            ),
            timeseries(
                "Straggler score",
                q(f"torshmon_straggler_score{{{RANKS}}}", "rank {{rank}}"),
                unit="none",
            ),
            timeline(
                "Anomalies",
                q(
                    f"max by (metric, rank) (torshmon_anomaly_active{{{RANKS_OR_JOB}}})",
                    "{{metric}} rank {{rank}}",
                ),
                description="Rolling z-score anomalies: the job's step time (no rank) and "
                "each rank's loss.",
            ),
            timeseries(
                "Anomaly z-score",
                q(f"torshmon_anomaly_zscore{{{RANKS_OR_JOB}}}", "{{metric}} rank {{rank}}"),
                unit="none",
            ),
            timeseries(
                "Oldest collective in flight",
                q(
                    f"max by (rank) (torshmon_inflight_oldest_age_seconds{{{RANKS}}})",
                    "rank {{rank}}",
                ),
                unit="s",
                width=24,
                description="A hung collective shows as peers' ages growing while one rank "
                "stays at 0; the Hung Collective alert names that rank, op and group.",
            ),
        ),
    )
    pipeline = Row(
        "torshmon itself",
        (
            timeseries(
                "Notifications",
                q(
                    f"sum by (target) (rate(torshmon_notifications_sent_total[{RATE}]))",
                    "{{target}} sent",
                ),
                q(
                    f"sum by (target) (rate(torshmon_notifications_failed_total[{RATE}]))",
                    "{{target}} failed",
                ),
                unit="none",
                width=8,
            ),
            timeseries(
                "Agents forwarding",
                q(f"torshmon_agent_forward_up{{{NODES}}}", "{{node}}"),
                unit="none",
                min_value=0,
                max_value=1,
                width=8,
                description="1 while the node's agent reaches the aggregator; otherwise it "
                "spools to disk and forwards later.",
            ),
            timeseries(
                "Agent spool",
                q(f"torshmon_agent_spool_records{{{NODES}}}", "{{node}}"),
                unit="none",
                width=8,
                description="Records waiting on disk to be forwarded.",
            ),
            timeseries(
                "Ingest",
                q(f"sum(rate(torshmon_ingest_records_total[{RATE}]))", "records"),
                q(f"sum(rate(torshmon_ingest_duplicates_total[{RATE}]))", "duplicates"),
                unit="none",
                width=12,
                description="Agent records the aggregator stored per second.",
            ),
            timeseries(
                "Records dropped by probes",
                q(
                    f"sum by (rank) (rate(torshmon_probe_dropped_records_total{{{RANKS}}}"
                    f"[{RATE}]))",
                    "rank {{rank}}",
                ),
                unit="none",
                width=12,
            ),
        ),
    )
    return Dashboard(
        "alerts",
        "torshmon / Alerts and anomalies",
        "Alerts, detector findings and the health of torshmon's own pipeline.",
        (firing, detectors, pipeline),
    )


DASHBOARDS: Final = (job_overview, ranks, collectives, ddp, autotuner, alerts)


# -- rendering with the SDK -----------------------------------------------------------------


def _query_variable(
    name: str, label: str, query: str, *, multi: bool, include_all: bool = True
) -> Extended[dashboard_models.VariableModel]:
    all_selected = dashboard_models.VariableOption(selected=True, text=["All"], value=["$__all"])
    variable = (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": query, "refId": f"torshmon-{name}"})
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(
            dashboard_models.VariableSort.NUMERICAL_ASC
            if name == "rank"
            else dashboard_models.VariableSort.ALPHABETICAL_ASC
        )
        .multi(multi)
        .include_all(include_all)
        .hide(dashboard_models.VariableHide.DONT_HIDE)
        .regex("")
        .options([])
    )
    if include_all:
        variable = variable.current(all_selected)
    return Extended(variable, {"definition": query})


def variables(
    extra: Iterable[cogbuilder.Builder[Any]] = (),
) -> list[cogbuilder.Builder[Any]]:
    """Data source, job, node and rank, then the dashboard's own."""
    datasource = (
        dashboard_builders.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(
            dashboard_models.VariableOption(selected=False, text="Prometheus", value=DATASOURCE_UID)
        )
        .hide(dashboard_models.VariableHide.DONT_HIDE)
        .regex("")
    )
    return [
        datasource,
        _query_variable(
            "job",
            "Job",
            "label_values(torshmon_steps_total, job)",
            multi=False,
            include_all=False,
        ),
        _query_variable(
            "node", "Node", "label_values(torshmon_cpu_utilization_ratio, node)", multi=True
        ),
        _query_variable(
            "rank", "Rank", f"label_values(torshmon_steps_total{{{JOB}}}, rank)", multi=True
        ),
        *extra,
    ]


def alerts_annotation() -> Extended[dashboard_models.AnnotationQuery]:
    """Firing alerts of the job (Prometheus' ALERTS series) marked on every time axis."""
    query = (
        dashboard_builders.AnnotationQuery()
        .name("torshmon alerts")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("red")
        .expr(f'ALERTS{{{JOB}, alertstate="firing"}}')
    )
    fields = {
        "step": "15s",
        "titleFormat": "{{alertname}}",
        "textFormat": "rank {{rank}}",
        "useValueForTime": False,
    }
    return Extended(query, fields)


def render(dashboard: Dashboard) -> dashboard_builders.Dashboard:
    """The dashboard as the SDK's builder; panels are laid out left to right by the SDK,
    a new line when the row's width (24) is full."""
    builder = (
        dashboard_builders.Dashboard(dashboard.title)
        .uid(dashboard.uid)
        .description(dashboard.description)
        .tags([TAG])
        .editable()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .time("now-30m", "now")
        .timezone("")
        .refresh("10s")
        .version(1)
        .week_start("")
        .fiscal_year_start_month(0)
        .variables(variables(dashboard.extra_variables))
        .annotation(alerts_annotation())
        .link(
            dashboard_builders.DashboardLink("torshmon")
            .type(dashboard_models.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
            .icon("external link")
            .target_blank(False)
            .tooltip("")
            .url("")
        )
    )
    next_id = 1
    for row in dashboard.rows:
        builder = builder.with_row(dashboard_builders.Row(row.title).id(next_id))
        next_id += 1
        for panel in row.panels:
            builder = builder.with_panel(panel.id(next_id))
            next_id += 1
    return builder


def dump(dashboard: dashboard_builders.Dashboard) -> str:
    return json.dumps(dashboard.build(), cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"


def catalogued(name: str) -> bool:
    """Whether a sample name is one of the catalogue's metrics (or a histogram's series)."""
    if name in METRICS:
        return True
    base, _, suffix = name.rpartition("_")
    spec = METRICS.get(base)
    return spec is not None and spec.kind == "histogram" and suffix in ("bucket", "sum", "count")


def check_metrics(model: Any, where: str) -> None:
    """ValueError naming the dashboard if a query names a metric torshmon does not export."""
    if isinstance(model, dict):
        for value in model.values():
            check_metrics(value, where)
    elif isinstance(model, list):
        for value in model:
            check_metrics(value, where)
    elif isinstance(model, str):
        unknown = sorted(n for n in METRIC_NAME.findall(model) if not catalogued(n))
        if unknown:
            raise ValueError(f"{where}: {', '.join(unknown)} not in torshmon.catalogue.metrics")


def files() -> dict[str, str]:
    """File name to JSON text, for every dashboard; ValueError if a query names an
    unknown metric."""
    out = {}
    for dashboard in (factory() for factory in DASHBOARDS):
        text = dump(render(dashboard))
        check_metrics(json.loads(text), dashboard.filename)
        out[dashboard.filename] = text
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    parser.add_argument("--out", type=Path, default=HERE, help="folder (this one)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in files().items():
        path = args.out / name
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python dashboards/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
