"""The ingest process (torshmon.aggregator.writer): the aggregator stores in a child
process, a crashed child costs a 503 and a retry, not data, and it stops with the
aggregator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread, count
from torshmon.aggregator.service import _other_process_can_open
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.aggregator.writer import ProcessIngest, ThreadIngest

pytestmark = pytest.mark.integration


def _settings(url: str, **overrides: object) -> AggregatorSettings:
    values: dict[str, object] = {
        "port": 0,
        "db_url": url,
        "token": "t",
        "aggregator_id": "agg-test",
        "eval_interval_s": 0.1,
    }
    values.update(overrides)
    return AggregatorSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    with AggregatorThread(_settings(f"sqlite:///{tmp_path / 'history.db'}")) as thread:
        yield thread


def _body(agent: str, seq: int, step: int) -> bytes:
    hello = wf.hello("j", 0, 1)
    messages = [hello] if seq == 1 else []
    return wf.ingest_body(
        agent, [(seq, wf.record(*messages, wf.batch(hello, seq, [wf.step(step)])))]
    )


def _ingest_pid(agg: AggregatorThread) -> int:
    ingest = agg.aggregator.ingest
    assert isinstance(ingest, ProcessIngest)
    assert ingest.pid is not None
    return ingest.pid


def test_a_file_database_is_stored_by_a_child_process(agg: AggregatorThread) -> None:
    pid = _ingest_pid(agg)
    assert pid != os.getpid()
    child = psutil.Process(pid)
    assert child.is_running()
    status, reply = agg.post_ingest(_body("a", 1, 1))
    assert status == 200 and reply["acked_seq"] == 1, reply
    assert count(agg.settings.db_url, "steps") == 1
    # The live state saw it: the rank's step, from the summary the child sent back.
    rank = agg.aggregator.live.jobs["j"].ranks[0]
    assert rank.last_step == 1 and rank.steps_total == 1


def test_a_killed_ingest_process_costs_a_retry_not_data(agg: AggregatorThread) -> None:
    assert agg.post_ingest(_body("a", 1, 1))[0] == 200
    first = _ingest_pid(agg)
    os.kill(first, signal.SIGKILL)
    psutil.Process(first).wait(10)
    # The POST that finds the child gone is answered 503 (the agent keeps it and
    # retries) or is stored by the child started for it; never lost, never a 500.
    status, reply = agg.post_ingest(_body("a", 2, 2))
    assert status in (200, 503), reply
    if status == 503:
        status, reply = agg.post_ingest(_body("a", 2, 2))
    assert status == 200 and reply["acked_seq"] == 2, reply
    second = _ingest_pid(agg)
    assert second != first
    assert count(agg.settings.db_url, "steps") == 2
    # The new child knows what the first one stored: a resend is de-duplicated.
    assert agg.post_ingest(_body("a", 1, 1))[0] == 200
    assert count(agg.settings.db_url, "steps") == 2
    ingest = agg.aggregator.ingest
    assert isinstance(ingest, ProcessIngest) and ingest.starts == 2


def test_the_ingest_process_stops_with_the_aggregator(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    with AggregatorThread(_settings(url)) as thread:
        pid = _ingest_pid(thread)
        assert thread.post_ingest(_body("a", 1, 1))[0] == 200
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the ingest process outlived the aggregator"
        time.sleep(0.05)


def test_the_writer_thread_stores_with_the_setting_off(tmp_path: Path) -> None:
    settings = _settings(f"sqlite:///{tmp_path / 'history.db'}", ingest_process=False)
    with AggregatorThread(settings) as thread:
        assert isinstance(thread.aggregator.ingest, ThreadIngest)
        status, reply = thread.post_ingest(_body("a", 1, 1))
        assert status == 200 and reply["acked_seq"] == 1, reply


@pytest.mark.parametrize(
    ("url", "can"),
    [
        ("sqlite:///history.db", True),
        ("postgresql+psycopg://localhost/test", True),
        ("sqlite://", False),
        ("sqlite:///:memory:", False),
    ],
)
def test_only_a_database_another_process_can_open_gets_an_ingest_process(
    url: str, can: bool
) -> None:
    assert _other_process_can_open(url) is can


_UNGUARDED_SCRIPT = """
import asyncio, gzip, sys
import aiohttp
from prometheus_client import CollectorRegistry
from tests.integration import wire_factory as wf
from torshmon.aggregator.service import INGEST_PATH, Aggregator
from torshmon.aggregator.settings import AggregatorSettings

async def main():
    settings = AggregatorSettings(port=0, db_url=sys.argv[1], aggregator_id="script")
    async with Aggregator(settings, registry=CollectorRegistry(), targets=[]) as agg:
        hello = wf.hello("j", 0, 1)
        body = wf.ingest_body("a", [(1, wf.record(hello, wf.batch(hello, 1, [wf.step(1)])))])
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        url = f"http://127.0.0.1:{agg.port}{INGEST_PATH}"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, data=gzip.compress(body), headers=headers) as resp:
                print("status", resp.status, flush=True)

asyncio.run(main())  # no __main__ guard, as many a user's script
"""


def test_a_script_without_a_main_guard_can_run_an_aggregator(tmp_path: Path) -> None:
    """The ingest process is a fresh interpreter: it must not run the user's script."""
    script = tmp_path / "embed.py"
    script.write_text(_UNGUARDED_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'history.db'}"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("status 200") == 1, done.stdout
    assert count(f"sqlite:///{tmp_path / 'history.db'}", "steps") == 1


async def test_a_failed_start_leaves_no_ingest_process_behind(tmp_path: Path) -> None:
    """The port is taken: start raises, and the ingest process and writer thread it had
    started are closed (a caller that got no aggregator has nothing to close)."""
    import socket

    from torshmon.aggregator.service import Aggregator

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = _settings(f"sqlite:///{tmp_path / 'history.db'}", port=taken.getsockname()[1])
        aggregator = Aggregator(settings)
        with pytest.raises(OSError):
            await aggregator.start()
    assert isinstance(aggregator.ingest, ProcessIngest)  # it had been spawned
    left = [
        p
        for p in me.children(recursive=True)
        if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert left == []
    with pytest.raises(RuntimeError):
        aggregator.writer.submit(int)  # shut down
