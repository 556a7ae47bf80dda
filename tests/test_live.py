"""The aggregator's live state: pruning of jobs and nodes that ended."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.live import LiveState
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.live_metrics import LiveCollector
from torshmon.aggregator.rule_files import default_rules
from torshmon.labels import MAX_LABEL_VALUES, OTHER
from torshmon.wire import AppliedConfig, BucketStat, DdpStats, Hello, InflightOp, StepRecord


def _stored(*, steps: bool) -> Stored:
    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    batches = [(wf.batch(h, 1, [wf.step(1)] if steps else []), "node-a") for h in (h0, h1)]
    return Stored(
        acked_seq=1, hellos=[h0, h1], batches=batches, node_samples=[wf.node_sample("j", 2)]
    )


def test_a_job_and_node_idle_past_the_limit_are_forgotten_with_their_metrics() -> None:
    live = LiveState(idle_s=60.0)
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    live.observe(_stored(steps=True), now_unix_s=1000.0)
    assert registry.get_sample_value("torshmon_steps_total", {"job": "j", "rank": "1"}) == 1.0

    live.expire(1059.0)
    assert "j" in live.jobs and "node-a" in live.nodes
    live.expire(1061.0)
    assert live.jobs == {} and live.nodes == {}
    assert live.job_summary("j") is None
    assert registry.get_sample_value("torshmon_steps_total", {"job": "j", "rank": "1"}) is None
    assert live.series.series_count() == 0


def test_heartbeats_of_a_stuck_job_keep_it_alive() -> None:
    live = LiveState(idle_s=60.0)
    live.observe(_stored(steps=True), now_unix_s=1000.0)
    # No steps for a long while, but the ranks still send heartbeats (a hang).
    live.observe(_stored(steps=False), now_unix_s=1050.0)
    live.expire(1100.0)
    assert "j" in live.jobs


def test_a_finding_that_starts_and_clears_inside_one_batch_is_evaluated_once() -> None:
    """A 3-step loss spike inside one ingested batch: the detector is active and clear
    again before any evaluation; findings() must still show it once."""
    live = LiveState(idle_s=60.0)
    hello = wf.hello("j", 0, 1)
    losses = [1.0 + 0.001 * (i % 3) for i in range(20)] + [50.0] * 3 + [1.0] * 4
    steps = [wf.step(i + 1, loss=loss) for i, loss in enumerate(losses)]
    live.observe(
        Stored(acked_seq=1, hellos=[hello], batches=[(wf.batch(hello, 1, steps), "n")]),
        now_unix_s=1000.0,
    )
    assert live.run("j").loss_z.active() == []  # cleared inside the batch
    found = [f for f in live.findings(1000.5) if f.labels.get("metric") == "loss"]
    assert [(f.kind, f.labels["rank"]) for f in found] == [("anomaly", "0")]
    assert [f for f in live.findings(1001.0) if f.labels.get("metric") == "loss"] == []


def _loss_batch(live: LiveState, first: int, losses: list[float], now: float) -> None:
    hello = wf.hello("j", 0, 1)
    steps = [wf.step(first + i, loss=loss) for i, loss in enumerate(losses)]
    live.observe(
        Stored(acked_seq=first, hellos=[hello], batches=[(wf.batch(hello, first, steps), "n")]),
        now_unix_s=now,
    )


def test_only_a_finding_not_yet_evaluated_asks_for_an_evaluation() -> None:
    live = LiveState(idle_s=60.0)
    normal = [1.0 + 0.001 * (i % 3) for i in range(20)]
    _loss_batch(live, 1, normal, 1000.0)
    assert not live.take_fresh()
    _loss_batch(live, 21, [50.0] * 3, 1000.5)
    assert live.take_fresh()
    assert not live.take_fresh()  # taken
    live.findings(1000.6)
    # Still active, but the last evaluation saw it: no new evaluation is asked for.
    _loss_batch(live, 24, [50.0] * 2, 1000.7)
    assert not live.take_fresh()


def test_a_non_finite_loss_asks_for_an_evaluation() -> None:
    live = LiveState(idle_s=60.0)
    hello = wf.hello("j", 0, 1)
    nan = msgspec.structs.replace(wf.step(2, loss=None), loss_nonfinite=True)
    steps = [wf.step(1, loss=1.0), nan]
    live.observe(
        Stored(acked_seq=1, hellos=[hello], batches=[(wf.batch(hello, 1, steps), "n")]),
        now_unix_s=1000.0,
    )
    assert live.take_fresh()


def _steps_of_rank(rank: int) -> list[StepRecord]:
    """100 steps: a loss spike at 12-14, a step-time spike at 16-18 (both found and
    cleared inside a batch), rank 2 computing 3x slower from step 20 (before the
    straggler detector has measured the noise: the onset enters the estimate and the rank
    is named only once that has washed out, tens of steps later), a non-finite loss at
    30, no loss at 31, no throughput at 32, a zero-length step at 33."""
    out = []
    for n in range(1, 101):
        duration = 0.1 + 0.001 * (n % 3)
        if rank == 2 and n >= 20:
            duration *= 3
        if 16 <= n <= 18:
            duration *= 4
        loss: float | None = 2.0 + 0.01 * (n % 2) + (30.0 if 12 <= n <= 14 else 0.0)
        if n == 31:
            loss = None
        step = wf.step(n, duration_s=duration, comm_wait_s=0.02, end_unix_ns=n * 10**8, loss=loss)
        if n == 30:
            step = msgspec.structs.replace(step, loss=None, loss_nonfinite=True)
        if n == 32:
            step = msgspec.structs.replace(step, samples_per_s=None)
        if n == 33:
            step = msgspec.structs.replace(step, duration_s=0.0, comm_wait_s=0.0, compute_s=0.0)
        out.append(step)
    return out


def _feed(*, one_step_per_batch: bool) -> LiveState:
    """Three ranks' steps, rank after rank: in one batch each, or one batch per step."""
    live = LiveState(idle_s=60.0)
    hellos = [wf.hello("j", rank, 3) for rank in range(3)]
    live.observe(Stored(acked_seq=0, hellos=hellos), now_unix_s=1000.0)
    for h in hellos:
        steps = _steps_of_rank(h.rank)
        chunks = [[s] for s in steps] if one_step_per_batch else [steps]
        for seq, chunk in enumerate(chunks, start=1):
            batch = wf.batch(h, seq, chunk)
            live.observe(Stored(acked_seq=0, batches=[(batch, "n")]), now_unix_s=1000.0)
    return live


