"""Fresh virtual environments with torshmon installed from its wheel, for the install tests.

Each venv is made without pip (``python -m venv --without-pip``); this interpreter's pip
installs into it (``pip --python``), without compiling bytecode: that halves the time of
an install, which is mostly unpacking numpy, scipy and the rest. Dependencies come from
the package index (or pip's cache) as they would for a user. Where pip cannot install
them the test fails under ``CI=true`` and is skipped elsewhere, saying why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

#: How long a daemon may take to answer /healthz; its first start imports scipy and
#: optuna, which takes seconds on a loaded machine.
START_TIMEOUT_S = 120


def clean_env() -> dict[str, str]:
    """This environment less ``PYTHON*`` (the tests' ``PYTHONPATH`` holds the checkout, which
    would pass for an installed torshmon) and ``TORSHMON_*`` settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TORSHMON_"))}


def build_wheel(dest: Path) -> Path:
    """The wheel of this checkout, built into ``dest``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
         "--no-deps", "--no-build-isolation", "-w", str(dest), str(REPO_ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dest.glob("torshmon-*.whl")
    return wheel


def make_venv(path: Path) -> Path:
    """A new, empty venv at ``path`` (no system site-packages); returns its ``bin``."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return path / "bin"


def pip_install(bin_dir: Path, *requirements: str) -> None:
    """``pip install`` into the venv of ``bin_dir``; fails (CI) or skips if pip cannot."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q",
         "--python", str(bin_dir / "python"), "install", "--no-compile", *requirements],
        env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode == 0:
        return
    errors = [line for line in done.stderr.splitlines() if "is ignored" not in line]
    message = f"pip install {' '.join(requirements)} failed:\n" + "\n".join(errors[-20:])
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def run(
    bin_dir: Path, cwd: Path, *argv: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A command of the venv (``torshmon``, ``python``) run in ``cwd``, outside the source tree."""
    return subprocess.run(
        [str(bin_dir / argv[0]), *argv[1:]],
        cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


@contextmanager
def daemon(
    bin_dir: Path, cwd: Path, argv: list[str], ready: Callable[[], bool]
) -> Iterator[subprocess.Popen[str]]:
    """A ``torshmon`` daemon of the venv, started in ``cwd``; yields once ``ready()`` holds
    (connection errors count as not yet), and stops it with SIGTERM, requiring exit 0."""
    log = cwd / f"{argv[0]}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(bin_dir / "torshmon"), *argv],
            cwd=cwd,
            env=clean_env(),
            stdout=out,
            stderr=out,
            text=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"torshmon {argv[0]} exited: {log.read_text()}"
            try:
                if ready():
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"torshmon {argv[0]} not ready: {log.read_text()}"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, f"torshmon {argv[0]} exited {proc.returncode}: {log.read_text()}"
