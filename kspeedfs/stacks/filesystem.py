"""`kspeedfs://NAME/path`: the cache as a read-only fsspec filesystem, no FUSE.

Registered under the `kspeedfs` protocol by the `fsspec.specs` entry point, so `fsspec.open`,
pyarrow (`filesystem=fs`, or `PyFileSystem(FSSpecHandler(fs))`) and `datasets.load_dataset`
reach it with no other setup. Settings come from the config file and environment as for every
client, with `nodes`, `token`, `user` and `password` storage options on top.

Every byte is read by the fast path's `Reader` (kspeedfs.client.dataset_reader): the local
node's mapped segments, then the owners over the network (one vectored read per node), then
the verified source. The dataset list is looked at again at most every `refresh` seconds (or
at once for a name not known yet, and on `invalidate_cache`); a name loaded again gets a new
Reader, while files opened before keep the old one (the old instance's bytes or StaleDataset).
"""

from __future__ import annotations

import datetime
import logging
import os
import posixpath
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from fsspec.spec import AbstractFileSystem

from kspeedfs.client.dataset_reader import CacheRef, Reader
from kspeedfs.client.job_settings import client_settings
from kspeedfs.client.reader import ClusterReader, local_node_for
from kspeedfs.format import tarview
from kspeedfs.format.contract.node import DatasetEntry
from kspeedfs.format.errors import (
    DataError,
    InvalidArgument,
    KSpeedError,
    NodeUnreachable,
    NoSuchPath,
    NotFound,
    ReadOnlyFileSystem,
)
from kspeedfs.format.names import validate_name
from kspeedfs.stacks.file import KSpeedFile
from kspeedfs.stacks.untar import UNTAR_VIEW, MergedViews

log = logging.getLogger(__name__)

REFRESH_S = 5.0
TAR_VIEW = "@tar"  # NAME@tar: the dataset with each .tar a folder of its members
VIEWS = (TAR_VIEW, UNTAR_VIEW)  # folders that read their dataset's tars
MAX_LINKS = 16  # symlinks followed for one open, as a kernel would stop a loop


