"""Samples the node the agent runs on: CPU, memory, network, disk, training processes, GPUs.

psutil reads the operating system's counters; NVML (the ``pynvml`` module of the
``nvidia-ml-py`` package, the ``gpu`` extra) reads the GPUs when it is present.
A sample is cheap (a few ``/proc`` reads plus one per training process), so the
agent can take one every second.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

# No stubs unless types-psutil is installed; either way this line checks clean.
import psutil  # type: ignore[import-untyped, unused-ignore]

from torshmon.ratelog import LogLimiter
from torshmon.wire import GpuSample, InterfaceSample, NodeSample, RankProcess

log = logging.getLogger(__name__)

__all__ = ["GpuUnavailableError", "NodeSampler"]


class GpuUnavailableError(RuntimeError):
    """GPU sampling was required (``gpu=True``) but NVML cannot be used."""


class _CpuTimes(NamedTuple):
    total_s: float
    idle_s: float
    iowait_s: float


class NodeSampler:
    """Takes NodeSample snapshots of this node; not thread-safe (one caller, the agent).

    ``gpu``: None uses NVML when it loads and reports no GPUs otherwise (logged once
    at INFO); True requires NVML and raises GpuUnavailableError if it cannot load;
    False never touches NVML. Call close() to shut NVML down.
    """

    def __init__(self, node: str | None = None, *, gpu: bool | None = None) -> None:
        self.node = node if node is not None else socket.gethostname()
        # The first sample's ratios are then averages since boot, not since now.
        self._last_cpu = _CpuTimes(0.0, 0.0, 0.0)
        self._cpu_ratio = 0.0
        self._iowait_ratio = 0.0
        self._processes: dict[int, psutil.Process] = {}
        self._nvml: Any = None
        self._gpu_error_log = LogLimiter()  # once
        self._xid_log = LogLimiter(interval_s=60.0)
        self._xid_events: Any = None
        #: GPU index -> (Xid events seen, the latest Xid)
        self._xids: dict[int, tuple[int, int]] = {}
        if gpu is not False:
            self._nvml = _load_nvml(required=gpu is True)
            self._register_xids()

    @property
    def gpu_enabled(self) -> bool:
        """Whether NVML loaded and GPUs are read."""
        return self._nvml is not None

    def sample(self, ranks: Sequence[tuple[str, int, int]]) -> NodeSample:
        """Snapshot the node and the given (job, rank, pid) processes; dead pids are skipped.

        CPU and I/O-wait ratios cover the interval since the previous call.
        """
        self._update_cpu()
        self._drain_xids()
        memory = psutil.virtual_memory()
        interfaces = _interfaces()
        disk_read, disk_write = _disk_bytes()
        return NodeSample(
            ts_unix_ns=time.time_ns(),
            node=self.node,
            cpu_utilization_ratio=self._cpu_ratio,
            memory_utilization_ratio=_ratio(memory.used, memory.total),
            memory_used_bytes=int(memory.used),
            io_wait_ratio=self._iowait_ratio,
            net_rx_bytes_total=sum(i.rx_bytes_total for i in interfaces),
            net_tx_bytes_total=sum(i.tx_bytes_total for i in interfaces),
            disk_read_bytes_total=disk_read,
            disk_write_bytes_total=disk_write,
            gpus=self._sample_gpus(),
            ranks=self._sample_ranks(ranks),
            interfaces=interfaces,
        )

    def close(self) -> None:
        """Release NVML; safe to call twice. The sampler then reports no GPUs."""
        nvml, self._nvml = self._nvml, None
        events, self._xid_events = self._xid_events, None
        if nvml is not None:
            if events is not None:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlEventSetFree(events)
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.info("NVML shutdown failed: %s", exc)
        self._processes.clear()

    def _update_cpu(self) -> None:
        now = _read_cpu_times()
        total = now.total_s - self._last_cpu.total_s
        if total <= 0.0:
            # Called again within one clock tick: keep the previous interval's ratios.
            return
        idle = now.idle_s - self._last_cpu.idle_s
        iowait = now.iowait_s - self._last_cpu.iowait_s
        self._cpu_ratio = _ratio(total - idle - iowait, total)
        self._iowait_ratio = _ratio(iowait, total)
        self._last_cpu = now

    def _sample_ranks(self, ranks: Sequence[tuple[str, int, int]]) -> list[RankProcess]:
        samples: list[RankProcess] = []
        live: dict[int, psutil.Process] = {}
        gpus = self._gpu_by_pid() if ranks else {}
        for job, rank, pid in ranks:
            process = live.get(pid) or self._processes.get(pid)
            try:
                # is_running() also catches a pid reused by an unrelated process.
                if process is None or not process.is_running():
                    process = psutil.Process(pid)
                rss = int(process.memory_info().rss)
                cpu = process.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            live[pid] = process
            samples.append(
                RankProcess(
                    job=job,
                    rank=rank,
                    pid=pid,
                    rss_bytes=rss,
                    cpu_s_total=cpu.user + cpu.system,
                    gpu=gpus.get(pid),
                )
            )
        # Forget processes no longer served, so the cache stays as small as the rank list.
        self._processes = live
        return samples

    def _sample_gpus(self) -> list[GpuSample]:
        nvml = self._nvml
        if nvml is None:
            return []
        try:
            gpus = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(
                    GpuSample(
                        index=index,
                        utilization_ratio=_ratio(float(utilization.gpu), 100.0),
                        memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total),
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        **self._gpu_health(nvml, index, handle),
                    )
                )
        except nvml.NVMLError as exc:
            if self._gpu_error_log.allow():
                log.info("reading GPUs through NVML failed, reporting none: %s", exc)
            return []
        return gpus

    def _gpu_health(self, nvml: Any, index: int, handle: Any) -> dict[str, Any]:
        """Power, temperature, throttle reasons, ECC and Xid errors of one GPU: each
        read on its own, so one NVML does not support (no ECC on a consumer card, no
        power reading in some VMs) costs only that field."""
        milliwatts = _optional(nvml, ("nvmlDeviceGetPowerUsage",), handle)
        temperature = _optional(
            nvml, ("nvmlDeviceGetTemperature",), handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        )
        reasons = _optional(
            nvml,
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            handle,
        )
        ecc = _optional(
            nvml,
            ("nvmlDeviceGetTotalEccErrors",),
            handle,
            getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            getattr(nvml, "NVML_VOLATILE_ECC", 0),
        )
        xid_count, last_xid = self._xids.get(index, (0, 0))
        return {
            "power_watts": None if milliwatts is None else float(milliwatts) / 1000.0,
            "temperature_celsius": None if temperature is None else float(temperature),
            "throttle_reasons": int(reasons or 0),
            "ecc_uncorrected_errors_total": None if ecc is None else int(ecc),
            "xid_errors_total": xid_count,
            "last_xid": last_xid,
        }

    def _drain_xids(self) -> None:
        """Count the Xid (critical error) events NVML queued since the last sample, per
        GPU. Never waits: a zero timeout returns at once when none is queued."""
        nvml, events = self._nvml, self._xid_events
        if nvml is None or events is None:
            return
        for _ in range(64):  # a bound: a GPU in an error storm must not stall sampling
            try:
                event = nvml.nvmlEventSetWait_v2(events, 0)
            except nvml.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing queued (or the set broke)
            try:
                index = int(nvml.nvmlDeviceGetIndex(event.device))
            except nvml.NVMLError:
                continue
            count, _last = self._xids.get(index, (0, 0))
            self._xids[index] = (count + 1, int(event.eventData))
            if self._xid_log.allow():
                log.warning("GPU %d reported Xid %d", index, int(event.eventData))

    def _register_xids(self) -> None:
        """Ask NVML for Xid events of every GPU; without support (or rights) none are
        counted and the totals stay 0."""
        nvml = self._nvml
        if nvml is None:
            return
        try:
            events = nvml.nvmlEventSetCreate()
            kind = nvml.nvmlEventTypeXidCriticalError
            for index in range(nvml.nvmlDeviceGetCount()):
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index), kind, events)
        except (nvml.NVMLError, AttributeError) as exc:
            log.info("NVML Xid events are not available, Xid errors are not counted: %s", exc)
            return
        self._xid_events = events

    def _gpu_by_pid(self) -> dict[int, int]:
        """The GPU (NVML index) each process computing on one runs on; {} without NVML."""
        nvml = self._nvml
        if nvml is None:
            return {}
        by_pid: dict[int, int] = {}
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    by_pid.setdefault(int(process.pid), index)
        except nvml.NVMLError as exc:
            if self._gpu_error_log.allow():
                log.info("reading GPU processes through NVML failed: %s", exc)
        return by_pid


def _optional(nvml: Any, names: tuple[str, ...], *args: Any) -> Any:
    """The first of the NVML functions ``names`` this pynvml has, called with ``args``
    (the newer name first); None where none exists or NVML says it cannot (not
    supported, no permission)."""
    for name in names:
        read = getattr(nvml, name, None)
        if read is not None:
            try:
                return read(*args)
            except nvml.NVMLError:
                return None
    return None


def _text(value: str | bytes) -> str:
    """NVML strings: bytes from older pynvml releases, str from newer ones."""
    return value.decode() if isinstance(value, bytes) else value


def _load_nvml(*, required: bool) -> Any:
    """The initialised pynvml module, or None (logged at INFO) when it cannot be used."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as exc:
        reason = f"pynvml is not installed ({exc}); install torshmon[gpu] (nvidia-ml-py)"
        return _nvml_absent(reason, required=required)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return _nvml_absent(f"NVML failed to initialise: {exc}", required=required)
    return nvml


