"""Walks a source folder into a flat, breadth-first list of entries (the manifest's input)."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path

from .errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Tree:
    """Entries in breadth-first order; a folder's children are contiguous and sorted by name.

    Entry 0 is the root. For a folder, `first_child`/`child_count` locate its children;
    for a symlink, `link_target` holds the target bytes.
    """

    names: list[bytes] = dataclasses.field(default_factory=list)
    parent: list[int] = dataclasses.field(default_factory=list)
    mode: list[int] = dataclasses.field(default_factory=list)
    size: list[int] = dataclasses.field(default_factory=list)
    mtime_ns: list[int] = dataclasses.field(default_factory=list)
    first_child: list[int] = dataclasses.field(default_factory=list)
    child_count: list[int] = dataclasses.field(default_factory=list)
    link_target: dict[int, bytes] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)

    def append(self, name: bytes, parent: int, mode: int, size: int, mtime_ns: int) -> None:
        """Add one entry; a folder's first_child/child_count are set when it is listed."""
        self.names.append(name)
        self.parent.append(parent)
        self.mode.append(mode)
        self.size.append(size)
        self.mtime_ns.append(mtime_ns)
        self.first_child.append(0)
        self.child_count.append(0)

    def path(self, i: int) -> bytes:
        parts = []
        while i != 0:
            parts.append(self.names[i])
            i = self.parent[i]
        return b"/".join(reversed(parts))

    @property
    def file_count(self) -> int:
        return sum(1 for m in self.mode if stat.S_ISREG(m))

    @property
    def data_bytes(self) -> int:
        return sum(s for s, m in zip(self.size, self.mode, strict=True) if stat.S_ISREG(m))


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
    """lstat every entry once; symlinks are kept as links, special files skipped with a warning."""
    root = check_source(source)
    root_bytes = os.fsencode(root)
    st = os.stat(root_bytes)
    tree = Tree()
    tree.append(b"", 0, st.st_mode, 0, st.st_mtime_ns)
    queue: list[tuple[int, bytes]] = [(0, root_bytes)]
    head = 0
    while head < len(queue):
        dir_idx, dir_path = queue[head]
        head += 1
        with os.scandir(dir_path) as it:
            children = sorted(it, key=lambda e: e.name)
        tree.first_child[dir_idx] = len(tree)
        count = 0
        for entry in children:
            est = entry.stat(follow_symlinks=False)
            mode = est.st_mode
            idx = len(tree)
            if stat.S_ISDIR(mode):
                tree.append(entry.name, dir_idx, mode, 0, est.st_mtime_ns)
                queue.append((idx, entry.path))
            elif stat.S_ISREG(mode):
                tree.append(entry.name, dir_idx, mode, est.st_size, est.st_mtime_ns)
            elif stat.S_ISLNK(mode):
                target = os.readlink(entry.path)
                tree.append(entry.name, dir_idx, mode, len(target), est.st_mtime_ns)
                tree.link_target[idx] = target
            else:
                log.warning("skipping special file %r", os.fsdecode(entry.path))
                continue
            count += 1
        tree.child_count[dir_idx] = count
    return tree
