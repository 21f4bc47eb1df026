"""A tar's members as a tree of folders, files and links over the tar's own bytes: the tar view.

`NAME@tar/` shows a dataset with each `.tar` file as a folder of its members (fuse/variants.py,
the fast path and `kspeedfs://` read it the same way). Nothing is extracted or copied: a member
file is a range of the cached tar, read like any range of a dataset file. Only the headers are
read to build the tree (tarfile seeks past the data), through `read(offset, size)` on the tar.

Nodes are numbered from the headers alone, so every process that parses the same bytes gives
the same numbers (the mount's inodes): node 0 is the tar itself (its folder), the k-th header
is node 1 + k, and the folders that members imply without a header of their own (`a/` of
`a/b.jpg`) come after every possible header: 1 + size // 512 + j. A tar of `size` bytes thus
spans at most `node_span(size)` numbers.

The rules (those of the tar index, kspeedfs.format.tarindex, plus what extraction would
refuse): a damaged header, a member past the end, a sparse member, a name that leaves the
folder (`..`, after leading `/` and `./` are dropped), a hard link to no earlier file, or a
path that is a file in one member and a folder in another make the whole tar a DataError in
one line, and the view lists nothing for it. Devices and fifos are left out. A later member of
the same path replaces an earlier one, as extraction does. A hard link is a file with its
target's bytes.
"""

from __future__ import annotations

import io
import stat
import struct
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field

from kspeedfs.format.errors import DataError

Reader = bytes | bytearray | memoryview
BLOCK = 512
TAIL_CHUNK = 1 << 20
DIR, FILE, LINK = "dir", "file", "link"
_NAMES = "surrogateescape"  # tarfile's str names back to the tar's bytes


def node_span(tar_size: int) -> int:
    """How many node numbers a tar of `tar_size` bytes may use (see the module's doc)."""
    return 2 * (tar_size // BLOCK) + 2


@dataclass(slots=True)
class TarNode:
    kind: str
    mode: int = 0o644  # permission bits from the header (folders without one: 0755)
    mtime: int = 0  # seconds
    offset: int = 0  # a file's data in the tar
    size: int = 0
    target: bytes = b""  # a symlink's
    parent: int = 0
    children: dict[bytes, int] = field(default_factory=dict)  # a folder's, by name


class TarTree:
    """The parsed tree of one tar: `nodes` by number; node 0 is the tar's folder."""

    def __init__(self, nodes: dict[int, TarNode], tar_size: int):
        self.nodes = nodes
        self.tar_size = tar_size
        self._sorted: dict[int, list[tuple[bytes, int]]] = {}

    def node(self, number: int) -> TarNode | None:
        return self.nodes.get(number)

    def children(self, number: int) -> list[tuple[bytes, int]]:
        """A folder's (name, node) sorted by name bytes."""
        out = self._sorted.get(number)
        if out is None:
            out = sorted(self.nodes[number].children.items())
            self._sorted[number] = out
        return out

    def resolve(self, path: bytes) -> int | None:
        """The node at `path` (relative to the tar's folder, no links followed), or None."""
        number = 0
        for part in path.split(b"/"):
            if part in (b"", b"."):
                continue
            node = self.nodes[number]
            if node.kind != DIR or part not in node.children:
                return None
            number = node.children[part]
        return number

    def files(self) -> list[tuple[bytes, int]]:
        """(path, node) of every file, in path order."""
        out: list[tuple[bytes, int]] = []

        def walk(number: int, prefix: bytes) -> None:
            for name, child in self.children(number):
                kind = self.nodes[child].kind
                if kind == FILE:
                    out.append((prefix + name, child))
                elif kind == DIR:
                    walk(child, prefix + name + b"/")

        walk(0, b"")
        return out


class _RangeFile(io.RawIOBase):
    """A read-only file over `read(offset, size)`: what tarfile reads the headers from."""

    def __init__(self, read: Callable[[int, int], Reader], size: int):
        self._read = read
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buf), self._size - self._pos))
        if n:
            buf[:n] = self._read(self._pos, n)
            self._pos += n
        return n


def _clean(name: str) -> list[bytes]:
    """A member's path as parts, leading `/` and `./` dropped; DataError where it leaves."""
    raw = name.encode("utf-8", _NAMES)
    parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if b".." in parts:
        raise DataError(f"member {raw!r} leaves the tar's folder")
    return parts


