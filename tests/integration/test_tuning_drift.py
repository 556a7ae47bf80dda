"""Re-tuning on drift in the aggregator: a session finishes, the job's throughput then
drops for good, and a new session starts, rate-limited; a fake clock, no real job."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from tests.integration import wire_factory as wf
from tests.integration.test_tuning import _report_bucket_cap
from torshmon.aggregator.core.commands import CommandStatus
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.core.tuner import RetuneSettings, TunerSettings
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings

pytestmark = pytest.mark.integration

FAST = TunerSettings(
    warmup_steps=1, window_steps=4, windows=5, min_windows=5, max_trials=2, codec_screen=1
)
RETUNE = RetuneSettings(window_steps=4, windows=5, for_s=60.0, min_interval_s=600.0)
FAST_RETUNE = msgspec.structs.replace(FAST, retune=RETUNE)


class FakeJob:
    """Rank 0 of a job that acknowledges configs and reports steps on a fake clock."""

    def __init__(self, agg: Aggregator, now: list[float]) -> None:
        self.agg, self.now = agg, now
        self.hello = wf.hello("j", 0, 1)
        self.step = 0
        self.seq = 0
        self.version = 0

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)
        while self.agg.tuning._tasks:
            await asyncio.gather(*list(self.agg.tuning._tasks))

    async def ack(self) -> None:
        """Apply the config command the session awaits."""
        await self.settle()
        entry = self.agg.tuning._active["j"]
        assert entry.command_id is not None
        status = self.agg.commands.get(entry.command_id)
        assert status is not None
        self.version += 1
        self.agg.tuning._on_command(
            CommandStatus(
                status.command,
                "applied",
                self.now[0],
                self.now[0],
                version=self.version,
                effective_step=self.step,
            )
        )
        await self.settle()

    async def run(self, steps: int, samples_per_s: float) -> None:
        """``steps`` steps at this speed, one second apart on the fake clock."""
        for _ in range(steps):
            self.step += 1
            self.seq += 1
            self.now[0] += 1.0
            record = msgspec.structs.replace(
                wf.step(self.step, duration_s=64 / samples_per_s),
                config_version=self.version,
            )
            stored = Stored(
                acked_seq=0, hellos=[], batches=[(wf.batch(self.hello, self.seq, [record]), "n")]
            )
            self.agg.tuning.observe(stored)
            await self.settle()


async def test_a_sustained_drop_after_a_session_starts_a_new_one(tmp_path: Path) -> None:
    now = [10_000.0]
    settings = AggregatorSettings(
        port=0, db_url=f"sqlite:///{tmp_path / 'h.db'}", aggregator_id="drift", tuner=FAST_RETUNE
    )
    async with Aggregator(
        settings,
        registry=CollectorRegistry(),
        targets=[],
        clock=lambda: now[0],
    ) as agg:
        _report_bucket_cap(agg, "j", 25 * 2**20)
        job = FakeJob(agg, now)
        first = await agg.tuning.start_session("j", trigger="test")
        # Baseline, then one trial at the same speed (not better): the baseline is restored.
        await job.ack()
        await job.run(30, 1000.0)
        await job.ack()
        await job.run(30, 1000.0)
        await job.ack()  # the restore
        assert agg.tuning.active("j") is None
        session = agg.tuning.session("j")
        assert session is not None and session.phase == "finished"
        watch = agg.tuning.drift_watch("j")
        assert watch is not None and watch.reference == session.trials[0].windows

        # Same speed for a long time: no new session.
        await job.run(300, 1000.0)
        assert agg.tuning.active("j") is None
        # 40 % slower, for good: drifting at once, but a new session waits for the rate
        # limit (600 s after the first ended), and the drift must last for_s (60 s).
        ended = now[0] - 300
        await job.run(200, 600.0)
        assert agg.tuning.active("j") is None, "started before the drift lasted for_s"
        assert watch.drifting_since is not None
        await job.run(200, 600.0)
        second = agg.tuning.active("j")
        assert second is not None and second != first
        assert now[0] - ended >= RETUNE.min_interval_s
        assert now[0] - watch.drifting_since >= RETUNE.for_s
        entry = agg.tuning._active["j"]
        assert entry.trigger.startswith("drift: throughput drifted -40%")
        assert agg.tuning.drift_watch("j") is None  # no second trigger while tuning


async def test_retuning_can_be_switched_off(tmp_path: Path) -> None:
    now = [10_000.0]
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'h.db'}",
        aggregator_id="drift-off",
        tuner=msgspec.structs.replace(FAST, retune=RetuneSettings(enabled=False)),
    )
    async with Aggregator(
        settings,
        registry=CollectorRegistry(),
        targets=[],
        clock=lambda: now[0],
    ) as agg:
        _report_bucket_cap(agg, "j", 25 * 2**20)
        job = FakeJob(agg, now)
        await agg.tuning.start_session("j", trigger="test")
        await job.ack()
        await job.run(30, 1000.0)
        await job.ack()
        await job.run(30, 1000.0)
        await job.ack()
        assert agg.tuning.active("j") is None
        assert agg.tuning.drift_watch("j") is None
        await job.run(1200, 500.0)
        assert agg.tuning.active("j") is None
