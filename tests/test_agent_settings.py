"""The agent's settings from flags, TORSHMON_* variables and a config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from torshmon.agent.settings import AgentSettings, load_settings
from torshmon.settings import SettingsError


def test_flags_win_over_variables_which_win_over_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "agent.yaml"
    conf.write_text(
        f"spool_path: {tmp_path}/file.db\nmetrics_port: 1111\nsample_interval_s: 500ms\n"
        "spool_max_bytes: 16MiB\nnode: from-file\n"
    )
    env = {"TORSHMON_AGENT_SPOOL": f"{tmp_path}//env.db", "TORSHMON_AGENT_METRICS_PORT": "2222"}
    settings = load_settings({"metrics_port": 3333}, config_file=conf, env=env)
    assert settings.metrics_port == 3333
    assert settings.spool_path == f"{tmp_path}/env.db"  # normalised, as the flag's was
    assert settings.sample_interval_s == 0.5 and settings.spool_max_bytes == 16 << 20
    assert settings.node == "from-file"
    assert load_settings({}, config_file=conf, env=env).metrics_port == 2222


def test_the_documented_variables_still_work() -> None:
    env = {
        "TORSHMON_AGGREGATOR_URL": "http://agg.example:9470",
        "TORSHMON_TOKEN": "agent-token",
        "TORSHMON_AGENT_SOCKET": "/run/torshmon/agent.sock",
        "TORSHMON_AGENT_SPOOL": "/var/lib/torshmon/spool.db",
        "TORSHMON_AGENT_SOCKET_GROUP": "0",
    }
    settings = load_settings({}, env=env)
    assert settings.aggregator_url == "http://agg.example:9470"
    assert settings.token == "agent-token"
    assert settings.socket_path == "/run/torshmon/agent.sock"
    assert settings.spool_path == "/var/lib/torshmon/spool.db"
    assert settings.socket_gid() == 0
    assert "agent-token" not in repr(settings) and "agg.example" not in repr(settings)


def test_a_blank_token_variable_is_refused_and_other_blank_ones_are_unset() -> None:
    with pytest.raises(SettingsError, match=r"^TORSHMON_TOKEN is set but empty"):
        load_settings({}, env={"TORSHMON_TOKEN": " "})
    assert load_settings({}, env={"TORSHMON_AGGREGATOR_URL": ""}).aggregator_url is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("metrics_port: 99999\n", ":1: metrics_port must be in 0..65535, got 99999"),
        ("sample_interval_s: soon\n", ":1: sample_interval_s must be a float"),
        ("spool_max_bytes: 1k\n", ":1: spool_max_bytes must be >= 1048576, got 1000"),
        ("host: x\n", ":1: unknown setting 'host'; known: agent_id, aggregator_url"),
        ("aggregator_url: ftp://u:Pw-S3cret@h/\n", "must be http:// or https://"),
        ("token: 12345678901234\n", "token must be a string, got a value of type int"),
    ],
)
def test_a_bad_config_file_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    conf = tmp_path / "agent.yaml"
    conf.write_text(content)
    with pytest.raises(SettingsError) as refused:
        load_settings({}, config_file=conf, env={})
    text = str(refused.value)
    assert message in text and "\n" not in text
    assert "S3cret" not in text and "12345678901234" not in text


def test_settings_built_in_code_are_checked_too() -> None:
    with pytest.raises(ValueError, match="sample_interval_s must be > 0"):
        AgentSettings(sample_interval_s=0)
    with pytest.raises(ValueError, match="no group on this host"):
        AgentSettings(socket_group="no-such-group-torshmon")


def test_the_defaults_under_the_runtime_folder_follow_the_environment_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORSHMON_AGENT_SOCKET", "/run/elsewhere/agent.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/elsewhere")
    settings = load_settings({}, env={"XDG_RUNTIME_DIR": "/run/user/given"})
    assert settings.socket_path == "/run/user/given/torshmon/agent.sock"
    assert settings.spool_path == "/run/user/given/torshmon/agent-spool.db"
    given = {"TORSHMON_AGENT_SOCKET": "/run/given.sock", "XDG_RUNTIME_DIR": "/run/user/given"}
    assert load_settings({}, env=given).socket_path == "/run/given.sock"
    # A flag still wins over the default.
    flagged = load_settings({"socket_path": "/run/flag.sock"}, env=given)
    assert flagged.socket_path == "/run/flag.sock"
