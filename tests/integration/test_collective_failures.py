"""A collective that raises, in a real 2-rank gloo job with the real agent and aggregator:
rank 1 calls an all-reduce (blocking, then async) on groups with a 1 s timeout that rank 0
never enters; each times out. The probe counts both, the aggregator exports
``torshmon_collective_failures_total``, says which op failed with what error, and the
Collective Failed rule fires naming rank 1, the op and the group."""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import time
import urllib.request
from typing import Any

import pytest

from tests.integration.aggregator_thread import AggregatorThread
from tests.integration.test_hang_groups import _Stack, stack  # noqa: F401 (the fixture)
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

JOB = "failing"
TIMEOUT_S = 300


def _fail_and_go_on(rank: int, world: int, sock: str, release: str) -> dict[str, str]:
    """Train; at step 5 rank 1 alone calls all_reduce on two groups with a 1 s timeout
    (blocking, then async) and catches what they raise; then both go on until released."""
    import torch
    import torch.distributed as dist

    import torshmon

    timeout = datetime.timedelta(seconds=1)
    blocking = dist.new_group([0, 1], timeout=timeout)
    asynchronous = dist.new_group([0, 1], timeout=timeout)
    monitor = torshmon.attach(None, job=JOB, agent_socket=sock, flush_interval_s=0.1)
    raised = {}
    step = 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        with monitor.step(batch_size=8):
            dist.all_reduce(torch.ones(4))
            if rank == 1 and step == 5:
                try:
                    dist.all_reduce(torch.ones(4), group=blocking)
                except RuntimeError as exc:
                    raised[str(blocking.group_name)] = type(exc).__name__
                work = dist.all_reduce(torch.ones(4), group=asynchronous, async_op=True)
                try:
                    work.wait()
                except RuntimeError as exc:
                    raised[str(asynchronous.group_name)] = type(exc).__name__
        step += 1
        time.sleep(0.05)
        if step % 10 == 0:
            flag = torch.tensor([1.0 if os.path.exists(release) else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
    monitor.close(timeout_s=10)
    return raised


def _failed_alerts(server: AggregatorThread) -> list[dict[str, Any]]:
    status, body = server.get(f"/api/v1/alerts?job={JOB}&rule=Collective%20Failed")
    assert status == 200, body
    return list(body["alerts"])


def _metrics(server: AggregatorThread) -> str:
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": "Bearer t"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.read().decode())


@pytest.mark.timeout(420)
def test_a_collective_that_raises_is_counted_exported_and_alerted(
    stack: _Stack,  # noqa: F811 (the fixture imported above)
) -> None:
    server, agent, release = stack.aggregator, stack.agent, stack.release
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            run_ranks, _fail_and_go_on, 2, str(agent.socket), str(release), timeout_s=TIMEOUT_S
        )
        try:
            deadline = time.monotonic() + TIMEOUT_S
            fired: list[dict[str, Any]] = []
            while time.monotonic() < deadline and not running.done():
                fired = [a for a in _failed_alerts(server) if a["state"] == "firing"]
                if len(fired) == 2:
                    break
                time.sleep(0.2)
            status, job = server.get(f"/api/v1/jobs/{JOB}")
            exported = _metrics(server)
        finally:
            release.touch()
        raised = running.result()[1]

    assert running.result()[0] == {}  # rank 0 never called them
    assert sorted(raised.values()) == ["RuntimeError", "RuntimeError"], raised
    blocking, asynchronous = raised  # group names, in the order rank 1 called them
    # One alert per failed (op, group), each naming rank 1.
    assert sorted((a["rank"], a["labels"]["op"], a["labels"]["pg"]) for a in fired) == sorted(
        [(1, "all_reduce", blocking), (1, "all_reduce", asynchronous)]
    ), fired
    for alert in fired:
        assert alert["value"] == 1.0
        assert alert["annotations"]["summary"] == (
            f"1 all_reduce call(s) failed on rank 1 of job {JOB} (group "
            f"{alert['labels']['pg']}) in the last 5 minutes"
        )
    # The API says what each raised; /metrics counts them.
    assert status == 200, job
    failures = {f["pg"]: f for f in job["live"]["collective_failures"]}
    assert set(failures) == {blocking, asynchronous}
    for pg, failure in failures.items():
        assert (failure["rank"], failure["op"], failure["count"]) == (1, "all_reduce", 1)
        assert failure["last_error"].startswith("RuntimeError: "), failure
        assert "imed out" in failure["last_error"], failure  # gloo: "Timed out waiting"
        line = (
            f'torshmon_collective_failures_total{{job="{JOB}",op="all_reduce",pg="{pg}",'
            f'rank="1",run="{job["run"]["run_id"]}"}} 1.0'
        )
        assert line in exported, [x for x in exported.splitlines() if "failures" in x]
