"""Property-based fuzz of the ingest API: whatever arrives, never a 5xx, nothing stored lost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, select

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread, count
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.history.models import Base

pytestmark = pytest.mark.integration

H0 = wf.hello("fuzz", 0, 2, session="s0")
H1 = wf.hello("fuzz", 1, 2, session="s1")
VALID = json.loads(
    wf.ingest_body(
        "agent-f",
        [
            (1, wf.record(H0, H1, samples=[wf.node_sample("fuzz", 2)])),
            (
                2,
                wf.record(wf.batch(H0, 1, [wf.step(1), wf.step(2)]), wf.batch(H1, 1, [wf.step(1)])),
            ),
        ],
    )
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=300),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=10,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    """A valid body with a few parts replaced, removed or added, or raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    body = json.loads(json.dumps(VALID))
    # Fresh sequence numbers, so a mutated body that is still valid is new data.
    seq = draw(st.integers(min_value=3, max_value=10**9))
    for i, record in enumerate(body["records"]):
        record["seq"] = seq + i
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)[1:]
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(json_value)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_value)
        else:
            parent.append(draw(json_value))
        if not isinstance(body, dict) or not body:
            break
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def agg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AggregatorThread]:
    path: Path = tmp_path_factory.mktemp("fuzz") / "history.db"
    settings = AggregatorSettings(
        port=0, db_url=f"sqlite:///{path}", token="t", aggregator_id="fuzz", eval_interval_s=0.2
    )
    with AggregatorThread(settings) as thread:
        status, _ = thread.post_ingest(json.dumps(VALID).encode())
        assert status == 200
        yield thread


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=mutated_bodies())
def test_any_body_gets_a_4xx_or_is_stored_and_nothing_is_lost(
    agg: AggregatorThread, body: bytes
) -> None:
    before = _step_rows(agg.settings.db_url)
    status, reply = agg.post_ingest(body)
    assert status in (200, 400, 413), (status, reply)
    after = _step_rows(agg.settings.db_url)
    assert before <= after  # no stored row lost or changed
    if status != 200:
        assert reply.get("error"), reply
        assert after == before  # a refused body stores nothing
    else:
        # at most the body's own steps are new (3 in the valid body, more if one was added)
        assert len(after - before) <= body.count(b'"step"'), (after - before, body)
    assert agg.get("/healthz")[0] == 200


def _step_rows(url: str) -> set[tuple[Any, ...]]:
    """Every stored step row, all columns but the surrogate id."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            table = Base.metadata.tables["steps"]
            columns = [c for c in table.columns if c.name != "id"]
            return {tuple(row) for row in conn.execute(select(*columns))}
    finally:
        engine.dispose()


def test_replayed_sequences_are_deduplicated_after_the_fuzz(agg: AggregatorThread) -> None:
    before = count(agg.settings.db_url, "steps")
    status, reply = agg.post_ingest(json.dumps(VALID).encode())
    assert status == 200 and reply["acked_seq"] >= 2
    assert count(agg.settings.db_url, "steps") == before
