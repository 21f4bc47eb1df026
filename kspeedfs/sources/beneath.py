"""Opening a path beneath a source's root without following a symlink in any of its components.

O_NOFOLLOW guards only the last component: a folder of the source swapped for a symlink would
lead a read outside the root. Linux 5.6+ resolves the whole path in the kernel with
openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) (called through ctypes: the os module has no
wrapper); elsewhere each component is opened relative to the one before with O_NOFOLLOW.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import posixpath

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "ppc64le": 437, "s390x": 437}.get(
    platform.machine(), 0
)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_openat2_works = bool(_SYS_OPENAT2)


def _openat2(dir_fd: int, path: bytes, flags: int) -> int:
    how = _OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = int(
        _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(path),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return fd


def _check_parts(relpath: bytes) -> list[bytes]:
    parts = relpath.split(b"/")
    if not relpath or any(p in (b"", b".", b"..") for p in parts):
        raise OSError(errno.EXDEV, "not a path beneath the source root", os.fsdecode(relpath))
    return parts


def _walk(dir_fd: int, parts: list[bytes], flags: int) -> int:
    fd = dir_fd
    try:
        for part in parts[:-1]:
            nxt = os.open(part, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_beneath(dir_fd: int, relpath: bytes, flags: int = os.O_RDONLY) -> int:
    """An fd of relpath under the folder dir_fd; OSError (ELOOP, EXDEV, ENOENT, ...) when a
    component is a symlink, climbs out, or is missing."""
    global _openat2_works
    parts = _check_parts(relpath)
    if _openat2_works:
        try:
            return _openat2(dir_fd, relpath, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM):  # old kernel, or seccomp
                raise
            _openat2_works = False
    return _walk(dir_fd, parts, flags)


def open_root(root: bytes) -> int:
    """The source root's fd (the root itself is configured, so a symlink there is followed)."""
    return os.open(root, DIR_FLAGS)


def link_stays_inside(link_relpath: bytes, target: bytes) -> bool:
    """Whether a symlink at link_relpath (relative to the root) names a path inside the root,
    judged on the names alone (each link on the way is judged the same when listed)."""
    if target.startswith(b"/") or not target:
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(link_relpath), target))
    return joined != b".." and not joined.startswith(b"../")
