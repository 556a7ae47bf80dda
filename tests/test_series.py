from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torshmon.aggregator.core.series import Cursor, LabelSet, SeriesStore, labelset, labelset_from


def test_labelset_is_sorted_whatever_the_input_order() -> None:
    expected = (("job", "j"), ("rank", "3"))
    assert labelset(rank="3", job="j") == expected
    assert labelset_from({"rank": "3", "job": "j"}) == expected
    assert labelset_from((("rank", "3"), ("job", "j"))) == expected


def test_a_mapping_and_a_labelset_address_the_same_series() -> None:
    store = SeriesStore()
    store.add("loss", {"rank": "0", "job": "j"}, 10.0, 1.5)
    store.add("loss", labelset(job="j", rank="0"), 11.0, 1.25)
    assert store.points("loss", {"job": "j", "rank": "0"}, 0.0) == [(10.0, 1.5), (11.0, 1.25)]
    assert store.latest("loss") == [(labelset(job="j", rank="0"), 11.0, 1.25)]
    assert store.series_count() == 1


def test_latest_last_seen_and_metrics() -> None:
    store = SeriesStore()
    for rank in range(3):
        for step in range(5):
            store.add("step_duration_seconds", labelset(job="j", rank=str(rank)), step, rank + step)
    store.add("cpu_utilization_ratio", labelset(node="n1"), 3.0, 0.5)
    latest = {labels: (ts, value) for labels, ts, value in store.latest("step_duration_seconds")}
    assert latest == {labelset(job="j", rank=str(rank)): (4.0, rank + 4.0) for rank in range(3)}
    assert store.last_seen("cpu_utilization_ratio") == {labelset(node="n1"): 3.0}
    assert store.metrics() == {"step_duration_seconds", "cpu_utilization_ratio"}
    assert store.latest("unknown") == []
    assert store.last_seen("unknown") == {}
    assert store.points("unknown", {}, 0.0) == []
    assert store.points("cpu_utilization_ratio", {"node": "n2"}, 0.0) == []


def test_points_since_is_inclusive_and_oldest_first() -> None:
    store = SeriesStore()
    labels = labelset(job="j", rank="0")
    for ts in range(10):
        store.add("loss", labels, float(ts), float(ts * 2))
    assert store.points("loss", labels, 7.0) == [(7.0, 14.0), (8.0, 16.0), (9.0, 18.0)]
    assert store.points("loss", labels, 100.0) == []
    assert len(store.points("loss", labels, -1.0)) == 10


def test_nan_is_stored() -> None:
    store = SeriesStore()
    store.add("loss", labelset(job="j", rank="0"), 1.0, math.nan)
    [(_, _, value)] = store.latest("loss")
    assert math.isnan(value)


def test_out_of_order_points_are_dropped_and_counted() -> None:
    store = SeriesStore()
    labels = labelset(node="n")
    store.add("cpu_utilization_ratio", labels, 5.0, 0.1)
    store.add("cpu_utilization_ratio", labels, 4.0, 0.2)
    store.add("cpu_utilization_ratio", labels, 5.0, 0.3)  # same time is kept
    assert store.points("cpu_utilization_ratio", labels, 0.0) == [(5.0, 0.1), (5.0, 0.3)]
    assert store.out_of_order_total == 1


def test_max_points_keeps_the_newest() -> None:
    store = SeriesStore(max_points=3)
    labels = labelset(node="n")
    for ts in range(10):
        store.add("cpu_utilization_ratio", labels, float(ts), 0.0)
    assert [ts for ts, _ in store.points("cpu_utilization_ratio", labels, 0.0)] == [7.0, 8.0, 9.0]


def test_expire_drops_old_points_then_empty_series_and_metrics() -> None:
    store = SeriesStore(retention_s=10.0)
    old, fresh = labelset(job="j", rank="0"), labelset(job="j", rank="1")
    for ts in range(0, 20):
        store.add("loss", fresh, float(ts), 1.0)
    for ts in range(0, 5):
        store.add("loss", old, float(ts), 1.0)
    store.add("cpu_utilization_ratio", labelset(node="n"), 2.0, 0.5)
    dropped = store.expire(now_unix_s=20.0)
    assert dropped == 10 + 5 + 1
    assert store.last_seen("loss") == {fresh: 19.0}
    assert [ts for ts, _ in store.points("loss", fresh, 0.0)] == [float(t) for t in range(10, 20)]
    assert store.metrics() == {"loss"}
    assert store.expire(now_unix_s=20.0) == 0


