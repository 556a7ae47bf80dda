"""The agent's folder and file rules (``torshmon.paths``), with real owners and modes.

The tests run as root (to hand folders to another uid); ``NOBODY`` is that other uid.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from torshmon.paths import (
    UnsafePathError,
    ensure_agent_dir,
    ensure_private_dir,
    runtime_dir,
    secure_private_file,
)

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="hands a folder to another uid")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_runtime_dir_is_under_xdg_runtime_dir_else_per_user_in_tmp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == tmp_path / "torshmon"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir().name == f"torshmon-{os.getuid()}"


def test_a_missing_runtime_dir_and_its_parents_are_made_0700_under_umask_000(
    tmp_path: Path, umask_000: None
) -> None:
    folder = tmp_path / "xdg" / "run" / "torshmon"
    ensure_private_dir(folder)
    for made in (tmp_path / "xdg", tmp_path / "xdg" / "run", folder):
        assert _mode(made) == 0o700, made
    ensure_private_dir(folder)  # an existing good one is taken as it is


@needs_root
def test_a_runtime_dir_of_another_uid_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "torshmon"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError) as refused:
        ensure_private_dir(folder)
    text = str(refused.value)
    assert str(folder) in text and f"uid {NOBODY}" in text and "0700" in text
    assert "\n" not in text


@pytest.mark.parametrize("mode", [0o777, 0o750, 0o701])
def test_a_runtime_dir_with_group_or_other_bits_is_refused_and_left_alone(
    tmp_path: Path, mode: int
) -> None:
    folder = tmp_path / "torshmon"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(UnsafePathError, match=f"mode {mode:04o}"):
        ensure_private_dir(folder)
    assert _mode(folder) == mode


def test_a_symlink_as_runtime_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "torshmon").symlink_to(target)
    with pytest.raises(UnsafePathError, match="symlink"):
        ensure_private_dir(tmp_path / "torshmon")


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o1777, 0o1770])
def test_an_explicit_folder_may_be_shared_for_reading_or_sticky(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(mode)
    ensure_agent_dir(folder, "socket folder")


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o2777, 0o703])
def test_an_explicit_folder_others_may_write_to_is_refused(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(UnsafePathError, match=f"socket folder {folder} .*mode {mode:04o}"):
        ensure_agent_dir(folder, "socket folder")


@needs_root
def test_an_explicit_folder_of_another_uid_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=f"uid {NOBODY}"):
        ensure_agent_dir(folder, "spool folder")


def test_a_missing_explicit_folder_is_made_0700(tmp_path: Path, umask_000: None) -> None:
    folder = tmp_path / "a" / "b"
    ensure_agent_dir(folder, "socket folder")
    assert _mode(tmp_path / "a") == _mode(folder) == 0o700


def test_the_spool_file_is_made_0600_under_umask_000(tmp_path: Path, umask_000: None) -> None:
    spool = tmp_path / "spool.db"
    secure_private_file(spool)
    assert _mode(spool) == 0o600


def test_an_own_loose_spool_and_its_wal_are_tightened(tmp_path: Path) -> None:
    spool, wal = tmp_path / "spool.db", tmp_path / "spool.db-wal"
    for path in (spool, wal):
        path.write_bytes(b"")
        path.chmod(0o644)
    secure_private_file(spool)
    assert _mode(spool) == _mode(wal) == 0o600


@needs_root
def test_a_spool_file_of_another_uid_is_refused(tmp_path: Path) -> None:
    spool = tmp_path / "spool.db"
    spool.write_bytes(b"")
    os.chown(spool, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=f"uid {NOBODY}"):
        secure_private_file(spool)


def test_a_symlinked_spool_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"")
    (tmp_path / "spool.db").symlink_to(target)
    with pytest.raises(UnsafePathError, match="spool"):
        secure_private_file(tmp_path / "spool.db")
