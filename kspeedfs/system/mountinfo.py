"""What is mounted where: /proc/self/mountinfo, stale FUSE mounts and their lazy unmount.

A mount process, mountd and the fstab helper remove only what is theirs: their own mount (see
FuseSession.unmount) or a stale one, whose process is gone. A live mount of someone else at
their path is refused, never unmounted."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

from kspeedfs.format.errors import MountError

_ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclasses.dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    device: str  # "major:minor" of its superblock: the st_dev of the files in it

    @property
    def is_kspeedfs(self) -> bool:
        return self.fstype == "fuse.kspeedfs" or (
            self.fstype.startswith("fuse") and self.source == "kspeedfs"
        )


def _unescape(field: bytes) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \ooo.
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), field))


def mount_entries() -> list[MountEntry]:
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    entries = []
    for line in lines:
        fields = line.split(b" ")
        try:
            sep = fields.index(b"-", 6)
            entries.append(
                MountEntry(
                    _unescape(fields[4]),
                    fields[sep + 1].decode(errors="replace"),
                    _unescape(fields[sep + 2]),
                    fields[2].decode(),
                )
            )
        except (ValueError, IndexError):
            continue
    return entries


def normalize(path: str | os.PathLike[str]) -> str:
    """The absolute path as the kernel lists it, without touching the (maybe stale) leaf."""
    p = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))


def mount_at(path: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount whose mountpoint is `path`, or None."""
    target = normalize(path)
    found = None
    for entry in mount_entries():
        if entry.mountpoint == target:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def kspeedfs_mounted(path: str | os.PathLike[str]) -> bool:
    entry = mount_at(path)
    return entry is not None and entry.is_kspeedfs


def is_stale(path: str | os.PathLike[str]) -> bool:
    """True for a FUSE mount whose process died: every access fails with ENOTCONN."""
    try:
        # Not stat: the kernel may answer it from cached attributes of a dead mount.
        os.statvfs(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def lazy_unmount(path: str | os.PathLike[str]) -> None:
    """Detach the kspeedfs mount at `path`, live or stale; a no-op when there is none."""
    entry = mount_at(path)
    if entry is None or not entry.is_kspeedfs:
        return
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise MountError("fusermount3 not found: install the fuse3 package")
    done = subprocess.run([tool, "-u", "-z", entry.mountpoint], capture_output=True, text=True)
    if done.returncode != 0 and kspeedfs_mounted(path):
        lines = done.stderr.strip().splitlines()
        raise MountError(lines[-1] if lines else f"cannot unmount {entry.mountpoint}")


def clear_stale(path: str | os.PathLike[str]) -> bool:
    """After a crash, a mount at `path` should just work: detach the dead kspeedfs mount left
    there (True), and leave anything else alone (False)."""
    entry = mount_at(path)
    if entry is None or not entry.is_kspeedfs or not is_stale(path):
        return False
    lazy_unmount(path)
    return True


def require_free_mountpoint(path: str | os.PathLike[str]) -> Path:
    """Clear a stale kspeedfs mount at `path`; refuse any live mount there (not ours to end)."""
    clear_stale(path)
    entry = mount_at(path)
    if entry is not None:
        raise MountError(f"mountpoint is busy ({entry.fstype} is mounted there): {path}")
    return Path(normalize(path))
