"""``torshmon agent`` as a real process: its files are its own, its labels are bounded;
and a real rank whose agent socket is someone else's trains on."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import foreign_agent as foreign
from tests.integration import wire_factory as wf
from torshmon.launch import free_port, run_ranks
from torshmon.wire import FRAME_HEADER, decode_ack, encode_frame

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="hands folders to another uid"),
]

NOBODY = foreign.NOBODY


def _agent_args(port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torshmon.cli", "agent",
        "--metrics-port", str(port),
        "--sample-interval-s", "0.5",
        "--node", "test-node",
        *extra,
    ]  # fmt: skip


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "TMPDIR")}
    env.pop("TORSHMON_AGENT_SOCKET", None)
    env.pop("TORSHMON_AGENT_SPOOL", None)
    return {**env, **values}


@pytest.mark.parametrize(
    ("owner", "mode"), [(NOBODY, 0o700), (0, 0o777), (0, 0o750)], ids=["nobody", "0777", "0750"]
)
def test_a_runtime_folder_not_the_agents_alone_is_refused_in_one_line(
    tmp_path: Path, owner: int, mode: int
) -> None:
    folder = tmp_path / "torshmon"
    folder.mkdir()
    folder.chmod(mode)
    os.chown(folder, owner, owner)
    done = subprocess.run(
        _agent_args(free_port()),
        env=_env(XDG_RUNTIME_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"torshmon agent: cannot start: runtime folder {folder} ")
    assert f"uid {owner} with mode {mode:04o}" in line
    assert not (folder / "agent.sock").exists() and not (folder / "agent-spool.db").exists()


def test_a_per_user_temp_folder_made_0777_by_another_user_is_refused(tmp_path: Path) -> None:
    """The case observed: no XDG_RUNTIME_DIR, and /tmp/torshmon-<uid> made by someone else."""
    folder = tmp_path / f"torshmon-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    os.chown(folder, NOBODY, NOBODY)
    done = subprocess.run(
        _agent_args(free_port()),
        env=_env(TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"runtime folder {folder} is owned by uid {NOBODY} with mode 0777" in done.stderr
    assert os.listdir(folder) == []


def test_an_explicit_socket_folder_others_may_write_to_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    done = subprocess.run(
        _agent_args(free_port(), "--socket", str(folder / "agent.sock")),
        env=_env(XDG_RUNTIME_DIR=str(tmp_path / "xdg")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"socket folder {folder} is owned by uid 0 with mode 0777" in done.stderr


@pytest.fixture
def agent_umask_000(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A real agent started under umask 000 with a runtime folder it has to make
    (parents included); yields the folder and the agent's /metrics port."""
    port = free_port()
    xdg = tmp_path / "run" / "user"
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        _agent_args(port), env=_env(XDG_RUNTIME_DIR=str(xdg)), stdout=log, stderr=log, umask=0
    )
    folder = xdg / "torshmon"
    try:
        deadline = time.monotonic() + 30
        while not (folder / "agent.sock").exists():
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, "the agent did not come up"
            time.sleep(0.1)
        _wait_for_metrics(port)
        yield folder, port
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log.close()


def _wait_for_metrics(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            _scrape(port)
            return
        except OSError:
            assert time.monotonic() < deadline, "no /metrics"
            time.sleep(0.1)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_socket_and_spool_are_private_under_umask_000(
    agent_umask_000: tuple[Path, int],
) -> None:
    folder, _ = agent_umask_000
    for made in (folder.parent.parent, folder.parent, folder):
        assert _mode(made) == 0o700, made
    assert _mode(folder / "agent.sock") == 0o600
    spool_files = sorted(p.name for p in folder.iterdir() if p.name.startswith("agent-spool"))
    assert "agent-spool.db-wal" in spool_files  # written by the node sampler
    for name in spool_files:
        assert _mode(folder / name) == 0o600, name


def test_2000_distinct_ops_and_groups_leave_the_agents_metrics_small(
    agent_umask_000: tuple[Path, int],
) -> None:
    folder, port = agent_umask_000
    hello = wf.hello("wide", 0, 1)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(folder / "agent.sock"))
        sock.sendall(encode_frame(hello))
        sock.sendall(encode_frame(wf.batch(hello, 1, [wf.step_naming(1, 2000)])))
        header = _recv_exact(sock, FRAME_HEADER.size)
        assert decode_ack(_recv_exact(sock, FRAME_HEADER.unpack(header)[0])).seq == 1
    text = _scrape(port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # Collectives are the aggregator's series (capped there); the agent names no op or pg.
    assert not any(name.startswith("torshmon_collective") for name in families)
    assert not any("op" in s.labels for f in families.values() for s in f.samples)
    assert len(text) < 256 * 1024  # 4.4 MiB before the cap


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the agent closed the connection"
        data += chunk
    return data


def _train(rank: int, world: int, sock: str, steps: int) -> tuple[int, int]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    monitor = torshmon.attach(
        model, job="refused", agent_socket=sock, flush_interval_s=0.05, max_buffered_steps=10
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    for _ in range(steps):
        with monitor.step(batch_size=4):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            time.sleep(0.01)
        done += 1
    monitor.close()
    return done, monitor.dropped_records_total


def test_a_rank_whose_agent_socket_is_another_users_trains_on_and_sends_nothing() -> None:
    with foreign.foreign_agent() as (path, agent):
        ((done, dropped),) = run_ranks(_train, 1, str(path), 100, timeout_s=180)
        assert agent.received() == 0
    assert done == 100
    assert dropped >= 90  # as with no agent: 10 buffered at most, the rest dropped and counted


def test_a_socket_shared_with_a_group_is_0660_in_it(tmp_path: Path) -> None:
    """As the systemd unit runs it: a folder the group may enter, the socket in the group."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o750)
    port = free_port()
    args = _agent_args(port, "--socket", str(folder / "agent.sock"), "--socket-group", "65534")
    args += ["--spool", str(tmp_path / "spool" / "agent-spool.db")]
    proc = subprocess.Popen(args, env=_env(), stderr=subprocess.PIPE, umask=0)
    try:
        _wait_for_metrics(port)
        info = os.stat(folder / "agent.sock")
        assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o660, NOBODY)
        assert _mode(tmp_path / "spool") == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_an_unknown_socket_group_is_a_usage_error() -> None:
    done = subprocess.run(
        _agent_args(free_port(), "--socket-group", "no-such-group-here"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "torshmon agent: socket_group 'no-such-group-here' is no group on this host\n"
    )


def test_the_agent_takes_its_settings_from_a_config_file(tmp_path: Path) -> None:
    """Flags win over the file; durations and sizes are written the human way."""
    port = free_port()
    (tmp_path / "agent.yaml").write_text(
        f"socket_path: {tmp_path / 'run' / 'agent.sock'}\n"
        f"spool_path: {tmp_path / 'spool' / 'agent-spool.db'}\n"
        "metrics_port: 1\n"  # the flag's port wins
        "sample_interval_s: 250ms\n"
        "spool_max_bytes: 16MiB\n"
        "node: from-config\n"
    )
    args = _agent_args(port, "--config", str(tmp_path / "agent.yaml"))
    args.remove("--node")
    args.remove("test-node")
    proc = subprocess.Popen(args, env=_env(), stderr=subprocess.PIPE)
    try:
        _wait_for_metrics(port)
        assert (tmp_path / "run" / "agent.sock").is_socket()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b'node="from-config"' in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