def test_a_batch_of_many_steps_is_observed_as_one_step_at_a_time() -> None:
    """The batched hot path (columns per batch) against batches of one step."""
    one, many = _feed(one_step_per_batch=True), _feed(one_step_per_batch=False)
    found = [(f.kind, f.labels, f.summary) for f in many.findings(1001.0)]
    assert found == [(f.kind, f.labels, f.summary) for f in one.findings(1001.0)]
    # What the scenario must show: the straggler, its step time and throughput, the loss
    # spike (latched).
    assert {(kind, labels.get("metric")) for kind, labels, _ in found} == {
        ("straggler", None),
        ("anomaly", "step_duration_seconds"),
        ("anomaly", "throughput_samples_per_second"),
        ("anomaly", "loss"),
    }
    for metric in sorted(one.series.metrics()):
        for labels in one.series.last_seen(metric):
            expected = one.series.points(metric, labels, 0.0)
            assert repr(many.series.points(metric, labels, 0.0)) == repr(expected), metric
    for rank, state in one.jobs["j"].ranks.items():
        assert repr(many.jobs["j"].ranks[rank]) == repr(state)


def _extras(n: int) -> StepRecord:
    """Step ``n`` with what a step may carry besides its timings: collectives (a
    histogram shorter or longer than the aggregator's), buckets, DDP statistics and a
    new config, on different steps."""
    step = wf.step(n, end_unix_ns=n * 10**8, collectives=n % 2 == 0)
    if n % 3 == 0:
        hist = [1, 0, 2] if n % 2 else [0] * 14 + [1, 5]  # 3 and 16 buckets
        coll = wf.step(n).collectives[0]
        step = msgspec.structs.replace(
            step, collectives=[msgspec.structs.replace(coll, duration_hist=hist)]
        )
    if n % 4 == 1:
        buckets = [
            BucketStat(
                index=0,
                size_bytes=100,
                parameters=2,
                duration_s=0.01,
                codec=codec,
                wire_bytes=10 * n,
                compression_ratio=0.1 * n,
                relative_error=None if n % 8 == 1 else 0.01 * n,
            )
            for codec in ("none", "fp16")
        ]
        step = msgspec.structs.replace(step, buckets=buckets)
    if n % 5 in (2, 3):
        ddp = DdpStats(
            bucket_cap_bytes=1000 + n,
            bucket_sizes_bytes=[n],
            num_buckets_reduced=1,
            avg_forward_compute_s=0.01,
            avg_backward_compute_s=0.02,
            avg_backward_comm_s=0.01,
            avg_backward_compute_comm_overlap_s=0.0,
        )
        step = msgspec.structs.replace(step, ddp=ddp)
    if n % 5 in (1, 3):
        config = AppliedConfig(
            version=n,
            bucket_cap_bytes=2000 + n,
            first_bucket_cap_bytes=1,
            codec="none",
            codec_params={},
            effective_step=n,
        )
        step = msgspec.structs.replace(step, applied_config=config, config_version=n)
    return step


