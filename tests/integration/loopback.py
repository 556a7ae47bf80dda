"""An aggregator and an agent on loopback, in process, for tests that run real ranks."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from torshmon.agent.daemon import Agent, AgentSettings
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings


@contextlib.asynccontextmanager
async def aggregator_and_agent(
    tmp_path: Path, aggregator_id: str, **overrides: Any
) -> AsyncIterator[tuple[Aggregator, AgentSettings]]:
    """An aggregator (history in ``tmp_path/history.db``, a fresh token, any free port,
    ``overrides`` on its settings) and an agent forwarding to it (socket and spool in
    ``tmp_path``); yields the aggregator and the agent's settings, ranks' socket included."""
    token = secrets.token_hex(8)
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token=token,
        aggregator_id=aggregator_id,
        **overrides,
    )
    async with Aggregator(settings, registry=CollectorRegistry(), targets=[]) as aggregator:
        agent_settings = AgentSettings(
            socket_path=str(tmp_path / "agent.sock"),
            metrics_port=0,
            aggregator_url=f"http://127.0.0.1:{aggregator.port}",
            token=token,
            spool_path=str(tmp_path / "spool.db"),
            sample_interval_s=1.0,
        )
        async with Agent(agent_settings, registry=CollectorRegistry()):
            yield aggregator, agent_settings
