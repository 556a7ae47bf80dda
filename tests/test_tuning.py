"""The tuning manager through its narrow interfaces: a history store on a SQLite file,
a fake command sink, fake live data, a recording notifier and tracer, a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.commands import CommandError, CommandStatus
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.core.tuner import TunerError, TunerSettings
from torshmon.aggregator.tuning_manager import (
    FINISHED_RULE,
    TuningConflict,
    TuningManager,
    TuningUnavailable,
)
from torshmon.history.models import Base
from torshmon.history.store import HistoryStore
from torshmon.wire import Command

MIB = 2**20
FAST = TunerSettings(
    warmup_steps=1, window_steps=4, windows=3, min_windows=3, max_trials=2, codec_screen=1
)
CONFIG = {
    "bucket_cap_bytes": 25 * MIB,
    "first_bucket_cap_bytes": 1 * MIB,
    "codec": "none",
    "codec_params": {},
}


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


class FakeCommands:
    """Accepts every command unless told to refuse; remembers them in order."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.sent: list[CommandStatus] = []
        self.refuse: str | None = None

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object]
    ) -> CommandStatus:
        if self.refuse is not None:
            raise CommandError(self.refuse)
        command = Command(id=f"c{len(self.sent)}", job=job, kind=kind, args=dict(args))
        status = CommandStatus(command, "pending", self.clock(), self.clock())
        self.sent.append(status)
        return status


class FakeJobs:
    def __init__(self) -> None:
        self.configs: dict[str, dict[str, Any]] = {}
        self.summaries: dict[str, dict[str, Any]] = {}
        self.links: dict[str, dict[str, Any]] = {}
        self.tuning: dict[str, bool] = {}

    def job_config(self, job: str) -> dict[str, Any] | None:
        return self.configs.get(job)

    def job_summary(self, job: str) -> dict[str, Any] | None:
        return self.summaries.get(job)

    def link_reading(self, job: str) -> dict[str, Any] | None:
        return self.links.get(job)

    def set_tuning(self, job: str, active: bool) -> None:
        self.tuning[job] = active

    def of_latest_run(self, job: str, session: str) -> bool:
        return True