def test_the_extras_of_a_batch_of_steps_are_taken_as_step_by_step() -> None:
    """A step's DDP statistics and the config applied at its end both set the bucket
    cap: within a batch the later step wins, as it would step by step."""
    for last in range(1, 16):
        steps = [_extras(n) for n in range(1, last + 1)]
        states = []
        for chunks in ([[s] for s in steps], [steps]):
            live = LiveState(idle_s=60.0)
            hello = wf.hello("j", 0, 1)
            live.observe(Stored(acked_seq=0, hellos=[hello]), now_unix_s=1000.0)
            for seq, chunk in enumerate(chunks, start=1):
                batch = wf.batch(hello, seq, chunk)
                live.observe(Stored(acked_seq=seq, batches=[(batch, "n")]), now_unix_s=1000.0)
            job = live.jobs["j"]
            states.append((job.bucket_cap_bytes, job.config, repr(job.ranks[0])))
        assert states[1] == states[0], last
    assert states[0][0] == 2013 and states[0][2].count("fp16") >= 3


def test_a_batch_naming_2000_ops_groups_and_codecs_keeps_metrics_bounded() -> None:
    """Past the cap, op, pg and codec values fold into 'other' as they are taken in."""
    live = LiveState(idle_s=60.0)
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    hello = wf.hello("j", 0, 1)
    batch = wf.batch(hello, 1, [wf.step_naming(1, 2000)])
    live.observe(Stored(acked_seq=1, hellos=[hello], batches=[(batch, "n")]), now_unix_s=1000.0)
    families = {f.name: f for f in registry.collect()}
    busbw = families["torshmon_collective_busbw_bytes_per_second"].samples
    assert len(busbw) == MAX_LABEL_VALUES + 1  # op-i/pg-i for i < 64, then other/other
    for name in ("torshmon_compression_ratio", "torshmon_compression_wire_bytes_total"):
        samples = [s for s in families[name.removesuffix("_total")].samples if s.name == name]
        assert len(samples) == MAX_LABEL_VALUES + 1, name
    wire = {"job": "j", "rank": "0", "codec": OTHER}
    assert registry.get_sample_value("torshmon_compression_wire_bytes_total", wire) == 1936 * 500
    assert len(live.jobs["j"].ranks[0].collectives) == MAX_LABEL_VALUES + 1
    for label in ("op", "pg", "codec"):
        folded = {"job": "j", "label": label}
        assert registry.get_sample_value("torshmon_label_values_folded_total", folded) == 1936
    assert len(generate_latest(registry)) < 256 * 1024  # 65 collective histograms

    live.forget("j")
    folded = {"job": "j", "label": "op"}
    assert registry.get_sample_value("torshmon_label_values_folded_total", folded) is None


