"""The flat, breadth-first list of a source tree's entries: what a scan yields and a manifest is built from."""

from __future__ import annotations

import dataclasses
import stat


@dataclasses.dataclass
class Tree:
    """Entries in breadth-first order; a folder's children are contiguous and sorted by name.

    Entry 0 is the root. For a folder, `first_child`/`child_count` locate its children;
    for a symlink, `link_target` holds the target bytes. `uid`/`gid` are the owners the source
    reported (0/0 where it has none), kept so the mount can answer with the source's permissions.
    `ctime_ns`/`ident`/`dev` complete a file's version (see `kspeedfs.sources.version`): what a
    copy of it is checked against.
    """

    names: list[bytes] = dataclasses.field(default_factory=list)
    parent: list[int] = dataclasses.field(default_factory=list)
    mode: list[int] = dataclasses.field(default_factory=list)
    size: list[int] = dataclasses.field(default_factory=list)
    mtime_ns: list[int] = dataclasses.field(default_factory=list)
    uid: list[int] = dataclasses.field(default_factory=list)
    gid: list[int] = dataclasses.field(default_factory=list)
    ctime_ns: list[int] = dataclasses.field(default_factory=list)
    ident: list[int] = dataclasses.field(default_factory=list)
    dev: list[int] = dataclasses.field(default_factory=list)
    first_child: list[int] = dataclasses.field(default_factory=list)
    child_count: list[int] = dataclasses.field(default_factory=list)
    link_target: dict[int, bytes] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)

    def append(
        self,
        name: bytes,
        parent: int,
        mode: int,
        size: int,
        mtime_ns: int,
        uid: int = 0,
        gid: int = 0,
        ctime_ns: int = 0,
        ident: int = 0,
        dev: int = 0,
    ) -> None:
        """Add one entry; a folder's first_child/child_count are set when it is listed."""
        self.names.append(name)
        self.parent.append(parent)
        self.mode.append(mode)
        self.size.append(size)
        self.mtime_ns.append(mtime_ns)
        self.uid.append(uid)
        self.gid.append(gid)
        self.ctime_ns.append(ctime_ns)
        self.ident.append(ident)
        self.dev.append(dev)
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
