"""Where a dataset's bytes come from: a local folder or an object store (fsspec), listed and read.

A `Source` lists itself into a `Tree` (the manifest's input) and reads byte ranges of its
files into caller buffers, checking that each file is still the one that was listed. The
preload functions at the bottom take either a local folder (`Path`, the loader's fast path)
or a `Source`, so the preload code needs no other change to load from object storage.
"""

from __future__ import annotations

import abc
import concurrent.futures
import datetime
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from . import loader
from .errors import (
    AuthError,
    DataError,
    InvalidArgument,
    KSpeedError,
    NotFound,
    SourceChanged,
)
from .manifest import Manifest
from .scan import Tree, check_source, scan_tree

log = logging.getLogger(__name__)

_URL_RE = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755
# Segments fetched at once by a preload from object storage (each is itself many parallel GETs).
PARALLEL_SEGMENTS = 4


def is_url(source: str) -> bool:
    return _URL_RE.match(source) is not None


def normalize_source(source: str) -> str:
    """The form the node records: an absolute, existing folder, or a URL as given."""
    if is_url(source):
        return source.rstrip("/") if not source.endswith("://") else source
    return os.path.abspath(check_source(source))


def name_from_source(source: str) -> str:
    """A dataset name derived from the source's last path part (`/nfs/imagenet` -> imagenet)."""
    m = _URL_RE.match(source)
    path = m.group(2) if m else source
    last = path.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", last).lstrip("._-")[:64]
    return name or "dataset"


class Piece(NamedTuple):
    """Bytes [offset, offset + len(buffer)) of one file, expected to be `size` long."""

    relpath: bytes
    offset: int
    size: int
    mtime_ns: int


class Source(abc.ABC):
    """A listable, readable dataset source. Thread-safe; shared per (url, endpoint)."""

    def __init__(self, url: str, endpoint: str = ""):
        self.url = url
        self.endpoint = endpoint

    @abc.abstractmethod
    def scan(self) -> Tree:
        """List the whole source: a breadth-first tree, children sorted by name bytes."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise a one-line error when the source is missing, refused or not a folder."""

    @abc.abstractmethod
    def read_pieces(self, pieces: Sequence[Piece], out: Sequence[memoryview]) -> None:
        """Fill out[k] from pieces[k]; SourceChanged when a file is no longer as listed."""

    def display(self, relpath: bytes) -> str:
        return f"{self.url}/{os.fsdecode(relpath)}"


