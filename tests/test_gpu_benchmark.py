"""``benchmarks/gpu.py``'s logic, run as it runs on GPUs but on CPU gloo (no kernel
comparison there): every profiled step's record reaches the receiver, and the overhead
arms (bare, probe, lean probe) each give a ratio."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.benchmark_loader import BENCHMARKS


def test_the_gpu_check_runs_its_logic_on_cpu_gloo() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--quick", "--backend", "gloo",
         "--device", "cpu", "--world-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["device"] == "cpu"
    assert summary["profiled_steps_missing"] == 0
    assert summary["collective_clock"] == ["host"]  # gloo: the host's clock
    assert summary["torshmon_collective_s"] > 0
    for key in ("overhead_ratio_median", "lean_overhead_ratio_median"):
        assert 0.5 < summary[key] < 2.0, summary
    assert len(summary["overhead_ratio_per_rank"]) == 2
    assert "lean probe/bare" in done.stdout
