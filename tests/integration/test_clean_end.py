"""A job that ends well pages no one: real gloo ranks, the real agent and aggregator.

The reproduction of a critical Hung Collective raised ~2.5 s after a clean job ended:
30 steps, then 8 small ``all_gather``s (a trainer's final evaluation and gathers), then
``close()``. Each rank's last batch could show it waiting in one of those gathers, and
no batch told the aggregator the rank had finished, so the report aged into a "hang".
Here the two ranks run that job many times in a row (each run its own job name), the
ranks' final evaluations taking different times, so a rank often waits in a gather when
a batch leaves; the last run leaves by process exit, without ``close()``. No run may
raise any alert, and every run's trailing gathers must be in the ``collectives`` table.
A rank that exits without ``close()`` says it closed too, from a plain script and from
a child that multiprocessing forked (which leaves past ``atexit``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import torshmon
from tests.integration.aggregator_thread import AggregatorThread
from tests.integration.conftest import ReceiverThread
from tests.integration.test_agent import AgentProcess
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

RUNS = 10  # the last one ends by process exit (atexit), the others by close()
STEPS = 30
GATHERS = 8
WORLD = 2


def _clean_runs(rank: int, world: int, sock: str, runs: int) -> list[float]:
    """``runs`` clean jobs one after another; returns when each ended (Unix s)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    torch.manual_seed(0)
    ended = []
    for run in range(runs):
        model = DistributedDataParallel(torch.nn.Linear(32, 32))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        monitor = torshmon.attach(model, job=f"clean-end-{run}", agent_socket=sock)
        for _ in range(STEPS):
            with monitor.step(batch_size=8):
                loss = model(torch.randn(8, 32)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            time.sleep(0.01)
        # The final evaluation: rank 1's takes longer, so rank 0 waits in each gather.
        for _ in range(GATHERS):
            time.sleep(0.02 + 0.06 * rank)
            parts = [torch.zeros(4) for _ in range(world)]
            dist.all_gather(parts, torch.full((4,), float(rank)))
            if [int(p[0]) for p in parts] != list(range(world)):
                raise AssertionError(f"all_gather returned {parts}")
        ended.append(time.time())
        if run < runs - 1:
            monitor.close()
        # else: the process's exit closes it (atexit), after the launcher destroyed
        # the process group
    return ended


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[AggregatorThread, AgentProcess]]:
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token="t",
        aggregator_id="a1",
        eval_interval_s=0.2,
    )
    with AggregatorThread(settings) as aggregator:
        agent = AgentProcess(tmp_path, aggregator.url, "t")
        # The agent sees a probe gone at its next node sample: every 2 s by default (the
        # helper's 0.5 s mostly hid the fault). Sampled every 5 s, that view comes after
        # the hang's timeout: only the probe's own close mark can keep a clean end quiet.
        at = agent._args.index("--sample-interval-s")
        agent._args[at + 1] = "5"
        agent.start()
        try:
            yield aggregator, agent
        finally:
            agent.stop()


def _query(aggregator: AggregatorThread, sql: str) -> list[list[Any]]:
    status, reply = aggregator.post_json("/api/v1/query", {"sql": sql})
    assert status == 200, reply
    return list(reply["rows"])


@pytest.mark.timeout(400)
def test_clean_jobs_that_gather_after_their_last_step_raise_no_alert(
    stack: tuple[AggregatorThread, AgentProcess],
) -> None:
    aggregator, agent = stack
    ended = run_ranks(_clean_runs, WORLD, str(agent.socket), RUNS, timeout_s=300)
    # A finished rank's report aged into a hang 2-5 s after the end (the shortest
    # collective timeout is 2 s, a report counts for 5 s): watch past that window.
    last = max(max(times) for times in ended)
    jobs = ",".join(f"'clean-end-{run}'" for run in range(RUNS))
    where = f"job IN ({jobs})"
    time.sleep(max(0.0, last + 8.0 - time.time()))
    # A page is an alert that fired (resolved ones stay in the table); a pending one
    # (High Communication Overhead waits 120 s on this tiny model) paged no one. A Hung
    # Collective is not even pending.
    paged = _query(
        aggregator,
        "SELECT job, rank, rule, state, annotations FROM alerts WHERE "
        f"{where} AND (fired_at_unix_s IS NOT NULL OR rule = 'Hung Collective') ORDER BY id",
    )
    said = [
        f"{job} rank {rank}: {rule} ({state}): {notes}" for job, rank, rule, state, notes in paged
    ]
    assert paged == [], f"{len({row[0] for row in paged})} of {RUNS} runs paged:\n" + "\n".join(
        said
    )
    status, body = aggregator.get("/api/v1/alerts?state=firing&limit=1000")
    assert status == 200, body
    assert [a for a in body["alerts"] if a["job"].startswith("clean-end-")] == []
    # Every run's trailing gathers, per rank: after step 30, so in the step that never
    # ended (31), all 8 and each 2 x 4 floats.
    rows = _query(
        aggregator,
        "SELECT job, rank, step, count, size_bytes FROM collectives "
        f"WHERE op = 'all_gather' AND {where} ORDER BY job, rank",
    )
    expected = [
        [f"clean-end-{run}", rank, STEPS + 1, GATHERS, GATHERS * WORLD * 4 * 4]
        for run in range(RUNS)
        for rank in range(WORLD)
    ]
    assert rows == expected
    # They made no step: each rank's steps are the 30 it ran.
    steps = _query(
        aggregator,
        f"SELECT job, rank, count(*), max(step) FROM steps WHERE {where} "
        "GROUP BY job, rank ORDER BY job, rank",
    )
    assert steps == [
        [f"clean-end-{run}", rank, STEPS, STEPS] for run in range(RUNS) for rank in range(WORLD)
    ]


_EXIT_SCRIPT = textwrap.dedent(
    """
    import multiprocessing
    import sys


    def rank(sock, store):
        import torch
        import torch.distributed as dist

        import torshmon

        dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
        monitor = torshmon.attach(None, job="exit-" + sys.argv[3], agent_socket=sock)
        for _ in range(3):
            with monitor.step():
                dist.all_reduce(torch.ones(2))
        for _ in range(2):
            dist.all_gather([torch.zeros(2)], torch.ones(2))
        # no close(), no destroy_process_group(): the process just ends


    if __name__ == "__main__":
        if sys.argv[3] == "fork":
            child = multiprocessing.get_context("fork").Process(target=rank, args=sys.argv[1:3])
            child.start()
            child.join()
            sys.exit(child.exitcode)
        rank(*sys.argv[1:3])
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["main", "fork"])
def test_a_rank_that_exits_without_close_says_it_closed_with_its_trailing_gathers(
    receiver: ReceiverThread, tmp_path: Path, how: str
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_EXIT_SCRIPT)
    args = [sys.executable, str(script), str(receiver.socket_path), str(tmp_path / "store"), how]
    # The torshmon under test, wherever the script lies.
    env = {**os.environ, "PYTHONPATH": str(Path(torshmon.__file__).parents[1])}
    done = subprocess.run(args, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    batches = receiver.batches(0)
    assert [s.step for b in batches for s in b.steps] == [1, 2, 3]
    last = batches[-1]
    assert last.closing is not None, batches
    assert [b.closing is not None for b in batches].count(True) == 1
    assert (last.closing.reason, last.closing.step, last.inflight) == ("exit", 4, [])
    assert [(c.op, c.count, c.size_bytes) for c in last.closing.collectives] == [
        ("all_gather", 2, 16)
    ]
