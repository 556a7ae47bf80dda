"""Aggregator settings from a config file, the environment and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from torshmon.aggregator.settings import SettingsError, load_settings


def test_booleans_read_from_a_config_file_and_overrides(tmp_path: Path) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text("eval_on_finding: false\neval_min_gap_s: 0.2\n")
    settings = load_settings({}, config_file=conf, env={})
    assert settings.eval_on_finding is False and settings.eval_min_gap_s == 0.2
    assert load_settings({"eval_on_finding": "yes"}, env={}).eval_on_finding is True
    assert load_settings({}, env={}).eval_on_finding is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eval_on_finding": "maybe"}, "eval_on_finding must be true or false"),
        ({"eval_min_gap_s": "0"}, "eval_min_gap_s must be > 0"),
    ],
)
def test_bad_values_are_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides, env={})


def test_the_query_url_defaults_to_the_history_url_as_the_reader_role() -> None:
    pg = "postgresql://torshmon:secret@db:5432/history?options=-csearch_path%3Dt"
    settings = load_settings({"db_url": pg}, env={})
    assert settings.query_db_url == (
        "postgresql+psycopg://torshmon_reader@db:5432/history?options=-csearch_path%3Dt"
    )
    reader = "postgresql://analyst@db/history"
    assert load_settings({"db_url": pg}, env={"TORSHMON_QUERY_DB_URL": reader}).query_db_url == (
        reader
    )
    assert load_settings({}, env={}).query_db_url == "sqlite:///torshmon.db"
    with pytest.raises(SettingsError, match=r"^db_url: database URL 'mysql://x/y' is 'mysql'"):
        load_settings({"db_url": "mysql://x/y"}, env={})
    with pytest.raises(SettingsError, match=r"^query_db_url: database URL 'mysql://x/y'"):
        load_settings({"db_url": pg}, env={"TORSHMON_QUERY_DB_URL": "mysql://x/y"})
