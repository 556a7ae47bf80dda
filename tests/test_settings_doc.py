"""docs/configuration.md is generated from the settings models and must be current."""

from __future__ import annotations

from pathlib import Path

from torshmon.settings_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_committed_configuration_page_is_current() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: python -m torshmon.settings_doc docs/configuration.md"
    )


def test_every_setting_has_its_variable_and_help() -> None:
    page = render()
    for name in (
        "TORSHMON_AGGREGATOR_STRAGGLER__MIN_SLOWDOWN",
        "TORSHMON_AGGREGATOR_HANG__TIMEOUT_S",
        "TORSHMON_AGGREGATOR_TUNER__RETUNE__MIN_INTERVAL_S",
        "TORSHMON_SLACK_WEBHOOK_URL",
        "TORSHMON_AGENT_SPOOL",
        "TORSHMON_FAST_LANE",
        "TORSHMON_PROBE_SYNC_EVERY",
        "`--config FILE`",
    ):
        assert name in page
    for line in page.splitlines():
        if line.startswith("| `"):
            assert not line.endswith("|  |"), f"a setting without help: {line}"
