from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.hang import HangDetector, HangSettings
from torshmon.wire import InflightOp, ProcessGroupMembers

DATA = Path(__file__).parent / "data" / "detection"
NOW = 1000.0


def _op(
    seq: int, age_s: float, *, op: str = "all_reduce", pg: str = "default", peer: int | None = None
) -> InflightOp:
    return InflightOp(
        pg=pg,
        seq=seq,
        op=op,
        size_bytes=4096,
        start_unix_ns=int((NOW - age_s) * 1e9),
        age_s=age_s,
        peer=peer,
    )


def _detector(world: int | None = 4, timeout_s: float = 5.0) -> HangDetector:
    det = HangDetector(HangSettings(timeout_s=timeout_s))
    if world is not None:
        det.set_world("demo", world)
    return det


def _by_rank(findings: list[Finding]) -> dict[str | None, Finding]:
    return {f.labels.get("rank"): f for f in findings}


@pytest.mark.parametrize("path", sorted(DATA.glob("hang_*.json")), ids=lambda p: p.stem)
def test_golden_scenarios(path: Path) -> None:
    scenario: dict[str, Any] = json.loads(path.read_text())
    det = HangDetector(HangSettings(timeout_s=scenario["timeout_s"]))
    det.set_world("demo", scenario["world_size"])
    det.observe_groups(
        "demo", msgspec.convert(scenario.get("groups", []), list[ProcessGroupMembers])
    )
    for report in scenario["reports"]:
        inflight = msgspec.convert(report["inflight"], list[InflightOp])
        det.observe("demo", report["rank"], report["ts_unix_s"], inflight)
    findings = det.evaluate(scenario["now_unix_s"])
    got: list[dict[str, Any]] = sorted(
        (
            {
                "labels": dict(f.labels),
                "reason": f.details["reason"],
                "waiting_ranks": f.details["waiting_ranks"],
                "seq": f.details["seq"],
                "victims": f.details["victims"],
                "summary": f.summary,
            }
            for f in findings
        ),
        key=lambda d: sorted(d["labels"].items()),
    )
    expected = sorted(scenario["expected"], key=lambda d: sorted(d["labels"].items()))
    assert got == expected
    assert all(f.kind == "hang" and f.severity == "critical" and f.recommendation for f in findings)


def test_the_missing_rank_is_named_with_op_seq_and_age() -> None:
    det = _detector()
    for rank in (0, 2, 3):
        det.observe("demo", rank, NOW - 0.2, [_op(1234, 7.0)])
    det.observe("demo", 1, NOW - 0.1, [])
    (finding,) = det.evaluate(NOW)
    assert dict(finding.labels) == {"job": "demo", "rank": "1", "op": "all_reduce", "pg": "default"}
    assert finding.value == pytest.approx(7.2)
    assert finding.score == pytest.approx(7.2 / 5.0)
    assert finding.since_unix_s == pytest.approx(NOW - 7.2 + 5.0)
    assert finding.details["waiting_ranks"] == [0, 2, 3]
    assert finding.details["seq"] == 1234
    assert finding.details["age_s"] == pytest.approx(7.2)
    assert "rank 1" in finding.recommendation.lower()


def test_nothing_before_the_timeout() -> None:
    det = _detector()
    for rank in (0, 2, 3):
        det.observe("demo", rank, NOW, [_op(1234, 4.9)])
    det.observe("demo", 1, NOW, [])
    assert det.evaluate(NOW) == []
    # the age grows with the time since the report
    assert len(det.evaluate(NOW + 0.2)) == 1


def test_it_clears_once_the_collective_completes() -> None:
    det = _detector(world=2)
    det.observe("demo", 0, NOW, [_op(10, 6.0)])
    det.observe("demo", 1, NOW, [])
    assert len(det.evaluate(NOW)) == 1
    det.observe("demo", 0, NOW + 0.5, [])
    assert det.evaluate(NOW + 0.5) == []


