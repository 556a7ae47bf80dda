"""A real slow link found and named: a 3-rank gloo DDP job over tbf-shaped links, the
real agent and aggregator; rank 1's link drops to 100 Mbit/s mid-run, the Slow Link
alert fires naming rank 1 and resolves once the link is back.

Needs root and iproute2 (``linkshape.available``), like ``test_linkshape.py``.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, text

from tests.integration.multinode import train_until_stopped
from torshmon.aggregator.core.linkcheck import LinkChecker
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.linkshape import LinkShaper, available, parse_rate

pytestmark = pytest.mark.integration

WORLD = 3
JOB = "slowlink"
SLOW_RATE = "100mbit"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def shaping() -> None:
    ok, reason = available()
    if not ok:
        pytest.skip(reason)


def _train(rank: int, world: int, socket_path: str, stop_file: str) -> int:
    """DDP over a small MLP until ``stop_file`` appears; every rank stops at one step."""
    return train_until_stopped(rank, world, stop_file, 0.01, JOB, socket_path)


async def _until(condition: Any, what: str, timeout_s: float = TIMEOUT_S) -> float:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return time.time()


def _links(aggregator: Aggregator) -> LinkChecker | None:
    """The link checker of the job's latest run (None before its first hello)."""
    try:
        return aggregator.live.run(JOB).links
    except KeyError:
        return None


def _link_state(aggregator: Aggregator) -> str:
    """Where the job's link checks stand, for a failure's message."""
    links = _links(aggregator)
    job = None if links is None else links._jobs.get(JOB)
    if job is None:
        return "the link checker knows no such job"
    checks = {c.id: (c.reason, sorted(c.results)) for c in job.checks.values()}
    return (
        f"latest link check: {job.last}; checks in flight "
        f"(reason, ranks answered): {checks}; rejections: {job.rejections}; "
        f"suspects: {sorted(job.suspects)}; findings: {sorted(job.findings)}"
    )


def _settled(aggregator: Aggregator) -> bool:
    """A check was read, and no naming awaits its confirming check."""
    links = _links(aggregator)
    job = None if links is None else links._jobs.get(JOB)
    return job is not None and job.last is not None and not job.suspects and not job.checks


def _slow_link_alerts(aggregator: Aggregator) -> list[Any]:
    return [a for a in aggregator.alerts.active() if a.rule == "Slow Link"]


@pytest.mark.parametrize(("world", "named"), [(3, "1"), (2, "0-1")])
async def test_slow_link_alert_names_the_rank_and_resolves(
    shaping: None, tmp_path: Path, world: int, named: str
) -> None:
    """At world size 3 rank 1 is named; at 2 a pairwise test can only name the pair."""
    from torshmon.agent.daemon import Agent, AgentSettings

    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    token = secrets.token_hex(8)
    stop_file = str(tmp_path / "stop")
    settings = AggregatorSettings(
        port=0, db_url=db_url, token=token, aggregator_id="slow-link", eval_interval_s=0.2
    )
    seen_ranks: set[str] = set()
    with LinkShaper(world, rate=None) as shaper:
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
                job = asyncio.ensure_future(
                    asyncio.to_thread(
                        shaper.run_ranks,
                        _train,
                        agent_settings.socket_path,
                        stop_file,
                        timeout_s=5 * TIMEOUT_S,
                    )
                )
                try:
                    # Warm-up ends with one reference check of the healthy links. On a
                    # busy 2-core box it can name a rank whose process was held up (a
                    # stop-31 CI run: rank 2 at 0.36x); such a naming is only a suspect
                    # until the check sent at once names it again, so wait for that.
                    await _until(lambda: _settled(aggregator), "the reference check")
                    links = _links(aggregator)
                    assert links is not None
                    healthy = links.last(JOB)
                    assert healthy is not None and healthy.slow == (), _link_state(aggregator)
                    assert not links.active(), _link_state(aggregator)

                    onset = time.time()
                    await asyncio.to_thread(shaper.set_rate, SLOW_RATE, 1)
                    try:
                        # About 1.7 s as a rule; once, in a fresh-clone CI run (stop 29),
                        # not in 60 s: say where the checks stood.
                        fired_at = await _until(
                            lambda: any(a.state == "firing" for a in _slow_link_alerts(aggregator)),
                            "the Slow Link alert",
                        )
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}; {_link_state(aggregator)}") from None
                    [alert] = _slow_link_alerts(aggregator)
                    seen_ranks.add(alert.labels["rank"])
                    slow = links.last(JOB)

                    recovery = time.time()
                    await asyncio.to_thread(shaper.set_rate, None, 1)
                    try:
                        # About 5 s as a rule; once, in a fresh-clone CI run, not in 60 s.
                        resolved_at = await _until(
                            lambda: not _slow_link_alerts(aggregator),
                            "the alert to resolve",
                            timeout_s=2 * TIMEOUT_S,
                        )
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}; {_link_state(aggregator)}") from None
                finally:
                    Path(stop_file).touch()
                steps = await job

    assert len(set(steps)) == 1  # every rank stopped at the same step
    assert seen_ranks == {named}
    where = "between rank 0 and rank 1" if world == 2 else "at rank 1"
    assert f"Slow network link {where} of job slowlink" in alert.annotations["summary"]
    assert slow is not None
    rate_bytes = parse_rate(SLOW_RATE) / 8
    if world == 2:
        assert slow.slow == (0, 1)
        assert 0.3 * rate_bytes < slow.pairs[(0, 1)] < 1.3 * rate_bytes
    else:
        # Rank 1 measured near the shaped rate; the others far above it.
        assert slow.slow == (1,)
        assert 0.3 * rate_bytes < slow.bandwidth_by_rank[1] < 1.3 * rate_bytes
        assert min(slow.bandwidth_by_rank[r] for r in (0, 2)) > 3 * rate_bytes

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT rank, state FROM alerts WHERE rule = 'Slow Link'")
            ).all()
            kinds = conn.execute(text("SELECT kind FROM commands WHERE job = :j"), {"j": JOB}).all()
            blamed = conn.execute(
                text(
                    "SELECT rule, rank, starts_at_unix_s, annotations FROM alerts "
                    "WHERE rule IN ('Straggler', 'Hung Collective')"
                )
            ).all()
            late, ends = {}, {}
            for r in conn.execute(
                text("SELECT rank, step, end_unix_ns, compute_s, input_wait_s FROM steps")
            ):
                late[(r.rank, r.step)] = r.compute_s + (r.input_wait_s or 0.0)
                ends[(r.rank, r.step)] = r.end_unix_ns / 1e9
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(1 if world == 3 else None, "resolved")]
    # A slow link is neither a straggler nor a hang: no rank was blamed for it (the job
    # did slow down and communicate more, so the job-level alerts may fire). Three ranks
    # share two cores with the daemons here, so a rank can really fall behind its peers
    # for a while (stop 52 CI: rank 0 paged); such a page must then be what the stored
    # steps show, and never name the rank whose link was slowed.
    for alert in blamed:
        assert alert.rule == "Straggler" and alert.rank != 1, tuple(alert)
        assert _was_late(late, ends, alert.rank, world, alert.starts_at_unix_s), tuple(alert)
    assert {k for (k,) in kinds} == {"link_check"}
    print(
        f"\nslow link at {world} ranks: detected {fired_at - onset:.2f} s after onset, resolved "
        f"{resolved_at - recovery:.2f} s after recovery; check cost {healthy.duration_s * 1e3:.1f}"
        f" ms healthy, {slow.duration_s * 1e3:.0f} ms with rank 1 at {SLOW_RATE}; "
        f"{len(kinds)} link checks"
    )