def test_forget_drops_series_whose_labels_contain_the_match() -> None:
    store = SeriesStore()
    for job in ("a", "b"):
        for rank in ("0", "1"):
            store.add("loss", labelset(job=job, rank=rank), 1.0, 1.0)
            store.add("rank_memory_rss_bytes", labelset(job=job, rank=rank, node="n"), 1.0, 1.0)
    store.add("cpu_utilization_ratio", labelset(node="n"), 1.0, 0.5)
    assert store.forget({"job": "a"}) == 4
    assert {labels for labels, _, _ in store.latest("loss")} == {
        labelset(job="b", rank="0"),
        labelset(job="b", rank="1"),
    }
    assert store.forget({"job": "b", "rank": "1"}) == 2
    assert store.forget({"job": "zzz"}) == 0
    assert store.series_count() == 3
    assert store.forget({"node": "n"}) == 2
    assert store.metrics() == {"loss"}


def test_forget_refuses_an_empty_match() -> None:
    with pytest.raises(ValueError, match="empty match"):
        SeriesStore().forget({})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"retention_s": 0.0}, "retention_s"), ({"max_points": 0}, "max_points")],
)
def test_constructor_rejects_bad_bounds(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SeriesStore(**kwargs)  # type: ignore[arg-type]


def test_a_hundred_thousand_adds_keep_one_series_per_rank_and_metric() -> None:
    # The CPU cost of this load is measured in benchmarks/series.py, not timed here.
    store = SeriesStore()
    ranks = [labelset(job="j", rank=str(rank)) for rank in range(256)]
    metrics = ["step_duration_seconds", "compute_seconds", "comm_wait_seconds", "loss"]
    steps = 100_000 // (len(ranks) * len(metrics)) + 1
    for ts in range(steps):
        for labels in ranks:
            for metric in metrics:
                store.add(metric, labels, float(ts), float(ts))
    assert store.series_count() == len(ranks) * len(metrics)
    assert store.out_of_order_total == 0
    newest = {(labels, value) for labels, _, value in store.latest("loss")}
    assert newest == {(labels, float(steps - 1)) for labels in ranks}


def _one_by_one_and_many(
    store_a: SeriesStore, store_b: SeriesStore, batches: list[list[tuple[float, float]]]
) -> None:
    labels = labelset(job="j", rank="0")
    for batch in batches:
        for ts, value in batch:
            store_a.add("loss", labels, ts, value)
            store_a.add("compute_seconds", labels, ts, 2 * value)
        times = [ts for ts, _ in batch]
        values = [value for _, value in batch]
        store_b.add_many(
            labels, times, {"loss": values, "compute_seconds": [2 * v for v in values]}
        )


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(
        st.lists(
            st.tuples(st.integers(0, 60).map(float), st.floats(allow_nan=True, width=32)),
            max_size=6,
        ),
        max_size=12,
    ),
    max_points=st.integers(1, 9),
)
def test_add_many_is_add_one_by_one(
    batches: list[list[tuple[float, float]]], max_points: int
) -> None:
    one, many = SeriesStore(max_points=max_points), SeriesStore(max_points=max_points)
    _one_by_one_and_many(one, many, batches)
    for metric in ("loss", "compute_seconds"):
        assert repr(many.latest(metric)) == repr(one.latest(metric))
        for labels in one.last_seen(metric):
            assert repr(many.points(metric, labels, -1.0)) == repr(one.points(metric, labels, -1.0))
    assert many.out_of_order_total == one.out_of_order_total
    assert many.series_count() == one.series_count()


def test_add_many_refuses_values_that_do_not_match_the_times() -> None:
    with pytest.raises(ValueError, match="2 times but 1 values of loss"):
        SeriesStore().add_many(labelset(node="n"), [1.0, 2.0], {"loss": [1.0]})