def test_since_is_stable_across_evaluations() -> None:
    det = _detector(world=2)
    det.observe("demo", 1, NOW, [])
    det.observe("demo", 0, NOW, [_op(10, 6.0)])
    first = det.evaluate(NOW)[0].since_unix_s
    # the next heartbeat's age is a little off (it is measured on the rank)
    det.observe("demo", 0, NOW + 1.0, [_op(10, 6.93)])
    det.observe("demo", 1, NOW + 1.0, [])
    (later,) = det.evaluate(NOW + 1.0)
    assert later.since_unix_s == first
    assert later.value == pytest.approx(6.93)


def test_a_rank_that_never_reported_is_missing_once_the_world_is_known() -> None:
    det = _detector(world=3)
    det.observe("demo", 0, NOW, [_op(3, 8.0)])
    det.observe("demo", 1, NOW, [_op(3, 8.0)])
    (finding,) = det.evaluate(NOW)
    assert finding.labels["rank"] == "2"
    assert finding.details["reason"] == "no_report"
    assert finding.summary.startswith("rank 2 of job demo has not reported and never joined")


def test_without_a_world_size_members_are_the_ranks_seen() -> None:
    det = _detector(world=None)
    det.observe("demo", 0, NOW, [_op(3, 8.0)])
    det.observe("demo", 1, NOW, [_op(3, 8.0)])
    # nobody else is known: both joined, so the collective itself is stuck
    (finding,) = det.evaluate(NOW)
    assert "rank" not in finding.labels
    det.observe("demo", 2, NOW, [])
    (finding,) = det.evaluate(NOW)
    assert finding.labels["rank"] == "2"


def test_a_silent_waiting_rank_is_no_evidence_of_a_hang() -> None:
    det = _detector(world=2)
    # rank 0 said it was in a collective, then went silent; rank 1 is busy computing
    det.observe("demo", 0, NOW - 9.0, [_op(10, 0.5)])
    det.observe("demo", 1, NOW - 0.2, [])
    assert det.evaluate(NOW) == []


def test_everyone_stuck_is_one_job_level_finding_only_once_the_last_rank_waited_long() -> None:
    det = _detector(world=3)
    det.observe("demo", 0, NOW, [_op(9, 12.0)])
    det.observe("demo", 1, NOW, [_op(9, 11.0)])
    det.observe("demo", 2, NOW, [_op(9, 1.0)])  # joined a second ago
    assert det.evaluate(NOW) == []
    (finding,) = det.evaluate(NOW + 4.5)
    assert dict(finding.labels) == {"job": "demo", "op": "all_reduce", "pg": "default"}
    assert finding.details["reason"] == "all_stuck"
    assert finding.value == pytest.approx(16.5)
    assert finding.since_unix_s == pytest.approx(NOW + 4.0)
    assert "network" in finding.recommendation


def test_a_subgroup_only_compares_its_members() -> None:
    det = _detector(world=4)
    # earlier reports showed ranks 0 and 1 on group "1" (a two-rank subgroup)
    det.observe("demo", 0, NOW - 3.0, [_op(1, 0.1, pg="1")])
    det.observe("demo", 1, NOW - 3.0, [_op(1, 0.1, pg="1")])
    det.observe("demo", 0, NOW, [_op(2, 6.0, pg="1", op="all_gather")])
    det.observe("demo", 1, NOW, [])
    det.observe("demo", 2, NOW, [])
    det.observe("demo", 3, NOW, [])
    (finding,) = det.evaluate(NOW)
    assert dict(finding.labels) == {"job": "demo", "rank": "1", "op": "all_gather", "pg": "1"}
    assert finding.summary == (
        "rank 1 of job demo never joined all_gather #2 on pg 1 that rank 0 entered 6.0 s ago"
    )


