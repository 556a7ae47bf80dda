from __future__ import annotations

from torshmon.probe.inflight import InflightTable


def test_sequence_numbers_count_per_group_and_peer() -> None:
    table = InflightTable()
    a = table.begin("default", "all_reduce", 4)
    table.end(a)
    b = table.begin("default", "broadcast", 4)
    c = table.begin("tp", "all_gather", 8)
    d = table.begin("default", "send", 4, peer=1)
    oldest = {(op.pg, op.peer): op for op in table.oldest()}
    assert oldest[("default", None)].seq == 2
    assert oldest[("default", None)].op == "broadcast"
    assert oldest[("tp", None)].seq == 1
    assert oldest[("default", 1)].seq == 1
    for token in (b, c, d):
        table.end(token)
    assert table.oldest() == []
    assert len(table) == 0


def test_oldest_reports_the_lowest_sequence_and_its_age() -> None:
    table = InflightTable()
    first = table.begin("default", "all_reduce", 4)
    table.begin("default", "all_reduce", 4)
    [op] = table.oldest(now_perf_ns=table._open[first].start_perf_ns + 2_000_000_000)
    assert op.seq == 1
    assert op.age_s == 2.0


def test_ending_an_unknown_token_is_harmless() -> None:
    table = InflightTable()
    table.end(12345)
    assert len(table) == 0


def test_a_failed_op_ends_and_is_counted_per_op_and_group_with_its_newest_error() -> None:
    table = InflightTable()
    first = table.begin("default", "all_reduce", 16)
    second = table.begin("default", "all_reduce", 16)
    other = table.begin("7", "broadcast", 4)
    table.fail(first, RuntimeError("Timed out waiting 1000ms for recv"))
    table.fail(second, RuntimeError("Connection closed by peer " + "x" * 1000))
    table.fail(second, RuntimeError("twice"))  # already ended: not counted again
    table.end(other)
    assert len(table) == 0
    assert table.failure_count() == 2
    [failed] = table.failures()
    assert (failed.op, failed.pg, failed.count) == ("all_reduce", "default", 2)
    assert failed.last_error.startswith("RuntimeError: Connection closed by peer xxx")
    assert len(failed.last_error) == 500
    table.count_failure("wait_tensor", "3", TimeoutError())
    assert sorted((f.op, f.count, f.last_error) for f in table.failures()) == [
        ("all_reduce", 2, failed.last_error),
        ("wait_tensor", 1, "TimeoutError: "),
    ]