def test_a_long_series_keeps_max_points_across_compactions() -> None:
    store = SeriesStore(max_points=100)
    labels = labelset(node="n")
    for ts in range(0, 1000, 5):
        store.add_many(labels, [float(t) for t in range(ts, ts + 5)], {"x": [1.0] * 5})
    assert [ts for ts, _ in store.points("x", labels, 0.0)] == [float(t) for t in range(900, 1000)]


def test_windows_keep_points_of_the_named_metrics_and_the_newest_of_the_others() -> None:
    store = SeriesStore(retention_s=300.0, windows_s={"loss": 10.0})
    labels = labelset(job="j", rank="0")
    for ts in range(0, 100):
        store.add_many(labels, [float(ts)], {"loss": [float(ts)], "compute_seconds": [2.0 * ts]})
    assert store.points("compute_seconds", labels, 0.0) == [(99.0, 198.0)]
    assert store.latest("compute_seconds") == [(labels, 99.0, 198.0)]
    store.add("compute_seconds", labels, 98.0, 0.0)  # out of order: dropped
    assert store.out_of_order_total == 1
    assert len(store.points("loss", labels, 0.0)) == 100
    assert store.expire(now_unix_s=100.0) == 90  # loss keeps 90..99, the window
    assert [ts for ts, _ in store.points("loss", labels, 0.0)] == [float(t) for t in range(90, 100)]
    assert store.last_seen("compute_seconds") == {labels: 99.0}
    # Past the window only the newest point stays (threshold rules read it) ...
    assert store.expire(now_unix_s=200.0) == 9
    assert store.points("loss", labels, 0.0) == [(99.0, 99.0)]
    # ... until the retention drops the series.
    assert store.expire(now_unix_s=400.0) == 2
    assert store.series_count() == 0


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window of loss"):
        SeriesStore(windows_s={"loss": 0.0})


# Operations on a store: add one point, add a batch, expire at ``ts``, forget a rank.
_Op = tuple[str, str, int, int, float, list[tuple[int, float]]]
_VALUES = st.sampled_from([0.0, 1.0, 2.5, -1.0, math.nan, math.inf, -math.inf])
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add_many", "add_many", "expire", "forget"]),
        st.sampled_from(["loss", "compute_seconds"]),
        st.integers(0, 2),
        st.integers(0, 200),
        _VALUES,
        st.lists(st.tuples(st.integers(0, 80), _VALUES), min_size=1, max_size=6),
    ),
    max_size=40,
)


def _apply(store: SeriesStore, op: _Op) -> None:
    kind, metric, rank, ts, value, points = op
    labels = labelset(rank=str(rank))
    if kind == "add":
        store.add(metric, labels, float(ts % 81), value)
    elif kind == "add_many":
        times = [float(t) for t, _ in points]
        values = [v for _, v in points]
        store.add_many(labels, times, {"loss": values, "compute_seconds": values})
    elif kind == "expire":
        store.expire(float(ts))
    else:
        store.forget({"rank": str(rank)})


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, max_points=st.integers(1, 9), windowed=st.booleans())
def test_newest_nonfinite_is_what_a_scan_of_the_points_finds(
    ops: list[_Op], max_points: int, windowed: bool
) -> None:
    # With windows, compute_seconds keeps its newest point only.
    windows = {"loss": 30.0} if windowed else None
    store = SeriesStore(retention_s=100.0, max_points=max_points, windows_s=windows)
    for op in ops:
        _apply(store, op)
        for metric in ("loss", "compute_seconds"):
            scanned = {}
            for labels in store.last_seen(metric):
                bad = [ts for ts, v in store.points(metric, labels, -1.0) if not math.isfinite(v)]
                if bad:
                    scanned[labels] = bad[-1]
            assert list(store.newest_nonfinite(metric).items()) == list(scanned.items())


