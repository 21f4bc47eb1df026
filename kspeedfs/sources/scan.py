"""Builds a source's `Tree` (the manifest's input): a folder walk, or an object store's listing."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from kspeedfs.format.errors import DataError, InvalidArgument, KSpeedError, NotFound, SourceChanged
from kspeedfs.format.tree import Tree
from kspeedfs.sources import version
from kspeedfs.sources.beneath import link_stays_inside, open_beneath, open_root

log = logging.getLogger(__name__)

FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755
# The longest relative path a file of the tree may have: the copies and the mount open every
# file by its path beneath the root, and the kernel refuses a longer one. A filesystem that
# shows a folder inside itself (a loop) ends here too instead of being walked forever.
PATH_MAX = 4096


def check_source(source: str | os.PathLike[str]) -> Path:
    path = Path(source)
    if not path.exists():
        raise NotFound(f"source not found: {path}")
    if not path.is_dir():
        raise InvalidArgument(f"source is not a folder: {path}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InvalidArgument(f"source is not readable: {path}")
    return path


def scan_tree(source: str | os.PathLike[str]) -> Tree:
    """lstat every entry once, each folder opened beneath the root without following a symlink
    (a folder swapped for one is not walked); symlinks are kept as links only when they point
    inside the tree, special files skipped with a warning."""
    root = check_source(source)
    try:
        root_fd = open_root(os.fsencode(root))
    except OSError as e:
        raise _scan_error(root, e) from None
    try:
        return _scan(root_fd)
    except OSError as e:
        raise _scan_error(root, e) from None
    finally:
        os.close(root_fd)


def _shown(path: str) -> str:
    return path if len(path) <= 120 else f"{path[:60]}...{path[-50:]}"


def _scan_error(root: Path, e: OSError) -> KSpeedError:
    """What a scan that the filesystem stopped tells the user, in one line."""
    # The path it failed on, relative to the root (a descriptor's number says nothing).
    named = isinstance(e.filename, (str, bytes)) and e.filename
    where = f"{root}/{_shown(os.fsdecode(e.filename))}" if named else str(root)
    if e.errno == errno.ENAMETOOLONG:
        return InvalidArgument(f"cannot scan {root}: a path in it is too long: {where}")
    if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL, errno.EXDEV):
        return SourceChanged(f"source changed while it was scanned: {where}: {e.strerror}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return InvalidArgument(f"source is not readable: {where}: {e.strerror}")
    return DataError(f"cannot scan {root}: {where}: {e.strerror}")


def _scan(root_fd: int) -> Tree:
    st = os.fstat(root_fd)
    tree = Tree()
    # A folder's size as the source reports it: the mount shows it (what `du -sb` adds up).
    tree.append(b"", 0, st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid, st.st_gid)
    root_dev = st.st_dev
    queue: list[tuple[int, bytes]] = [(0, b"")]
    head = 0
    while head < len(queue):
        dir_idx, rel = queue[head]
        head += 1
        fd = root_fd if not rel else open_beneath(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:
                children = sorted(((os.fsencode(e.name), e) for e in it), key=lambda p: p[0])
            tree.first_child[dir_idx] = len(tree)
            count = 0
            for name, entry in children:
                est = entry.stat(follow_symlinks=False)
                mode = est.st_mode
                idx = len(tree)
                if len(rel) + len(name) + (1 if rel else 0) >= PATH_MAX:
                    child = rel + b"/" + name if rel else name
                    raise InvalidArgument(
                        f"cannot scan the source: a path in it is longer than {PATH_MAX} bytes"
                        f" (a folder loop, or a tree too deep): {_shown(os.fsdecode(child))}"
                    )
                if stat.S_ISREG(mode):  # the common case first: 1.28 M times for ImageNet
                    size, mtime, ctime, ino, dev = version.of_stat(est, root_dev)
                    tree.append(
                        name, dir_idx, mode, size, mtime, est.st_uid, est.st_gid, ctime, ino, dev
                    )
                    count += 1
                    continue
                child = rel + b"/" + name if rel else name
                if stat.S_ISDIR(mode):
                    size = est.st_size
                    tree.append(name, dir_idx, mode, size, est.st_mtime_ns, est.st_uid, est.st_gid)
                    queue.append((idx, child))
                elif stat.S_ISLNK(mode):
                    target = os.readlink(name, dir_fd=fd)
                    if not link_stays_inside(child, target):
                        log.warning("skipping symlink %r: it points outside the source", child)
                        continue
                    tree.append(
                        name, dir_idx, mode, len(target), est.st_mtime_ns, est.st_uid, est.st_gid
                    )
                    tree.link_target[idx] = target
                else:
                    log.warning("skipping special file %r", os.fsdecode(child))
                    continue
                count += 1
            tree.child_count[dir_idx] = count
        finally:
            if fd != root_fd:
                os.close(fd)
    return tree


def tree_from_listing(files: dict[bytes, tuple[int, int, int]]) -> Tree:
    """A Tree from flat object keys: folders are the key prefixes; a folder's time is the
    newest of its files' (object stores have no folder times), so a change shows up. Object
    stores have no owners or modes either: files are 0644 and folders 0755, owned by 0/0 (on
    the mount, readable by everyone on the machine; the bucket's credentials are the gate).
    `files` maps a key to (size, mtime_ns, ident: its ETag's hash, 0 for none)."""
    children: dict[bytes, set[bytes]] = {b"": set()}
    dir_mtime: dict[bytes, int] = {b"": 0}
    for rel, (_size, mtime, _ident) in list(files.items()):
        parts = rel.split(b"/")
        if any(part in (b"", b".", b"..") for part in parts):
            log.warning("skipping object %r: not a usable path", rel)
            del files[rel]
            continue
        parent = b""
        for depth, part in enumerate(parts):
            path = b"/".join(parts[: depth + 1])
            children[parent].add(part)
            dir_mtime[parent] = max(dir_mtime[parent], mtime)
            if depth < len(parts) - 1:
                if path in files:
                    log.warning("skipping object %r: a folder of the same name exists", path)
                children.setdefault(path, set())
                dir_mtime.setdefault(path, 0)
            parent = path
    tree = Tree()
    tree.append(b"", 0, DIR_MODE, 0, dir_mtime[b""])
    queue: list[tuple[int, bytes]] = [(0, b"")]
    head = 0
    while head < len(queue):
        idx, path = queue[head]
        head += 1
        kids = sorted(children[path])
        tree.first_child[idx] = len(tree)
        tree.child_count[idx] = len(kids)
        for name in kids:
            child = path + b"/" + name if path else name
            if child in children:
                queue.append((len(tree), child))
                tree.append(name, idx, DIR_MODE, 0, dir_mtime[child])
            else:
                size, mtime, ident = files[child]
                tree.append(name, idx, FILE_MODE, size, mtime, ident=ident)
    return tree
