"""``attach(fast_lane=..., cpu_wait=...)`` in real 2-rank gloo DDP jobs: what each
option leaves out is gone (no urgent send, no run-queue reading, no schedstat file
open), and the rest of every record is there; by default the lane is open and the
run-queue clocks are off. The same from ``$TORSHMON_FAST_LANE`` / ``$TORSHMON_CPU_WAIT``
where the script passes neither."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from tests.integration.test_probe import _model
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

STEPS = 40
SLOW_STEP = 30  # far out of line (0.3 s more), with the lane's history long since there


def _schedstat_files() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").endswith("/schedstat")
        except OSError:
            continue  # closed meanwhile (listdir's own)
    return count


def _train(rank: int, world: int, sock: str, job: str, options: dict[str, bool]) -> int:
    """Train ``STEPS`` steps; returns how many schedstat files were open mid-run."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    # A long flush: records travel early only by the fast lane.
    monitor = torshmon.attach(ddp, job=job, agent_socket=sock, flush_interval_s=30.0, **options)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    open_files = -1
    for index in range(1, STEPS + 1):
        with monitor.step(batch_size=16) as step:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step.loss = loss
            if index == SLOW_STEP:
                time.sleep(0.3)
                open_files = _schedstat_files()
    monitor.close()
    return open_files


#: An operator's word for every rank, the opposite of both defaults.
FLIPPED_BY_ENV = {"TORSHMON_FAST_LANE": "off", "TORSHMON_CPU_WAIT": "1"}


@pytest.mark.parametrize(
    ("options", "env", "lane", "cpu_wait"),
    [
        ({}, {}, True, False),
        ({"fast_lane": False}, {}, False, False),
        ({"cpu_wait": True}, {}, True, True),
        ({"fast_lane": False, "cpu_wait": True}, {}, False, True),
        # An operator's word under torchrun, the script unchanged...
        ({}, FLIPPED_BY_ENV, False, True),
        # ...which the script's own word overrides.
        ({"fast_lane": True, "cpu_wait": False}, FLIPPED_BY_ENV, True, False),
    ],
    ids=["default", "no-lane", "cpu-wait", "no-lane-cpu-wait", "flipped-by-env", "code-wins"],
)
def test_each_option_takes_out_its_part_and_nothing_else(
    receiver: ReceiverThread,
    monkeypatch: pytest.MonkeyPatch,
    options: dict[str, Any],
    env: dict[str, str],
    lane: bool,
    cpu_wait: bool,
) -> None:
    for name in FLIPPED_BY_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the ranks inherit it
    sock = str(receiver.socket_path)
    open_files = run_ranks(_train, 2, sock, "lean", options, timeout_s=180)
    for rank in range(2):
        batches = receiver.batches(rank)
        steps = [s for b in batches for s in b.steps]
        assert [s.step for s in steps] == list(range(1, STEPS + 1))
        urgent = [s.step for b in batches if b.urgent for s in b.steps]
        if lane:
            # The slow step went at once, not with the closing flush 30 s later.
            assert SLOW_STEP in urgent, urgent
        else:
            assert urgent == []
        for s in steps:
            assert s.duration_s > 0 and s.forward_s is not None and s.loss is not None
            assert (s.cpu_wait_s is not None) is cpu_wait, s
            assert (s.process_cpu_wait_s is not None) is cpu_wait, s
        # Every thread's schedstat (the training thread's, gloo's) open, or none.
        assert (open_files[rank] > 0) is cpu_wait, open_files
