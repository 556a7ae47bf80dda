"""Default locations shared by the probe and the agent, and the rules their folders keep.

The agent's socket and spool must be its own: a local user who can write to their
folder can swap the socket (and pose as the agent to the probes) or plant records
that the agent forwards under its token. So the agent's runtime folder is owned by
its user with mode 0700, and the folder of a socket or spool given explicitly is
writable by no other user. A folder that is missing is made 0700 whatever the umask.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

#: The mode of the folders the agent makes, and the only one its runtime folder may have.
PRIVATE_DIR_MODE: Final = 0o700
#: The mode of the spool file (SQLite gives its -wal and -shm files the same).
PRIVATE_FILE_MODE: Final = 0o600


class UnsafePathError(PermissionError):
    """A folder or file the agent would use is someone else's or writable by others.

    The text is one line: the path, the owner and mode found, and what to do.
    """


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/torshmon``, else a per-user folder under the temp dir; the
    variable read from ``env`` (``os.environ`` where None)."""
    base = (os.environ if env is None else env).get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "torshmon"
    return Path(tempfile.gettempdir()) / f"torshmon-{os.getuid()}"


def default_agent_socket(env: Mapping[str, str] | None = None) -> str:
    """The agent's Unix socket: ``$TORSHMON_AGENT_SOCKET`` or ``<runtime dir>/agent.sock``,
    read from ``env`` (``os.environ`` where None)."""
    env = os.environ if env is None else env
    return env.get("TORSHMON_AGENT_SOCKET") or str(runtime_dir(env) / "agent.sock")


def ensure_private_dir(path: Path, what: str = "runtime folder") -> None:
    """Make ``path`` 0700, with any missing parents, or check the one that is there.

    An existing folder must be this user's with no group or other bits: one left by
    someone else, or a looser one, raises UnsafePathError (it is not changed: the
    user decides what it held and who else used it).
    """
    _make_missing(path)
    st = _lstat_dir(path, what)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafePathError(
            f"{what} {path} is owned by uid {st.st_uid} with mode {_mode(st)}; it must be "
            f"owned by uid {os.geteuid()} (this user) with mode 0700: remove it, or "
            f"'chmod 0700' it if it is yours, or set XDG_RUNTIME_DIR to a folder of your own"
        )


def ensure_agent_dir(path: Path, what: str) -> None:
    """Make the folder of an explicitly given socket or spool 0700 if it is missing,
    or check the one that is there.

    It must be owned by this user or root and writable by no one else: no group or
    other write bit, unless the sticky bit is set (as on /tmp), which keeps others
    from removing or renaming what the agent puts there. UnsafePathError otherwise.
    The group may read and enter it (a socket shared with the training users' group).
    """
    _make_missing(path)
    st = _lstat_dir(path, what)
    loose = stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX
    if st.st_uid not in (os.geteuid(), 0) or loose:
        raise UnsafePathError(
            f"{what} {path} is owned by uid {st.st_uid} with mode {_mode(st)}; it must be "
            f"owned by uid {os.geteuid()} (this user) or root and writable by no one else "
            "(no group/other write bit unless sticky): use a folder of the agent's own, "
            "e.g. one it makes itself"
        )


def secure_private_file(path: Path, what: str = "spool") -> None:
    """Create ``path`` 0600 if it is missing, or make this user's existing file 0600.

    SQLite gives the -wal and -shm files it creates the database file's mode; ones
    left by an older agent are tightened too. A file (or a symlink) that is not this
    user's raises UnsafePathError.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    _secure_file(path, what, flags)
    for suffix in ("-wal", "-shm", "-journal"):
        companion = path.with_name(path.name + suffix)
        if os.path.lexists(companion):
            _secure_file(companion, what, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)


def _secure_file(path: Path, what: str, flags: int) -> None:
    try:
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
    except OSError as exc:
        raise UnsafePathError(f"cannot open {what} file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(
                f"{what} file {path} is owned by uid {st.st_uid} with mode {_mode(st)}; it "
                f"must be a file of uid {os.geteuid()} (this user): move it aside"
            )
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)


def _make_missing(path: Path) -> None:
    """Make the missing folders of ``path``, each 0700 whatever the umask."""
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile, by whom the caller's check will tell
        except OSError as exc:
            raise UnsafePathError(f"cannot make folder {folder}: {exc.strerror}") from None
        # The umask can only narrow mkdir's 0700 (0500 under umask 0277 would keep the
        # agent out): set it exactly, on the folder opened without following a symlink.
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, PRIVATE_DIR_MODE)
        finally:
            os.close(fd)


def _lstat_dir(path: Path, what: str) -> os.stat_result:
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePathError(f"cannot use {what} {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "symlink" if stat.S_ISLNK(st.st_mode) else "file"
        raise UnsafePathError(f"{what} {path} is a {kind} of uid {st.st_uid}, not a folder")
    return st


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"
