"""The shipper sends only to an agent of a trusted user (``torshmon.probe.shipper``).

The foreign agent is a real listener in a process that runs as uid 65534
(``tests/integration/foreign_agent.py``), so the kernel's peer credentials are what
the probe reads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import foreign_agent as foreign
from tests.integration.foreign_agent import NOBODY, ForeignAgent
from torshmon.probe.events import RawStep, StepEvents
from torshmon.probe.inflight import InflightTable
from torshmon.probe.shipper import Shipper, StepOutbox
from torshmon.wire import SCHEMA_VERSION, Hello

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a listener as another uid")


@pytest.fixture
def foreign_agent() -> Iterator[tuple[Path, ForeignAgent]]:
    with foreign.foreign_agent() as served:
        yield served


def _hello() -> Hello:
    return Hello(
        v=SCHEMA_VERSION,
        session="s",
        job="j",
        rank=0,
        world_size=1,
        local_rank=0,
        node="n",
        pid=os.getpid(),
        backend="gloo",
        torch_version="test",
        probe_version="test",
    )


def _raw_step(n: int) -> RawStep:
    now = time.time_ns()
    return RawStep(
        step=n,
        start_ns=time.perf_counter_ns(),
        end_ns=time.perf_counter_ns() + 1_000_000,
        end_unix_ns=now,
        batch_size=4,
        loss=None,
        events=StepEvents(),
        ddp_logging=None,
    )


def _ship(path: Path, steps: int, trusted_uids: frozenset[int] | None = None) -> Shipper:
    """Run a shipper while ``steps`` steps are put, as the training thread does."""
    outbox = StepOutbox(1000)
    # Left out unless given: the default is what a probe gets.
    trusted: dict[str, Any] = {} if trusted_uids is None else {"trusted_uids": trusted_uids}
    shipper = Shipper(
        socket_path=str(path),
        hello=_hello(),
        outbox=outbox,
        inflight=InflightTable(),
        flush_interval_s=0.05,
        poll_s=0.01,
        max_buffered_steps=10,
        reconnect_max_s=0.1,
        **trusted,
    )
    shipper.start()
    for n in range(steps):
        outbox.put(_raw_step(n))  # training goes on: a put never waits or raises
        time.sleep(0.01)
    shipper.close(timeout_s=2.0)
    return shipper


def test_a_socket_served_by_another_uid_gets_nothing_and_training_goes_on(
    foreign_agent: tuple[Path, ForeignAgent], caplog: pytest.LogCaptureFixture
) -> None:
    path, agent = foreign_agent
    with caplog.at_level(logging.WARNING, logger="torshmon.probe.shipper"):
        shipper = _ship(path, steps=50)
    assert agent.received() == 0
    assert shipper.dropped_records_total >= 40  # as with no agent: kept 10 at most, dropped
    refusals = [r.getMessage() for r in caplog.records if f"uid {NOBODY}" in r.getMessage()]
    assert len(refusals) == 1, refusals  # said once, though it tried again and again


def test_the_same_socket_gets_the_data_when_its_user_is_trusted(
    foreign_agent: tuple[Path, ForeignAgent],
) -> None:
    """The control: the listener does see what a probe sends to it."""
    path, agent = foreign_agent
    _ship(path, steps=5, trusted_uids=frozenset({os.geteuid(), 0, NOBODY}))
    assert agent.received() > 0


def test_the_agent_user_is_trusted_by_name_or_uid() -> None:
    from torshmon.probe.settings import load_probe_settings
    from torshmon.probe.shipper import trusted_agent_uids
    from torshmon.settings import SettingsError

    by_name = load_probe_settings({}, env={"TORSHMON_AGENT_USER": "nobody"})
    assert trusted_agent_uids(by_name.agent_uid()) == {os.geteuid(), 0, NOBODY}
    by_uid = load_probe_settings({"agent_user": "4242"}, env={})
    assert trusted_agent_uids(by_uid.agent_uid()) == {os.geteuid(), 0, 4242}
    assert trusted_agent_uids(load_probe_settings({}, env={}).agent_uid()) == {os.geteuid(), 0}
    # A user unknown here stops attach with one line, not the first send.
    with pytest.raises(SettingsError) as refused:
        load_probe_settings({}, env={"TORSHMON_AGENT_USER": "no-such-user-here"})
    assert str(refused.value) == (
        "TORSHMON_AGENT_USER: agent_user 'no-such-user-here' is no user on this host"
    )
