"""What dashboards/build.py adds to the Grafana SDK's models reaches the JSON.

The SDK (grafana-foundation-sdk, types for Grafana 10.1) has no attribute for a
Prometheus annotation's title and text templates nor for a query variable's
``definition``; build.py's ``Extended`` adds them. Without them Grafana would mark
alerts untitled and list the variables without their queries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.test_deploy_files import load_module

ROOT = Path(__file__).resolve().parents[1]


def boards() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))]


def test_alert_annotations_keep_their_title_and_text_templates() -> None:
    for board in boards():
        (annotation,) = board["annotations"]["list"]
        assert annotation["expr"].startswith("ALERTS{")
        assert annotation["titleFormat"] == "{{alertname}}", board["uid"]
        assert annotation["textFormat"] == "rank {{rank}}", board["uid"]


def test_query_variables_show_their_query_as_definition() -> None:
    for board in boards():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                assert variable["definition"] == variable["query"]["query"], variable["name"]


def test_extended_adds_fields_to_what_the_sdk_builds() -> None:
    build = load_module(ROOT / "dashboards" / "build.py", "torshmon_dashboards_build_sdk")

    def as_json(model: Any) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(json.dumps(model, cls=build.JSONEncoder))
        return result

    plain = as_json(build.alerts_annotation().builder.build())
    assert "titleFormat" not in plain, "the SDK has it now: drop it from Extended"
    extended = as_json(build.alerts_annotation().build())
    assert extended == {**plain, **build.alerts_annotation().fields}
