"""The Flight Recorder's ring buffer on a real 2-rank gloo DDP job: one all-reduce per
DDP bucket per step, their bytes the gradients' bytes, read back without a comm hook."""

from __future__ import annotations

from typing import Any

import pytest

from torshmon.launch import run_ranks
from torshmon.probe import flightrec

pytestmark = pytest.mark.integration

STEPS = 3


def _rank(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    model = DDP(net, bucket_cap_mb=0.1)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    per_step: list[list[tuple[str, int | None]]] = []
    last = max((c.record_id for c in flightrec.read()), default=-1)
    for _ in range(STEPS):
        model(torch.randn(4, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
        fresh = flightrec.read(last)
        last = max((c.record_id for c in fresh), default=last)
        per_step.append([(c.op, c.bytes) for c in fresh])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"per_step": per_step, "grad_bytes": grad_bytes}


def test_flight_recorder_holds_every_ddp_bucket_all_reduce() -> None:
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1"}
    assert flightrec.enabled(env) and not flightrec.enabled({"TORCH_FR_BUFFER_SIZE": "x"})
    results = run_ranks(_rank, 2, env=env, timeout_s=120)
    for rank, result in enumerate(results):
        counts: set[int] = set()
        for step, records in enumerate(result["per_step"], start=1):
            # DDP's bucket rebuild after step 1 broadcasts its new order in step 2.
            assert {op for op, _ in records} <= {"all_reduce", "broadcast"}, (rank, step)
            buckets = [b for op, b in records if op == "all_reduce"]
            # Every bucket once: together, every gradient's bytes.
            assert sum(b or 0 for b in buckets) == result["grad_bytes"], (rank, step)
            if step > 1:
                counts.add(len(buckets))
        # Step 1 runs on DDP's first buckets (the first one takes 1 MiB: here, all); from
        # step 2 on, the rebuilt ones: several, as many each step.
        assert len(counts) == 1 and counts.pop() > 1, result["per_step"]
