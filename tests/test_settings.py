"""Aggregator settings from a config file, the environment and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from torshmon.aggregator.core.hang import HangSettings
from torshmon.aggregator.core.linkcheck import LinkCheckSettings
from torshmon.aggregator.core.live import LiveState
from torshmon.aggregator.core.step_time import StepTimeDetector
from torshmon.aggregator.core.straggler import StragglerSettings
from torshmon.aggregator.core.tuner import RetuneSettings, TunerSettings
from torshmon.aggregator.core.zscore import ZScoreSettings
from torshmon.aggregator.evidence import EvidenceSettings
from torshmon.aggregator.notify.targets import AlertmanagerTarget, SlackTarget, WebhookTarget
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings, SettingsError, load_settings
from torshmon.settings import parse_duration_s, parse_size_bytes


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
    assert load_settings({}, env={}).query_db_url == f"sqlite:///{Path.cwd() / 'torshmon.db'}"
    with pytest.raises(SettingsError, match=r"^db_url: database URL mysql://x/y is 'mysql'"):
        load_settings({"db_url": "mysql://x/y"}, env={})
    with pytest.raises(SettingsError, match=r"^query_db_url: database URL mysql://x/y "):
        load_settings({"db_url": pg}, env={"TORSHMON_QUERY_DB_URL": "mysql://x/y"})


def test_the_history_is_a_path_or_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    file_url = f"sqlite:///{tmp_path / 'h.db'}"
    assert load_settings({"db_url": "h.db"}, env={}).db_url == file_url
    assert load_settings({}, env={"TORSHMON_DB_URL": "./h.db"}).db_url == file_url
    (tmp_path / "conf.yaml").write_text("db_url: h.db\nquery_db_url: q.db\n")
    settings = load_settings({}, env={}, config_file=tmp_path / "conf.yaml")
    assert (settings.db_url, settings.query_db_url) == (file_url, f"sqlite:///{tmp_path / 'q.db'}")


# -- the one model: layers, units, sections, targets ---------------------------------------


def test_flags_win_over_variables_which_win_over_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text("port: 1111\nhost: 127.0.0.2\naggregator_id: from-file\n")
    env = {"TORSHMON_AGGREGATOR_PORT": "2222", "TORSHMON_AGGREGATOR_ID": "from-env"}
    settings = load_settings({"port": 3333}, config_file=conf, env=env)
    assert (settings.port, settings.aggregator_id, settings.host) == (3333, "from-env", "127.0.0.2")
    assert load_settings({"port": None}, config_file=conf, env=env).port == 2222


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0.5", 0.5), ("2", 2.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("1h30m", 5400.0)],
)
def test_durations_are_seconds_or_human(text: str, seconds: float, tmp_path: Path) -> None:
    assert parse_duration_s(text) == seconds
    assert load_settings({"eval_interval_s": text}, env={}).eval_interval_s == seconds
    env = {"TORSHMON_AGGREGATOR_HANG__TIMEOUT_S": text}
    assert load_settings({}, env=env).hang.timeout_s == seconds
    conf = tmp_path / "conf.yaml"
    conf.write_text(f"raw_retention_s: {text}\n")
    assert load_settings({}, config_file=conf, env={}).raw_retention_s == seconds


@pytest.mark.parametrize("text", ["soon", "5 parsecs", "m", "1h x", ""])
def test_a_bad_duration_is_named_with_what_is_allowed(text: str) -> None:
    assert parse_duration_s(text) is None
    with pytest.raises(SettingsError) as refused:
        load_settings({"eval_interval_s": text}, env={})
    assert str(refused.value).startswith("eval_interval_s must be a float")
    assert "500ms, 2m or 1h" in str(refused.value)


def test_sizes_take_units() -> None:
    assert parse_size_bytes("64MiB") == 64 << 20
    assert parse_size_bytes("1.5GB") == 1_500_000_000
    assert parse_size_bytes("4096") == 4096
    assert parse_size_bytes("12 parsecs") is None
    assert load_settings({"max_body_bytes": "2MiB"}, env={}).max_body_bytes == 2 << 20
    with pytest.raises(SettingsError, match=r"max_body_bytes must be >= 1024, got 512"):
        load_settings({"max_body_bytes": "512"}, env={})


def test_detector_sections_come_from_the_file_and_variables(tmp_path: Path) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text(
        "straggler:\n  min_slowdown: 0.2\n  persistence: 6\n"
        "zscore:\n  threshold: 3\n"
        "hang:\n  timeout_s: 30s\n"
        "link_check:\n  min_interval_s: 1m\n  reference_check: off\n"
    )
    env = {"TORSHMON_AGGREGATOR_STRAGGLER__PERSISTENCE": "8"}
    settings = load_settings({}, config_file=conf, env=env)
    assert settings.straggler == StragglerSettings(min_slowdown=0.2, persistence=8)
    assert settings.zscore == ZScoreSettings(threshold=3.0)
    assert settings.hang == HangSettings(timeout_s=30.0)
    assert settings.link_check == LinkCheckSettings(min_interval_s=60.0, reference_check=False)
    assert load_settings({}, env={}).straggler == StragglerSettings()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("straggler:\n  min_slowdown: -1\n", ":2: straggler.min_slowdown must be > 0, got -1"),
        ("straggler:\n  persistnce: 3\n", ":2: unknown setting 'straggler.persistnce'; known: "),
        ("straggler: 3\n", ":1: expected a mapping of straggler settings"),
        ("hang:\n  timeout_s: soon\n", ":2: hang.timeout_s must be a float"),
        (
            "zscore:\n  window: 20\n  min_samples: 30\n",
            "zscore: min_samples must be at most window (20), got 30",
        ),
        (
            "straggler:\n  persistence: 5\n  window_steps: 4\n",
            "straggler: persistence must be at most window_steps (4), got 5",
        ),
        ("link_check:\n  slow_ratio: 2\n", ":2: link_check.slow_ratio must be > 0 and < 1"),
    ],
)
def test_a_bad_detector_setting_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text(content)
    with pytest.raises(SettingsError) as refused:
        load_settings({}, config_file=conf, env={})
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_bad_variable_is_named() -> None:
    env = {"TORSHMON_AGGREGATOR_ZSCORE__WINDOW": "many"}
    with pytest.raises(SettingsError) as refused:
        load_settings({}, env=env)
    assert str(refused.value) == (
        "TORSHMON_AGGREGATOR_ZSCORE__WINDOW: zscore.window must be an integer, got 'many'"
    )


def test_the_tuner_and_evidence_sections_come_from_the_file_and_variables(
    tmp_path: Path,
) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text(
        "tuner:\n  max_trials: 8\n  max_relative_error:\n    fp16: 0.2\n  proposer: random\n"
        f"evidence:\n  dir: {tmp_path / 'ev'}\n  max_bytes: 10GiB\n  profile_steps: 5\n"
    )
    env = {
        "TORSHMON_AGGREGATOR_TUNER__BUCKET_SCREEN": "0.5, 2",
        "TORSHMON_AGGREGATOR_TUNER__MAX_RELATIVE_ERROR": "int8=0.05,bf16=0.3",
        "TORSHMON_AGGREGATOR_EVIDENCE__RETENTION_S": "1d",
    }
    settings = load_settings({}, config_file=conf, env=env)
    assert settings.tuner == TunerSettings(
        max_trials=8,
        max_relative_error={"int8": 0.05, "bf16": 0.3},  # the variable beats the file
        proposer="random",
        bucket_screen=(0.5, 2.0),
    )
    assert settings.evidence == EvidenceSettings(
        dir=str(tmp_path / "ev"), max_bytes=10 * 2**30, retention_s=86400.0, profile_steps=5
    )
    defaults = load_settings({"db_url": str(tmp_path / "h.db")}, env={})
    assert defaults.tuner == TunerSettings()
    assert defaults.evidence.dir == str(tmp_path / "h.db.evidence")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "tuner:\n  proposer: grid\n",
            ":2: tuner.proposer must be one of 'tpe', 'random', got 'grid'",
        ),
        ("tuner:\n  min_windows: 9\n", "tuner: min_windows (9) must not exceed windows (5)"),
        ("tuner:\n  max_relative_error: {zip: 0.1}\n", "tuner: max_relative_error: codec must"),
        ("evidence:\n  profile_steps: 50\n", ":2: evidence.profile_steps must be in 1..20, got 50"),
        (
            "tuner:\n  retune:\n    threshold: 1.5\n",
            ":3: tuner.retune.threshold must be > 0 and < 1, got 1.5",
        ),
        ("tuner:\n  retune:\n    every_s: 9\n", ":3: unknown setting 'tuner.retune.every_s'"),
        # The flat keys of earlier versions: refused, their new place named.
        (
            "evidence_max_bytes: 2GiB\n",
            ":1: unknown setting 'evidence_max_bytes'; it is 'evidence.max_bytes' now",
        ),
        ("hang_timeout_s: 9\n", ":1: unknown setting 'hang_timeout_s'; it is 'hang.timeout_s' now"),
    ],
)
def test_a_bad_tuner_or_evidence_setting_is_one_line(
    tmp_path: Path, content: str, message: str
) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text(content)
    with pytest.raises(SettingsError) as refused:
        load_settings({}, config_file=conf, env={})
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_flat_evidence_variables_of_earlier_versions_are_refused() -> None:
    env = {"TORSHMON_AGGREGATOR_EVIDENCE_RETENTION_S": "1d"}
    with pytest.raises(SettingsError) as refused:
        load_settings({}, env=env)
    assert str(refused.value) == (
        "TORSHMON_AGGREGATOR_EVIDENCE_RETENTION_S is not read any more: evidence_retention_s "
        "is evidence.retention_s now (TORSHMON_AGGREGATOR_EVIDENCE__RETENTION_S)"
    )
    with pytest.raises(SettingsError, match=r"'evidence_dir'; it is 'evidence\.dir' now"):
        load_settings({"evidence_dir": "/tmp/x"}, env={})


def test_retuning_on_drift_comes_from_the_file_and_variables(tmp_path: Path) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text("tuner:\n  max_trials: 6\n  retune:\n    threshold: 0.25\n    for_s: 2m\n")
    env = {"TORSHMON_AGGREGATOR_TUNER__RETUNE__MIN_INTERVAL_S": "1h30m"}
    settings = load_settings({}, config_file=conf, env=env)
    assert settings.tuner == TunerSettings(
        max_trials=6,
        retune=RetuneSettings(threshold=0.25, for_s=120.0, min_interval_s=5400.0),
    )
    off = load_settings({}, env={"TORSHMON_AGGREGATOR_TUNER__RETUNE__ENABLED": "false"})
    assert off.tuner.retune == RetuneSettings(enabled=False)
    assert load_settings({}, env={}).tuner.retune == RetuneSettings()


def test_the_tuner_and_evidence_sections_reach_the_service(tmp_path: Path) -> None:
    settings = load_settings(
        {
            "db_url": str(tmp_path / "h.db"),
            "tuner": {"max_trials": 4, "retune": {"enabled": False}},
            "evidence": {"max_bytes": 4096},
        },
        env={},
    )
    service = Aggregator(settings, registry=CollectorRegistry(), targets=[])
    try:
        assert service.tuning.settings.max_trials == 4
        assert service.tuning.settings.retune.enabled is False
        assert service.evidence.settings.max_bytes == 4096
        assert service.evidence.directory == tmp_path / "h.db.evidence"
    finally:
        service.writer.shutdown()


def test_detector_settings_reach_the_live_state() -> None:
    settings = load_settings({"straggler": {"persistence": 7}, "hang": {"timeout_s": 7}}, env={})
    state = LiveState(straggler=settings.straggler, hang=settings.hang, zscore=settings.zscore)
    # Every run of a job gets its own detectors, built with these settings.
    state.restore_job("j", 2, 1000.0, "r1")
    live = state.run("j")
    assert live.straggler.settings.persistence == 7
    assert live.hang._timeout_s == 7.0
    assert live.step_z._threshold == live.loss_z._threshold == 2.5
    assert live.step_z._explained_share == 0.5
    assert live.step_z._min_out_share == 0.7
    assert (live.step_z._level_window_s, live.step_z._level_sigmas) == (1.0, 1.5)
    assert live.step_z._level_share == 0.6
    # The policies are step time's: the other metrics run the generic detector.
    assert isinstance(live.step_z, StepTimeDetector)
    assert not isinstance(live.loss_z, StepTimeDetector)


SLACK = "https://hooks.slack.com/services/T0/B0/SlackS3cret"
HOOK = "https://hooks.example.com/HookS3cretPath"


def test_notification_targets_from_the_file_and_the_environment(tmp_path: Path) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text(
        f"notify:\n  slack:\n    - url: {SLACK}\n"
        f"  webhooks:\n    - url: {HOOK}\n      name: oncall\n      bearer_token: T0kS3cret\n"
        "  alertmanagers:\n    - base_url: http://am:9093\n      resend_interval_s: 2m\n"
        "  max_attempts: 3\n"
    )
    notify = load_settings({}, config_file=conf, env={}).notify
    assert notify.targets() == [
        SlackTarget(SLACK),
        WebhookTarget(HOOK, name="oncall", bearer_token="T0kS3cret"),
        AlertmanagerTarget("http://am:9093", resend_interval_s=120.0),
    ]
    assert notify.delivery()["max_attempts"] == 3
    # A variable replaces the file's targets of its kind, and only those.
    env = {"TORSHMON_SLACK_WEBHOOK_URL": "http://a.example/x,http://b.example/y"}
    notify = load_settings({}, config_file=conf, env=env).notify
    assert [t.name for t in notify.targets()] == ["slack", "slack-2", "oncall", "alertmanager"]
    assert "S3cret" not in repr(load_settings({}, config_file=conf, env={}))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("notify:\n  slack:\n    - url: ftp://x/SlackS3cret\n", "must start with http://"),
        ("notify:\n  slack:\n    - url: 7\n", "Expected `str`"),
        ("notify:\n  slack:\n    - urll: http://x/SlackS3cret\n", ":3: unknown setting"),
        (
            "notify:\n  slack:\n    - url: http://x/SlackS3cret\n    - url: http://y/SlackS3cret\n",
            "target names must be unique; repeated: slack",
        ),
    ],
)
def test_a_bad_target_in_the_file_is_named_without_its_url(
    tmp_path: Path, content: str, message: str
) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text(content)
    with pytest.raises(SettingsError) as refused:
        load_settings({}, config_file=conf, env={})
    assert message in str(refused.value) and "S3cret" not in str(refused.value)


def test_a_secret_of_the_wrong_type_is_not_shown(tmp_path: Path) -> None:
    conf = tmp_path / "conf.yaml"
    conf.write_text("token: 12345678901234\n")
    with pytest.raises(SettingsError) as refused:
        load_settings({}, config_file=conf, env={})
    assert str(refused.value) == (
        f"{conf}:1: token must be a string, got a value of type int (not shown)"
    )


def test_settings_built_in_code_are_checked_too() -> None:
    with pytest.raises(SettingsError, match=r"^port must be in 0\.\.65535, got 70000$"):
        AggregatorSettings(port=70000)
    with pytest.raises(SettingsError, match="eval_interval_s must be > 0"):
        AggregatorSettings(eval_interval_s=0)
    assert AggregatorSettings(allowed_hosts=["A.example"]).allowed_hosts == ("a.example",)  # type: ignore[arg-type]


def test_unknown_overrides_are_refused() -> None:
    with pytest.raises(SettingsError, match=r"unknown setting 'straggler\.bogus'; known: "):
        load_settings({"straggler": {"bogus": 1}}, env={})