@settings(max_examples=300, deadline=None)
@given(
    ops=_OPS,
    max_points=st.integers(1, 9),
    windowed=st.booleans(),
    since=st.lists(st.integers(0, 90), min_size=1, max_size=3),
)
def test_columns_are_the_points(
    ops: list[_Op], max_points: int, windowed: bool, since: list[int]
) -> None:
    windows = {"loss": 30.0} if windowed else None
    store = SeriesStore(retention_s=100.0, max_points=max_points, windows_s=windows)
    for op in ops:
        _apply(store, op)
        for metric in ("loss", "compute_seconds"):
            for start in since:
                for labels in store.last_seen(metric):
                    ts, values = store.columns(metric, labels, float(start))
                    points = repr(list(zip(ts, values, strict=True)))
                    assert points == repr(store.points(metric, labels, float(start)))


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, max_points=st.integers(1, 9), windowed=st.booleans())
def test_add_many_is_add_one_by_one_through_expiry_and_forgetting(
    ops: list[_Op], max_points: int, windowed: bool
) -> None:
    windows = {"loss": 30.0} if windowed else None
    many = SeriesStore(retention_s=100.0, max_points=max_points, windows_s=windows)
    one = SeriesStore(retention_s=100.0, max_points=max_points, windows_s=windows)
    for op in ops:
        _apply(many, op)
        kind, _, rank, _, _, points = op
        if kind == "add_many":
            for ts, value in points:
                for metric in ("loss", "compute_seconds"):
                    one.add(metric, labelset(rank=str(rank)), float(ts), value)
        else:
            _apply(one, op)
        for metric in ("loss", "compute_seconds"):
            assert repr(many.latest(metric)) == repr(one.latest(metric))
            for labels in one.last_seen(metric):
                assert repr(many.points(metric, labels, -1.0)) == repr(
                    one.points(metric, labels, -1.0)
                )


class _PlainStore:
    """What a SeriesStore holds, kept the plain way: a list of points per series, and
    ``expire`` looks at every one of them."""

    def __init__(self, retention_s: float, max_points: int, windows_s: dict[str, float] | None):
        self.retention_s, self.max_points, self.windows_s = retention_s, max_points, windows_s
        self.series: dict[str, dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]] = {}

    def add(self, metric: str, labels: tuple[tuple[str, str], ...], ts: float, v: float) -> None:
        points = self.series.setdefault(metric, {}).setdefault(labels, [])
        if points and ts < points[-1][0]:
            return
        if self.windows_s is not None and metric not in self.windows_s:
            points[:] = [(ts, v)]
        else:
            points.append((ts, v))
            del points[: max(0, len(points) - self.max_points)]

    def expire(self, now: float) -> int:
        cutoff = now - self.retention_s
        dropped = 0
        for metric, by_labels in list(self.series.items()):
            window_s = None if self.windows_s is None else self.windows_s.get(metric)
            points_cutoff = cutoff if window_s is None else max(cutoff, now - window_s)
            for labels, points in list(by_labels.items()):
                if points[-1][0] < cutoff:
                    dropped += len(points)
                    del by_labels[labels]
                    continue
                kept = [p for p in points[:-1] if p[0] >= points_cutoff] + points[-1:]
                dropped += len(points) - len(kept)
                points[:] = kept
            if not by_labels:
                del self.series[metric]
        return dropped

    def forget(self, rank: str) -> None:
        for metric, by_labels in list(self.series.items()):
            for labels in [labels for labels in by_labels if ("rank", rank) in labels]:
                del by_labels[labels]
            if not by_labels:
                del self.series[metric]


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, max_points=st.integers(1, 9), windowed=st.booleans())
def test_expire_drops_what_a_scan_of_every_series_drops(
    ops: list[_Op], max_points: int, windowed: bool
) -> None:
    # Expire visits only the series that may have something to drop; the plain store
    # looks at all of them, at times that go forwards and backwards.
    # A short retention, so that expiry times often fall among the points' times.
    windows = {"loss": 10.0} if windowed else None
    store = SeriesStore(retention_s=30.0, max_points=max_points, windows_s=windows)
    plain = _PlainStore(30.0, max_points, windows)
    for op in ops:
        kind, metric, rank, ts, value, points = op
        labels = labelset(rank=str(rank))
        if kind == "expire":
            assert store.expire(float(ts)) == plain.expire(float(ts))
        else:
            _apply(store, op)
            if kind == "add":
                plain.add(metric, labels, float(ts % 81), value)
            elif kind == "add_many":
                for metric in ("loss", "compute_seconds"):
                    for t, v in points:
                        plain.add(metric, labels, float(t), v)
            else:
                plain.forget(str(rank))
        assert store.metrics() == set(plain.series)
        for metric, by_labels in plain.series.items():
            assert list(store.last_seen(metric)) == list(by_labels)
            for labels, expected in by_labels.items():
                assert repr(store.points(metric, labels, -math.inf)) == repr(expected)