def parse(read: Callable[[int, int], Reader], size: int) -> TarTree:
    """The tree of the tar of `size` bytes that `read(offset, size)` reads; DataError in one
    line for a damaged or hostile one."""
    nodes: dict[int, TarNode] = {0: TarNode(DIR, 0o755)}
    implied = 1 + size // BLOCK
    by_path: dict[tuple[bytes, ...], int] = {(): 0}

    def folder(parts: tuple[bytes, ...]) -> int:
        number = by_path.get(parts)
        if number is None:
            parent = folder(parts[:-1])
            number = implied + len(nodes)  # numbered after every possible header
            nodes[number] = TarNode(DIR, 0o755, parent=parent)
            nodes[parent].children[parts[-1]] = number
            by_path[parts] = number
        elif nodes[number].kind != DIR:
            raise DataError(f"{b'/'.join(parts)!r} is a file and a folder")
        return number

    try:
        with tarfile.open(fileobj=_RangeFile(read, size), mode="r:") as tar:
            for k, info in enumerate(tar):
                if info.offset_data + info.size > size:
                    raise DataError(f"member {info.name!r} runs past the end of the tar")
                if info.issparse():
                    raise DataError(f"member {info.name!r} is a sparse file")
                tar.members = []  # type: ignore[attr-defined]  # one TarInfo at a time
                parts = tuple(_clean(info.name))
                if not parts:
                    continue  # the tar's own folder (`./`)
                number = 1 + k
                mode = info.mode & 0o7777
                if info.isdir():
                    old = by_path.get(parts)
                    if old is not None:  # seen (implied or not): its header's mode and time
                        if nodes[old].kind != DIR:
                            raise DataError(f"{b'/'.join(parts)!r} is a file and a folder")
                        nodes[old].mode, nodes[old].mtime = mode, int(info.mtime)
                        continue
                    node = TarNode(DIR, mode, int(info.mtime))
                elif info.isreg():
                    node = TarNode(FILE, mode, int(info.mtime), info.offset_data, info.size)
                elif info.islnk():
                    target = by_path.get(tuple(_clean(info.linkname)))
                    if target is None or nodes[target].kind != FILE:
                        raise DataError(f"hard link {info.name!r} to no file before it")
                    t = nodes[target]
                    node = TarNode(FILE, mode, int(info.mtime), t.offset, t.size)
                elif info.issym():
                    target_bytes = info.linkname.encode("utf-8", _NAMES)
                    node = TarNode(LINK, 0o777, int(info.mtime), target=target_bytes)
                else:
                    continue  # devices, fifos: not extracted
                parent = folder(parts[:-1])
                old = by_path.get(parts)
                if old is not None:
                    if nodes[old].kind == DIR or node.kind == DIR:
                        raise DataError(f"{b'/'.join(parts)!r} is a file and a folder")
                    del nodes[old]  # a later member of the same path replaces it
                node.parent = parent
                nodes[number] = node
                nodes[parent].children[parts[-1]] = number
                by_path[parts] = number
            end = tar.offset
    except tarfile.TarError as e:
        raise DataError(f"not a readable tar: {e}") from None
    except (UnicodeError, ValueError, OverflowError, struct.error, EOFError) as e:
        raise DataError(f"not a readable tar: {e!r}") from None
    # tarfile ends quietly at a damaged header: what follows must be zero blocks (or nothing).
    pos = min(end, size)
    while pos < size:
        n = min(TAIL_CHUNK, size - pos)
        if any(bytes(read(pos, n))):
            raise DataError(f"unreadable tar header at byte {end} (damaged or not a tar)")
        pos += n
    return TarTree(nodes, size)


def is_tar_name(name: bytes) -> bool:
    return name.endswith(b".tar")


def shown_mode(node: TarNode) -> int:
    """The mode the view shows: readable by everyone (the tar's own owners and modes are not
    this machine's), executable files kept executable, never writable."""
    if node.kind == LINK:
        return stat.S_IFLNK | 0o777
    if node.kind == DIR:
        return stat.S_IFDIR | 0o555
    return stat.S_IFREG | (0o555 if node.mode & 0o111 else 0o444)