def _two_ranks(live: LiveState, *, urgent: bool = False) -> None:
    """Two ranks of job j, three steps each (rank 1 twice as slow), rank 1's last batch
    urgent and inside a collective."""
    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    steps0 = [wf.step(n, duration_s=0.1, comm_wait_s=0.02) for n in (1, 2, 3)]
    steps1 = [wf.step(n, duration_s=0.2, comm_wait_s=0.05) for n in (1, 2, 3)]
    inflight = [
        InflightOp(pg="0", seq=9, op="all_reduce", size_bytes=8, start_unix_ns=0, age_s=1.5)
    ]
    b1 = msgspec.structs.replace(wf.batch(h1, 1, steps1, inflight=inflight), urgent=urgent)
    stored = Stored(acked_seq=1, hellos=[h0, h1], batches=[(wf.batch(h0, 1, steps0), "a")])
    stored.batches.append((b1, "a"))
    live.observe(stored, now_unix_s=1000.0)


def test_the_rank_counters_add_every_step_so_rates_give_shares() -> None:
    live = LiveState(idle_s=60.0)
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    _two_ranks(live, urgent=True)
    value = registry.get_sample_value
    r1 = {"job": "j", "rank": "1"}
    assert value("torshmon_steps_total", r1) == 3
    assert value("torshmon_step_seconds_total", r1) == pytest.approx(0.6)
    assert value("torshmon_comm_wait_seconds_total", r1) == pytest.approx(0.15)
    assert value("torshmon_compute_seconds_total", r1) == pytest.approx(0.45)
    assert value("torshmon_probe_urgent_steps_total", r1) == 3
    assert value("torshmon_probe_urgent_steps_total", {"job": "j", "rank": "0"}) == 0
    assert value("torshmon_inflight_oldest_age_seconds", r1) == 1.5
    # The API's ranks (and the detection benchmark's urgent share) read the same counts.
    ranks = live.rank_summaries("j")
    assert [(r["steps_total"], r["urgent_steps_total"]) for r in ranks.values()] == [(3, 0), (3, 3)]
    # The training series only: node series are the agents' to export.
    assert value("torshmon_cpu_utilization_ratio", {"node": "node-a"}) is None


@pytest.mark.parametrize("per_rank", [False, True])
def test_the_collective_histogram_is_job_level_unless_asked_per_rank(per_rank: bool) -> None:
    live = LiveState(idle_s=60.0)
    registry = CollectorRegistry()
    registry.register(LiveCollector(live, collectives_per_rank=per_rank))
    _two_ranks(live)
    families = {f.name: f for f in registry.collect()}
    counts = [
        s for s in families["torshmon_collective_duration_seconds"].samples
        if s.name.endswith("_count")
    ]  # fmt: skip
    collective = {"job": "j", "op": "all_reduce", "pg": "0"}
    if per_rank:
        assert sorted((s.labels["rank"], s.value) for s in counts) == [("0", 3), ("1", 3)]
        assert registry.get_sample_value(
            "torshmon_collective_bytes_total", {**collective, "rank": "1"}
        ) == pytest.approx(3 * 4_000_000)
    else:
        assert [(s.labels, s.value) for s in counts] == [(collective, 6)]
        total = registry.get_sample_value("torshmon_collective_bytes_total", collective)
        assert total == 6 * 4_000_000
        sum_s = registry.get_sample_value("torshmon_collective_duration_seconds_sum", collective)
        assert sum_s == pytest.approx(3 * 0.02 + 3 * 0.05)


# -- silence is not a hang (issue 23) ---------------------------------------------------

#: The nodes' clocks run 40 s behind the aggregator's: dating must not depend on sync.
_SKEW_S = 40.0


def _node_post(hellos: list[Hello], t: float, seq: int, inflight: list[InflightOp]) -> Stored:
    """One agent POST at aggregator time ``t``: a short step and in-flight ops per rank,
    stamped on the node's clock, 50 ms before they arrive."""
    sent_ns = int((t - _SKEW_S - 0.05) * 1e9)
    batches = [
        (
            msgspec.structs.replace(
                wf.batch(h, seq, [wf.step(seq, duration_s=0.02, end_unix_ns=sent_ns)]),
                sent_unix_ns=sent_ns,
                inflight=inflight,
            ),
            "node-b" if h.rank >= 2 else "node-a",
        )
        for h in hellos
    ]
    return Stored(acked_seq=seq, hellos=hellos if seq == 1 else [], batches=batches)


def _op(seq: int, age_s: float) -> InflightOp:
    return InflightOp(
        pg="default", seq=seq, op="ddp_reduce", size_bytes=1, start_unix_ns=0, age_s=age_s
    )


