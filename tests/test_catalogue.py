"""The torch-free catalogue: codec specs, and who imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torshmon.catalogue.codecs import (
    CODEC_SPECS,
    MAX_BUCKET_CAP_MB,
    MIN_BUCKET_CAP_MB,
    ConfigError,
    validate_bucket_cap_mb,
    validate_codec,
)

ROOT = Path(__file__).resolve().parent.parent

# -- torch stays out of the daemons ---------------------------------------------------------

_NO_TORCH = """
import importlib, pkgutil, sys
import torshmon.agent, torshmon.aggregator, torshmon.catalogue, torshmon.cli
for package in (torshmon.agent, torshmon.aggregator, torshmon.catalogue):
    for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
import torshmon.probe, torshmon.probe.config
torshmon.probe.CommConfig, torshmon.probe.ConfigError
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(",".join(loaded))
"""


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_daemons_the_cli_and_the_catalogue_do_not_import_torch() -> None:
    assert _run(_NO_TORCH) == ""


def test_the_probe_loads_torch_when_its_monitor_is_used() -> None:
    code = "import sys, torshmon.probe\ntorshmon.probe.attach\nprint('torch' in sys.modules)"
    assert _run(code) == "True"


# -- codecs ---------------------------------------------------------------------------------


def test_codec_params_get_their_defaults_and_bounds() -> None:
    assert {name: spec.defaults() for name, spec in CODEC_SPECS.items()} == {
        "none": {},
        "fp16": {},
        "bf16": {},
        "powersgd": {"rank": 4},
        "topk": {"ratio": 0.01},
        "int8": {"bits": 8},
    }
    assert validate_codec("topk", {"ratio": 1}) == {"ratio": 1.0}
    with pytest.raises(ConfigError, match=r"'ratio' must be a number in \(0, 1\], got 0"):
        validate_codec("topk", {"ratio": 0})
    with pytest.raises(ConfigError, match="codec must be one of bf16, fp16, int8, none"):
        validate_codec(3, {})


def test_bucket_caps_are_bounded_in_mib() -> None:
    assert validate_bucket_cap_mb(MIN_BUCKET_CAP_MB) == MIN_BUCKET_CAP_MB
    assert validate_bucket_cap_mb(int(MAX_BUCKET_CAP_MB)) == MAX_BUCKET_CAP_MB
    with pytest.raises(ConfigError, match="first_bucket_cap_mb must be between"):
        validate_bucket_cap_mb(MAX_BUCKET_CAP_MB * 2, "first_bucket_cap_mb")
    with pytest.raises(ConfigError, match="must be a number of MiB, got True"):
        validate_bucket_cap_mb(True)