def test_a_rank_on_a_newer_seq_skipped_the_collective() -> None:
    det = _detector(world=3)
    det.observe("demo", 0, NOW, [_op(5, 7.0)])
    det.observe("demo", 1, NOW, [_op(5, 7.0)])
    det.observe("demo", 2, NOW, [_op(6, 6.5, op="broadcast")])
    (finding,) = det.evaluate(NOW)
    assert finding.labels["rank"] == "2"
    assert finding.details["reason"] == "never_joined"
    assert finding.details["seq"] == 5


def test_point_to_point_is_judged_only_between_the_two_ranks() -> None:
    det = _detector(world=3)
    det.observe("demo", 0, NOW, [_op(4, 6.0, op="send", peer=1)])
    det.observe("demo", 1, NOW, [_op(3, 9.0, op="recv", peer=0)])  # still on an older recv
    det.observe("demo", 2, NOW, [])  # not involved: never named
    # Rank 1 is behind on its ops with rank 0: it is the cause, and rank 0, which moved
    # on to send #4, waits for it - a victim, not blamed for rank 1's recv #3.
    (finding,) = det.evaluate(NOW)
    assert dict(finding.labels) == {"job": "demo", "rank": "1", "op": "send", "pg": "default"}
    assert finding.details["reason"] == "stuck_in_older_op"
    assert finding.details["waiting_ranks"] == [0]


def test_it_accepts_any_object_with_the_inflight_fields() -> None:
    @dataclass(frozen=True)
    class Op:
        pg: str
        seq: int
        op: str
        start_unix_ns: int
        age_s: float
        peer: int | None = None

    det = _detector(world=2)
    det.observe("demo", 0, NOW, [Op("default", 2, "barrier", 0, 6.0)])
    det.observe("demo", 1, NOW, ())
    (finding,) = det.evaluate(NOW)
    assert finding.labels["op"] == "barrier"


def test_an_older_report_does_not_replace_a_newer_one() -> None:
    det = _detector(world=2)
    det.observe("demo", 0, NOW, [_op(1, 6.0)])
    det.observe("demo", 1, NOW, [])
    det.observe("demo", 0, NOW - 2.0, [])  # a late duplicate of an earlier batch
    assert len(det.evaluate(NOW)) == 1


def test_jobs_are_independent_and_forget_drops_one() -> None:
    det = _detector(world=2)
    det.set_world("other", 2)
    for job in ("demo", "other"):
        det.observe(job, 0, NOW, [_op(1, 6.0)])
        det.observe(job, 1, NOW, [])
    assert [f.labels["job"] for f in det.evaluate(NOW)] == ["demo", "other"]
    det.forget("demo")
    assert [f.labels["job"] for f in det.evaluate(NOW)] == ["other"]


def test_a_smaller_world_drops_reports_of_ranks_outside_it() -> None:
    det = _detector(world=4)
    det.observe("demo", 3, NOW, [_op(1, 9.0)])
    det.set_world("demo", 2)
    det.observe("demo", 0, NOW, [])
    det.observe("demo", 1, NOW, [])
    assert det.evaluate(NOW) == []


def test_bad_input_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        HangSettings(timeout_s=0)
    det = _detector(world=2)
    with pytest.raises(ValueError, match="world_size"):
        det.set_world("demo", 0)
    with pytest.raises(ValueError, match=r"rank of job 'demo' must be in 0\.\.1, got 2"):
        det.observe("demo", 2, NOW, [])
    with pytest.raises(ValueError, match="rank"):
        HangDetector().observe("demo", -1, NOW, [])


def test_short_steps_shorten_the_collective_timeout_down_to_its_floor() -> None:
    det = _detector(world=2)
    assert det.collective_timeout_s("demo") == 5.0  # no step seen yet
    det.observe("demo", 0, NOW, [_op(50, 2.5)])
    det.observe("demo", 1, NOW, [])
    assert det.evaluate(NOW) == []
    for _ in range(50):
        det.observe_step_duration("demo", 0.012)  # 20 x 12 ms is under the 2 s floor
    assert det.collective_timeout_s("demo") == 2.0
    [finding] = det.evaluate(NOW)
    assert (finding.labels["rank"], finding.details["reason"]) == ("1", "never_joined")