def test_a_dead_agents_last_in_flight_reports_raise_agent_down_not_a_hang() -> None:
    """The issue's scenario: node b's agent is killed right after its ranks reported
    being in ddp_reduce #N; node a's ranks go on training. No hang, at any time; Agent
    Down on node b fires and resolves when the agent is back; a replay of its spool
    (old in-flight reports) names nobody either."""
    live = LiveState()
    engine = AlertEngine(default_rules())
    on_a = [wf.hello("j", r, 4) for r in (0, 1)]
    on_b = [wf.hello("j", r, 4) for r in (2, 3)]
    t, seq = 1000.0, 1
    for _ in range(5):
        live.observe(_node_post(on_a, t, seq, []), t, "node-a")
        live.observe(_node_post(on_b, t, seq, []), t, "node-b")
        t, seq = t + 0.5, seq + 1
    live.observe(_node_post(on_b, t, seq, [_op(300, 0.01)]), t, "node-b")  # then killed
    killed = t
    agent_down: list[Alert] = []
    while t < killed + 12.0:
        t, seq = t + 0.5, seq + 1
        live.observe(_node_post(on_a, t, seq, []), t, "node-a")
        findings = live.findings(t)
        assert [f for f in findings if f.kind == "hang"] == [], t
        agent_down += [
            a for a in engine.evaluate(t, live.series, findings) if a.rule == "Agent Down"
        ]
    assert [(a.state, a.labels["node"]) for a in agent_down] == [("firing", "node-b")]
    assert "node node-b" in agent_down[0].annotations["summary"]
    # The agent is back and replays its spool first: reports from before it died.
    old = _node_post(on_b, killed + 0.5, seq, [_op(301, 0.01)])
    fresh = _node_post(on_b, t, seq + 1, [])
    live.observe(Stored(acked_seq=seq + 1, batches=old.batches + fresh.batches), t, "node-b")
    findings = live.findings(t + 0.5)
    assert [f for f in findings if f.kind == "hang"] == []
    resolved = [
        a for a in engine.evaluate(t + 0.5, live.series, findings) if a.rule == "Agent Down"
    ]
    assert [(a.state, a.labels["node"]) for a in resolved] == [("resolved", "node-b")]


def test_a_genuine_hang_across_nodes_is_still_named() -> None:
    """Node b's ranks wait in ddp_reduce #300 while node a's never join: with both
    agents heard every half second, the hang names ranks 0 and 1."""
    live = LiveState()
    on_a = [wf.hello("j", r, 4) for r in (0, 1)]
    on_b = [wf.hello("j", r, 4) for r in (2, 3)]
    t, seq = 1000.0, 1
    for _ in range(5):
        live.observe(_node_post(on_a, t, seq, []), t, "node-a")
        live.observe(_node_post(on_b, t, seq, []), t, "node-b")
        t, seq = t + 0.5, seq + 1
    stuck_at = t
    hangs: list[Finding] = []
    while not hangs and t < stuck_at + 10.0:
        live.observe(_node_post(on_a, t, seq, []), t, "node-a")
        live.observe(_node_post(on_b, t, seq, [_op(300, t - stuck_at)]), t, "node-b")
        hangs = [f for f in live.findings(t) if f.kind == "hang"]
        t, seq = t + 0.5, seq + 1
    assert sorted(f.labels["rank"] for f in hangs) == ["0", "1"]
    assert {f.details["reason"] for f in hangs} == {"never_joined"}


def test_the_last_reports_of_a_job_whose_processes_ended_make_no_hang() -> None:
    """When a job ends its ranks' final reports are frozen, one of them perhaps inside
    the last collective; the node's agent stops listing their processes, and that ends
    their waiting."""
    live = LiveState()
    ranks = [wf.hello("j", r, 2) for r in (0, 1)]
    t = 1000.0
    running = msgspec.structs.replace(
        wf.node_sample("j", 2), ts_unix_ns=int((t - _SKEW_S - 0.05) * 1e9)
    )
    assert {p.rank for p in running.ranks} == {0, 1}
    post = _node_post(ranks, t, 1, [])
    live.observe(
        Stored(acked_seq=1, hellos=ranks, batches=post.batches, node_samples=[running]), t, "node-a"
    )
    last = _node_post(ranks[:1], t + 0.5, 2, [_op(40, 0.01)])  # rank 0 ends "inside" #40
    live.observe(last, t + 0.5, "node-a")
    ended = msgspec.structs.replace(running, ranks=[])
    for i in range(10):
        now = t + 1.0 + 0.5 * i
        sample = msgspec.structs.replace(ended, ts_unix_ns=int((now - _SKEW_S) * 1e9))
        live.observe(Stored(acked_seq=3 + i, node_samples=[sample]), now, "node-a")
        assert [f for f in live.findings(now) if f.kind == "hang"] == [], now


