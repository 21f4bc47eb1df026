"""A node's own folders (its shm folder, its spill folder): the marker it keeps in each, locked
while it runs, and their removal once it is stopped (`kspeedfs clean-node`).

A node makes MARKER (an empty file: it takes no memory) in each folder when it opens them and holds a shared flock on it for as
long as it runs; the kernel drops the lock with the process, killed with -9 too. Removal takes
the exclusive lock without waiting: refused (InUse) while a node holds the shared one, and held
through the removal, so a node started meanwhile refuses the folder instead of filling it. A
folder without the marker is not a node's: refused, nothing removed. Published segments carry
the immutable flag (format/sealing.py), which `rm -rf` cannot pass: their flags are cleared
first. Everything is reached through descriptors, never through a symlink; the marker goes
last, so a removal cut short can be run again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kspeedfs.format import sealing
from kspeedfs.format.errors import InUse, InvalidArgument, KSpeedError

MARKER = ".kspeedfs-node"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def hold(folder_fd: int, shown: Path, what: str) -> BinaryIO:
    """The running node's claim on a folder it opened: its marker, made when absent, with a
    shared lock held until the returned file is closed (or the process ends). Refused in one
    line when the marker is not a regular file or a removal holds the folder."""
    try:
        fd = os.open(
            MARKER, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640, dir_fd=folder_fd
        )
    except OSError as e:
        raise InvalidArgument(f"refusing {what} {shown}: its {MARKER}: {e.strerror}") from None
    marker = os.fdopen(fd, "rb", buffering=0)
    try:
        _lock(fd, f"{what} {shown}", fcntl.LOCK_SH, "`kspeedfs clean-node` is removing it")
    except BaseException:
        marker.close()
        raise
    return marker


def _lock(fd: int, shown: str, kind: int, held: str) -> None:
    """Lock marker `fd` (`kind`: LOCK_SH, LOCK_EX) without waiting; refused in one line when
    it is not a regular file (InvalidArgument) or the other side holds it (InUse, `held`)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise InvalidArgument(f"refusing {shown}: its {MARKER} is not a file")
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InUse(f"refusing {shown}: {held}") from None


@dataclass
class _Claimed:
    """A folder checked and locked for removal: its parent's descriptor, its name there, its
    own descriptor and its marker's (the exclusive lock)."""

    path: Path
    parent_fd: int
    name: str
    fd: int
    marker_fd: int = -1

    def close(self) -> None:
        for fd in (self.marker_fd, self.fd, self.parent_fd):
            if fd >= 0:
                os.close(fd)


def remove_stopped(folders: list[Path]) -> list[str]:
    """Remove each of `folders` (a stopped node's shm or spill folder), sealed files included;
    what was done, a line per folder. Every folder is checked and locked before anything is
    removed: one that is not a node's (InvalidArgument) or that a node runs on (InUse) refuses
    the lot. An absent folder is skipped."""
    claimed: list[_Claimed] = []
    done: list[str] = []
    try:
        for folder in folders:
            found = _claim(Path(os.path.abspath(folder)))
            if found is None:
                done.append(f"{folder}: absent, nothing to remove")
            else:
                claimed.append(found)
        for c in claimed:
            done.append(_remove(c))
    finally:
        for c in claimed:
            c.close()
    return done


def _claim(path: Path) -> _Claimed | None:
    """`path` opened without following a symlink, its marker checked and locked exclusively."""
    try:
        parent_fd = os.open(path.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InvalidArgument(f"refusing {path}: its folder: {e.strerror}") from None
    claimed = _Claimed(path, parent_fd, path.name, -1)
    try:
        try:
            st = os.stat(path.name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            claimed.close()
            return None
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"
            raise InvalidArgument(f"refusing {path}: it is {kind}, not a node's folder")
        claimed.fd = os.open(path.name, _DIR_FLAGS, dir_fd=parent_fd)
        claimed.marker_fd = _locked_marker(claimed)
    except BaseException:
        claimed.close()
        raise
    return claimed


def _locked_marker(c: _Claimed) -> int:
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=c.fd)
    except OSError as e:
        why = "it has no" if e.errno == errno.ENOENT else f"{e.strerror}:"
        raise InvalidArgument(
            f"refusing {c.path}: {why} {MARKER}, so it is not a node's folder (nothing removed)"
        ) from None
    try:
        held = "a node runs on it (it holds the folder's lock); stop it first (nothing removed)"
        _lock(fd, str(c.path), fcntl.LOCK_EX, held)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(c: _Claimed) -> str:
    """Everything in a claimed folder, flags cleared first, the marker last; then the folder
    itself, unless it is a mount point (a disk of its own: emptied, kept)."""
    try:
        sealed = sealing.unseal_tree(c.parent_fd, c.name)
    except OSError as e:
        raise KSpeedError(
            f"cannot clear the immutable flag of the sealed files in {c.path}: {e.strerror} "
            "(needs root or CAP_LINUX_IMMUTABLE)"
        ) from None
    failed: list[str] = []

    def note(_func: object, path: str, exc: tuple[type, BaseException, object]) -> None:
        failed.append(f"{path}: {exc[1]}")

    assert shutil.rmtree.avoids_symlink_attacks
    for entry in sorted(os.listdir(c.fd)):
        if entry == MARKER:
            continue
        if stat.S_ISDIR(os.stat(entry, dir_fd=c.fd, follow_symlinks=False).st_mode):
            shutil.rmtree(entry, dir_fd=c.fd, onerror=note)
        else:
            try:
                os.unlink(entry, dir_fd=c.fd)
            except OSError as e:
                failed.append(f"{c.path / entry}: {e.strerror}")
    if failed:
        raise KSpeedError(f"could not remove {len(failed)} entries of {c.path}: {failed[0]}")
    os.unlink(MARKER, dir_fd=c.fd)
    if os.fstat(c.fd).st_dev != os.fstat(c.parent_fd).st_dev:
        return f"{c.path}: emptied ({sealed} sealed files unsealed); a mount point, kept"
    here = os.stat(c.name, dir_fd=c.parent_fd, follow_symlinks=False)
    if (here.st_dev, here.st_ino) == (os.fstat(c.fd).st_dev, os.fstat(c.fd).st_ino):
        with contextlib.suppress(OSError):
            os.rmdir(c.name, dir_fd=c.parent_fd)
    return f"{c.path}: removed ({sealed} sealed files unsealed)"
