"""The immutable flag (FS_IMMUTABLE_FL, `chattr +i`) of segment files.

A file with the flag cannot be written, truncated, extended, renamed, linked or unlinked by
anyone, root included, until someone with CAP_LINUX_IMMUTABLE clears it. The node sets it on
each segment of a preloaded dataset it publishes (memory and disk tier) when it can, and
clears it first on every path that removes or replaces one (node/safedir.py); a reader looks at
it once per segment per process: a sealed segment cannot be cut short under a map, so it may be
mapped; an unsealed one is read with pread (disk tier) or has its size checked before each use
(memory tier). See docs/tiers.md and docs/security.md.

ext4, xfs, btrfs and tmpfs (Linux 6.0 and later) have the flag; setting or clearing it needs
CAP_LINUX_IMMUTABLE (root has it unless it was dropped).
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import stat

# <linux/fs.h>: _IOR('f', 1, long) and _IOW('f', 2, long); the kernel reads and writes an int.
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What a filesystem without the flag, or a process without the right, answers.
UNSUPPORTED = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def get_flags(fd: int) -> int:
    """The inode flags of open file `fd` (OSError where the filesystem has none)."""
    buf = array.array("l", [0])
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
    return int(buf[0]) & 0xFFFFFFFF


def is_sealed(fd: int) -> bool:
    """Whether open file `fd` carries the immutable flag (False where it cannot be asked)."""
    try:
        return bool(get_flags(fd) & FS_IMMUTABLE_FL)
    except OSError:
        return False


def set_sealed(fd: int, sealed: bool) -> bool:
    """Set or clear the immutable flag of open file `fd`; whether it changed. OSError (EPERM
    without CAP_LINUX_IMMUTABLE, ENOTTY/EOPNOTSUPP where the filesystem has no flags)."""
    flags = get_flags(fd)
    new = flags | FS_IMMUTABLE_FL if sealed else flags & ~FS_IMMUTABLE_FL
    if new == flags:
        return False
    fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("l", [new]), True)
    return True


def unseal_at(dir_fd: int | None, name: str, shared: list[int] | None = None) -> bool:
    """Clear the immutable flag of regular file `name` (relative to dir_fd; never through a
    symlink); whether it had it. A missing file, or one whose flag cannot be asked, is left.
    `shared`: a sealed file with other links (an instance's segment carried into the next by
    a hard link: the flag is the file's, not the name's) has a descriptor added there, for
    reseal_shared once this name is gone."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            cleared = set_sealed(fd, False)
        except OSError as e:
            if e.errno in UNSUPPORTED:
                return False
            raise
        if cleared and shared is not None and st.st_nlink > 1:
            shared.append(os.dup(fd))
        return cleared
    finally:
        os.close(fd)


def reseal_shared(shared: list[int]) -> None:
    """Seal again each file unseal_at put in `shared` that still has a link (its other
    names' readers map it), and close the descriptors."""
    for fd in shared:
        try:
            if os.fstat(fd).st_nlink > 0:
                set_sealed(fd, True)
        except OSError:
            pass  # the flag cannot be set here any more: readers check its size instead
        finally:
            os.close(fd)
    shared.clear()


def unseal_tree(dir_fd: int | None, name: str, shared: list[int] | None = None) -> int:
    """Clear the immutable flag of every regular file at or beneath `name` (a file or a
    folder, relative to dir_fd), walked by descriptors, never through a symlink; how many had
    it. For removing a folder of segments: an unlink of a sealed file fails, even as root.
    `shared` as in unseal_at."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return 0
    if stat.S_ISREG(st.st_mode):
        return int(unseal_at(dir_fd, name, shared))
    if not stat.S_ISDIR(st.st_mode):
        return 0
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return 0
    cleared = 0
    try:
        with contextlib.suppress(OSError):
            for entry in os.scandir(fd):
                if entry.is_dir(follow_symlinks=False):
                    cleared += unseal_tree(fd, entry.name, shared)
                elif entry.is_file(follow_symlinks=False):
                    cleared += int(unseal_at(fd, entry.name, shared))
    finally:
        os.close(fd)
    return cleared


def sealed_beneath(path: str | os.PathLike[str]) -> list[str]:
    """The regular files at or beneath `path` that carry the immutable flag (for tests and
    leftovers checks)."""
    found = []
    for root, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            with contextlib.suppress(OSError):
                fd = os.open(full, _FILE_FLAGS)
                try:
                    if stat.S_ISREG(os.fstat(fd).st_mode) and is_sealed(fd):
                        found.append(full)
                finally:
                    os.close(fd)
    if os.path.isfile(path) and not found:
        with contextlib.suppress(OSError):
            fd = os.open(path, _FILE_FLAGS)
            try:
                if is_sealed(fd):
                    found.append(os.fspath(path))
            finally:
                os.close(fd)
    return found