def _job_steps(
    live: LiveState,
    world: int,
    durations: list[float],
    *,
    versions: list[int] | None = None,
    process_waits: dict[int, list[float]] | None = None,
) -> None:
    """Every rank of a ``world``-rank job runs steps 1.. with these step times (the
    same on every rank, as in synchronous training: a step waits for the slowest rank),
    these config versions, and per rank its threads' CPU wait in each step."""
    hellos = [wf.hello("j", rank, world) for rank in range(world)]
    live.observe(Stored(acked_seq=0, hellos=hellos), now_unix_s=1000.0)
    for h in hellos:
        steps = []
        for n, duration in enumerate(durations, start=1):
            jitter = 1.0 + 0.01 * ((n + h.rank) % 3)
            step = wf.step(n, duration_s=duration * jitter, comm_wait_s=0.02, end_unix_ns=n * 10**8)
            if versions is not None:
                step = msgspec.structs.replace(step, config_version=versions[n - 1])
            if process_waits is not None and h.rank in process_waits:
                waited = process_waits[h.rank][n - 1]
                step = msgspec.structs.replace(step, process_cpu_wait_s=waited)
            steps.append(step)
        live.observe(Stored(acked_seq=0, batches=[(wf.batch(h, 1, steps), "n")]), 1000.0)


@pytest.mark.parametrize("slow_steps", [10, 40])
def test_a_job_wide_slowdown_is_one_job_level_step_time_anomaly(slow_steps: int) -> None:
    """Every rank's steps take 3x longer: one Step Time Anomaly for the job, without a
    rank (it used to be one per rank), and no straggler. The finding is shown at once;
    the rule fires once 32 of its steps were slow over at least 1 s
    (``zscore.step_page_steps``, ``step_page_min_s``; the steps are 0.1 s apart): 10 slow
    steps are shown only, 40 page."""
    live = LiveState(idle_s=60.0, anomaly_metrics=())  # step time's z-score alone
    _job_steps(live, 3, [0.1] * 40 + [0.3] * slow_steps)
    found = live.findings(1001.0)
    assert [(f.kind, dict(f.labels)) for f in found] == [
        ("anomaly", {"job": "j", "metric": "step_duration_seconds"})
    ]
    pages = slow_steps == 40
    assert found[0].summary.startswith("step time of job j is 0.3")
    assert found[0].details["page"] is pages
    assert found[0].details["rise_steps"] == slow_steps
    note = "(for 10 steps so far: it pages if it lasts)"
    assert found[0].summary.endswith(note) is not pages
    engine = AlertEngine(default_rules())
    firing = [a for a in engine.evaluate(1001.0, live.series, found) if a.state == "firing"]
    assert [(a.rule, a.rank) for a in firing] == ([("Step Time Anomaly", None)] if pages else [])
    # /metrics says the same: active while shown, paging (what the exported Prometheus
    # rule fires on) only once it pages.
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    series = {"job": "j", "rank": "", "metric": "step_duration_seconds"}
    assert registry.get_sample_value("torshmon_anomaly_active", series) == 1.0
    assert registry.get_sample_value("torshmon_anomaly_paging", series) == (1.0 if pages else None)


@pytest.mark.parametrize("switch", [True, False])
def test_a_config_switch_starts_the_step_time_baseline_over(switch: bool) -> None:
    """An autotuner trial makes steps 1.6x longer (a slower codec) from step 41: with the
    config version rising there, nothing fires; the same change without a switch is a
    Step Time Anomaly."""
    live = LiveState(idle_s=60.0, anomaly_metrics=())  # step time's z-score alone
    durations = [0.1] * 40 + [0.16] * 40
    versions = [0] * 40 + ([1] if switch else [0]) * 40
    _job_steps(live, 2, durations, versions=versions)
    found = [f.labels.get("metric") for f in live.findings(1001.0)]
    assert found == ([] if switch else ["step_duration_seconds"])
    assert live.jobs["j"].config_version == (1 if switch else 0)
    # the alert engine's rate rules hear of it (when the aggregator learnt of it)
    assert live.config_switches() == ({"j": 1000.0} if switch else {})


