"""The probe inside real multi-process gloo jobs, shipping to a real receiver."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from torshmon.launch import run_ranks
from torshmon.wire import Batch

pytestmark = pytest.mark.integration

TIMEOUT_S = 120


def _model(seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    )


def _train(ddp: Any, steps: int, rank: int, monitor: Any = None) -> list[float]:
    """Train on a fixed per-rank data stream; returns each step's wall time."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    times = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=generator)
        y = torch.randn(16, 8, generator=generator)
        start = time.perf_counter()
        if monitor is None:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            with monitor.step(batch_size=16) as step:
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step.loss = loss
        times.append(time.perf_counter() - start)
    return times


def _param_bytes(module: Any) -> bytes:
    import torch

    return torch.cat([p.detach().flatten() for p in module.parameters()]).numpy().tobytes()


# -- counts and bytes of every op ---------------------------------------------------------


def _issue_every_op(rank: int, world: int, sock: str) -> None:
    import torch
    import torch.distributed as dist

    import torshmon

    monitor = torshmon.attach(None, job="ops", agent_socket=sock, flush_interval_s=0.05)
    peers = [torch.zeros(1) for _ in range(world)]
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    with monitor.step():
        for _ in range(3):
            dist.all_reduce(torch.ones(1000))
        dist.all_reduce(torch.ones(500, dtype=torch.float64), async_op=True).wait()
        dist.all_gather([torch.zeros(100) for _ in peers], torch.ones(100))
        dist.all_gather_into_tensor(torch.zeros(100 * world), torch.ones(100))
        dist.broadcast(torch.ones(256), src=0)
        dist.reduce(torch.ones(256), dst=0)
        dist.reduce_scatter(torch.zeros(50), [torch.ones(50) for _ in peers])
        dist.reduce_scatter_tensor(torch.zeros(50), torch.ones(50 * world))
        dist.all_to_all([torch.zeros(10) for _ in peers], [torch.ones(10) for _ in peers])
        dist.all_to_all_single(torch.zeros(10 * world), torch.ones(10 * world))
        dist.gather(torch.ones(20), [torch.zeros(20) for _ in peers] if rank == 0 else None, dst=0)
        dist.scatter(torch.zeros(20), [torch.ones(20) for _ in peers] if rank == 0 else None, src=0)
        dist.barrier()
        if rank % 2 == 0:
            dist.send(torch.ones(30), nxt)
            dist.recv(torch.zeros(30), prv)
        else:
            dist.recv(torch.zeros(30), prv)
            dist.send(torch.ones(30), nxt)
        for work in (dist.isend(torch.ones(40), nxt), dist.irecv(torch.zeros(40), prv)):
            work.wait()
    monitor.close()
    monitor.close()  # twice is safe
    # uninstalled: calls after close are not recorded, and still work
    dist.all_reduce(torch.ones(3))
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"


