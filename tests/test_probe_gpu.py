"""The probe's GPU memory readings: the allocator's counters, into the step record."""

from __future__ import annotations

import pytest
import torch

from torshmon.probe import gpu
from torshmon.probe.events import RawStep, StepEvents
from torshmon.probe.summary import summarize_step


def _raw(gpu_memory: tuple[int, int, int] | None) -> RawStep:
    return RawStep(
        step=1,
        start_ns=0,
        end_ns=10**7,
        end_unix_ns=10**18,
        batch_size=None,
        loss=None,
        events=StepEvents(),
        ddp_logging=None,
        gpu_memory=gpu_memory,
    )


def test_off_cuda_there_is_no_reading_and_the_record_says_none() -> None:
    assert not torch.cuda.is_initialized()  # this CPU build never initialises CUDA
    assert gpu.cuda_memory() is None
    record = summarize_step(_raw(None))
    assert (record.gpu_memory_allocated_bytes, record.gpu_memory_reserved_bytes) == (None, None)
    assert record.gpu_memory_peak_bytes is None


def test_on_cuda_the_current_devices_counters_reach_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []

    def counter(value: int):  # type: ignore[no-untyped-def]
        def read(device: int) -> int:
            asked.append(device)
            return value

        return read

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "memory_allocated", counter(5 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", counter(7 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", counter(6 * 2**30))
    reading = gpu.cuda_memory()
    assert reading == (5 * 2**30, 7 * 2**30, 6 * 2**30) and asked == [3, 3, 3]
    record = summarize_step(_raw(reading))
    assert record.gpu_memory_allocated_bytes == 5 * 2**30
    assert record.gpu_memory_reserved_bytes == 7 * 2**30
    assert record.gpu_memory_peak_bytes == 6 * 2**30


def test_a_cuda_error_while_reading_is_no_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", broken)
    assert gpu.cuda_memory() is None