def test_long_steps_keep_the_configured_timeout_and_bad_durations_are_ignored() -> None:
    det = _detector(world=2)
    det.observe_step_duration("demo", float("nan"))
    det.observe_step_duration("demo", -1.0)
    assert det.collective_timeout_s("demo") == 5.0
    det.observe_step_duration("demo", 0.15)
    assert det.collective_timeout_s("demo") == pytest.approx(3.0)
    det.observe_step_duration("demo", 10.0)
    assert det.collective_timeout_s("demo") == 5.0  # capped by timeout_s
    with pytest.raises(ValueError, match="step_multiple"):
        HangSettings(step_multiple=0)


# -- silence is not a hang (issue 23) ---------------------------------------------------


def test_a_quiet_nodes_last_reports_make_no_hang_against_the_healthy_node() -> None:
    """Node b's agent died right after its ranks reported being in all_reduce #7; the
    ranks of node a keep reporting, outside any collective. Their peers' old op is
    not extrapolated past what node b's agent delivered, and once node b is quiet
    for ``fresh_s`` its reports are no evidence at all."""
    det = HangDetector(HangSettings(timeout_s=5.0, min_timeout_s=2.0, fresh_s=3.0))
    det.set_world("demo", 4)
    for _ in range(50):
        det.observe_step_duration("demo", 0.02)  # short steps: the 2 s floor applies
    for rank in (2, 3):
        det.observe("demo", rank, NOW, [_op(7, 0.01)], node="b")
    for t in (NOW + 1.0, NOW + 2.0, NOW + 2.5, NOW + 4.0, NOW + 10.0):
        for rank in (0, 1):
            det.observe("demo", rank, t, [], node="a")
        assert det.evaluate(t, {"a": t, "b": NOW}) == [], t


def test_a_probe_catching_up_after_its_agent_came_back_shows_no_hang() -> None:
    """Node b's agent restarted: it is heard again (its horizon is now), and its ranks'
    probes resend what they buffered meanwhile, one batch per ack, each arriving
    seconds after its own time. Rank 3's report from 4 s ago shows it in all_reduce #525,
    which it has long left (its newer reports are queued behind it): it is not taken as
    4 s of waiting, so node a's ranks, past #525, are not named as never joining it
    (a fresh-clone CI run named ranks 0, 1 and 2 so). A report that came on time keeps
    vouching for the silence after it."""
    det = HangDetector(HangSettings(timeout_s=5.0, min_timeout_s=2.0, fresh_s=3.0))
    det.set_world("demo", 4)
    for _ in range(50):
        det.observe_step_duration("demo", 0.02)  # short steps: the 2 s floor applies
    for rank in (0, 1):
        det.observe("demo", rank, NOW, [], node="a", received_unix_s=NOW)
    det.observe("demo", 2, NOW - 4.0, [_op(523, 0.01)], node="b", received_unix_s=NOW)
    det.observe("demo", 3, NOW - 4.0, [_op(525, 0.01)], node="b", received_unix_s=NOW)
    for t in (NOW, NOW + 0.5):
        assert det.evaluate(t, {"a": t, "b": t}) == [], t
    # The same reports, come on time 4 s ago and nothing from those ranks since while
    # their agent is heard: they did wait (or stopped reporting), and it is a hang.
    det = HangDetector(HangSettings(timeout_s=5.0, min_timeout_s=2.0, fresh_s=3.0))
    det.set_world("demo", 4)
    for _ in range(50):
        det.observe_step_duration("demo", 0.02)
    for rank in (0, 1):
        det.observe("demo", rank, NOW, [], node="a", received_unix_s=NOW)
    det.observe("demo", 2, NOW - 4.0, [_op(523, 0.01)], node="b", received_unix_s=NOW - 4.0)
    det.observe("demo", 3, NOW - 4.0, [_op(525, 0.01)], node="b", received_unix_s=NOW - 4.0)
    found = _by_rank(det.evaluate(NOW, {"a": NOW, "b": NOW}))
    assert set(found) == {"0", "1", "2"}


