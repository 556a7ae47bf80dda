"""What the probe reads of the rank's GPU: the CUDA caching allocator's counters.

``cuda_memory()`` is called on the training thread at each step's end. It reads the
allocator's statistics (host memory, no synchronisation, no kernel launch), so it
costs microseconds; on a CPU job (CUDA never initialised) it is one check.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CudaMemory", "cuda_memory"]


class CudaMemory(NamedTuple):
    """Bytes on the rank's current CUDA device: held by tensors, reserved by the
    caching allocator, and the peak held since the process started or the job last
    called ``torch.cuda.reset_peak_memory_stats`` (the probe never resets it: the job's
    own peak readings stay its own)."""

    allocated_bytes: int
    reserved_bytes: int
    peak_bytes: int


def cuda_memory() -> CudaMemory | None:
    """The current device's allocator counters; None where this process has not
    initialised CUDA (a CPU job, or a CUDA job before its first CUDA call)."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return None
    try:
        device = cuda.current_device()
        return CudaMemory(
            allocated_bytes=int(cuda.memory_allocated(device)),
            reserved_bytes=int(cuda.memory_reserved(device)),
            peak_bytes=int(cuda.max_memory_allocated(device)),
        )
    except RuntimeError:  # a CUDA error is the job's to see, not the probe's to raise
        return None