def _was_late(
    late: dict[tuple[int, int], float],
    ends: dict[tuple[int, int], float],
    rank: int,
    world: int,
    paged_at: float,
) -> bool:
    """Whether ``rank`` was late as a page says, by the stored steps alone: late (its
    compute and input wait) by at least 5 % over its peers' median in 16 of some 28
    consecutive steps that ended before ``paged_at``, the least the detector pages for."""
    flags = []
    for step in sorted(s for r, s in late if r == rank and ends[(r, s)] <= paged_at):
        peers = [late.get((r, step)) for r in range(world) if r != rank]
        if None in peers:
            continue
        flags.append(late[(rank, step)] >= 1.05 * statistics.median(p for p in peers if p))
    return any(sum(flags[i : i + 28]) >= 16 for i in range(max(1, len(flags) - 27)))


def _time_checks(rank: int, world: int, size_bytes: int, repeats: int, reps: int) -> list[float]:
    import torch.distributed as dist

    from torshmon.probe.linkcheck import run_link_check

    group = dist.new_group(backend="gloo")
    run_link_check(group, rank, world, size_bytes, repeats)  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        run_link_check(group, rank, world, size_bytes, repeats)
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.parametrize("rate", [None, "1gbit"])
def test_link_check_cost(shaping: None, rate: str | None) -> None:
    """What one check as the aggregator sends it (1 MiB each way per pair, best of 2
    exchanges, 3 ranks) costs the job."""
    from torshmon.aggregator.core.linkcheck import LinkCheckSettings
    from torshmon.probe.linkcheck import DEFAULT_SIZE_BYTES, rounds

    repeats = LinkCheckSettings().repeats
    with LinkShaper(WORLD, rate=rate) as shaper:
        results = shaper.run_ranks(
            _time_checks, DEFAULT_SIZE_BYTES, repeats, 5, timeout_s=TIMEOUT_S
        )
    cost_s = statistics.median(max(times) for times in zip(*results, strict=True))
    print(f"\nlink check at {WORLD} ranks, {rate or 'unshaped'}: {cost_s * 1e3:.1f} ms")
    if rate is not None:
        # Rounds run one after another (each needs a rank of the previous one), each
        # pair sending the block both ways at the link's rate.
        expected_s = len(rounds(WORLD)) * repeats * DEFAULT_SIZE_BYTES * 8 / parse_rate(rate)
        assert 0.8 * expected_s < cost_s < 2.5 * expected_s, f"{cost_s:.3f} s vs {expected_s:.3f}"
    else:
        assert cost_s < 0.5