def test_a_genuine_hang_still_fires_with_fresh_reports_through_live_agents() -> None:
    det = HangDetector(HangSettings(timeout_s=5.0, fresh_s=3.0))
    det.set_world("demo", 4)
    for t in (NOW, NOW + 1.0, NOW + 2.0):
        for rank in (2, 3):
            det.observe("demo", rank, t, [_op(7, 4.0 + (t - NOW))], node="b")
        for rank in (0, 1):
            det.observe("demo", rank, t, [], node="a")
    found = det.evaluate(NOW + 2.5, {"a": NOW + 2.4, "b": NOW + 2.4})
    assert sorted(f.labels["rank"] for f in found) == ["0", "1"]
    assert {f.details["reason"] for f in found} == {"never_joined"}
    # The age extrapolates up to what node b's agent vouches for, not beyond.
    assert found[0].value == pytest.approx(6.0 + 0.4)


def test_a_rank_on_a_quiet_node_is_not_named_but_a_silent_rank_under_a_live_agent_is() -> None:
    det = HangDetector(HangSettings(timeout_s=5.0, fresh_s=3.0))
    det.set_world("demo", 3)
    det.observe("demo", 0, NOW, [_op(4, 8.0)], node="a")
    det.observe("demo", 1, NOW - 6.0, [], node="b")  # its agent is gone
    det.observe("demo", 2, NOW - 6.0, [], node="a")  # its agent is heard, it is not
    (finding,) = det.evaluate(NOW, {"a": NOW, "b": NOW - 6.0})
    assert (finding.labels["rank"], finding.details["reason"]) == ("2", "stopped_reporting")
    # Node b back: rank 1's fresh report shows it elsewhere, so it is named too.
    det.observe("demo", 1, NOW + 0.5, [], node="b")
    found = _by_rank(det.evaluate(NOW + 0.5, {"a": NOW + 0.5, "b": NOW + 0.5}))
    assert found["1"].details["reason"] == "never_joined"


def test_fresh_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="fresh_s"):
        HangSettings(fresh_s=0.0)


def test_an_exited_rank_waits_in_nothing_and_is_named_as_exited() -> None:
    det = HangDetector(HangSettings(timeout_s=5.0))
    det.set_world("demo", 3)
    det.observe("demo", 0, NOW, [_op(9, 8.0)], node="a")
    det.observe("demo", 1, NOW, [_op(9, 8.0)], node="a")
    det.observe("demo", 2, NOW - 1.0, [], node="b")
    # The job ended: ranks 0 and 1 last reported from inside the collective.
    assert det.evaluate(NOW, {"a": NOW, "b": NOW}, gone={("demo", 0), ("demo", 1)}) == []
    # Rank 2's process is gone while its peers wait: that is the hang.
    found = det.evaluate(NOW, {"a": NOW, "b": NOW}, gone={("demo", 2)})
    assert [(f.labels["rank"], f.details["reason"]) for f in found] == [("2", "process_gone")]
    assert "has exited" in found[0].summary


# -- membership, root cause and victims (issue 19) --------------------------------------


def _groups(**members: list[int]) -> list[ProcessGroupMembers]:
    return [ProcessGroupMembers(pg=pg, ranks=ranks) for pg, ranks in members.items()]


