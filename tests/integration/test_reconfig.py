"""Live reconfiguration of real gloo DDP jobs: every rank switches at the same step."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from tests.integration.test_probe import _model, _param_bytes, _train
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 180

CODEC_CHOICES: list[tuple[str, dict[str, object]]] = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("powersgd", {"rank": 1}),
    ("powersgd", {"rank": 4}),
    ("topk", {"ratio": 0.1}),
    ("topk", {"ratio": 1.0}),
    ("int8", {}),
]
CAPS_MB = [0.001, 0.004, 0.01, 0.05, 25.0]


def _random_changes(rank: int, world: int, sock: str, changes: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    monitor = torshmon.attach(
        ddp,
        job="reconfig",
        agent_socket=sock,
        flush_interval_s=0.05,
        sync_every=2,
        error_sample_every=3,
    )
    rng = random.Random(7)
    requested = []
    for _ in range(changes):
        if rank == 0:
            codec, params = rng.choice(CODEC_CHOICES)
            version = monitor.request_config(
                bucket_cap_mb=rng.choice(CAPS_MB), codec=codec, codec_params=params
            )
            requested.append(version)
        _train(ddp, 2, rank, monitor)
    _train(ddp, 4, rank, monitor)
    final = monitor.config
    monitor.close()
    return {"params": _param_bytes(ddp), "final": final, "requested": requested}


@pytest.mark.parametrize(("world", "changes"), [(2, 60), (4, 50)])
def test_random_changes_never_hang_and_ranks_stay_identical(
    receiver: ReceiverThread, world: int, changes: int
) -> None:
    results = run_ranks(
        _random_changes, world, str(receiver.socket_path), changes, timeout_s=TIMEOUT_S
    )
    assert results[0]["requested"] == list(range(1, changes + 1))
    for result in results:
        assert result["params"] == results[0]["params"], "ranks disagree on parameters"
        assert result["final"] == results[0]["final"]
    assert results[0]["final"].version == changes
    applied_by_rank = []
    for rank in range(world):
        steps = receiver.steps(rank)
        applied = [(s.step, s.applied_config) for s in steps if s.applied_config is not None]
        applied_by_rank.append(applied)
        assert len(applied) == changes
        assert all(c.effective_step == step + 1 for step, c in applied)
        # every step ran with the version applied before it
        version_at = {c.effective_step: c.version for _, c in applied}
        current = 0
        for step in steps:
            current = version_at.get(step.step, current)
            assert step.config_version == current
        # buckets are timed while a codec runs (DDP reduces in C++ under "none")
        codecs = {b.codec for s in steps for b in s.buckets}
        assert codecs == {name for name, _ in CODEC_CHOICES} - {"none"}
        by_version = {c.version: c.codec for _, c in applied}
        for step in steps:
            expected = by_version.get(step.config_version, "none")
            assert {b.codec for b in step.buckets} <= {expected}
        sampled = [b for s in steps for b in s.buckets if b.relative_error is not None]
        assert sampled, "relative error is never measured"
    assert all(a == applied_by_rank[0] for a in applied_by_rank), "ranks switched differently"


def _cap_changes_only(rank: int, world: int, change: bool) -> bytes:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    monitor = torshmon.attach(ddp, agent_socket="/nonexistent/agent.sock", sync_every=1)
    for cap in (0.002, 0.05, 0.004, 25.0, 0.001):
        if change and rank == 0:
            monitor.request_config(bucket_cap_mb=cap)
        _train(ddp, 3, rank, monitor)
    assert monitor.config is not None
    assert monitor.config.version == (5 if change else 0)
    monitor.close()
    return _param_bytes(ddp)


def test_bucket_cap_changes_keep_results_bit_identical() -> None:
    changed = run_ranks(_cap_changes_only, 2, True, timeout_s=TIMEOUT_S)
    unchanged = run_ranks(_cap_changes_only, 2, False, timeout_s=TIMEOUT_S)
    assert changed == unchanged


def _invalid_requests(rank: int, world: int, sock: str) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon
    from torshmon.probe.config import ConfigError

    ddp = DistributedDataParallel(_model())
    monitor = torshmon.attach(
        ddp, job="invalid", agent_socket=sock, flush_interval_s=0.05, sync_every=2
    )
    errors = []
    bad: list[dict[str, Any]] = [
        {"codec": "zstd"},
        {"bucket_cap_mb": 0},
        {"bucket_cap_mb": -3},
        {"bucket_cap_mb": 1e9},
        {"codec": "topk", "codec_params": {"ratio": 1.5}},
        {"codec": "topk", "codec_params": {"ratio": 0}},
        {"codec": "powersgd", "codec_params": {"rank": 0}},
        {"codec": "int8", "codec_params": {"bits": 3}},
    ]
    if rank == 0:
        for request in bad:
            try:
                monitor.request_config(**request)
            except ConfigError as exc:
                errors.append(str(exc))
    _train(ddp, 6, rank, monitor)
    if rank == 1:
        try:
            monitor.request_config(codec="fp16")
        except RuntimeError as exc:
            errors.append(str(exc))
    assert monitor.config is not None and monitor.config.version == 0
    monitor.close()
    return errors


def test_invalid_configs_are_rejected_naming_the_field_and_training_goes_on(
    receiver: ReceiverThread,
) -> None:
    errors = run_ranks(_invalid_requests, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    assert len(errors[0]) == 8
    for message, field in zip(
        errors[0],
        [
            "codec",
            "bucket_cap_mb",
            "bucket_cap_mb",
            "bucket_cap_mb",
            "ratio",
            "ratio",
            "rank",
            "bits",
        ],
        strict=True,
    ):
        assert field in message, message
    assert "zstd" in errors[0][0] and "fp16" in errors[0][0]  # names what is allowed
    assert errors[1] == ["only rank 0 takes configuration requests"]
    for rank in range(2):
        assert [s.step for s in receiver.steps(rank)] == list(range(1, 7))
        assert all(s.config_version == 0 for s in receiver.steps(rank))
    rejections = [r for s in receiver.steps(0) for r in s.config_rejections]
    assert len(rejections) == 8


def _layouts(rank: int, world: int, sock: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    monitor = torshmon.attach(ddp, job="layout", agent_socket=sock, sync_every=4, ddp_stats_every=1)
    requests: list[dict[str, float]] = [
        {"bucket_cap_mb": 0.002},
        {"bucket_cap_mb": 0.01},
        {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.002},
        {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.01},
    ]
    _train(ddp, 4, rank, monitor)
    for request in requests:
        if rank == 0:
            monitor.request_config(**request)
        _train(ddp, 4, rank, monitor)
    _train(ddp, 4, rank, monitor)
    monitor.close()


def test_bucket_layout_follows_the_config_alone(receiver: ReceiverThread) -> None:
    run_ranks(_layouts, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    steps = receiver.steps(0)
    sampled = {s.step: s.ddp.bucket_sizes_bytes for s in steps if s.ddp is not None}
    applied = [s.applied_config for s in steps if s.applied_config is not None]
    assert len(applied) == 4
    # DDP's layout in force under each config: sampled on the last step before
    # the next config takes effect (its first step runs with one bucket)
    ends = [a.effective_step - 1 for a in applied] + [steps[-1].step]
    initial, small, back, first_small, back_again = (sampled[end] for end in ends)
    assert small != initial and len(small) > len(initial)
    assert back == initial
    # DDP closes a bucket once it passes the cap: the first bucket shrinks to about
    # the first cap (one parameter past it), the others keep the full cap
    assert first_small[0] < initial[0] and first_small[0] < 2 * 0.002 * 1024 * 1024
    assert first_small[1:] != initial[1:] and max(first_small) <= max(initial)
    assert back_again == initial
    assert [a.first_bucket_cap_bytes for a in applied] == [
        int(0.002 * 1024 * 1024),
        int(0.01 * 1024 * 1024),
        int(0.002 * 1024 * 1024),
        int(0.01 * 1024 * 1024),
    ]


def _attach_close_cycles(rank: int, world: int, cycles: int) -> list[int]:
    """Threads of the process after each attach / train / close cycle."""
    import gc
    import os

    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    counts = []
    for _ in range(cycles):
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
        monitor = torshmon.attach(ddp, agent_socket="/nonexistent/agent.sock", sync_every=1)
        _train(ddp, 3, rank, monitor)
        monitor.close()
        gc.collect()
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def test_a_closed_monitor_lets_its_side_group_go() -> None:
    """Each attach creates a gloo side group (the consensus's) with a thread of its own;
    close ends it, so a process that attaches again (a notebook, a benchmark) does not
    pile them up. Before: three more threads a cycle."""
    for counts in run_ranks(_attach_close_cycles, 2, 6, timeout_s=TIMEOUT_S):
        assert counts[-1] <= counts[1], counts


def _threads_by_name() -> dict[str, int]:
    import os

    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except FileNotFoundError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


def _side_group_footprint(rank: int, world: int, fallback: bool) -> dict[str, Any]:
    """What attach adds to the process and to torch's registry of groups, whether the
    consensus still applies a change, and the name of a group the job makes after it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    if fallback:  # as where the default group has no gloo backend to build on
        c10d._get_default_store = _raise_runtime_error
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    before, registered = _threads_by_name(), len(c10d._world.pg_group_ranks)
    monitor = torshmon.attach(ddp, agent_socket="/nonexistent/agent.sock", sync_every=1)
    registered = len(c10d._world.pg_group_ranks) - registered
    # A new native thread is "python" until it names itself (gloo's do, at their start);
    # the shipper, a Python thread, stays "python". Wait for the others to say their names.
    deadline = time.monotonic() + 5.0
    while True:
        added = {
            name: count - before.get(name, 0)
            for name, count in _threads_by_name().items()
            if count != before.get(name, 0)
        }
        if added.get("python", 0) <= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if rank == 0:
        monitor.request_config(bucket_cap_mb=0.05, codec="fp16")
    _train(ddp, 3, rank, monitor)
    config = monitor.config
    job_group = dist.new_group([0, 1])
    monitor.close()
    return {
        "added": added,
        "registered": registered,
        "codec": None if config is None else config.codec,
        "job_group_name": job_group.group_name,
    }


def _raise_runtime_error() -> None:
    raise RuntimeError("no default store")


def test_on_a_gloo_job_the_side_group_shares_the_jobs_network_thread() -> None:
    """A gloo device's loop thread wakes every 10 ms: the side group builds on the
    job's own device and adds one worker thread, none of gloo's loops; it is not in
    torch's registry, so a group the job makes after attach gets the name it would get
    without torshmon ("1", the first after the world group). Where it cannot build on
    the job's device it is a new_group with a device of its own, and works the same."""
    for result in run_ranks(_side_group_footprint, 2, False, timeout_s=TIMEOUT_S):
        assert "gloo_tcp_loop" not in result["added"], result
        assert result["added"].get("pt_gloo_runloop") == 1, result
        assert result["registered"] == 0 and result["job_group_name"] == "1", result
        assert result["codec"] == "fp16"
    for result in run_ranks(_side_group_footprint, 2, True, timeout_s=TIMEOUT_S):
        assert result["added"].get("gloo_tcp_loop") == 1, result
        assert result["registered"] == 1 and result["job_group_name"] == "2", result
        assert result["codec"] == "fp16"
