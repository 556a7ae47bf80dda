"""The Prometheus Operator's PodMonitor scrapes what the sidecar manifest serves.

No cluster here: the test checks that the PodMonitor parses, selects the training
pod by its labels, and scrapes the agent's container port by the name and path the
pod's annotations give an annotation-driven Prometheus.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "agent" / "k8s"
POD_MONITOR = K8S / "podmonitor.yaml"
SIDECAR_JOB = K8S / "torchrun-with-agent.yaml"


def load_one(path: Path) -> dict[str, Any]:
    (document,) = list(yaml.safe_load_all(path.read_text()))
    assert isinstance(document, dict), path
    return document


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) matches."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def named_ports(pod: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(port name, container, port number) of every named port of a pod spec."""
    return [
        (port["name"], container["name"], port["containerPort"])
        for container in pod.get("initContainers", []) + pod["containers"]
        for port in container.get("ports", [])
        if "name" in port
    ]


def test_pod_monitor_selects_the_sidecar_pod_and_scrapes_the_agent() -> None:
    monitor = load_one(POD_MONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    template = load_one(SIDECAR_JOB)["spec"]["template"]
    spec = monitor["spec"]
    assert spec["selector"].get("matchLabels") or spec["selector"].get("matchExpressions")
    assert selects(spec["selector"], template["metadata"]["labels"])
    (endpoint,) = spec["podMetricsEndpoints"]
    # Exactly one container answers on that port name: the agent.
    (match,) = [p for p in named_ports(template["spec"]) if p[0] == endpoint["port"]]
    _, container, number = match
    assert container == "torshmon-agent"
    annotations = template["metadata"]["annotations"]
    assert str(number) == annotations["prometheus.io/port"]
    assert endpoint["path"] == annotations["prometheus.io/path"] == "/metrics"
    # The training job's name is the series' `job` label, as in deploy/prometheus.yml.
    assert endpoint["honorLabels"] is True


def test_selector_rejects_a_pod_without_the_label() -> None:
    # What makes the test above meaningful.
    selector = load_one(POD_MONITOR)["spec"]["selector"]
    labels = dict(load_one(SIDECAR_JOB)["spec"]["template"]["metadata"]["labels"])
    assert selects(selector, labels)
    for key in selector.get("matchLabels", {}):
        assert not selects(selector, {k: v for k, v in labels.items() if k != key})
    assert not selects({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, labels)
