"""An on/off straggler in a real 3-rank gloo DDP job (``torshmon demo``'s system): one
Straggler alert naming the rank, paged in its first slow spell once the slowness lasts
(16 slow steps), kept firing through the normal spells between, resolved after the fault
ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from torshmon.demo import DemoConfig, run_system
from torshmon.faults import parse_fault
from torshmon.history.query import run_query

pytestmark = pytest.mark.integration

#: Rank 2 computes 8x slower (the fault sleeps inside the step, after the optimizer:
#: compute, not communication) for 20 steps, then 12 normal, then 15 and 15 with 12
#: between (the first spell outlasts the 16 slow steps a page takes). The
#: magnitude is for the lifecycle under test, not sensitivity (that is the golden
#: scenarios' and benchmarks/detection.py's): on 2 cores shared with other busy
#: processes single steps of a healthy rank scatter 2-5x, the noise bar rises with them,
#: and 2.5x and 4x went unnamed in some runs.
SPELLS = [(45, 65), (77, 92), (104, 119)]
STEPS = 185


async def test_an_on_off_straggler_is_one_alert_from_first_spell_to_after_the_last(
    tmp_path: Path,
) -> None:
    specs = [f"straggler:rank=2,slowdown=7,from={a},to={b}" for a, b in SPELLS]
    config = DemoConfig(
        world_size=3,
        steps=STEPS,
        hidden=512,
        layers=3,
        db=tmp_path / "history.db",
        step_compute_s=0.1,  # ~115 ms steps, as in test_faults.py
        faults=tuple(parse_fault(spec) for spec in specs),
        linger_s=2.0,
        quiet=True,
    )
    result = await run_system(config)
    events: dict[str, float] = {}
    for per_rank in result.results:
        events.update({k: v for k, v in per_rank.items() if k.startswith("fault")})
    stragglers = [
        a for a in result.alerts if a["rule"] == "Straggler" and a["fired_at_unix_s"] is not None
    ]
    # One alert, naming rank 2: the normal spells between the slow ones did not resolve it.
    assert [a["rank"] for a in stragglers] == [2], result.alerts
    (alert,) = stragglers
    onset = events["fault0_onset_unix_s"]
    assert alert["fired_at_unix_s"] >= onset
    # Paged at the 16th slow step of its last 28 (a few of them may be noise before the
    # onset), and a few more for the pipeline (the agent's flush, the rule evaluation):
    # steps rank 2 ended before it fired.
    ends = run_query(
        config.db_url,
        "SELECT step, end_unix_ns FROM steps WHERE rank = 2 ORDER BY step",
    ).rows
    before = [step for step, end_ns in ends if onset < end_ns / 1e9 <= alert["fired_at_unix_s"]]
    assert 12 <= len(before) <= 21, before
    # Still firing when the last spell ended; resolved after it.
    last_end = events[f"fault{len(SPELLS) - 1}_end_unix_s"]
    assert alert["state"] == "resolved"
    assert alert["ends_at_unix_s"] > last_end
