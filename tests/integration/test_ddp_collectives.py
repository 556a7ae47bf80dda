"""DDP's bucket all-reduces in the history of a plain DDP job, from the Flight Recorder:
a real 2-rank gloo job attaches with no comm hook, a real agent and aggregator on
loopback store what it ships. Every step has one untimed all-reduce row holding every
bucket (its bytes the gradients' bytes), apart from the job's own all-reduce of its
loss, which the probe's wrappers timed and which is counted once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.integration.loopback import aggregator_and_agent
from torshmon.history.query import run_query
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

STEPS = 6
JOB = "ddp-fr"
LOSS_BYTES = 4  # one float32


def _rank(rank: int, world: int, socket_path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torshmon

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    model = DDP(net, bucket_cap_mb=0.1)  # several buckets once DDP rebuilds them
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = torshmon.attach(model, job=JOB, agent_socket=socket_path)
    for _ in range(STEPS):
        with mon.step(batch_size=4):
            loss = model(torch.randn(4, 128)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss.detach())  # the job's own, traced by the probe
    reader = mon._shipper.ddp_collectives
    mon.close()
    data = model._get_ddp_logging_data()
    return {
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "buckets": len(str(data["rebuilt_bucket_sizes"]).split(",")),
        "reads": None if reader is None else reader.reads,
        "lost": None if reader is None else reader.lost_total,
    }


def _rows(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in run_query(db_url, sql).rows]


async def test_a_plain_ddp_job_ships_every_bucket_all_reduce(tmp_path: Path) -> None:
    async with aggregator_and_agent(tmp_path, "ddp-fr") as (_, agent_settings):
        results = await asyncio.to_thread(
            run_ranks,
            _rank,
            2,
            agent_settings.socket_path,
            env={"TORCH_FR_BUFFER_SIZE": "256", "OMP_NUM_THREADS": "1"},
            timeout_s=120,
        )
    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    for rank, result in enumerate(results):
        assert result["reads"] and result["lost"] == 0, result
        assert result["buckets"] > 1, result
        rows = _rows(
            db_url,
            "SELECT step, count, size_bytes, duration_s, busbw_bytes_per_s FROM collectives "
            f"WHERE job = '{JOB}' AND rank = {rank} AND op = 'all_reduce' "
            "AND pg = 'default' AND dtype = 'float32' ORDER BY step, duration_s IS NULL",
        )
        untimed = [r for r in rows if r[3] is None]
        timed = [r for r in rows if r[3] is not None]
        # One untimed row a step: every bucket once, together every gradient's bytes;
        # gloo times none of them, so no duration and no bandwidth.
        assert [r[0] for r in untimed] == list(range(1, STEPS + 1)), rows
        assert {r[2] for r in untimed} == {result["grad_bytes"]}, rows
        assert all(r[4] is None for r in untimed)
        # Step 1 runs on DDP's first buckets (the first takes 1 MiB: here, all); from
        # step 2 on, on the rebuilt ones.
        assert untimed[0][1] == 1 and {r[1] for r in untimed[1:]} == {result["buckets"]}, rows
        # The job's own all-reduce of its loss: timed by the wrappers, counted once.
        assert [(r[0], r[1], r[2]) for r in timed] == [
            (step, 1, LOSS_BYTES) for step in range(1, STEPS + 1)
        ], rows
        assert all(r[3] > 0 and r[4] > 0 for r in timed)
