"""A folder the node owns: checked before use, walked with descriptors, never through a symlink.

The node's shm folder and its spill folder (with the disk tier in it) are such folders. The
node often runs as root over a folder in a world-writable place (/dev/shm). Whoever could
write to that folder, or to a folder above it, could swap a part of it for a symlink and have
the node delete or serve files outside it. So the folder and each folder above it must be
owned by the node's uid or root and not writable by others (a sticky /dev/shm is fine), and
everything inside is opened relative to a descriptor with O_NOFOLLOW.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from kspeedfs.format import sealing
from kspeedfs.format.errors import InvalidArgument

log = logging.getLogger(__name__)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_MODE = 0o2750  # setgid: files made inside belong to the readers' group
FILE_MODE = 0o640


@contextlib.contextmanager
def closing_fd(fd: int) -> Iterator[int]:
    """A descriptor, closed when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)


def resolve_group(name: str) -> int:
    """The gid of the readers' group; "" is the node's own group."""
    if not name:
        return os.getegid()
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise InvalidArgument(f"group {name!r} does not exist (setting `group`)") from None


def _unsafe(what: Path, st: os.stat_result, uid: int, sticky_ok: bool) -> str:
    """Why a folder is not safe to use, or ''."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid not in (uid, 0):
        return f"is owned by uid {st.st_uid}, not {uid}"
    writable = st.st_mode & 0o022
    if writable and not (sticky_ok and st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        return f"is writable by {'others' if st.st_mode & 0o002 else 'its group'}"
    return ""


def open_owned_dir(path: Path, what: str) -> int:
    """A descriptor of `path` (`what` names it in a refusal: "shm folder", "spill folder"),
    created (with its missing parents) when absent; refused with one line when it or a folder
    above it could be changed by someone else. Nothing that exists is changed: claim_dir
    gives it the readers' group and mode once every folder the node needs has been checked."""
    uid = os.geteuid()
    path = Path(os.path.abspath(path))
    missing = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o750 if folder != path else 0o700)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
    _check_above(path, uid, what)
    fd = _open_dir(path, path, what)
    _refuse_unowned(fd, path, what)
    return fd


def open_owned_subdir(parent_fd: int, name: str, shown: Path, what: str) -> int:
    """A descriptor of folder `name` inside parent_fd (a folder checked by open_owned_dir),
    made when absent; refused like open_owned_dir's folder (a symlink, another uid's folder,
    one others may write to), nothing changed."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    fd = _open_dir(Path(name), shown, what, dir_fd=parent_fd)
    _refuse_unowned(fd, shown, what)
    return fd


def _refuse_unowned(fd: int, path: Path, what: str) -> None:
    """Close fd and refuse (one line) a folder the node's uid does not own or others may
    change. Only the node's uid may own it: root-owned is someone else's then."""
    uid = os.geteuid()
    st = os.fstat(fd)
    why = _unsafe(path, st, uid, sticky_ok=False)
    if not why and st.st_uid != uid:
        why = f"is owned by uid {st.st_uid}, not {uid}"
    if why:
        os.close(fd)
        raise InvalidArgument(f"refusing {what} {path}: it {why}")


def claim_dir(fd: int, gid: int) -> None:
    """Give a checked folder the readers' group and DIR_MODE (setgid: what is made inside
    belongs to the group)."""
    _give(fd, gid, DIR_MODE)


def _give(fd: int, gid: int, mode: int) -> None:
    """Group `gid` (-1: keep it) and `mode` for an open file or folder. The mode is set after
    the group: a chown may clear the setgid bit."""
    st = os.fstat(fd)
    chowned = gid >= 0 and st.st_gid != gid
    if not chowned and stat.S_IMODE(st.st_mode) == mode:
        return
    resealed = stat.S_ISREG(st.st_mode) and sealing.is_sealed(fd)
    if resealed:  # a sealed segment (found at start): its flag forbids a chmod too
        sealing.set_sealed(fd, False)
    try:
        if chowned:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    finally:
        if resealed:
            sealing.set_sealed(fd, True)


def _check_above(path: Path, uid: int, what: str) -> None:
    """Refuse `path` when a folder above it could be changed by someone else: a shared sticky
    one owned by root (/dev/shm, /tmp) is fine; a symlink among them must be root's or ours,
    and so must what it points to."""
    for above in path.parents:
        link = os.lstat(above)
        why = _unsafe(above, os.stat(above), uid, sticky_ok=True)
        if not why and stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
            why = f"is a symlink owned by uid {link.st_uid}"
        if why:
            raise InvalidArgument(f"refusing {what} {path}: {above} {why}")


def check_socket_dir(path: Path) -> None:
    """Make sure only the node's uid (or root) can create names in `path`, the folder of the
    node's socket, so that nobody can bind the socket's path first: created 0755 when absent
    (readers outside the group must reach the socket), refused in one line when it or a
    folder above it could be changed by someone else."""
    uid = os.geteuid()
    path = Path(os.path.abspath(path))
    missing = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o755)
            os.chmod(folder, 0o755)  # whatever the umask
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
        except OSError as e:
            raise InvalidArgument(f"cannot make socket folder {folder}: {e.strerror}") from None
    _check_above(path, uid, "socket folder")
    why = _unsafe(path, os.lstat(path), uid, sticky_ok=False)
    if why:
        raise InvalidArgument(f"refusing socket folder {path}: it {why}")


def _open_dir(path: Path, shown: Path, what: str, dir_fd: int | None = None) -> int:
    try:
        return os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if os.path.islink(path) if dir_fd is None else _is_link(dir_fd, str(path)):
            raise InvalidArgument(f"refusing {what} {shown}: it is a symlink") from None
        raise InvalidArgument(f"cannot open {shown}: {e.strerror}") from None


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_subdir(parent_fd: int, name: str, shown: Path, what: str = "shm folder") -> int:
    """A descriptor of folder `name` inside parent_fd, made when absent; a symlink or a folder
    owned by another uid there is refused."""
    try:
        os.mkdir(name, 0o750, dir_fd=parent_fd)
    except FileExistsError:
        pass
    fd = _open_dir(Path(name), shown, what, dir_fd=parent_fd)
    st = os.fstat(fd)
    why = _unsafe(shown, st, os.geteuid(), sticky_ok=False)
    if why:
        os.close(fd)
        raise InvalidArgument(f"refusing {what}: {shown} {why}")
    return fd


def remove_beneath(dir_fd: int | None, name: str) -> None:
    """Remove entry `name` of dir_fd (None: `name` is a path): a folder with everything in
    it, never what a symlink in it points to (shutil.rmtree with dir_fd walks by
    descriptors). Sealed segments in it (the immutable flag: see seal_segment) are unsealed
    first, also those a killed node left."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shared = _unseal(dir_fd, name, tree=True)
        assert shutil.rmtree.avoids_symlink_attacks
        try:
            shutil.rmtree(name, dir_fd=dir_fd, onerror=_log_rm_error)
        finally:
            sealing.reseal_shared(shared)
    else:
        try:
            unlink_segment(dir_fd, name)
        except FileNotFoundError:
            pass