class KSpeedFileSystem(AbstractFileSystem):
    """Datasets in the cache as top-level folders; read-only (writes raise ReadOnlyFileSystem)."""

    protocol: ClassVar[str] = "kspeedfs"
    root_marker: ClassVar[str] = ""

    def __init__(
        self,
        nodes: str | Sequence[str] | None = None,
        token: str | os.PathLike[str] | None = None,
        user: str | None = None,
        password: str | None = None,
        local: bool | None = None,
        refresh: float = REFRESH_S,
        **kwargs: Any,
    ):
        """`local`: None maps the local node's segments where it can, False always reads
        over the network, True refuses a dataset this process cannot map."""
        super().__init__(**kwargs)
        self.settings = client_settings(nodes, token, user, password, origin="storage options")
        self.local = local
        self.refresh = float(refresh)
        self._cluster = ClusterReader(
            self.settings, None if local is False else local_node_for(self.settings)
        )
        self._lock = threading.Lock()
        self._ready: dict[str, DatasetEntry] = {}
        self._listed_at = -float("inf")
        self._ever_listed = False
        self._readers: dict[str, Reader] = {}
        # Folder path -> (reader, entry) of folders looked up since the last listing: a file's
        # lookup is then one search among its folder's children, not one per path component.
        self._folders: dict[str, tuple[Reader, int]] = {}
        # Parsed tars of the tar views, by (instance, entry); None: refused (damaged).
        self._tars: dict[tuple[str, int], tarview.TarTree | None] = {}
        self._untar = MergedViews()  # NAME@untar: every tar of NAME extracted in one tree

    # Paths.

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = os.fspath(path)
        if path.startswith("kspeedfs://"):
            path = path[len("kspeedfs://") :]
        return path.strip("/")

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        return {}

    def _split(self, path: str) -> tuple[str, str]:
        """(dataset name, path inside it) of a stripped path; a bad name is InvalidArgument."""
        path = self._strip_protocol(path)
        name, _, rel = path.partition("/")
        validate_name(_base_name(name))
        try:
            os.fsencode(rel)
        except UnicodeEncodeError:  # a lone surrogate: no name in any manifest is spelled so
            raise NoSuchPath(f"no such file: kspeedfs://{path!r} (not encodable)") from None
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise InvalidArgument(f"'..' in kspeedfs://{path}: paths are from the dataset root")
        return name, "/".join(parts)

    # Datasets and instances.

    def _datasets(self, force: bool = False) -> dict[str, DatasetEntry]:
        if not force and time.monotonic() - self._listed_at < self.refresh:
            return self._ready
        with self._lock:
            if force or time.monotonic() - self._listed_at >= self.refresh:
                try:
                    ready = self._cluster.list_datasets()
                except NodeUnreachable as e:
                    if not self._ever_listed:
                        raise
                    # As the mount does: serve on with what is known (the instances' readers
                    # still fail over to the source), and look again in `refresh` seconds.
                    log.warning("no node answers (%s): serving the datasets already known", e)
                    ready = self._ready
                self._ready, self._ever_listed = ready, True
                self._listed_at = time.monotonic()
                self._folders = {}
                for gone in set(self._readers) - set(self._ready):
                    del self._readers[gone]  # open files keep theirs
            return self._ready

    def _reader(self, name: str) -> Reader:
        """This filesystem's reader of the current instance of `name`."""
        name = _base_name(name)  # a tar view reads its dataset
        info = self._datasets().get(name) or self._datasets(force=True).get(name)
        for _attempt in range(3):
            if info is None:
                raise NoSuchPath(f"no dataset named {name!r} in the cache")
            uuid = info.uuid
            with self._lock:
                reader = self._readers.get(name)
            if reader is not None and reader.ref.uuid == uuid:
                return reader
            ref = CacheRef(self.settings, name, uuid, info.source, info, self.local)
            try:
                reader = Reader(ref)
            except (NotFound, DataError):
                info = self._datasets(force=True).get(name)
                if info is not None and info.uuid == uuid:
                    raise  # not a reload under way: a real failure to open it
                continue  # unloaded or loaded again meanwhile: look again
            with self._lock:
                self._readers[name] = reader
            return reader
        raise NoSuchPath(f"dataset {name!r} kept changing while opening it")

    def invalidate_cache(self, path: str | None = None) -> None:
        """Look at the dataset list again on the next call (a dataset loaded, unloaded or
        loaded again meanwhile)."""
        with self._lock:
            self._listed_at = -float("inf")
        super().invalidate_cache(path)

    def _entry(self, path: str, follow: bool = True) -> tuple[Reader, int, str]:
        """(reader, manifest entry, dataset name) of a path; its symlinks inside the dataset
        followed when `follow` (a link out of it is not found)."""
        path = self._strip_protocol(path)
        folder, _, leaf = path.rpartition("/")
        known = self._folders.get(folder)
        if known is not None and time.monotonic() - self._listed_at < self.refresh:
            reader, at = known
            m = reader.manifest
            try:
                entry = m.lookup(at, os.fsencode(leaf))
            except UnicodeEncodeError:
                entry = None  # the slow path says why
            if entry is not None and not (follow and m.is_link(entry)):
                return reader, entry, reader.ref.name
        name, rel = self._split(path)
        reader = self._reader(name)
        m = reader.manifest
        for hop in range(MAX_LINKS):
            try:
                entry = m.resolve(rel)
            except NotFound:
                raise NoSuchPath(f"no such file: kspeedfs://{name}/{rel}") from None
            if hop == 0 and rel:
                self._folders[folder] = (reader, int(m.parent[entry]))
            if not follow or not m.is_link(entry):
                return reader, entry, name
            target = os.fsdecode(m.link_target(entry))
            joined = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
            if target.startswith("/") or joined == ".." or joined.startswith("../"):
                raise NoSuchPath(f"kspeedfs://{name}/{rel} links out of the dataset ({target})")
            rel = "" if joined == "." else joined
        raise NoSuchPath(f"kspeedfs://{name}/{rel}: too many levels of symbolic links")

    # The tar view: NAME@tar/.../shard.tar/member

    def _tar_tree(self, reader: Reader, entry: int) -> tarview.TarTree | None:
        key = (reader.ref.uuid, entry)
        if key not in self._tars:

            def read(offset: int, n: int) -> memoryview:
                return reader.range_bytes(entry, offset, n)

            try:
                tree: tarview.TarTree | None = tarview.parse(read, int(reader.manifest.size[entry]))
            except DataError as e:
                path = os.fsdecode(reader.manifest.path(entry))
                log.warning("%s%s: %s is shown empty: %s", reader.ref.name, TAR_VIEW, path, e)
                tree = None
            self._tars[key] = tree
        return self._tars[key]

    def _is_tar(self, reader: Reader, entry: int) -> bool:
        m = reader.manifest
        return m.is_file(entry) and tarview.is_tar_name(m.name(entry))

    def _tar_spot(self, path: str) -> tuple[str, Reader, int, tarview.TarTree | None, int]:
        """(view name, reader, manifest entry, the tar's tree or None, node) of a tar view
        path: node -1 for a dataset entry that is not a tar; else the entry is a tar and the
        node is in its tree (0: the tar's folder)."""
        name, rel = self._split(path)
        reader = self._reader(name)
        m = reader.manifest
        entry = 0
        parts = [os.fsencode(p) for p in rel.split("/") if p]
        k = 0
        while k < len(parts) and not self._is_tar(reader, entry):
            found = m.lookup(entry, parts[k]) if m.is_dir(entry) else None
            if found is None:
                raise NoSuchPath(f"no such file: kspeedfs://{name}/{rel}")
            entry, k = found, k + 1
        parts_left = parts[k:]
        if not self._is_tar(reader, entry):
            return name, reader, entry, None, -1
        tree = self._tar_tree(reader, entry)
        node = 0 if tree is None and not parts_left else None
        if tree is not None:
            node = tree.resolve(b"/".join(parts_left))
        if node is None:
            raise NoSuchPath(f"no such file: kspeedfs://{name}/{rel}")
        return name, reader, entry, tree, node

    def _describe_tar(
        self,
        name: str,
        reader: Reader,
        entry: int,
        tree: tarview.TarTree | None,
        node: int,
        path: str,
    ) -> dict[str, Any]:
        if node < 0:
            plain = self._describe(name, reader, entry, path)
            plain["dataset"] = name
            return plain
        _mode, _size, uid, gid, mtime_ns = reader.manifest.stat_fields(entry)
        n = tree.nodes[node] if tree is not None and node else None
        kind = "directory" if n is None or n.kind == tarview.DIR else n.kind
        kind = "link" if kind == tarview.LINK else kind
        out: dict[str, Any] = {
            "name": path,
            "size": n.size if n is not None and kind == "file" else 0,
            "type": kind,
            "mode": tarview.shown_mode(n) if n is not None else stat.S_IFDIR | 0o555,
            "uid": uid,
            "gid": gid,
            "mtime": n.mtime if n is not None else mtime_ns / 1e9,
            "islink": kind == "link",
            "dataset": name,
            "instance": reader.ref.uuid,
        }
        if kind == "link" and n is not None:
            out["destination"] = os.fsdecode(n.target)
        return out

    def _tar_ls(self, path: str) -> list[dict[str, Any]]:
        name, reader, entry, tree, node = self._tar_spot(path)
        m = reader.manifest
        if node < 0:
            if not m.is_dir(entry):
                return [self._describe_tar(name, reader, entry, None, -1, path)]
            out = []
            for child in m.children(entry):
                child_path = f"{path}/{os.fsdecode(m.name(child))}"
                if self._is_tar(reader, child):
                    out.append(self._describe_tar(name, reader, child, None, 0, child_path))
                else:
                    out.append(self._describe_tar(name, reader, child, None, -1, child_path))
            return out
        if tree is None:
            return []
        if node and tree.nodes[node].kind != tarview.DIR:
            return [self._describe_tar(name, reader, entry, tree, node, path)]
        return [
            self._describe_tar(name, reader, entry, tree, c, f"{path}/{os.fsdecode(n)}")
            for n, c in tree.children(node)
        ]

    def _tar_file(self, path: str) -> tuple[Reader, int, int, int, dict[str, Any]]:
        """(reader, tar entry, offset, size, details) of a member file of a tar view."""
        name, reader, entry, tree, node = self._tar_spot(path)
        details = self._describe_tar(name, reader, entry, tree, node, path)
        if node < 0:
            if not reader.manifest.is_file(entry):
                raise IsADirectoryError(f"kspeedfs://{path} is not a regular file")
            return reader, entry, 0, int(reader.manifest.size[entry]), details
        n = tree.nodes[node] if tree is not None and node else None
        if n is None or n.kind != tarview.FILE:
            raise IsADirectoryError(f"kspeedfs://{path} is not a regular file")
        return reader, entry, n.offset, n.size, details

    # Listing.

    def _describe(self, name: str, reader: Reader, entry: int, path: str) -> dict[str, Any]:
        m = reader.manifest
        mode, size, uid, gid, mtime_ns = m.stat_fields(entry)
        kind = "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "link"
        out: dict[str, Any] = {
            "name": path,
            "size": size if kind == "file" else 0,
            "type": kind,
            "mode": mode,
            "uid": uid,
            "gid": gid,
            "mtime": _seconds(mtime_ns),
            "islink": kind == "link",
            "dataset": name,
            "instance": reader.ref.uuid,
        }
        if kind == "file":
            # Changes with the instance and the bytes: what `datasets` keys its download cache on.
            out["ETag"] = f"{reader.ref.uuid}-{int(m.checksum[entry]):016x}"
        elif kind == "link":
            out["destination"] = os.fsdecode(m.link_target(entry))
        return out

    def _root_entries(self) -> list[dict[str, Any]]:
        """A folder per dataset (the tar views are not listed: open `NAME@tar/` or
        `NAME@untar/` by name)."""
        return [
            {
                "name": name,
                "size": 0,
                "type": "directory",
                "dataset": name,
                "instance": info.uuid,
            }
            for name, info in sorted(self._datasets().items())
        ]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if path == "":
            return {"name": "", "size": 0, "type": "directory"}
        name, rel = self._split(path)
        if name.endswith(UNTAR_VIEW):
            return self._untar.info(self._reader(name), rel, path)
        if name.endswith(TAR_VIEW):
            name, reader, entry, tree, node = self._tar_spot(path)
            return self._describe_tar(name, reader, entry, tree, node, path)
        reader, entry, name = self._entry(path, follow=False)
        return self._describe(name, reader, entry, path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        if path == "":
            found = self._root_entries()
        elif self._split(path)[0].endswith(UNTAR_VIEW):
            name, rel = self._split(path)
            found = self._untar.ls(self._reader(name), rel, path)
        elif self._split(path)[0].endswith(TAR_VIEW):
            found = self._tar_ls(path)
        else:
            reader, entry, name = self._entry(path, follow=False)
            m = reader.manifest
            if not m.is_dir(entry):
                found = [self._describe(name, reader, entry, path)]
            else:
                base = f"{name}/{m.path(entry).decode(errors='surrogateescape')}".rstrip("/")
                found = [
                    self._describe(name, reader, child, f"{base}/{os.fsdecode(m.name(child))}")
                    for child in m.children(entry)
                ]
        return found if detail else [f["name"] for f in found]

    def modified(self, path: str) -> datetime.datetime:
        mtime = self.info(path).get("mtime")
        if mtime is None:
            raise InvalidArgument(f"kspeedfs://{path} has no modification time")
        try:
            return datetime.datetime.fromtimestamp(mtime, tz=datetime.UTC)
        except (OverflowError, ValueError, OSError):
            raise InvalidArgument(
                f"kspeedfs://{path}: its modification time ({mtime:.0f} s) is past what a"
                " Python datetime holds (years 1 to 9999)"
            ) from None

    # Reading.

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> KSpeedFile:
        if mode != "rb":
            raise ReadOnlyFileSystem(f"kspeedfs:// is read-only: cannot open {path} for {mode!r}")
        path = self._strip_protocol(path)
        name, rel = self._split(path)
        if name.endswith(UNTAR_VIEW):
            reader = self._reader(name)
            entry, offset, size, details = self._untar.member(reader, rel, path)
            return KSpeedFile(self, path, reader, entry, details, (offset, size))
        if name.endswith(TAR_VIEW):
            reader, entry, offset, size, details = self._tar_file(path)
            return KSpeedFile(self, path, reader, entry, details, (offset, size))
        reader, entry, name = self._entry(path)
        m = reader.manifest
        if not m.is_file(entry):
            raise IsADirectoryError(f"kspeedfs://{path} is not a regular file")
        return KSpeedFile(self, path, reader, entry, self._describe(name, reader, entry, path))

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        if self._split(path)[0].endswith(VIEWS):
            with self._open(path) as f:
                lo, hi = _clip(start, end, f.size)
                f.seek(lo)
                return f.read(max(0, hi - lo))
        reader, entry = self._file(path)
        size = int(reader.manifest.size[entry])
        if start is None and end is None:
            return bytes(reader.view(entry))
        lo, hi = _clip(start, end, size)
        if hi <= lo:
            return b""
        view = reader.range_view(entry, lo, hi - lo)
        if view is not None:
            return bytes(view)
        out = bytearray(hi - lo)
        reader.gather([(entry, lo, hi - lo)], memoryview(out))
        return bytes(out)

    def _file(self, path: str) -> tuple[Reader, int]:
        reader, entry, _name = self._entry(path)
        if not reader.manifest.is_file(entry):
            raise IsADirectoryError(f"kspeedfs://{self._strip_protocol(path)} is not a file")
        return reader, entry

    def cat_ranges(
        self,
        paths: list[str],
        starts: int | list[int] | None,
        ends: int | list[int] | None,
        max_gap: int | None = None,
        on_error: str = "return",
        **kwargs: Any,
    ) -> list[bytes | Exception]:
        """Byte ranges of many files: the ranges of each dataset in one `gather` (one vectored
        read per node; local ones copied from the map). A path that cannot be read gets its
        error in its place (`on_error="return"`) or raises it."""
        if not isinstance(paths, list):
            raise TypeError("cat_ranges takes a list of paths")
        n = len(paths)
        starts_ = starts if isinstance(starts, list) else [starts] * n
        ends_ = ends if isinstance(ends, list) else [ends] * n
        if len(starts_) != n or len(ends_) != n:
            raise ValueError("cat_ranges: paths, starts and ends differ in length")
        out: list[bytes | Exception] = [b""] * n
        batches: dict[int, tuple[Reader, list[tuple[int, int, int, int]]]] = {}
        for k, (path, start, end) in enumerate(zip(paths, starts_, ends_, strict=True)):
            try:
                if self._split(path)[0].endswith(VIEWS):  # a member: its own read
                    out[k] = self.cat_file(path, start, end)
                    continue
                reader, entry = self._file(path)
            except (KSpeedError, OSError) as e:
                if on_error != "return":
                    raise
                out[k] = e
                continue
            lo, hi = _clip(start, end, int(reader.manifest.size[entry]))
            if hi > lo:
                batches.setdefault(id(reader), (reader, []))[1].append((k, entry, lo, hi - lo))
        for reader, wanted in batches.values():
            buf = memoryview(bytearray(sum(w[3] for w in wanted)))
            try:
                reader.gather([(entry, lo, length) for _k, entry, lo, length in wanted], buf)
            except KSpeedError as e:
                if on_error != "return":
                    raise
                for k, *_rest in wanted:
                    out[k] = e
                continue
            pos = 0
            for k, _entry, _lo, length in wanted:
                out[k] = bytes(buf[pos : pos + length])
                pos += length
        return out

    # Writing: refused, whatever the call.

    def _refuse(self, path: Any = "", *args: Any, **kwargs: Any) -> Any:
        raise ReadOnlyFileSystem(f"kspeedfs:// is read-only: cannot change {path or 'it'}")

    mkdir = makedirs = rmdir = rm_file = _rm = rm = touch = _refuse
    pipe_file = put_file = cp_file = mv = copy = setxattrs = _refuse


def _base_name(name: str) -> str:
    """The dataset a top-level name reads: NAME of NAME, NAME@tar and NAME@untar."""
    for view in VIEWS:
        if name.endswith(view):
            return name.removesuffix(view)
    return name


def _clip(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    """fsspec's [start, end) of a file of `size` bytes: None the ends, negative from the end."""
    lo = 0 if start is None else start + size if start < 0 else start
    hi = size if end is None else end + size if end < 0 else end
    return max(0, min(lo, size)), max(0, min(hi, size))


def _seconds(ns: int) -> float:
    """A time in nanoseconds as float seconds, rounded as `os.stat_result.st_mtime` is."""
    sec, nsec = divmod(ns, 1_000_000_000)
    return float(sec) + nsec * 1e-9