def test_without_reported_members_a_subgroup_is_not_said_to_have_every_member_in() -> None:
    det = _detector(world=4)
    det.observe("demo", 2, NOW, [_op(7, 8.0, pg="3")])
    det.observe("demo", 3, NOW, [])
    for rank in (0, 1):
        det.observe("demo", rank, NOW, [_op(31, 7.5, op="ddp_reduce")])
    unknown = {f.details["reason"]: f for f in det.evaluate(NOW)}
    assert "its members were not reported" in unknown["all_stuck"].summary
    # Once the probes report group 3's members, rank 3 is the one named, alone.
    det.observe_groups("demo", _groups(**{"3": [2, 3]}))
    (finding,) = det.evaluate(NOW)
    assert (finding.labels["rank"], finding.labels["pg"]) == ("3", "3")
    assert finding.details["members"] == [2, 3]
    assert finding.details["victims"] == [0, 1, 2]


def test_a_rank_briefly_busy_in_another_group_is_not_named_until_its_own_wait_lasts() -> None:
    det = _detector(world=4)
    det.observe_groups("demo", _groups(**{"3": [2, 3]}))
    for rank in (0, 1):
        det.observe("demo", rank, NOW, [_op(31, 6.0)])
    det.observe("demo", 2, NOW, [_op(7, 1.0, pg="3")])  # entered a second ago
    det.observe("demo", 3, NOW, [])
    (finding,) = det.evaluate(NOW)
    assert finding.labels["rank"] == "3"  # not in any collective: it holds world #31 up
    assert finding.labels["pg"] == "default"
    # Later rank 2's own wait in group 3 has lasted too: rank 2 is a victim, and rank 3
    # is still named for world #31, the op it has held up longest (one identity).
    det.observe("demo", 2, NOW + 4.5, [_op(7, 5.5, pg="3")])
    det.observe("demo", 3, NOW + 4.5, [])
    for rank in (0, 1):
        det.observe("demo", rank, NOW + 4.5, [_op(31, 10.5)])
    (finding,) = det.evaluate(NOW + 4.5)
    assert (finding.labels["rank"], finding.labels["pg"]) == ("3", "default")
    assert finding.details["victims"] == [0, 1, 2]


def test_a_waiting_rank_is_not_named_while_its_own_op_is_young() -> None:
    det = _detector(world=4)
    det.observe_groups("demo", _groups(**{"3": [2, 3]}))
    for rank in (0, 1):
        det.observe("demo", rank, NOW, [_op(31, 6.0)])
    det.observe("demo", 2, NOW, [_op(7, 1.0, pg="3")])
    det.observe("demo", 3, NOW, [_op(7, 1.0, pg="3")])  # both in it: about to finish
    assert det.evaluate(NOW) == []


def test_groups_naming_ranks_outside_the_world_are_ignored() -> None:
    det = _detector(world=2)
    det.observe_groups("demo", _groups(**{"5": [1, 2]}, **{"6": []}))
    det.observe("demo", 0, NOW, [_op(1, 6.0, pg="5")])
    det.observe("demo", 1, NOW, [])
    # "5" falls back to the ranks seen on it: rank 0 only, so nobody is named missing
    (finding,) = det.evaluate(NOW)
    assert finding.details["reason"] == "all_stuck"


def test_victims_are_listed_from_the_first_finding_even_before_their_own_wait_lasts() -> None:
    det = _detector(world=4)
    det.observe("demo", 0, NOW, [_op(9, 6.0, op="irecv", peer=1)])
    det.observe("demo", 1, NOW, [])  # never posts its send
    for rank in (2, 3):
        det.observe("demo", rank, NOW, [_op(20, 0.5)])  # just entered the next all-reduce
    (finding,) = det.evaluate(NOW)
    assert (finding.labels["rank"], finding.labels["op"]) == ("1", "irecv")
    assert finding.details["victims"] == [0, 2, 3]
    assert finding.summary == (
        "rank 1 of job demo never posted the send matching rank 0's irecv #9 on pg default, "
        "entered 6.0 s ago; ranks 2, 3 wait behind it in all_reduce #20 on pg default"
    )


# -- a rank that closed (its probe's last batch says so) --------------------------------


def _short_steps(det: HangDetector) -> HangDetector:
    det.observe_step_duration("demo", 0.02)  # the collective timeout comes down to 2 s
    return det


