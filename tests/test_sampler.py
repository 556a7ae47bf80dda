from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import psutil  # type: ignore[import-untyped, unused-ignore]
import pytest

from torshmon.agent.sampler import GpuUnavailableError, NodeSampler
from torshmon.wire import NodeSample


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _busy_wait(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _assert_ratios(sample: NodeSample) -> None:
    for value in (
        sample.cpu_utilization_ratio,
        sample.memory_utilization_ratio,
        sample.io_wait_ratio,
    ):
        assert 0.0 <= value <= 1.0


def test_two_samples_have_ratios_in_range_and_growing_counters() -> None:
    sampler = NodeSampler("node-a", gpu=False)
    ranks = [("job", 0, os.getpid())]
    first = sampler.sample(ranks)
    _busy_wait(0.2)
    second = sampler.sample(ranks)

    for sample in (first, second):
        assert sample.node == "node-a"
        _assert_ratios(sample)
        assert sample.memory_used_bytes > 0
    assert second.cpu_utilization_ratio > 0.0  # this test kept a core busy
    assert second.ts_unix_ns >= first.ts_unix_ns
    assert second.net_rx_bytes_total >= first.net_rx_bytes_total
    assert second.net_tx_bytes_total >= first.net_tx_bytes_total
    assert second.disk_read_bytes_total >= first.disk_read_bytes_total
    assert second.disk_write_bytes_total >= first.disk_write_bytes_total


def test_rss_of_own_process_and_dead_pid_skipped() -> None:
    sampler = NodeSampler(gpu=False)
    dead = _dead_pid()
    sample = sampler.sample([("job", 0, os.getpid()), ("job", 1, dead)])
    assert [(p.job, p.rank, p.pid) for p in sample.ranks] == [("job", 0, os.getpid())]
    assert sample.ranks[0].rss_bytes > 0
    # Cached process objects are reused, and a rank that is no longer served is forgotten.
    again = sampler.sample([("job", 0, os.getpid())])
    assert again.ranks[0].rss_bytes > 0
    assert sampler.sample([]).ranks == []


def test_rank_whose_process_exits_between_samples_is_dropped() -> None:
    sampler = NodeSampler(gpu=False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert [p.pid for p in sampler.sample([("job", 3, child.pid)]).ranks] == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert sampler.sample([("job", 3, child.pid)]).ranks == []


def test_gpu_none_without_nvml_reports_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails even where installed
    sampler = NodeSampler(gpu=None)
    assert not sampler.gpu_enabled
    assert sampler.sample([]).gpus == []
    sampler.close()
    sampler.close()


def test_gpu_true_without_nvml_raises_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuUnavailableError, match=r"gpu=True.*nvidia-ml-py"):
        NodeSampler(gpu=True)


class _FakeNvmlError(Exception):
    pass


@dataclass
class _Utilization:
    gpu: int


@dataclass
class _Memory:
    used: int
    total: int


def _fake_nvml(*, init_fails: bool = False) -> tuple[types.ModuleType, dict[str, int]]:
    """A stand-in pynvml with two GPUs, and its counters (``shutdown``, ``broken``)."""
    state = {"shutdown": 0, "broken": 0}

    def init() -> None:
        if init_fails:
            raise _FakeNvmlError("driver not loaded")

    def count() -> int:
        if state["broken"]:
            raise _FakeNvmlError("GPU is lost")
        return 2

    def shutdown() -> None:
        state["shutdown"] += 1

    module = types.ModuleType("pynvml")
    module.__dict__.update(
        NVMLError=_FakeNvmlError,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=count,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUtilizationRates=lambda handle: _Utilization(gpu=[55, 100][handle]),
        nvmlDeviceGetMemoryInfo=lambda handle: _Memory(used=(handle + 1) * 2**30, total=2**34),
        nvmlDeviceGetUUID=lambda handle: f"GPU-{handle}".encode(),
        # This test process computes on GPU 1.
        nvmlDeviceGetComputeRunningProcesses=lambda handle: (
            [types.SimpleNamespace(pid=os.getpid())] if handle == 1 else []
        ),
    )
    return module, state


def test_gpus_read_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, state = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NodeSampler(gpu=True)
    gpus = sampler.sample([]).gpus
    assert [(g.index, g.utilization_ratio, g.memory_used_bytes) for g in gpus] == [
        (0, 0.55, 2**30),
        (1, 1.0, 2**31),
    ]
    assert all(g.memory_total_bytes == 2**34 for g in gpus)
    assert [g.uuid for g in gpus] == ["GPU-0", "GPU-1"]
    (process,) = sampler.sample([("job", 0, os.getpid())]).ranks
    assert process.gpu == 1
    state["broken"] = 1
    assert sampler.sample([]).gpus == []  # a runtime NVML error means no GPUs, not a crash
    sampler.close()
    sampler.close()
    assert state["shutdown"] == 1


def test_nvml_init_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(init_fails=True)[0])
    assert NodeSampler(gpu=None).sample([]).gpus == []
    with pytest.raises(GpuUnavailableError, match="driver not loaded"):
        NodeSampler(gpu=True)


