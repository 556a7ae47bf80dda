"""docker-compose.yml parses and says which Docker Compose it needs.

No Docker Compose here: the test finds the features of the file that set a minimum
Compose version and checks that the file's header and the docs name the highest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCS = ROOT / "docs" / "prometheus-grafana.md"


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def needed(compose: dict[str, Any]) -> dict[str, str]:
    """Feature -> the first Docker Compose v2 release that reads it, for those used."""
    features = {}
    if "name" in compose:
        features["top-level name"] = "2.3.3"
    if any("environment" in s for s in compose.get("secrets", {}).values()):
        features["secret from an environment variable"] = "2.6.1"
    return features


def stated(text: str) -> str:
    match = re.search(r"Docker Compose v(\d+\.\d+\.\d+) or later", " ".join(text.split()))
    assert match, "no 'Docker Compose vX.Y.Z or later'"
    return match[1]


def test_compose_file_parses_and_names_the_compose_version_it_needs() -> None:
    text = COMPOSE.read_text()
    compose = yaml.safe_load(text)
    assert isinstance(compose, dict) and compose["services"]
    assert "version" not in compose, "obsolete in Compose v2: it warns and ignores it"
    features = needed(compose)
    assert features, "the file uses no versioned feature: say so instead"
    minimum = max(features.values(), key=version)
    header = "\n".join(line[1:] for line in text.splitlines() if line.startswith("#"))
    assert stated(header) == minimum, features
    assert stated(DOCS.read_text()) == minimum, features


def test_every_service_reference_resolves() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on", [])
        assert set(depends) <= set(services), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith("."):
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
        for secret in service.get("secrets", []):
            assert secret in compose["secrets"], f"{name}: undeclared secret {secret}"
        pid = service.get("pid", "")
        if pid.startswith("service:"):
            assert pid.removeprefix("service:") in services, name
