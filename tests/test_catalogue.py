"""The torch-free catalogue: codec specs, metric specs, and who imports torch."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import torshmon.version as torshmon
from torshmon.agent.metrics import AgentMetrics
from torshmon.aggregator.core.promrules import PER_STEP_MEANS
from torshmon.aggregator.core.rules import METRIC_LABELS
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.codecs import (
    CODEC_SPECS,
    MAX_BUCKET_CAP_MB,
    MIN_BUCKET_CAP_MB,
    ConfigError,
    validate_bucket_cap_mb,
    validate_codec,
)
from torshmon.catalogue.docs import render_metrics_markdown
from torshmon.catalogue.metrics import METRICS, MetricSpec, exported_by
from torshmon.wire import NodeSample

ROOT = Path(__file__).resolve().parent.parent

# -- torch stays out of the daemons ---------------------------------------------------------

_NO_TORCH = """
import importlib, pkgutil, sys
import torshmon.agent, torshmon.aggregator, torshmon.catalogue, torshmon.cli
for package in (torshmon.agent, torshmon.aggregator, torshmon.catalogue):
    for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
import torshmon.probe, torshmon.probe.config
torshmon.probe.CommConfig, torshmon.probe.ConfigError
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(",".join(loaded))
"""


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_daemons_the_cli_and_the_catalogue_do_not_import_torch() -> None:
    assert _run(_NO_TORCH) == ""


def test_the_probe_loads_torch_when_its_monitor_is_used() -> None:
    code = "import sys, torshmon.probe\ntorshmon.probe.attach\nprint('torch' in sys.modules)"
    assert _run(code) == "True"


# -- codecs ---------------------------------------------------------------------------------


def test_codec_params_get_their_defaults_and_bounds() -> None:
    assert {name: spec.defaults() for name, spec in CODEC_SPECS.items()} == {
        "none": {},
        "fp16": {},
        "bf16": {},
        "powersgd": {"rank": 4},
        "topk": {"ratio": 0.01},
        "int8": {"bits": 8},
    }
    assert validate_codec("topk", {"ratio": 1}) == {"ratio": 1.0}
    with pytest.raises(ConfigError, match=r"'ratio' must be a number in \(0, 1\], got 0"):
        validate_codec("topk", {"ratio": 0})
    with pytest.raises(ConfigError, match="codec must be one of bf16, fp16, int8, none"):
        validate_codec(3, {})


def test_bucket_caps_are_bounded_in_mib() -> None:
    assert validate_bucket_cap_mb(MIN_BUCKET_CAP_MB) == MIN_BUCKET_CAP_MB
    assert validate_bucket_cap_mb(int(MAX_BUCKET_CAP_MB)) == MAX_BUCKET_CAP_MB
    with pytest.raises(ConfigError, match="first_bucket_cap_mb must be between"):
        validate_bucket_cap_mb(MAX_BUCKET_CAP_MB * 2, "first_bucket_cap_mb")
    with pytest.raises(ConfigError, match="must be a number of MiB, got True"):
        validate_bucket_cap_mb(True)


# -- metrics --------------------------------------------------------------------------------


def test_metric_specs_follow_prometheus_naming() -> None:
    for spec in METRICS.values():
        assert spec.name.startswith(catalogue.PREFIX)
        assert (spec.kind == "counter") == spec.name.endswith("_total")
    assert catalogue.STEP_DURATION_SECONDS.unit == "seconds"
    assert catalogue.COLLECTIVE_BUSBW_BYTES_PER_SECOND.unit == "bytes_per_second"
    assert catalogue.STEPS_TOTAL.unit == ""
    assert catalogue.STEPS_TOTAL.family_name == "torshmon_steps"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "steps_total", "kind": "counter"}, "must match"),
        ({"name": "torshmon_steps", "kind": "counter"}, "only counters end in _total"),
        ({"name": "torshmon_x_total", "kind": "gauge"}, "only counters end in _total"),
        ({"name": "torshmon_x", "kind": "gauge", "exporter": "both"}, "exporter must be"),
        # Only a daemon's description of itself may come from each daemon.
        ({"name": "torshmon_x", "kind": "gauge", "exporter": "each"}, "only an _info gauge"),
        (
            {"name": "torshmon_x_info", "kind": "gauge", "exporter": "each"},
            "only an _info gauge with a daemon label",
        ),
    ],
)
def test_a_spec_against_the_conventions_is_refused(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"help": "h", "exporter": "agent", "labels": ("node",), **kwargs}
    with pytest.raises(ValueError, match=message):
        MetricSpec(**fields)  # type: ignore[arg-type]


def test_every_series_has_one_exporter_but_build_info() -> None:
    agent = {spec.name for spec in exported_by("agent")}
    aggregator = {spec.name for spec in exported_by("aggregator")}
    assert agent & aggregator == {catalogue.BUILD_INFO.name}
    assert agent | aggregator == set(METRICS)
    # Node and process facts come from the agent; training series from the aggregator.
    assert catalogue.RANK_MEMORY_RSS_BYTES.exporter == "agent"
    assert catalogue.NETWORK_RECEIVE_BYTES_TOTAL.labels == ("node", "interface")
    for spec in (catalogue.STEPS_TOTAL, catalogue.LOSS, catalogue.COLLECTIVE_DURATION_SECONDS):
        assert spec.exporter == "aggregator"
    # RSS under one name.
    assert [name for name in METRICS if "rss" in name or "resident" in name] == [
        catalogue.RANK_MEMORY_RSS_BYTES.name
    ]


def test_a_family_takes_the_specs_labels_and_its_kind() -> None:
    histogram = catalogue.COLLECTIVE_DURATION_SECONDS
    assert histogram.label_names() == ("job", "run", "op", "pg")
    assert histogram.label_names(optional=True) == ("job", "run", "op", "pg", "rank")
    assert histogram.histogram(optional=True).samples == []
    with pytest.raises(TypeError, match="is a gauge, not a counter"):
        catalogue.DDP_BUCKET_CAP_BYTES.counter()


def _families(registry: CollectorRegistry) -> dict[str, tuple[str, str]]:
    """Family name (as prometheus-client keeps it) to (type, HELP)."""
    return {f.name: (f.type, f.documentation) for f in registry.collect()}


def _expected(exporter: catalogue.Exporter) -> dict[str, tuple[str, str]]:
    return {s.family_name: (s.kind, s.help) for s in exported_by(exporter)}


def test_the_agent_exports_exactly_its_catalogue() -> None:
    registry = CollectorRegistry()
    agent = AgentMetrics(registry, node="n1")
    agent.observe_node(
        NodeSample(
            ts_unix_ns=0,
            node="n1",
            cpu_utilization_ratio=0.5,
            memory_utilization_ratio=0.5,
            memory_used_bytes=1,
            io_wait_ratio=0.0,
            net_rx_bytes_total=0,
            net_tx_bytes_total=0,
            disk_read_bytes_total=0,
            disk_write_bytes_total=0,
        )
    )
    assert _families(registry) == _expected("agent")


def test_the_aggregator_exports_exactly_its_catalogue() -> None:
    aggregator = Aggregator(
        AggregatorSettings(db_url="sqlite://", aggregator_id="t"),
        registry=CollectorRegistry(),
        targets=[],
    )
    try:
        assert _families(aggregator.registry) == _expected("aggregator")
    finally:
        aggregator.writer.shutdown()


def test_build_info_names_the_daemon() -> None:
    (sample,) = catalogue.build_info("aggregator").samples
    assert sample.labels["daemon"] == "aggregator"
    assert sample.labels["version"] == torshmon.__version__
    assert sample.labels["python"] == platform.python_version()
    assert sample.value == 1


def test_rule_metrics_are_catalogued_with_their_labels() -> None:
    """Each rule metric is a series one daemon exports, or a per-step mean of series
    with its labels (so the exported Prometheus rules read what is scraped); the
    export adds a job's run, which the rules' series leave to the alerts."""
    for name, labels in METRIC_LABELS.items():
        if name in PER_STEP_MEANS:
            names = [re.sub(r"_(sum|count)$", "", series) for series in PER_STEP_MEANS[name]]
        else:
            names = [catalogue.PREFIX + name]
        for series in names:
            exported = set(METRICS[series].labels)
            assert exported - {"run"} == set(labels), name
            by_aggregator = METRICS[series].exporter == "aggregator"
            assert ("run" in exported) == ("job" in labels and by_aggregator), name


# -- docs -----------------------------------------------------------------------------------


def test_docs_metrics_md_is_the_current_rendering() -> None:
    assert (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8") == (
        render_metrics_markdown()
    ), "docs/metrics.md is stale: run python -m torshmon.catalogue.docs docs/metrics.md"


def test_docs_name_only_catalogued_metrics() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    # torshmon_reader is the PostgreSQL reader role, not a metric.
    not_metrics = {"torshmon_reader"}
    for page in pages:
        for name in set(re.findall(r"\btorshmon_[a-z0-9_]+", page.read_text())) - not_metrics:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in METRICS or base in METRICS, f"{page.name} names unknown {name}"