def test_a_tuning_session_leaves_step_time_unjudged_until_it_has_settled() -> None:
    """While the autotuner tries configs the job's step time is not judged (a trial's
    slow steps are the tuner's to judge); once the session ends, the z-score starts
    over past the settling steps, so a slowdown then fires again."""
    live = LiveState(idle_s=60.0, anomaly_metrics=())
    _job_steps(live, 2, [0.1] * 40)
    live.set_tuning("j", True)
    assert live.jobs["j"].judged_from() > 10**18
    # a 2x slower trial, on the config the job already runs (no version change)
    _job_steps(live, 2, [0.1] * 40 + [0.2] * 40)
    assert live.findings(1001.0) == []
    live.set_tuning("j", False)
    assert live.jobs["j"].judged_from() == 80 + live.config_settle_steps
    _job_steps(live, 2, [0.1] * 40 + [0.2] * 40 + [0.1] * 40 + [0.3] * 10)
    assert [f.labels.get("metric") for f in live.findings(1002.0)] == ["step_duration_seconds"]


def _contended_job(*, held_in: str) -> LiveState:
    """Three ranks, 120 steps of ~0.1 s; from step 60 rank 2 is 0.2 s later than its
    peers: in its compute, in time its training thread waited for a CPU (``host``) or
    in its wait for the batch before the step (``input``)."""
    live = LiveState(idle_s=60.0)
    hellos = [wf.hello("j", rank, 3) for rank in range(3)]
    live.observe(Stored(acked_seq=0, hellos=hellos), now_unix_s=1000.0)
    for h in hellos:
        steps = []
        for n in range(1, 121):
            duration = 0.1 + 0.002 * ((n * (h.rank + 1)) % 5)
            held = 0.2 if h.rank == 2 and n >= 60 else 0.0
            in_step = 0.0 if held_in == "input" else held
            step = wf.step(
                n, duration_s=duration + in_step, comm_wait_s=0.01, end_unix_ns=n * 10**8
            )
            step = msgspec.structs.replace(
                step,
                cpu_wait_s=held + 0.001 if held_in == "host" else None,
                input_wait_s=0.002 + (held if held_in == "input" else 0.0),
            )
            steps.append(step)
        live.observe(Stored(acked_seq=0, batches=[(wf.batch(h, 1, steps), "n")]), 1000.0)
    return live


@pytest.mark.parametrize("held_in", ["compute", "host", "input"])
def test_a_rank_late_in_any_phase_is_the_straggler_named_with_that_phase(held_in: str) -> None:
    """Whatever makes rank 2 arrive late at the step's collectives (its compute, its
    node's other work keeping its thread from a CPU, its data loader), its peers wait for
    it: it is named, with the phase, and pages once it lasts."""
    [finding] = _contended_job(held_in=held_in).run("j").straggler.active()
    assert finding.labels["rank"] == "2"
    assert finding.details["phase"] == held_in
    assert finding.details["page"] is True
    assert finding.details["excess_s"] == pytest.approx(0.2, abs=0.01)


@pytest.mark.parametrize("waited", [0.0, 0.0015, 0.15])
def test_a_slowdown_a_busy_node_explains_is_no_step_time_anomaly(waited: float) -> None:
    """Steps 2.5x slower while one rank's threads waited 0.15 s for a CPU in each (a busy
    node held its communication back): no Step Time Anomaly. The same slowdown with no
    wait, or a wait far short of the rise, is one."""
    live = LiveState(idle_s=60.0, anomaly_metrics=())
    waits = [0.0] * 40 + [waited] * 10
    _job_steps(live, 2, [0.1] * 40 + [0.25] * 10, process_waits={1: waits})
    found = [f.labels.get("metric") for f in live.findings(1001.0)]
    assert found == ([] if waited == 0.15 else ["step_duration_seconds"])