def test_a_clean_end_is_no_hang_though_a_rank_closed_while_its_peer_waited_in_a_gather() -> None:
    # The reproduction: rank 0's last report was sent while it waited in a final
    # all_gather for rank 1; both then finished. Rank 1's last batch says it closed.
    det = _short_steps(_detector(world=2))
    det.observe("demo", 0, NOW, [_op(93, 0.05, op="all_gather")])
    det.observe("demo", 1, NOW + 0.1, [], closed=True)
    for later in (0.0, 2.2, 4.9):
        assert det.evaluate(NOW + later) == []
    # Without the mark, the same reports age into a page naming rank 1.
    unmarked = _short_steps(_detector(world=2))
    unmarked.observe("demo", 0, NOW, [_op(93, 0.05, op="all_gather")])
    unmarked.observe("demo", 1, NOW + 0.1, [])
    (finding,) = unmarked.evaluate(NOW + 2.2)
    assert (finding.labels["rank"], finding.labels["op"], finding.details["seq"]) == (
        "1",
        "all_gather",
        93,
    )


def test_a_rank_that_closed_with_an_op_in_flight_waits_in_nothing() -> None:
    # close() at the process's exit while another thread was in a collective: the
    # rank's last report shows the op, but a closed rank waits for no one.
    det = _detector(world=2)
    det.observe("demo", 0, NOW, [_op(5, 9.0)], closed=True)
    det.observe("demo", 1, NOW, [])
    assert det.evaluate(NOW + 1.0) == []
    # Open, the same report names rank 1 as holding rank 0 up.
    det.observe("demo", 0, NOW + 0.5, [_op(5, 9.5)])
    assert [f.labels["rank"] for f in det.evaluate(NOW + 1.0)] == ["1"]


def test_a_closed_rank_is_left_out_and_the_open_rank_missing_is_still_named() -> None:
    det = _detector(world=4)
    det.observe("demo", 0, NOW, [_op(7, 6.0)])
    det.observe("demo", 2, NOW, [_op(7, 6.5)])
    det.observe("demo", 1, NOW, [], closed=True)
    det.observe("demo", 3, NOW, [])  # open, never joined: the hang
    (finding,) = det.evaluate(NOW)
    assert finding.labels["rank"] == "3"
    assert finding.details["reason"] == "never_joined"
    assert finding.details["waiting_ranks"] == [0, 2]
    assert finding.details["members"] == [0, 1, 2, 3]
    assert finding.summary.startswith(
        "rank 3 of job demo never joined all_reduce #7 on pg default"
    ), finding.summary


def test_a_peer_that_closed_is_not_named_for_a_point_to_point_op() -> None:
    det = _detector(world=2)
    det.observe("demo", 0, NOW, [_op(3, 8.0, op="irecv", peer=1)])
    det.observe("demo", 1, NOW, [], closed=True)
    assert det.evaluate(NOW) == []
    det.observe("demo", 1, NOW + 0.1, [])  # it attached again: open, and it is the hang
    (finding,) = det.evaluate(NOW + 0.1)
    assert (finding.labels["rank"], finding.labels["op"]) == ("1", "irecv")


def test_a_closed_rank_is_not_among_the_waiting_ranks_of_a_finding() -> None:
    # Ranks 0 and 1 wait in #4 for rank 2; rank 3 closed, its last report in #4.
    det = _detector(world=4)
    det.observe("demo", 0, NOW, [_op(4, 7.0)])
    det.observe("demo", 1, NOW, [_op(4, 6.0)])
    det.observe("demo", 2, NOW, [])
    det.observe("demo", 3, NOW, [_op(4, 7.5)], closed=True)
    (finding,) = det.evaluate(NOW)
    assert finding.labels["rank"] == "2"
    assert finding.details["waiting_ranks"] == [0, 1]
    assert finding.value == pytest.approx(7.0)
