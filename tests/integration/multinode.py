"""A multi-node cluster on one machine, for tests: network namespaces as nodes.

Each node is a network namespace of a :class:`~torshmon.linkshape.LinkShaper` (one
"rank link" of the shaper per node), joined to a bridge in the hub namespace. Each
node runs one real ``torshmon agent`` process (``--node nodeI``, its own socket and
spool); one real ``torshmon aggregator`` process runs in the hub namespace, at the
bridge's address, reachable from every node. A job runs ``ranks_per_node`` gloo
ranks in each node's namespace with the environment torchrun sets for
``--nnodes=N --nproc-per-node=K`` (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
WORLD_SIZE, MASTER_ADDR/PORT) plus GLOO_SOCKET_IFNAME and the node's agent socket::

    node0 ns: eth0 10.213.0.1  agent --node node0  ranks 0, 1  ┐
    node1 ns: eth0 10.213.0.2  agent --node node1  ranks 2, 3  ├─ br0 10.213.255.254
    node2 ns: eth0 10.213.0.3  agent --node node2  ranks 4, 5  ┘   aggregator :9470

Ranks of one node talk over loopback (one address), ranks of two nodes over their
nodes' veths, so ``shape(node, "100mbit")`` slows one node's NIC and nothing else.
Agents and the aggregator can be killed and started again on the same spool and
database (``kill_agent``/``start_agent``, ``kill_aggregator``/``start_aggregator``).

The test process stays in the host's namespace; ``api`` and ``agent_metrics``
reach the namespaced servers from a short-lived thread that enters the hub
namespace first. Needs root and iproute2, like ``torshmon.linkshape``.

Usage::

    with Cluster(tmp_path, nodes=2, ranks_per_node=2) as cluster:
        job = cluster.start_job(train_until_stopped, cluster.stop_file)
        cluster.wait(lambda: cluster.api("/api/v1/jobs/multinode/ranks")["ranks"], "ranks")
        cluster.shape(1, "100mbit")
        ...
        steps = cluster.stop_job(job)
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

from torshmon.linkshape import LinkShaper
from torshmon.netns import enter_netns

T = TypeVar("T")

JOB = "multinode"
AGGREGATOR_PORT = 9470
AGENT_METRICS_PORT = 9465
#: Fast enough for tests to see alerts within seconds.
DEFAULT_AGGREGATOR_CONFIG: Mapping[str, Any] = {"eval_interval_s": 0.2}
_CLI = "import sys; from torshmon.cli import main; sys.exit(main())"


class Cluster:
    """``nodes`` namespaces with an agent each, one aggregator, and a job of
    ``ranks_per_node`` ranks per node; a context manager that leaves nothing behind.

    ``aggregator_config``: the aggregator's YAML settings (merged over
    DEFAULT_AGGREGATOR_CONFIG); ``rate``: every node's link rate at start (None:
    unshaped). Not thread-safe: one test drives it.
    """

    def __init__(
        self,
        workdir: Path,
        nodes: int,
        ranks_per_node: int,
        *,
        job: str = JOB,
        rate: str | None = None,
        aggregator_config: Mapping[str, Any] | None = None,
        agent_sample_interval_s: float = 1.0,
    ) -> None:
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(
                f"need nodes >= 1 and ranks_per_node >= 1, got {nodes}, {ranks_per_node}"
            )
        self.workdir = workdir
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.job = job
        self.token = secrets.token_hex(8)
        self.token_file = workdir / "token"
        self.db_path = workdir / "history.db"
        self.stop_file = workdir / "stop"
        self.aggregator_config = {**DEFAULT_AGGREGATOR_CONFIG, **(aggregator_config or {})}
        self.agent_sample_interval_s = agent_sample_interval_s
        self.shaper = LinkShaper(nodes, rate=rate)
        self._aggregator: subprocess.Popen[bytes] | None = None
        self._agents: dict[int, subprocess.Popen[bytes]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    # -- layout ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_name(self, node: int) -> str:
        return f"node{node}"

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def agent_socket(self, node: int) -> Path:
        return self.workdir / self.node_name(node) / "agent.sock"

    @property
    def aggregator_url(self) -> str:
        return f"http://{self.shaper.hub_address}:{AGGREGATOR_PORT}"

    def rank_env(self, rank: int) -> dict[str, str]:
        """What torchrun (``--nnodes=N --nproc-per-node=K``) and the node's setup give ``rank``."""
        node = self.node_of(rank)
        return {
            **self.shaper.rank_env(node),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node),
            "TORSHMON_NODE": self.node_name(node),
            "TORSHMON_AGENT_SOCKET": str(self.agent_socket(node)),
            "TORSHMON_JOB": self.job,
        }

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Namespaces, the aggregator, then one agent per node; each ready when this returns."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(self.token)
        (self.workdir / "aggregator.yaml").write_text(yaml.safe_dump(self.aggregator_config))
        self.shaper.start()
        try:
            self.start_aggregator()
            for node in range(self.nodes):
                self.start_agent(node)
            for node in range(self.nodes):
                self.wait_agent(node)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every agent and the aggregator, then delete the namespaces; safe twice."""
        for node in list(self._agents):
            self.kill_agent(node, signal.SIGTERM)
        if self._aggregator is not None:
            self.kill_aggregator(signal.SIGTERM)
        self._pool.shutdown(wait=True)
        self.shaper.close()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- processes ------------------------------------------------------------------------
    def start_aggregator(self) -> None:
        """``torshmon aggregator`` in the hub namespace, on the cluster's database; waits
        until it answers."""
        if self._aggregator is not None:
            raise RuntimeError("the aggregator is running")
        command = [
            "aggregator", "--host", self.shaper.hub_address, "--port", str(AGGREGATOR_PORT),
            "--db", f"sqlite:///{self.db_path}", "--token-file", str(self.token_file),
            "--config", str(self.workdir / "aggregator.yaml"), "--id", "multinode",
        ]  # fmt: skip
        self._aggregator = self._spawn(self.shaper.hub_netns, command, "aggregator")
        self.wait(self._aggregator_up, "the aggregator to answer", timeout_s=60)

    def kill_aggregator(self, sig: int = signal.SIGKILL) -> None:
        if self._aggregator is not None:
            _stop(self._aggregator, sig)
            self._aggregator = None

    def start_agent(self, node: int) -> None:
        """``torshmon agent --node nodeI`` in node ``node``'s namespace, on its own spool."""
        if node in self._agents:
            raise RuntimeError(f"the agent of {self.node_name(node)} is running")
        home = self.workdir / self.node_name(node)
        home.mkdir(exist_ok=True)
        command = [
            "agent", "--node", self.node_name(node), "--socket", str(self.agent_socket(node)),
            "--spool", str(home / "spool.db"), "--aggregator", self.aggregator_url,
            "--token-file", str(self.token_file),
            "--metrics-host", self.shaper.links[node].address,
            "--metrics-port", str(AGENT_METRICS_PORT),
            "--sample-interval-s", str(self.agent_sample_interval_s),
        ]  # fmt: skip
        self._agents[node] = self._spawn(self.shaper.links[node].netns, command, f"agent-{node}")

    def wait_agent(self, node: int) -> None:
        self.wait(lambda: self._agent_up(node), f"the agent of {self.node_name(node)}", 60)

    def kill_agent(self, node: int, sig: int = signal.SIGKILL) -> None:
        proc = self._agents.pop(node, None)
        if proc is not None:
            _stop(proc, sig)

    def agent_alive(self, node: int) -> bool:
        proc = self._agents.get(node)
        return proc is not None and proc.poll() is None

    def _spawn(self, netns: str, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        log = open(self.workdir / f"{log_name}.log", "ab")  # noqa: SIM115 (the child owns it)
        try:
            return subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-c", _CLI, *command],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()

    def log(self, name: str) -> str:
        """What ``aggregator`` or ``agent-I`` has written so far (for failure messages)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the job --------------------------------------------------------------------------
    def start_job(
        self, target: Callable[..., Any], *args: Any, timeout_s: float = 300.0
    ) -> concurrent.futures.Future[list[Any]]:
        """Run ``target(rank, world_size, *args)`` on every rank, in the background."""
        from torshmon.launch import run_ranks

        netns = [self.shaper.links[self.node_of(r)].netns for r in range(self.world_size)]
        return self._pool.submit(
            run_ranks,
            target,
            self.world_size,
            *args,
            timeout_s=timeout_s,
            rank_env=self.rank_env,
            master_addr=self.shaper.links[0].address,
            netns=netns,
        )

    def stop_job(
        self, job: concurrent.futures.Future[list[Any]], timeout_s: float = 120.0
    ) -> list[Any]:
        """Ask ``train_until_stopped`` ranks to stop and return their results."""
        self.stop_file.touch()
        return job.result(timeout=timeout_s)

    def shape(self, node: int, rate: str | None) -> None:
        """Set node ``node``'s link rate (both directions), e.g. ``"100mbit"``; None unshapes."""
        self.shaper.set_rate(rate, node)

    # -- reading --------------------------------------------------------------------------
    def api(self, path: str, body: Any = None) -> Any:
        """GET (or, with ``body``, POST) the aggregator's API; the decoded JSON.

        Raises urllib.error.HTTPError on an error status.
        """

        def call() -> Any:
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(
                self.aggregator_url + path,
                data=data,
                headers={
                    "Authorization": f"Bearer {self.token}",
                    "Content-Type": "application/json",
                },
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())

        return self.in_hub(call)

    def agent_metrics(self, node: int) -> str:
        """Node ``node``'s agent ``/metrics`` text."""
        url = f"http://{self.shaper.links[node].address}:{AGENT_METRICS_PORT}/metrics"
        return self.in_hub(lambda: _get_text(url))

    def aggregator_metrics(self) -> str:
        return self.in_hub(lambda: _get_text(self.aggregator_url + "/metrics"))

    def in_hub(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a new thread inside the hub namespace (the caller's stays where it is)."""
        out: list[T] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                enter_netns(self.shaper.hub_netns)
                out.append(fn())
            except BaseException as exc:  # re-raised on the caller's thread
                error.append(exc)

        thread = threading.Thread(target=run, name="multinode-hub")
        thread.start()
        thread.join()
        if error:
            raise error[0]
        return out[0]

    def alerts(self) -> list[dict[str, Any]]:
        """The aggregator's alerts (``GET /api/v1/alerts``)."""
        reply = self.api("/api/v1/alerts")
        return list(reply["alerts"] if isinstance(reply, dict) else reply)

    def wait(self, condition: Callable[[], T], what: str, timeout_s: float = 60.0) -> T:
        """Poll ``condition`` until it returns something true, and return that;
        AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.1)

    def _aggregator_up(self) -> bool:
        proc = self._aggregator
        if proc is None or proc.poll() is not None:
            raise AssertionError(f"the aggregator exited:\n{self.log('aggregator')[-3000:]}")
        try:
            self.in_hub(lambda: _get_text(self.aggregator_url + "/healthz"))
        except OSError:
            return False
        return True

    def _agent_up(self, node: int) -> bool:
        proc = self._agents.get(node)
        if proc is None or proc.poll() is not None:
            raise AssertionError(
                f"the agent of node{node} exited:\n{self.log(f'agent-{node}')[-3000:]}"
            )
        if not self.agent_socket(node).exists():
            return False
        try:
            self.agent_metrics(node)
        except OSError:
            return False
        return True


def train_until_stopped(
    rank: int,
    world: int,
    stop_file: str,
    sleep_s: float = 0.01,
    job: str | None = None,
    agent_socket: str | None = None,
) -> int:
    """DDP over a small MLP with the probe attached until ``stop_file`` appears; every
    rank stops at the same step, returned. ``job`` and ``agent_socket`` default to the
    environment's (as the node comes from it)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    monitor = torshmon.attach(
        model, job=job, agent_socket=agent_socket, flush_interval_s=0.1, sync_every=5
    )
    step = 0
    try:
        while True:
            x = torch.randn(32, 256, generator=generator)
            with monitor.step(batch_size=32) as scope:
                loss = model(x).square().mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scope.loss = loss
            step += 1
            time.sleep(sleep_s)  # leave CPU to the agents and aggregator on a small machine
            if step % 10 == 0:
                flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0:
                    return step
    finally:
        monitor.close()


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return root if not rest else f"{root}{os.pathsep}{rest}"


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = ["JOB", "Cluster", "train_until_stopped"]