# Sealed segments: a published segment file gets the immutable flag (FS_IMMUTABLE_FL) when the
# node may set it (CAP_LINUX_IMMUTABLE) and its filesystem has it, so that nobody (root
# included, short of clearing the flag first) can cut it short under a reader's map. Every path
# that unlinks, renames over or rewrites a segment goes through unlink_segment, unseal_segment
# or remove_beneath, which clear the flag first.
_can_seal: dict[int, bool] = {}  # by device: whether the flag could be set there (tried once)
_seal_lock = threading.Lock()


def seal_segment(fd: int) -> bool:
    """Give open segment file `fd` the immutable flag, where the node can (tried once per
    filesystem and remembered); whether it is sealed."""
    dev = os.fstat(fd).st_dev
    if _can_seal.get(dev) is False:
        return False
    try:
        sealing.set_sealed(fd, True)
    except OSError as e:
        with _seal_lock:
            if dev not in _can_seal:
                why = "no CAP_LINUX_IMMUTABLE" if e.errno == errno.EPERM else e.strerror
                log.info(
                    "segments on device %d:%d are not sealed (immutable flag: %s); readers "
                    "read them by pread or check their size before each use",
                    os.major(dev),
                    os.minor(dev),
                    why,
                )
            _can_seal[dev] = False
        return False
    _can_seal[dev] = True
    return True


def seals(dev: int) -> bool | None:
    """Whether the node seals segments on device `dev` (None: not tried yet)."""
    return _can_seal.get(dev)


def unseal_segment(dir_fd: int | None, name: str) -> None:
    """Clear the immutable flag of file `name` (before it is replaced or rewritten)."""
    for fd in _unseal(dir_fd, name, tree=False):
        os.close(fd)  # (a file with other names: those are left unsealed)


def unlink_segment(dir_fd: int | None, name: str) -> None:
    """os.unlink of a segment file that may be sealed: its flag cleared first."""
    shared = _unseal(dir_fd, name, tree=False)
    try:
        os.unlink(name, dir_fd=dir_fd)
    finally:
        sealing.reseal_shared(shared)  # its other names (a later instance's) stay sealed


def seal_file(path: Path) -> bool:
    """seal_segment of the file at `path` (never through a symlink); whether it is sealed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return seal_segment(fd)
    finally:
        os.close(fd)


def unlink_file(path: Path) -> None:
    """unlink_segment of the file at `path`, which may be sealed; a missing one is left."""
    try:
        unlink_segment(None, os.fspath(path))
    except FileNotFoundError:
        pass


def link_segment(src: Path, dest: Path) -> None:
    """os.link of a segment that may be sealed (a sealed file cannot be linked): its flag is
    cleared for the link and set again after, on the one file both names now share."""
    was_sealed = sealing.unseal_at(None, os.fspath(src))
    try:
        os.link(src, dest)
    finally:
        if was_sealed:
            seal_file(src)


def _unseal(dir_fd: int | None, name: str, tree: bool) -> list[int]:
    """Clear the flag of `name` (or of everything beneath it); the files that have other
    links, to seal again once this name is gone (sealing.reseal_shared)."""
    shared: list[int] = []
    try:
        if tree:
            sealing.unseal_tree(dir_fd, name, shared)
        else:
            sealing.unseal_at(dir_fd, name, shared)
    except OSError as e:  # EPERM: the node lost the right; the unlink after says what failed
        log.warning("cannot clear the immutable flag of %s: %s", name, e.strerror)
    return shared


def _log_rm_error(func: object, path: str, exc: object) -> None:
    log.warning("could not remove %s from a folder of the node: %s", path, exc)


def restrict_files(dir_fd: int, gid: int = -1) -> None:
    """Give the folders beneath dir_fd DIR_MODE and the files FILE_MODE (whatever the umask
    made them), and group `gid` when one is given; symlinks are removed."""
    for entry in os.scandir(dir_fd):
        if entry.is_symlink():
            os.unlink(entry.name, dir_fd=dir_fd)
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        flags = DIR_FLAGS if is_dir else os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(entry.name, flags, dir_fd=dir_fd)
        try:
            _give(fd, gid, DIR_MODE if is_dir else FILE_MODE)
            if is_dir:
                restrict_files(fd, gid)
        finally:
            os.close(fd)
