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


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.0.0.7", "agg.example"])
def test_a_non_loopback_address_needs_a_token(host: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings({"host": host}, env={})
    message = str(refused.value)
    assert "\n" not in message and "--token-file" in message and "TORSHMON_TOKEN" in message
    assert load_settings({"host": host}, env={"TORSHMON_TOKEN": "t0k"}).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "localhost", "::1"])
def test_loopback_addresses_need_no_token(host: str) -> None:
    assert load_settings({"host": host}, env={}).token is None


def test_allowed_hosts_from_flags_the_environment_and_a_config_file(tmp_path: Path) -> None:
    env = {"TORSHMON_ALLOWED_HOSTS": "a.example, B.example,"}
    assert load_settings({}, env=env).allowed_hosts == ("a.example", "b.example")
    assert load_settings({"allowed_hosts": ["c.example"]}, env=env).allowed_hosts == ("c.example",)
    conf = tmp_path / "conf.yaml"
    conf.write_text("allowed_hosts: [d.example, '[fd00::1]']\n")
    settings = load_settings({}, config_file=conf, env={})
    assert settings.allowed_hosts == ("d.example", "[fd00::1]")
    with pytest.raises(SettingsError, match=r"without a port, got 'e\.example:9470'"):
        load_settings({"allowed_hosts": ["e.example:9470"]}, env={})
    with pytest.raises(SettingsError, match="allowed_hosts must be a list of strings"):
        load_settings({"allowed_hosts": 7}, env={})


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
    with pytest.raises(SettingsError, match=r"^db_url: database URL mysql://x/y is 'mysql'"):
        load_settings({"db_url": "mysql://x/y"}, env={})
    with pytest.raises(SettingsError, match=r"^query_db_url: database URL mysql://x/y "):
        load_settings({"db_url": pg}, env={"TORSHMON_QUERY_DB_URL": "mysql://x/y"})