class Recorder:
    """Notifier and tracer: what the manager told them."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.decisions: list[str] = []

    def submit(self, alerts: Sequence[Alert]) -> None:
        self.alerts.extend(alerts)

    def record_decision(self, name: str, attributes: dict[str, str | float | int]) -> None:
        self.decisions.append(name)


class Parts:
    def __init__(self, store: HistoryStore) -> None:
        self.store = store
        self.clock = Clock()
        self.commands = FakeCommands(self.clock)
        self.jobs = FakeJobs()
        self.recorder = Recorder()
        self.registry = CollectorRegistry()

    def manager(self, **kwargs: Any) -> TuningManager:
        """A manager on these parts with a registry of its own (``self.registry``)."""
        self.registry = CollectorRegistry()
        return TuningManager(
            store=self.store,
            commands=self.commands,
            jobs=self.jobs,
            notifier=self.recorder,
            tracer=self.recorder,
            registry=self.registry,
            clock=self.clock,
            **kwargs,
        )


@pytest.fixture
def parts(store: HistoryStore) -> Parts:
    return Parts(store)


async def settle(manager: TuningManager) -> None:
    for _ in range(20):
        await asyncio.sleep(0)
    while manager._tasks:
        await asyncio.gather(*list(manager._tasks))


async def apply(parts: Parts, manager: TuningManager, version: int, step: int) -> None:
    """The job applied the last config command at ``step`` (on the fake clock)."""
    await settle(manager)
    status = parts.commands.sent[-1]
    manager._on_command(
        CommandStatus(
            status.command,
            "applied",
            parts.clock(),
            parts.clock(),
            version=version,
            effective_step=step,
        )
    )
    await settle(manager)


async def run_steps(
    parts: Parts, manager: TuningManager, first: int, count: int, version: int, speed: float
) -> None:
    hello = wf.hello("j", 0, 1)
    for n in range(first, first + count):
        parts.clock.now += 1.0
        record = msgspec.structs.replace(wf.step(n, duration_s=64 / speed), config_version=version)
        manager.observe(Stored(acked_seq=0, batches=[(wf.batch(hello, n, [record]), "n")]))
        await settle(manager)


async def test_a_session_starts_from_the_jobs_config_and_pushes_it(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    manager = parts.manager(settings=FAST, seed=1)
    await manager.start()
    session_id = await manager.start_session("j", trigger="test")
    assert manager.active("j") == session_id
    [status] = parts.commands.sent
    assert status.command.kind == "config" and status.command.job == "j"
    rows = await parts.store.rows("tuning_sessions", {"job": "j"}, 10)
    assert [(r["id"], r["state"], r["trigger"]) for r in rows] == [(session_id, "applying", "test")]
    assert rows[0]["aggregator_id"] == "a1"
    assert (
        parts.registry.get_sample_value("torshmon_tuner_state", {"job": "j", "state": "applying"})
        == 1.0
    )
    await manager.aclose()


async def test_a_session_takes_the_slowest_link_of_the_jobs_link_check(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    parts.jobs.links["j"] = {"bandwidth_by_rank": {"0": 1.2e8, "1": 1.2e8, "2": 3.0e7}}
    manager = parts.manager(settings=FAST, seed=1)
    await manager.start()
    await manager.start_session("j", trigger="test")
    session = manager.session("j")
    assert session is not None and session.evidence().link_bytes_per_s == 3.0e7
    await manager.aclose()


async def test_starting_refuses_a_second_session_an_unknown_job_and_bad_arguments(
    parts: Parts,
) -> None:
    manager = parts.manager(settings=FAST)
    await manager.start()
    with pytest.raises(TuningUnavailable, match="no config or DDP stats"):
        await manager.start_session("j", trigger="test")
    # Without a reported config, DDP's own bucket cap is the baseline.
    parts.jobs.summaries["j"] = {"bucket_cap_bytes": 25 * MIB}
    with pytest.raises(TunerError, match="max_trials must be an integer"):
        await manager.start_session("j", trigger="test", max_trials="3")  # type: ignore[arg-type]
    await manager.start_session("j", trigger="test")
    with pytest.raises(TuningConflict, match="already has an active tuning session"):
        await manager.start_session("j", trigger="test")
    await manager.aclose()


async def test_a_whole_session_is_stored_notified_and_ends(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    manager = parts.manager(settings=FAST, seed=1)
    await manager.start()
    session_id = await manager.start_session("j", trigger="test")
    assert parts.jobs.tuning == {"j": True}  # the live state stops judging its step time
    step = 0
    for version in (1, 2):
        await apply(parts, manager, version, step)
        await run_steps(parts, manager, step + 1, 30, version, 1000.0)
        step += 30
    # The trial was no better: the baseline is pushed back, and once applied it ends.
    assert parts.commands.sent[2].command.args == parts.commands.sent[0].command.args
    await apply(parts, manager, 3, step)
    assert manager.active("j") is None
    assert parts.jobs.tuning == {"j": False}
    session = manager.session("j")
    assert session is not None and session.phase == "finished"
    [row] = await parts.store.rows("tuning_sessions", {"job": "j"}, 10)
    assert row["id"] == session_id and row["state"] == "finished"
    trials = await parts.store.rows("tuning_trials", {"session_id": session_id}, 10)
    assert sorted((t["trial_index"], t["decision"]) for t in trials) == [
        (0, "kept"),
        (1, "not_better"),
    ]
    assert [t["command_id"] for t in sorted(trials, key=lambda t: t["trial_index"])] == [
        "c0",
        "c1",
    ]
    assert (
        parts.registry.get_sample_value(
            "torshmon_tuner_trials_total", {"job": "j", "decision": "not_better"}
        )
        == 1.0
    )
    [alert] = parts.recorder.alerts
    assert alert.rule == FINISHED_RULE and alert.fingerprint == f"tune-{session_id}"
    assert "finish" in parts.recorder.decisions
    await manager.aclose()


async def test_a_refused_command_is_a_rejection_of_that_config(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    parts.commands.refuse = "job gone"
    manager = parts.manager(settings=FAST)
    await manager.start()
    await manager.start_session("j", trigger="test")
    await settle(manager)
    # The session gives up after its refusals and ends: nothing was ever sent.
    assert manager.active("j") is None
    session = manager.session("j")
    assert session is not None and session.done
    await manager.aclose()


async def test_an_unfinished_session_resumes_in_a_new_manager(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    first = parts.manager(settings=FAST, seed=1)
    await first.start()
    session_id = await first.start_session("j", trigger="test")
    await first.aclose()
    parts.clock.now += 5.0
    second = parts.manager(settings=FAST, seed=1)
    await second.start()
    assert second.active("j") == session_id
    # The awaited config is asked for again: the old command book is gone.
    assert len(parts.commands.sent) == 2
    assert parts.commands.sent[0].command.args == parts.commands.sent[1].command.args
    await second.aclose()


async def test_a_stored_session_that_cannot_resume_is_marked_aborted(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    first = parts.manager(settings=FAST)
    await first.start()
    session_id = await first.start_session("j", trigger="test")
    await first.aclose()
    with parts.store.engine.begin() as conn:
        table = Base.metadata.tables["tuning_sessions"]
        conn.execute(table.update().values(state_blob={"not": "a session"}))
    second = parts.manager(settings=FAST)
    await second.start()
    assert second.active("j") is None
    [row] = await parts.store.rows("tuning_sessions", {"job": "j"}, 10)
    assert row["id"] == session_id and row["state"] == "aborted"
    assert row["reason"].startswith("not resumable")


async def test_an_autotune_alert_starts_a_session_once(parts: Parts) -> None:
    parts.jobs.configs["j"] = CONFIG
    manager = parts.manager(settings=FAST)
    await manager.start()
    alert = Alert(
        rule="High Communication Overhead",
        state="firing",
        severity="high",
        labels={"job": "j"},
        annotations={},
        value=0.5,
        starts_at_unix_s=parts.clock(),
        actions=("notify", "autotune"),
    )
    manager.on_alert(alert)
    await settle(manager)
    session_id = manager.active("j")
    assert session_id is not None
    manager.on_alert(alert)
    await settle(manager)
    assert manager.active("j") == session_id and len(parts.commands.sent) == 1
    [row] = await parts.store.rows("tuning_sessions", {"job": "j"}, 10)
    assert row["trigger"] == "alert: High Communication Overhead"
    await manager.aclose()


@pytest.mark.parametrize("restore", [True, False])
async def test_abort_during_a_trial_restores_the_baseline_unless_told_not_to(
    parts: Parts, restore: bool
) -> None:
    parts.jobs.configs["j"] = CONFIG
    manager = parts.manager(settings=FAST, seed=1)
    await manager.start()
    await manager.start_session("j", trigger="test")
    await apply(parts, manager, 1, 0)
    await run_steps(parts, manager, 1, 30, 1, 1000.0)
    baseline, trial = (s.command.args for s in parts.commands.sent)
    assert baseline != trial
    await apply(parts, manager, 2, 30)  # the job runs the trial's config now
    assert await manager.abort_session("j", "stopped by the user", restore=restore)
    assert manager.active("j") is None
    pushed = [s.command.args for s in parts.commands.sent[2:]]
    assert pushed == ([baseline] if restore else [])
    assert not await manager.abort_session("j", "again")
    [row] = await parts.store.rows("tuning_sessions", {"job": "j"}, 10)
    assert row["state"] == "aborted"
    assert [a.severity for a in parts.recorder.alerts] == ["warning"]
    await manager.aclose()
