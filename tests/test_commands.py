"""The command book's hand-out to ingest replies: reserved, then sent or released."""

from __future__ import annotations

from torshmon.aggregator.core.commands import CommandBook


def _book() -> tuple[CommandBook, list[str]]:
    book = CommandBook(clock=lambda: 100.0)
    ids = []
    for job, bucket in (("j", 1), ("j", 2), ("k", 3)):
        command = book.new(job, "config", {"bucket_cap_mb": bucket})
        book.add(command)
        ids.append(command.id)
    return book, ids


def test_a_reserved_command_goes_to_one_reply_only() -> None:
    book, (a, b, c) = _book()
    assert [x.id for x in book.reserve(["j"])] == [a, b]
    # A second POST while the first is being stored: nothing left for it.
    assert book.reserve(["j"]) == []
    assert [x.id for x in book.reserve(["k", "j"])] == [c]
    book.sent([a, b])
    statuses = [book.get(i) for i in (a, b)]
    assert [s.status for s in statuses if s is not None] == ["sent", "sent"]


def test_a_failed_reply_releases_its_commands_first_in_line() -> None:
    book, (a, b, _) = _book()
    reserved = book.reserve(["j"])
    later = book.new("j", "config", {"bucket_cap_mb": 9})
    book.add(later)
    book.release([x.id for x in reserved])
    assert [x.id for x in book.reserve(["j"])] == [a, b, later.id]
    status = book.get(a)
    assert status is not None and status.status == "pending"


def test_release_leaves_a_command_that_moved_on() -> None:
    book, (a, _, _) = _book()
    book.reserve(["j"])
    book.sent([a])
    book.release([a])
    assert [x.id for x in book.reserve(["j"])] == []