@pytest.mark.parametrize("world", [2, 4])
def test_counts_and_bytes_per_op_match_what_the_job_issued(
    receiver: ReceiverThread, world: int
) -> None:
    run_ranks(_issue_every_op, world, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    expected = {
        ("all_reduce", "float32"): (3, 3 * 4000),
        ("all_reduce", "float64"): (1, 8 * 500),
        ("all_gather", "float32"): (1, 400 * world),
        ("all_gather_into_tensor", "float32"): (1, 400 * world),
        ("broadcast", "float32"): (1, 1024),
        ("reduce", "float32"): (1, 1024),
        ("reduce_scatter", "float32"): (1, 200 * world),
        ("reduce_scatter_tensor", "float32"): (1, 200 * world),
        ("all_to_all", "float32"): (1, 40 * world),
        ("all_to_all_single", "float32"): (1, 40 * world),
        ("gather", "float32"): (1, 80),
        ("scatter", "float32"): (1, 80),
        ("barrier", "none"): (1, 0),
        ("send", "float32"): (1, 120),
        ("recv", "float32"): (1, 120),
        ("isend", "float32"): (1, 160),
        ("irecv", "float32"): (1, 160),
    }
    assert {h.rank for h in receiver.hellos()} == set(range(world))
    for rank in range(world):
        [step] = receiver.steps(rank)
        got = {(c.op, c.dtype): (c.count, c.size_bytes) for c in step.collectives}
        assert got == expected, f"rank {rank}"
        assert all(c.pg == "default" for c in step.collectives)
        assert all(c.duration_s > 0 for c in step.collectives)
        [all_reduce] = [c for c in step.collectives if (c.op, c.dtype) == ("all_reduce", "float32")]
        assert all_reduce.busbw_bytes_per_s == pytest.approx(
            all_reduce.algbw_bytes_per_s * 2 * (world - 1) / world
        )
        assert sum(all_reduce.duration_hist) == 3
        # nothing left in flight once every op completed
        assert receiver.batches(rank)[-1].inflight == []


# -- asynchronous ops are timed to completion ---------------------------------------------

DELAY_S = 0.6


def _late_peer(rank: int, world: int, sock: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import torshmon

    monitor = torshmon.attach(None, job="async", agent_socket=sock, flush_interval_s=0.05)
    issue: dict[str, float] = {}
    with monitor.step():
        if rank == 1:
            time.sleep(DELAY_S)
        start = time.perf_counter()
        work = dist.all_reduce(torch.ones(10), async_op=True)
        issue["all_reduce"] = time.perf_counter() - start
        work.wait()
        if rank == 0:
            start = time.perf_counter()
            work = dist.irecv(torch.zeros(10), 1)
            issue["irecv"] = time.perf_counter() - start
            work.wait()
        else:
            time.sleep(DELAY_S)
            dist.isend(torch.ones(10), 0).wait()
    monitor.close()
    return issue


def test_async_ops_are_timed_to_completion(receiver: ReceiverThread) -> None:
    issue = run_ranks(_late_peer, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)[0]
    [step] = receiver.steps(0)
    durations = {c.op: c.duration_s for c in step.collectives}
    for op in ("all_reduce", "irecv"):
        assert issue[op] < 0.2, f"{op} call should return at once"
        assert durations[op] >= DELAY_S * 0.8, f"{op} timed only to issue: {durations[op]}"
    # async ops are not counted as time the step blocked in communication
    assert step.comm_wait_s < DELAY_S * 0.5


# -- DDP: buckets, phases, DDP's own stats, bit-identical results -------------------------


def _ddp_with_and_without_probe(rank: int, world: int, sock: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    bare = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    _train(bare, 12, rank)
    result: dict[str, Any] = {"bare": _param_bytes(bare), "dropped": 0}
    for job, bucket_timing in (("ddp", False), ("ddp-timed", True)):
        probed = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
        monitor = torshmon.attach(
            probed,
            job=job,
            agent_socket=sock,
            flush_interval_s=0.05,
            ddp_stats_every=5,
            bucket_timing=bucket_timing,
        )
        _train(probed, 12, rank, monitor)
        monitor.close()
        result[job] = _param_bytes(probed)
        result["dropped"] += monitor.dropped_records_total
    result["grad_bytes"] = sum(p.numel() * p.element_size() for p in bare.parameters())
    return result


def test_ddp_buckets_phases_and_bit_identical_training(receiver: ReceiverThread) -> None:
    results = run_ranks(
        _ddp_with_and_without_probe, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S
    )
    for rank, result in enumerate(results):
        assert result["ddp"] == result["bare"], "the probe changed training results"
        assert result["ddp-timed"] == result["bare"], "the bucket hook changed results"
        assert result["bare"] == results[0]["bare"], "ranks disagree"
        assert result["dropped"] == 0
        for job in ("ddp", "ddp-timed"):
            steps = receiver.steps(rank, job)
            assert [s.step for s in steps] == list(range(1, 13))
            for step in steps:
                assert step.forward_s and step.backward_s and step.optimizer_s is not None
                assert step.forward_s + step.backward_s + step.optimizer_s <= step.duration_s
                assert 0.0 < step.comm_wait_s <= step.backward_s
                assert step.compute_s == pytest.approx(step.duration_s - step.comm_wait_s)
                assert step.samples_per_s == pytest.approx(16 / step.duration_s)
                assert step.loss is not None
            sampled = [s for s in steps if s.ddp is not None]
            assert [s.step for s in sampled] == [3, 5, 10]
            ddp = sampled[-1].ddp
            assert ddp is not None
            assert sum(ddp.bucket_sizes_bytes) == result["grad_bytes"]
            assert len(ddp.bucket_sizes_bytes) >= 2
            assert ddp.avg_backward_compute_s > 0
        # by default DDP reduces in C++: no per-bucket records, no Python hook
        assert all(s.buckets == [] for s in receiver.steps(rank, "ddp"))
        for step in receiver.steps(rank, "ddp-timed"):
            assert len(step.buckets) >= (2 if step.step > 1 else 1)
            assert sum(b.size_bytes for b in step.buckets) == result["grad_bytes"]
            assert sum(b.parameters for b in step.buckets) == 8
            assert all(b.duration_s > 0 and b.compression_ratio == 1.0 for b in step.buckets)


# -- no agent, then the agent returns -----------------------------------------------------


def _agent_absent_then_back(rank: int, world: int, sock_dir: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    sock = Path(sock_dir) / f"agent-{rank}.sock"
    ddp = DistributedDataParallel(_model())
    monitor = torshmon.attach(
        ddp, job="absent", agent_socket=str(sock), flush_interval_s=0.05, max_buffered_steps=10
    )
    _train(ddp, 30, rank, monitor)
    time.sleep(0.3)  # let the shipper find out
    dropped_while_absent = monitor.dropped_records_total
    receiver = ReceiverThread(sock).start()
    try:
        _train(ddp, 10, rank, monitor)
        monitor.close()
        batches = receiver.batches()
    finally:
        receiver.stop()
    return {
        "dropped_while_absent": dropped_while_absent,
        "received": [s.step for b in batches for s in b.steps],
        "reported_dropped": batches[-1].dropped_records_total if batches else None,
    }


def test_without_an_agent_training_completes_and_drops_are_counted(tmp_path: Path) -> None:
    results = run_ranks(_agent_absent_then_back, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    for result in results:
        received = result["received"]
        assert len(received) == len(set(received)), "a step arrived twice"
        assert result["dropped_while_absent"] >= 15
        # the count made while absent reaches the agent once it is back (the bound
        # of 10 buffered steps may drop more meanwhile, and those are counted too)
        assert result["reported_dropped"] >= result["dropped_while_absent"]
        # every step is either delivered or counted as dropped: nothing vanishes
        assert len(received) + result["reported_dropped"] == 40
        # The bound drops the oldest: the steps after the agent came back arrive as one
        # run ending at the last step. (All ten arrive when the shipper reconnects before
        # the tenth; on a loaded machine its reconnect can take longer, and the first
        # ones go, counted above.)
        back = [s for s in received if s > 30]
        assert back and back == list(range(41 - len(back), 41)), received
        assert received == sorted(received)


# -- a slow agent never blocks training ----------------------------------------------------


def _stuck_agent(rank: int, world: int, sock_dir: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    path = str(Path(sock_dir) / f"stuck-{rank}.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    held: list[socket.socket] = []
    # accepts every connection and never reads or answers
    threading.Thread(
        target=lambda: [held.append(server.accept()[0]) for _ in range(100)], daemon=True
    ).start()
    ddp = DistributedDataParallel(_model())
    monitor = torshmon.attach(
        ddp, job="stuck", agent_socket=path, flush_interval_s=0.05, max_buffered_steps=20
    )
    times = _train(ddp, 150, rank, monitor)
    started = time.perf_counter()
    monitor.close(timeout_s=1.0)
    return {
        "max_step_s": max(times),
        "close_s": time.perf_counter() - started,
        "dropped": monitor.dropped_records_total,
        "connections": len(held),
    }


def test_a_stuck_agent_never_blocks_training(tmp_path: Path) -> None:
    results = run_ranks(_stuck_agent, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    for result in results:
        assert result["connections"] >= 1
        # the shipper waits up to 2 s for an ack; a training step never does
        assert result["max_step_s"] < 1.0
        assert result["close_s"] < 2.0
        assert result["dropped"] >= 100


# -- collectives in flight name the rank that never joined --------------------------------


def _one_rank_late(rank: int, world: int, sock: str) -> None:
    import torch
    import torch.distributed as dist

    import torshmon

    monitor = torshmon.attach(None, job="hang", agent_socket=sock, flush_interval_s=0.05)
    for step in range(3):
        with monitor.step():
            if step == 2 and rank == 1:
                time.sleep(2.5)  # rank 1 is late for all_reduce #3; rank 0 waits in it
            dist.all_reduce(torch.ones(10))
    monitor.close()


def test_inflight_reports_show_who_waits_in_which_collective(receiver: ReceiverThread) -> None:
    run_ranks(_one_rank_late, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    waiting = [op for batch in receiver.batches(0) for op in batch.inflight if op.age_s >= 0.5]
    assert waiting, "rank 0's heartbeats should show the all_reduce it is stuck in"
    assert {(op.op, op.seq, op.pg) for op in waiting} == {("all_reduce", 3, "default")}
    late = [op for batch in receiver.batches(1) for op in batch.inflight if op.age_s >= 0.5]
    assert late == []


# -- misuse fails fast with a clear message -----------------------------------------------


def _misuse(rank: int, world: int) -> list[str]:
    import torch

    import torshmon

    errors = []
    try:
        torshmon.attach(torch.nn.Linear(2, 2))
    except TypeError as exc:
        errors.append(str(exc))
    try:
        torshmon.attach(None, agent_socket="/nonexistent/agent.sock", fast_lane="off")
    except TypeError as exc:
        errors.append(str(exc))
    os.environ["TORSHMON_CPU_WAIT"] = "nope"
    try:
        torshmon.attach(None, agent_socket="/nonexistent/agent.sock")
    except ValueError as exc:
        errors.append(str(exc))
    del os.environ["TORSHMON_CPU_WAIT"]
    monitor = torshmon.attach(None, agent_socket="/nonexistent/agent.sock")
    try:
        torshmon.attach(None)
    except RuntimeError as exc:
        errors.append(str(exc))
    monitor.close()
    torshmon.attach(None, agent_socket="/nonexistent/agent.sock").close()  # re-attach works
    return errors


def test_misuse_fails_fast_with_a_clear_message() -> None:
    errors = run_ranks(_misuse, 1, timeout_s=TIMEOUT_S)[0]
    assert "DistributedDataParallel" in errors[0] and "Linear" in errors[0]
    assert errors[1] == "fast_lane must be true or false, got 'off'"
    assert errors[2] == "TORSHMON_CPU_WAIT: cpu_wait must be true or false, got 'nope'"
    # Neither refused attach left anything attached.
    assert "already attached" in errors[3]
    assert len(errors) == 4


def test_attach_before_init_process_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torshmon

    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of a job (alone, attach is a no-op)
    with pytest.raises(RuntimeError, match="init_process_group"):
        torshmon.attach(None)


def _late_for_ddp(rank: int, world: int, sock: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model())
    monitor = torshmon.attach(ddp, job="ddp-hang", agent_socket=sock, flush_interval_s=0.05)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(6):
        with monitor.step():
            if step == 4 and rank == 1:
                time.sleep(2.5)  # rank 0 finishes backward compute and waits in DDP
            optimizer.zero_grad()
            ddp(torch.randn(4, 32)).sum().backward()
            optimizer.step()
    monitor.close()


def test_a_rank_waiting_inside_ddp_reduction_shows_it_in_flight(
    receiver: ReceiverThread,
) -> None:
    run_ranks(_late_for_ddp, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    waiting = [op for b in receiver.batches(0) for op in b.inflight if op.age_s >= 0.5]
    assert waiting, "rank 0's heartbeats should show the DDP reduction it waits in"
    assert {(op.op, op.seq, op.pg) for op in waiting} == {("ddp_reduce", 5, "default")}
    assert [op for b in receiver.batches(1) for op in b.inflight if op.age_s >= 0.5] == []
    assert receiver.batches(0)[-1].inflight == []


# -- the fast lane --------------------------------------------------------------------------

SLOW_STEP = 15


def _one_slow_step(rank: int, world: int, sock: str) -> float:
    """20 ms steps with a 5 s flush; step SLOW_STEP takes 150 ms on every rank (a
    job-wide slowdown). Returns when that step ended (wall clock)."""
    import torch
    import torch.distributed as dist

    import torshmon

    monitor = torshmon.attach(None, job="lane", agent_socket=sock, flush_interval_s=5.0)
    slow_end = 0.0
    for step in range(1, SLOW_STEP + 11):
        with monitor.step():
            time.sleep(0.15 if step == SLOW_STEP else 0.02)
            dist.all_reduce(torch.ones(10))
        if step == SLOW_STEP:
            slow_end = time.time()
    time.sleep(1.0)  # the flush (5 s) is not due: only the fast lane can have sent them
    monitor.close()
    return slow_end


def test_a_slow_step_is_sent_at_once_marked_urgent(tmp_path: Path) -> None:
    arrivals: list[tuple[float, Any]] = []

    class Timed(ReceiverThread):
        def _observe(self, message: Any) -> None:
            arrivals.append((time.time(), message))
            super()._observe(message)

    receiver = Timed(tmp_path / "agent.sock").start()
    try:
        ends = run_ranks(_one_slow_step, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    finally:
        receiver.stop()
    for rank, slow_end in enumerate(ends):
        mine = [(t, m) for t, m in arrivals if isinstance(m, Batch) and m.rank == rank]
        [(arrived, batch)] = [(t, m) for t, m in mine if SLOW_STEP in [s.step for s in m.steps]]
        assert batch.urgent
        # (the close flush would come 1.3 s after it)
        assert arrived - slow_end < 0.8, f"rank {rank}: {arrived - slow_end:.2f} s"
        # Every step arrived once (earlier ones may have opened the lane already: the
        # first steps' times scatter); the lane stayed open for the steps after it.
        assert sorted(s.step for _t, m in mine for s in m.steps) == list(range(1, SLOW_STEP + 11))
        after = [m for _t, m in mine if m.steps and m.steps[0].step > SLOW_STEP]
        assert after and all(m.urgent for m in after[:-1])