def test_gpu_false_never_loads_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml()[0])
    assert NodeSampler(gpu=False).sample([]).gpus == []


def test_default_sampler_on_this_machine() -> None:
    sampler = NodeSampler()
    sample = sampler.sample([])
    _assert_ratios(sample)
    if importlib.util.find_spec("pynvml") is None:
        assert not sampler.gpu_enabled
        assert sample.gpus == []
    sampler.close()


def test_network_is_sampled_per_interface_without_loopback() -> None:
    sample = NodeSampler(gpu=False).sample([])
    names = [i.name for i in sample.interfaces]
    loopback = {
        name
        for name, stats in psutil.net_if_stats().items()
        if "loopback" in stats.flags.split(",")
    }
    assert "lo" in loopback  # this machine has one, else the test shows nothing
    assert not loopback & set(names)
    assert set(names) == set(psutil.net_io_counters(pernic=True)) - loopback
    assert sample.net_rx_bytes_total == sum(i.rx_bytes_total for i in sample.interfaces)
    assert sample.net_tx_bytes_total == sum(i.tx_bytes_total for i in sample.interfaces)


def test_rank_processes_carry_their_cpu_time() -> None:
    (process,) = NodeSampler(gpu=False).sample([("job", 0, os.getpid())]).ranks
    assert process.cpu_s_total > 0.0  # this interpreter has run for a while
    assert process.gpu is None  # no NVML: unknown


def test_gpu_health_power_temperature_throttle_ecc_and_xids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU 0 reports everything; GPU 1 has no ECC and no power reading (NVML says not
    supported), which costs only those fields. Two Xid events queued on GPU 1 (79: fallen
    off the bus) are counted at the next sample and not again."""
    fake, _state = _fake_nvml()
    queued: list[types.SimpleNamespace] = []

    def not_on_gpu1(value: int) -> Callable[..., int]:
        def read(handle: int, *_args: int) -> int:
            if handle == 1:
                raise _FakeNvmlError("Not Supported")
            return value

        return read

    def wait(_events: object, timeout_ms: int) -> types.SimpleNamespace:
        assert timeout_ms == 0  # sampling never waits for events
        if not queued:
            raise _FakeNvmlError("Timeout")
        return queued.pop(0)

    registered: list[int] = []
    fake.__dict__.update(
        nvmlDeviceGetPowerUsage=not_on_gpu1(251_500),  # milliwatts
        nvmlDeviceGetTemperature=lambda handle, sensor: [61, 87][handle],
        nvmlDeviceGetCurrentClocksEventReasons=lambda handle: [0, 0x40 | 0x4][handle],
        nvmlDeviceGetTotalEccErrors=not_on_gpu1(3),
        nvmlEventSetCreate=lambda: "events",
        nvmlEventTypeXidCriticalError=8,
        nvmlDeviceRegisterEvents=lambda handle, kind, events: registered.append(handle),
        nvmlEventSetWait_v2=wait,
        nvmlDeviceGetIndex=lambda device: device,
        nvmlEventSetFree=lambda events: None,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NodeSampler(gpu=True)
    assert registered == [0, 1]
    queued += [types.SimpleNamespace(device=1, eventData=79)] * 2
    gpu0, gpu1 = sampler.sample([]).gpus
    assert (gpu0.power_watts, gpu0.temperature_celsius, gpu0.throttle_reasons) == (251.5, 61.0, 0)
    assert (gpu0.ecc_uncorrected_errors_total, gpu0.xid_errors_total, gpu0.last_xid) == (3, 0, 0)
    assert (gpu1.power_watts, gpu1.temperature_celsius, gpu1.throttle_reasons) == (None, 87.0, 0x44)
    assert (gpu1.ecc_uncorrected_errors_total, gpu1.xid_errors_total, gpu1.last_xid) == (
        None,
        2,
        79,
    )
    assert sampler.sample([]).gpus[1].xid_errors_total == 2  # counted once
    sampler.close()