class LocalSource(Source):
    """A folder on a local or shared filesystem."""

    def __init__(self, url: str):
        super().__init__(url)
        self.root = os.fsencode(url)

    def scan(self) -> Tree:
        return scan_tree(self.url)

    def check(self) -> None:
        check_source(self.url)

    def read_pieces(self, pieces: Sequence[Piece], out: Sequence[memoryview]) -> None:
        for piece, view in zip(pieces, out, strict=True):
            path = self.root + b"/" + piece.relpath
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as e:
                raise SourceChanged(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
            try:
                st = os.fstat(fd)
                # The dataset is a snapshot: a file that changed since it was listed is not
                # served under the old size and time.
                if st.st_size != piece.size or st.st_mtime_ns != piece.mtime_ns:
                    raise SourceChanged(f"source file changed since listing: {os.fsdecode(path)}")
                got = 0
                while got < len(view):
                    n = os.preadv(fd, [view[got:]], piece.offset + got)
                    if n <= 0:
                        raise SourceChanged(f"source file shrank: {os.fsdecode(path)}")
                    got += n
            except OSError as e:
                raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
            finally:
                os.close(fd)


class FsspecSource(Source):
    """An object store (or any fsspec filesystem): one listing, ranged reads in parallel."""

    def __init__(self, url: str, endpoint: str = ""):
        super().__init__(url, endpoint)
        m = _URL_RE.match(url)
        assert m is not None
        self.protocol = m.group(1)
        try:
            import fsspec
        except ImportError:
            raise InvalidArgument(
                f"{self.protocol}:// sources need fsspec: pip install 'kspeedfs[s3]'"
            ) from None
        kwargs: dict[str, Any] = {}
        if self.protocol in ("s3", "s3a"):
            # Fail fast on a wrong endpoint instead of botocore's long retry ladder.
            kwargs["config_kwargs"] = {
                "connect_timeout": 5,
                "read_timeout": 60,
                "retries": {"max_attempts": 3},
            }
            if endpoint:
                kwargs["endpoint_url"] = endpoint
        elif endpoint:
            raise InvalidArgument(f"--endpoint is for s3:// sources, not {self.protocol}://")
        try:
            self.fs = fsspec.filesystem(self.protocol, **kwargs)
        except (ImportError, ValueError) as e:
            raise InvalidArgument(
                f"cannot open {self.protocol}:// sources ({_one_line(e)}): "
                "pip install 'kspeedfs[s3]'"
            ) from None
        self.root = str(self.fs._strip_protocol(url)).rstrip("/")

    def _error(self, e: BaseException, what: str) -> KSpeedError:
        msg = _one_line(e)
        if isinstance(e, KSpeedError):
            return e
        if isinstance(e, FileNotFoundError):
            return NotFound(f"source not found: {what} ({msg})")
        if isinstance(e, PermissionError):
            return AuthError(f"access to {what} refused: {msg} (check the credentials)")
        return DataError(f"cannot read {what}: {msg}")

    def check(self) -> None:
        try:
            self.fs.invalidate_cache(self.root)
            info = self.fs.info(self.root)
        except FileNotFoundError:
            raise NotFound(f"source not found: {self.url} ({self._missing()})") from None
        except Exception as e:
            raise self._error(e, self.url) from None
        if info.get("type") != "directory":
            raise InvalidArgument(f"source is not a folder (a prefix): {self.url}")

    def _missing(self) -> str:
        """Why a path is not found: its bucket is missing, or nothing is under the prefix."""
        bucket = self.root.split("/", 1)[0]
        try:
            if bucket != self.root and self.fs.exists(bucket):
                return "no objects under it"
        except Exception:
            pass
        return f"no bucket {bucket!r}" if self.protocol in ("s3", "s3a", "gs") else "missing"

    def scan(self) -> Tree:
        self.check()
        try:
            self.fs.invalidate_cache(self.root)
            listing = self.fs.find(self.root, detail=True, withdirs=False)
        except Exception as e:
            raise self._error(e, self.url) from None
        prefix = self.root + "/"
        files: dict[bytes, tuple[int, int]] = {}
        for path, info in listing.items():
            if not path.startswith(prefix) or path.endswith("/"):
                continue  # folder markers ("dir/" objects) are not files
            rel = path[len(prefix) :].encode("utf-8", "surrogateescape")
            files[rel] = (int(info.get("size") or 0), _mtime_ns(info))
        if not files:
            raise NotFound(f"source not found: {self.url} (no objects under it)")
        return tree_from_listing(files)

    def read_pieces(self, pieces: Sequence[Piece], out: Sequence[memoryview]) -> None:
        if not pieces:
            return
        paths = [f"{self.root}/{p.relpath.decode('utf-8', 'surrogateescape')}" for p in pieces]
        starts = [p.offset for p in pieces]
        ends = [p.offset + len(v) for p, v in zip(pieces, out, strict=True)]
        try:
            results = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        except Exception as e:
            raise self._error(e, self.url) from None
        for piece, view, data in zip(pieces, out, results, strict=True):
            if isinstance(data, BaseException):
                err = self._error(data, self.display(piece.relpath))
                if isinstance(err, NotFound):
                    raise SourceChanged(str(err))
                raise err
            if len(data) != len(view):
                raise SourceChanged(f"source object shrank: {self.display(piece.relpath)}")
            view[:] = data


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _mtime_ns(info: dict[str, Any]) -> int:
    value = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if isinstance(value, datetime.datetime):
        return int(value.timestamp() * 1_000_000_000)
    if isinstance(value, (int, float)):
        return int(value * 1_000_000_000)
    return 0


def tree_from_listing(files: dict[bytes, tuple[int, int]]) -> Tree:
    """A Tree from flat object keys: folders are the key prefixes; a folder's time is the
    newest of its files' (object stores have no folder times), so a change shows up."""
    children: dict[bytes, set[bytes]] = {b"": set()}
    dir_mtime: dict[bytes, int] = {b"": 0}
    for rel, (_size, mtime) in list(files.items()):
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
                size, mtime = files[child]
                tree.append(name, idx, FILE_MODE, size, mtime)
    return tree


_sources: dict[tuple[str, str], Source] = {}
_sources_lock = threading.Lock()


def open_source(url: str, endpoint: str = "") -> Source:
    """The shared Source for a URL or an absolute folder (one per process and endpoint)."""
    key = (url, endpoint or "")
    with _sources_lock:
        found = _sources.get(key)
        if found is None:
            if is_url(url):
                found = FsspecSource(url, endpoint or "")
            else:
                if endpoint:
                    raise InvalidArgument("--endpoint is for object storage (s3://) sources")
                if not os.path.isabs(url):
                    raise InvalidArgument(f"source must be an absolute path or a URL: {url}")
                found = LocalSource(url)
            _sources[key] = found
    return found


class Layout:
    """Which bytes of which files make up each segment (regular, non-empty files only)."""

    def __init__(
        self,
        entries: np.ndarray,
        starts: np.ndarray,
        sizes: np.ndarray,
        mtimes: np.ndarray,
        path: Callable[[int], bytes],
        segment_size: int,
    ):
        self.entries, self.starts, self.sizes, self.mtimes = entries, starts, sizes, mtimes
        self.ends = starts + sizes
        self.path = path
        self.segment_size = segment_size

    @classmethod
    def of_manifest(cls, m: Manifest) -> Layout:
        files = np.flatnonzero(((m.mode & 0o170000) == stat.S_IFREG) & (m.size > 0))
        return cls(
            files,
            m.data[files].astype(np.int64),
            m.size[files].astype(np.int64),
            m.mtime_ns[files],
            m.path,
            m.segment_size,
        )

    @classmethod
    def of_tree(cls, tree: Tree, offsets: list[int], segment_size: int) -> Layout:
        files = np.array(
            [
                i
                for i, (mode, size) in enumerate(zip(tree.mode, tree.size, strict=True))
                if stat.S_ISREG(mode) and size
            ],
            dtype=np.int64,
        )
        pick = files.tolist()
        return cls(
            files,
            np.array([offsets[i] for i in pick], dtype=np.int64),
            np.array([tree.size[i] for i in pick], dtype=np.int64),
            np.array([tree.mtime_ns[i] for i in pick], dtype=np.int64),
            tree.path,
            segment_size,
        )

    def segment(self, seg: int, length: int) -> list[tuple[int, Piece, int, int]]:
        """(entry, piece, offset in the segment, length) for every file piece in segment seg."""
        base = seg * self.segment_size
        lo = int(np.searchsorted(self.ends, base, side="right"))
        hi = int(np.searchsorted(self.starts, base + length, side="left"))
        out = []
        for k in range(lo, hi):
            start, end = max(int(self.starts[k]), base), min(int(self.ends[k]), base + length)
            if start >= end:
                continue
            entry = int(self.entries[k])
            piece = Piece(
                self.path(entry),
                start - int(self.starts[k]),
                int(self.sizes[k]),
                int(self.mtimes[k]),
            )
            out.append((entry, piece, start - base, end - start))
        return out

    def signature(self, seg: int, length: int) -> bytes:
        """Identifies a segment's contents by what is in it (paths, sizes, times, places)."""
        h = xxhash.xxh3_128()
        h.update(b"%d\0" % length)
        for _entry, p, at, n in self.segment(seg, length):
            h.update(b"%d\0%d\0%d\0%d\0%d\0" % (p.offset, p.size, p.mtime_ns, at, n) + p.relpath)
        return h.digest()


def fill_segment(source: Source, layout: Layout, seg: int, out: memoryview) -> int:
    """Read segment seg's bytes from the source into out; returns the number of source reads."""
    parts = layout.segment(seg, len(out))
    source.read_pieces(
        [p for _e, p, _at, _n in parts], [out[at : at + n] for _e, _p, at, n in parts]
    )
    return len(parts)


def read_file_range(source: Source, piece: Piece, length: int) -> bytes:
    """length bytes of one file straight from the source (a read the cache cannot serve)."""
    buf = bytearray(length)
    source.read_pieces([piece], [memoryview(buf)])
    return bytes(buf)


def diff_counts(m: Manifest, tree: Tree) -> int:
    """How many files were added, removed or changed (size or time) since the manifest."""
    old = {}
    for i in m.iter_files():
        old[m.path(i)] = (int(m.size[i]), int(m.mtime_ns[i]))
    changed = 0
    for i, (mode, size, mtime) in enumerate(zip(tree.mode, tree.size, tree.mtime_ns, strict=True)):
        if not stat.S_ISREG(mode):
            continue
        before = old.pop(tree.path(i), None)
        if before != (size, mtime):
            changed += 1
    return changed + len(old)


# Preload from any source: a local folder keeps the loader's zero-extra-copy path.


def source_for(source: str, endpoint: str = "") -> Path | Source:
    return open_source(source, endpoint) if is_url(source) else Path(source)


def scan_any(source: Path | Source) -> Tree:
    return scan_tree(source) if isinstance(source, Path) else source.scan()


def load_segments(
    source: Path | Source,
    tree: Tree,
    offsets: list[int],
    seg_len: list[int],
    held: Collection[int],
    staging: Path,
    segment_size: int,
    progress: loader.Progress,
    seg_checksums: dict[int, int] | None = None,
) -> dict[int, int]:
    """loader.load_segments for any source; object stores are read segments in parallel."""
    if isinstance(source, Path):
        return loader.load_segments(
            source, tree, offsets, seg_len, held, staging, segment_size, progress, seg_checksums
        )
    held = sorted(set(held))
    layout = Layout.of_tree(tree, offsets, segment_size)
    todo = loader.files_in(tree, offsets, segment_size, set(held))
    progress.files_total = len(todo)
    progress.bytes_total = sum(tree.size[i] for i in todo)
    maps: dict[int, mmap.mmap] = {}
    try:
        for seg in held:
            fd = loader.create_segment(staging, seg, seg_len[seg])
            try:
                maps[seg] = mmap.mmap(fd, seg_len[seg])
            finally:
                os.close(fd)

        def one(seg: int) -> None:
            if progress.cancel.is_set():
                raise KSpeedError("preload cancelled")
            view = memoryview(maps[seg])
            try:
                fill_segment(source, layout, seg, view)
                if seg_checksums is not None:  # while the bytes are hot, as the loader does
                    seg_checksums[seg] = xxhash.xxh3_64_intdigest(view)
            finally:
                view.release()
            progress.bytes_done += seg_len[seg]

        with concurrent.futures.ThreadPoolExecutor(PARALLEL_SEGMENTS) as pool:
            for fut in [pool.submit(one, seg) for seg in held]:
                fut.result()
        progress.bytes_done = progress.bytes_total
        progress.files_done = len(todo)
        return _checksums(tree, offsets, segment_size, maps, todo)
    finally:
        for m in maps.values():
            m.close()


def _checksums(
    tree: Tree, offsets: list[int], segment_size: int, maps: dict[int, mmap.mmap], todo: list[int]
) -> dict[int, int]:
    """Checksums of the files whose every piece is in the held (mapped) segments."""
    out = {}
    for i in todo:
        pos, end = offsets[i], offsets[i] + tree.size[i]
        hasher = xxhash.xxh3_64()
        while pos < end:
            seg, off = divmod(pos, segment_size)
            if seg not in maps:
                break
            n = min(end - pos, segment_size - off)
            hasher.update(memoryview(maps[seg])[off : off + n])
            pos += n
        else:
            out[i] = hasher.intdigest()
    return out


def read_segment(
    source: Path | Source, tree: Tree, offsets: list[int], segment_size: int, seg: int, length: int
) -> bytearray:
    if isinstance(source, Path):
        return loader.read_segment(source, tree, offsets, segment_size, seg, length)
    out = bytearray(length)
    fill_segment(source, Layout.of_tree(tree, offsets, segment_size), seg, memoryview(out))
    return out


def checksum_source_file(source: Path | Source, relpath: bytes, size: int) -> int:
    if isinstance(source, Path):
        return loader.checksum_source_file(source, relpath, size)
    hasher = xxhash.xxh3_64()
    chunk = 8 << 20
    for pos in range(0, size, chunk):
        n = min(chunk, size - pos)
        hasher.update(read_file_range(source, Piece(relpath, pos, size, 0), n))
    return hasher.intdigest()


def checked_source(source: str, endpoint: str = "") -> Path | Source:
    """source_for, with a local folder checked first (one-line errors when it is not usable)."""
    return open_source(source, endpoint) if is_url(source) else check_source(source)