def test_an_idle_series_goes_at_the_first_expire_past_its_retention() -> None:
    store = SeriesStore(retention_s=30.0, windows_s={})  # newest points only
    labels = labelset(node="n")
    store.add("cpu_utilization_ratio", labels, 10.0, 0.5)
    assert store.expire(now_unix_s=20.0) == 0
    store.add("cpu_utilization_ratio", labels, 12.0, 0.5)  # newer than expire last saw
    assert store.expire(now_unix_s=41.0) == 0
    assert store.expire(now_unix_s=42.0) == 0  # the newest point is not older than 12
    assert store.expire(now_unix_s=42.5) == 1
    assert store.series_count() == 0
    store.add("cpu_utilization_ratio", labels, 50.0, 0.5)  # back, as a new series
    assert store.expire(now_unix_s=80.0) == 0
    assert store.expire(now_unix_s=80.5) == 1


def test_a_series_whose_newest_time_is_nan_stays_until_a_newer_point_ages() -> None:
    store, plain = SeriesStore(retention_s=30.0), _PlainStore(30.0, 4096, None)
    labels = labelset(node="n")
    for ts, now in [(math.nan, 1000.0), (5.0, 20.0), (math.nan, 1000.0), (6.0, 1000.0)]:
        store.add("cpu_utilization_ratio", labels, ts, 0.5)
        plain.add("cpu_utilization_ratio", labels, ts, 0.5)
        store.expire(now)  # (which points a NaN time keeps is bisect's business)
        plain.expire(now)
        assert store.series_count() == sum(map(len, plain.series.values()))
    assert store.series_count() == 0


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, max_points=st.integers(1, 9), windowed=st.booleans())
def test_a_reader_of_changes_knows_every_newest_point(
    ops: list[_Op], max_points: int, windowed: bool
) -> None:
    # A reader that keeps the newest points it was told of, by serial, has them all, and
    # sorting by serial lists them as the store does.
    windows = {"loss": 30.0} if windowed else None
    store = SeriesStore(retention_s=100.0, max_points=max_points, windows_s=windows)
    other = SeriesStore()
    cursors: dict[str, Cursor | None] = {"loss": None, "compute_seconds": None}
    known: dict[str, dict[int, tuple[LabelSet, float, float]]] = {m: {} for m in cursors}
    for op in ops:
        _apply(store, op)
        for metric in cursors:
            cursors[metric], every, changed = store.changes(metric, cursors[metric])
            if every:
                known[metric].clear()
            for serial, labels, ts, value in changed:
                known[metric][serial] = (labels, ts, value)
            listed = [known[metric][serial] for serial in sorted(known[metric])]
            assert repr(listed) == repr(store.latest(metric))
            # Another store's cursor means nothing here, and the other way round.
            assert store.changes(metric, other.changes(metric, None)[0])[1]
            assert other.changes(metric, cursors[metric])[1]


def test_a_reader_far_behind_the_change_log_reads_every_series() -> None:
    store = SeriesStore()
    labels = [labelset(node=str(n)) for n in range(3)]
    cursor, every, changed = store.changes("cpu_utilization_ratio", None)
    assert every and changed == []
    store.add("cpu_utilization_ratio", labels[0], 0.0, 0.5)
    cursor, every, changed = store.changes("cpu_utilization_ratio", cursor)
    assert not every and [row[1:] for row in changed] == [(labels[0], 0.0, 0.5)]
    for ts in range(1, 200):  # more changes than the log keeps
        store.add("cpu_utilization_ratio", labels[ts % 3], float(ts), 0.25)
        store.expire(float(ts))
    cursor, every, changed = store.changes("cpu_utilization_ratio", cursor)
    assert every and [row[1:] for row in changed] == [
        (labels[0], 198.0, 0.25),
        (labels[1], 199.0, 0.25),
        (labels[2], 197.0, 0.25),
    ]
    store.add("cpu_utilization_ratio", labels[1], 200.0, 0.75)
    store.add("cpu_utilization_ratio", labels[1], 201.0, 1.0)
    _, every, changed = store.changes("cpu_utilization_ratio", cursor)
    assert not every and [row[1:] for row in changed] == [(labels[1], 201.0, 1.0)]
