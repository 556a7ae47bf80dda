"""The probe's settings: attach's keywords, else TORSHMON_* variables, else defaults."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import torshmon
from tests.integration.conftest import ReceiverThread
from torshmon.integrations._common import attach_to
from torshmon.probe import autoattach
from torshmon.probe.api import attach
from torshmon.probe.monitor import Monitor, NullMonitor
from torshmon.probe.settings import (
    ENV_PREFIX,
    ProbeSettings,
    default_job_name,
    load_probe_settings,
)
from torshmon.settings import Layers, SettingsError, field_specs
from torshmon.settings_doc import render

#: For each setting: a variable's text, the value it reads as (not the default), and a
#: keyword's value (not that).
SAMPLES: dict[str, tuple[str, object, object]] = {
    "job": ("env-job", "env-job", "code-job"),
    "agent_socket": ("/run/env.sock", "/run/env.sock", "/run/code.sock"),
    "node": ("env-node", "env-node", "code-node"),
    "agent_user": ("nobody", "nobody", "4242"),
    "run_id": ("env-run", "env-run", "code-run"),
    "local_rank": ("3", 3, 5),
    "flush_interval_s": ("250ms", 0.25, 2.0),
    "max_buffered_steps": ("500", 500, 70),
    "ddp_stats_every": ("7", 7, 9),
    "sync_every": ("4", 4, 6),
    "error_sample_every": ("11", 11, 13),
    "bucket_timing": ("yes", True, False),
    "fast_lane": ("off", False, True),
    "cpu_wait": ("1", True, False),
}


def _variables() -> dict[str, str]:
    layers = Layers(ProbeSettings, env_prefix=ENV_PREFIX)
    return {path[0]: layers.env_name(path, spec) for path, spec in layers.leaves()}


def test_the_samples_cover_every_setting() -> None:
    assert set(SAMPLES) == {spec.name for spec in field_specs(ProbeSettings)}


def test_attach_takes_exactly_the_settings_as_typed_keywords() -> None:
    parameters = inspect.signature(attach).parameters
    keywords = {n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == set(SAMPLES)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def test_a_keyword_beats_its_variable_which_beats_the_default() -> None:
    variables = _variables()
    env = {variables[name]: text for name, (text, _, _) in SAMPLES.items()}
    from_env = load_probe_settings({}, env=env)
    from_code = load_probe_settings({n: code for n, (_, _, code) in SAMPLES.items()}, env=env)
    defaults = load_probe_settings({}, env={})
    for name, (_, read, code) in SAMPLES.items():
        assert getattr(from_env, name) == read, name
        assert getattr(from_code, name) == code, name
        assert getattr(defaults, name) != read != code, name  # each layer shows
    # None is "not given": the variable stands.
    assert load_probe_settings({"fast_lane": None}, env=env).fast_lane is False


def test_the_operators_variables_keep_their_names() -> None:
    variables = _variables()
    names = ("job", "agent_socket", "node", "agent_user", "run_id", "fast_lane", "cpu_wait")
    assert {n: variables[n] for n in names} == {
        "job": "TORSHMON_JOB",
        "agent_socket": "TORSHMON_AGENT_SOCKET",
        "node": "TORSHMON_NODE",
        "agent_user": "TORSHMON_AGENT_USER",
        "run_id": "TORSHMON_RUN_ID",
        "fast_lane": "TORSHMON_FAST_LANE",
        "cpu_wait": "TORSHMON_CPU_WAIT",
    }
    assert variables["local_rank"] == "LOCAL_RANK"  # torchrun's
    assert variables["sync_every"] == "TORSHMON_PROBE_SYNC_EVERY"


def test_a_blank_variable_counts_as_unset() -> None:
    settings = load_probe_settings({}, env={"TORSHMON_FAST_LANE": " ", "TORSHMON_NODE": ""})
    assert settings.fast_lane is True and settings.node == ProbeSettings().node


def test_the_job_is_named_by_torshmon_then_torchrun_then_default() -> None:
    run = {"TORCHELASTIC_RUN_ID": "train-42"}
    assert default_job_name({"TORSHMON_JOB": "mine", **run}) == "mine"
    assert default_job_name(run) == "train-42"
    # torchrun's own default, where no --rdzv-id was given, names nothing.
    assert default_job_name({"TORCHELASTIC_RUN_ID": "none"}) == "default"
    assert default_job_name({}) == "default"
    assert default_job_name({"TORSHMON_JOB": "", "TORCHELASTIC_RUN_ID": ""}) == "default"
    assert load_probe_settings({}, env=run).job == "train-42"
    assert load_probe_settings({"job": "mine"}, env=run).job == "mine"


def test_the_run_id_is_torchruns_then_torshmons_then_none() -> None:
    both = {"TORCHELASTIC_RUN_ID": "rdzv-7", "TORSHMON_RUN_ID": "mine"}
    assert load_probe_settings({}, env=both).run_id == "rdzv-7"
    # torchrun's "none" (no --rdzv-id) names nothing: TORSHMON_RUN_ID does.
    assert load_probe_settings({}, env={**both, "TORCHELASTIC_RUN_ID": "none"}).run_id == "mine"
    # Neither: None, and rank 0 makes one at attach (shared through the rendezvous store).
    assert load_probe_settings({}, env={"TORCHELASTIC_RUN_ID": "none"}).run_id is None
    assert load_probe_settings({"run_id": "code"}, env=both).run_id == "code"
    # A launcher's over-long id is cut, as the wire takes it; a keyword's is refused.
    assert load_probe_settings({}, env={"TORSHMON_RUN_ID": "r" * 80}).run_id == "r" * 64
    with pytest.raises(SettingsError, match=r"^run_id must be 1 to 64 characters, got 0$"):
        load_probe_settings({"run_id": ""}, env={})


def test_the_defaults_under_the_runtime_folder_follow_the_environment_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/elsewhere")
    settings = load_probe_settings({}, env={"XDG_RUNTIME_DIR": "/run/user/given"})
    assert settings.agent_socket == "/run/user/given/torshmon/agent.sock"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TORSHMON_CPU_WAIT": "nope"},
            "TORSHMON_CPU_WAIT: cpu_wait must be true or false, got 'nope'",
        ),
        (
            {"TORSHMON_FAST_LANE": "2"},
            "TORSHMON_FAST_LANE: fast_lane must be true or false, got '2'",
        ),
        (
            {"TORSHMON_PROBE_SYNC_EVERY": "0"},
            "TORSHMON_PROBE_SYNC_EVERY: sync_every must be >= 1, got '0'",
        ),
        (
            {"TORSHMON_PROBE_FLUSH_INTERVAL_S": "soon"},
            "TORSHMON_PROBE_FLUSH_INTERVAL_S: flush_interval_s must be a float (seconds, or a "
            "duration such as 500ms, 2m or 1h), got 'soon'",
        ),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK: local_rank must be >= 0, got -1"),
        ({"TORSHMON_JOB": "j" * 201}, "TORSHMON_JOB: job must be 1 to 200 characters, got 201"),
    ],
)
def test_a_bad_variable_stops_attach_with_one_line_naming_it(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # no job: attach checks all the same
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as refused:
        torshmon.attach(None)
    assert str(refused.value) == message


def test_a_keyword_that_is_no_setting_or_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'fast_lan'"):
        attach(None, fast_lan=False)  # type: ignore[call-arg]
    # Where keywords travel in a mapping (an integration's options), the known are named.
    known = ", ".join(sorted(SAMPLES))
    with pytest.raises(TypeError) as refused:
        load_probe_settings({"fast_lan": False}, env={})
    assert str(refused.value) == f"unknown probe setting 'fast_lan'; known: {known}"
    with pytest.raises(TypeError) as refused:
        attach_to(None, None, "job", {"fast_lan": False})
    assert str(refused.value) == f"unknown probe setting 'fast_lan'; known: {known}"
    # A wish in words, or 1 for True, is not read: the code says what it means.
    wrong: tuple[tuple[str, Any, str], ...] = (
        ("fast_lane", "off", "true or false"),
        ("cpu_wait", 1, "true or false"),
        ("sync_every", True, "an integer"),
        ("job", 7, "a string"),
    )
    for name, value, what in wrong:
        with pytest.raises(TypeError) as refused:
            attach(None, **{name: value})
        assert str(refused.value) == f"{name} must be {what}, got {value!r}"


def test_a_keyword_out_of_range_is_a_value_error_naming_it() -> None:
    out_of_range: tuple[tuple[dict[str, Any], str], ...] = (
        ({"sync_every": 0}, "sync_every must be >= 1, got 0"),
        ({"flush_interval_s": 0.0}, "flush_interval_s must be > 0, got 0.0"),
        ({"job": ""}, "job must be 1 to 200 characters, got 0"),
        ({"local_rank": -1}, "local_rank must be >= 0, got -1"),
    )
    for keywords, message in out_of_range:
        with pytest.raises(ValueError) as refused:
            attach(None, **keywords)
        assert str(refused.value) == message


def test_every_setting_is_on_the_configuration_page_with_its_variable_and_help() -> None:
    page = render()
    probe = page[page.index("## The probe (`torshmon.attach`)") :]
    rows = {
        line.split(" | ")[0][3:-1]: line for line in probe.splitlines() if line.startswith("| `")
    }
    variables = _variables()
    assert set(rows) == set(SAMPLES)
    for name, row in rows.items():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[3] == f"`{variables[name]}`"
        assert cells[4], f"{name} has no help"


# -- what a Monitor is given is all it reads ---------------------------------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[ReceiverThread]:
    rx = ReceiverThread(tmp_path / "agent.sock").start()
    try:
        yield rx
    finally:
        rx.stop()


def _hello(receiver: ReceiverThread) -> Any:
    deadline = time.monotonic() + 10
    while not receiver.hellos():
        assert time.monotonic() < deadline, "no hello"
        time.sleep(0.02)
    return receiver.hellos()[0]


def test_attach_hands_the_monitor_keywords_and_variables_merged(
    one_rank: None, receiver: ReceiverThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORSHMON_JOB", "env-job")
    monkeypatch.setenv("TORSHMON_NODE", "env-node")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("TORSHMON_PROBE_SYNC_EVERY", "4")
    mon = attach(None, node="code-node", agent_socket=str(receiver.socket_path))
    try:
        assert isinstance(mon, Monitor)
        assert mon.settings.sync_every == 4
        hello = _hello(receiver)
        assert (hello.job, hello.node, hello.local_rank) == ("env-job", "code-node", 3)
    finally:
        mon.close()


def test_a_monitor_reads_no_variable_itself(
    one_rank: None, receiver: ReceiverThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, (text, _, _) in SAMPLES.items():
        monkeypatch.setenv(_variables()[name], text)
    settings = ProbeSettings(job="given", node="given-node", agent_socket=str(receiver.socket_path))
    mon = Monitor(None, settings=settings)
    try:
        hello = _hello(receiver)
        assert (hello.job, hello.node, hello.local_rank) == ("given", "given-node", 0)
    finally:
        mon.close()


def test_outside_a_job_attach_still_reads_the_job_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TORSHMON_JOB", "solo")
    mon = attach(None)
    assert isinstance(mon, NullMonitor) and mon.job == "solo"


def test_the_zero_code_attach_reads_its_settings_at_install_and_installs_nothing_on_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    monkeypatch.setenv("TORSHMON_FAST_LANE", "maybe")
    with pytest.raises(SettingsError, match=r"^TORSHMON_FAST_LANE: fast_lane must be"):
        autoattach.install()
    assert DistributedDataParallel.__init__ is init
    monkeypatch.setenv("TORSHMON_FAST_LANE", "off")
    autoattach.install()
    try:
        assert autoattach._state.settings is not None
        assert autoattach._state.settings.fast_lane is False
    finally:
        autoattach.uninstall()
    assert DistributedDataParallel.__init__ is init