def _nvml_absent(reason: str, *, required: bool) -> None:
    if required:
        raise GpuUnavailableError(f"gpu=True but GPUs cannot be read: {reason}")
    log.info("no GPU metrics: %s", reason)
    return None


def _read_cpu_times() -> _CpuTimes:
    times = psutil.cpu_times()
    total = sum(times)
    if sys.platform.startswith("linux"):
        # Linux already counts guest time inside user and nice (as psutil.cpu_percent does).
        total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    return _CpuTimes(total, times.idle, getattr(times, "iowait", 0.0))


def _interfaces() -> list[InterfaceSample]:
    """Byte counters of every network interface but loopback ones (``lo`` and any whose
    flags say loopback): traffic between a node's own processes is not network."""
    counters = psutil.net_io_counters(pernic=True)
    stats = psutil.net_if_stats()
    return [
        InterfaceSample(
            name=name, rx_bytes_total=int(c.bytes_recv), tx_bytes_total=int(c.bytes_sent)
        )
        for name, c in sorted(counters.items())
        if not _loopback(name, stats.get(name))
    ]


def _loopback(name: str, stats: Any) -> bool:
    if name == "lo":
        return True
    # psutil's flags ("up,loopback,running") are a string on Linux, BSD and macOS.
    flags = getattr(stats, "flags", "") if stats is not None else ""
    return "loopback" in flags.split(",")


def _disk_bytes() -> tuple[int, int]:
    # None where the kernel exposes no disk statistics (some containers).
    counters = psutil.disk_io_counters()
    if counters is None:
        return 0, 0
    return int(counters.read_bytes), int(counters.write_bytes)


def _ratio(part: float, whole: float) -> float:
    """part / whole within [0, 1]; counter deltas can be a tick off, so the ends are pinned."""
    if whole <= 0.0 or not math.isfinite(part):
        return 0.0
    return min(1.0, max(0.0, part / whole))
