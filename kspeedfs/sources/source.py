"""Where a dataset's bytes come from: one `Source` interface over a local folder or an object store.

A source lists itself into a `Tree` (the manifest's input), fills segments from its files
(the local folder with sendfile straight into the segment file), checksums a file, and serves
verified failover reads: bytes of a file only while it is still the file the manifest lists.
`open_source` returns the one shared source of a folder or URL.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from kspeedfs.format.errors import (
    AuthError,
    DataError,
    InvalidArgument,
    KSpeedError,
    NotFound,
    SourceChanged,
    SourceModified,
    StaleDataset,
)
from kspeedfs.format.layout import FilePiece, FileTable, Layout
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tree import Tree
from kspeedfs.sources import version
from kspeedfs.sources.beneath import open_beneath, open_root
from kspeedfs.sources.naming import URL_RE, is_url
from kspeedfs.sources.scan import check_source, scan_tree, tree_from_listing

log = logging.getLogger(__name__)

CHECKSUM_CHUNK = 8 << 20
# Object store reads are split into ranges of at most this many bytes, fetched in parallel.
FETCH_CHUNK = 8 << 20
# sendfile errors that mean "this source cannot be spliced": read into the mapping instead.
_NO_SENDFILE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
# open() errors that mean the listed file is gone or is no longer a plain file (ENXIO: a socket).
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV, errno.ENXIO})
# O_NONBLOCK: a FIFO swapped in after the listing would block open() until a writer came; it
# opens at once instead and is refused by the S_ISREG check on the descriptor. O_NOCTTY: a
# terminal swapped in never becomes the node's. The flag stays set on a regular file (Linux's
# page cache reads and sendfile ignore it; clearing it would cost a syscall per file): a source
# filesystem that answers EAGAIN because of it gets it cleared and the read again.
_FILE_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
_DURING = "while loading"

PieceDone = Callable[[FilePiece, memoryview], None]


class Source(abc.ABC):
    """A listable, readable dataset source. Thread-safe; shared per (url, endpoint)."""

    # Segments a preload fills at once from this source.
    fill_threads = 2

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
    def fill(
        self,
        files: FileTable,
        layout: Layout,
        seg: int,
        out: memoryview,
        fd: int | None = None,
        done: PieceDone | None = None,
    ) -> int:
        """Copy segment seg's file pieces into out (= the segment file `fd` when given, which
        a local source writes with sendfile); done(piece, bytes) after each piece. Raises
        SourceChanged when a file is not at its listed version (`kspeedfs.sources.version`)
        before and after its copy: the bytes in out are then not to be used. Returns the
        number of source reads."""

    @abc.abstractmethod
    def checksum(self, files: FileTable, i: int) -> int:
        """xxh3_64 of file i, read whole at its listed version (else SourceChanged)."""

    @abc.abstractmethod
    def read_verified(
        self, files: FileTable, i: int, offset: int, length: int, checksum: int = 0
    ) -> bytes:
        """Bytes [offset, offset+length) of file i (fewer only past its end), only while the
        file is still at its listed version and, for a whole file, hashes to `checksum` (when
        non-zero); else StaleDataset. Never returns a short read."""

    def display(self, relpath: bytes) -> str:
        return f"{self.url}/{os.fsdecode(relpath)}"

    def read_segment(self, files: FileTable, layout: Layout, seg: int) -> bytearray:
        """One segment's bytes assembled from the source (for a node that cannot read it)."""
        out = bytearray(int(layout.seg_len[seg]))
        self.fill(files, layout, seg, memoryview(out))
        return out

    def _stale(self, relpath: bytes, why: str = "") -> StaleDataset:
        more = f" ({why})" if why else ""
        return StaleDataset(f"source file changed since preload: {self.display(relpath)}{more}")


def _span(offset: int, length: int, size: int) -> int:
    """How many bytes a read of [offset, offset+length) gets from a file of `size` bytes."""
    if offset < 0 or length < 0:
        raise InvalidArgument(f"bad read: offset {offset}, length {length}")
    return max(0, min(length, size - offset))


class LocalSource(Source):
    """A folder on a local or shared filesystem."""

    def __init__(self, url: str):
        super().__init__(url)
        self.root = os.fsencode(url)

    def scan(self) -> Tree:
        return scan_tree(self.url)

    def check(self) -> None:
        check_source(self.url)

    @contextlib.contextmanager
    def _rooted(self) -> Iterator[tuple[int, int]]:
        """The root's fd and device, opened once for the files one call reads (the root is
        configured: a symlink there is followed)."""
        try:
            root_fd = open_root(self.root)
        except OSError as e:
            raise DataError(f"cannot open the source {self.url}: {e.strerror}") from None
        try:
            yield root_fd, os.fstat(root_fd).st_dev
        finally:
            os.close(root_fd)

    def _open(self, rooted: tuple[int, int], relpath: bytes) -> tuple[int, version.Version]:
        """An fd of the regular file relpath and its version now, resolved beneath the root:
        no component is followed when it is a symlink (a folder swapped for a link to
        elsewhere reads as a changed source), and opening never waits (see _FILE_OPEN)."""
        root_fd, root_dev = rooted
        path = self.root + b"/" + relpath
        try:
            fd = open_beneath(root_fd, relpath, _FILE_OPEN)
        except OSError as e:
            if e.errno in _GONE:
                raise SourceChanged(
                    f"source file gone or replaced: {os.fsdecode(path)} ({e.strerror})"
                ) from None
            raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise DataError(f"cannot read {os.fsdecode(path)}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise SourceChanged(f"source file replaced by a non-regular file: {os.fsdecode(path)}")
        return fd, version.of_stat(st, root_dev)

    def _check(
        self, want: version.Version, got: version.Version, relpath: bytes, when: str
    ) -> None:
        if got != want:  # equal: the common case, one tuple compare
            version.check(want, got, self.display(relpath), when)

    def fill(
        self,
        files: FileTable,
        layout: Layout,
        seg: int,
        out: memoryview,
        fd: int | None = None,
        done: PieceDone | None = None,
    ) -> int:
        pieces = layout.segment_files(seg)
        splice = fd is not None
        with self._rooted() as rooted:
            for p in pieces:
                relpath = files.path(p.entry)
                want = version.listed(files, p.entry)
                src, now = self._open(rooted, relpath)
                dest = out[p.seg_offset : p.seg_offset + p.length]
                try:
                    self._check(want, now, relpath, "since it was listed")
                    if splice:
                        assert fd is not None
                        splice = _sendfile(src, p.file_offset, fd, p.seg_offset, p.length)
                    if not splice:
                        _pread_into(src, p.file_offset, dest)
                    # One version or nothing: a write during the copy moved ctime and mtime, a
                    # growth the size (one fstat a piece).
                    self._check(want, version.of_stat(os.fstat(src), rooted[1]), relpath, _DURING)
                    if done is not None:
                        done(p, dest)
                except (EOFError, OSError) as e:
                    raise self._copy_error(relpath, e) from None
                finally:
                    dest.release()
                    os.close(src)
        return len(pieces)

    def _copy_error(self, relpath: bytes, e: EOFError | OSError) -> KSpeedError:
        """The one-line error of a copy that read short (the file shrank) or failed."""
        if isinstance(e, EOFError):
            return SourceModified(
                f"source changed while loading (shorter): {self.display(relpath)}"
            )
        return DataError(f"cannot read {self.display(relpath)}: {e.strerror}")

    def checksum(self, files: FileTable, i: int) -> int:
        relpath = files.path(i)
        want = version.listed(files, i)
        hasher = xxhash.xxh3_64()
        with self._rooted() as rooted:
            fd, now = self._open(rooted, relpath)
            try:
                self._check(want, now, relpath, "since it was listed")
                buf = bytearray(CHECKSUM_CHUNK)
                for pos in range(0, want[0], CHECKSUM_CHUNK):
                    with memoryview(buf)[: min(CHECKSUM_CHUNK, want[0] - pos)] as chunk:
                        _pread_into(fd, pos, chunk)
                        hasher.update(chunk)
                self._check(want, version.of_stat(os.fstat(fd), rooted[1]), relpath, _DURING)
            except (EOFError, OSError) as e:
                raise self._copy_error(relpath, e) from None
            finally:
                os.close(fd)
        return hasher.intdigest()

    def read_verified(
        self, files: FileTable, i: int, offset: int, length: int, checksum: int = 0
    ) -> bytes:
        relpath = files.path(i)
        want = version.listed(files, i)
        n = _span(offset, length, want[0])
        with self._rooted() as rooted:
            try:
                fd, now = self._open(rooted, relpath)
            except SourceChanged as e:
                raise StaleDataset(str(e)) from None
            try:
                if version.difference(want, now):
                    raise self._stale(relpath)
                data = _pread(fd, n, offset) if n else b""
                if len(data) < n:  # shrank after the fstat: never a short read
                    rest = bytearray(n - len(data))
                    try:
                        _pread_into(fd, offset + len(data), memoryview(rest))
                    except EOFError:
                        raise self._stale(relpath, "shrank") from None
                    data += rest
                if version.difference(want, version.of_stat(os.fstat(fd), rooted[1])):
                    raise self._stale(relpath, "changed while reading")
            except OSError as e:
                raise DataError(f"cannot read {self.display(relpath)}: {e.strerror}") from None
            finally:
                os.close(fd)
        if checksum and n == want[0] and xxhash.xxh3_64_intdigest(data) != checksum:
            raise self._stale(relpath, "checksum")
        return data


def _sendfile(src: int, src_off: int, dest: int, dest_off: int, n: int) -> bool:
    """Copy n bytes in the kernel into dest at dest_off; False when the files cannot be
    spliced (nothing copied: the caller reads instead). EOFError when the source is short."""
    os.lseek(dest, dest_off, os.SEEK_SET)
    got = 0
    while got < n:
        try:
            r = os.sendfile(dest, src, src_off + got, n - got)
        except BlockingIOError:
            os.set_blocking(src, True)  # see _FILE_OPEN
            continue
        except OSError as e:
            if got == 0 and e.errno in _NO_SENDFILE:
                return False
            raise
        if not r:
            raise EOFError
        got += r
    return True


def _pread(fd: int, n: int, offset: int) -> bytes:
    try:
        return os.pread(fd, n, offset)
    except BlockingIOError:
        os.set_blocking(fd, True)  # see _FILE_OPEN
        return os.pread(fd, n, offset)


def _pread_into(fd: int, offset: int, out: memoryview) -> None:
    """Fill out from fd at offset; EOFError when the file ends first."""
    got = 0
    while got < len(out):
        try:
            r = os.preadv(fd, [out[got:]], offset + got)
        except BlockingIOError:
            os.set_blocking(fd, True)  # see _FILE_OPEN
            continue
        if not r:
            raise EOFError
        got += r


class FsspecSource(Source):
    """An object store (or any fsspec filesystem): one listing, ranged reads in parallel."""

    fill_threads = 4  # network-bound: more segments in flight than cores

    def __init__(self, url: str, endpoint: str = ""):
        super().__init__(url, endpoint)
        m = URL_RE.match(url)
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

    def _key(self, relpath: bytes) -> str:
        return f"{self.root}/{relpath.decode('utf-8', 'surrogateescape')}"

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
        files: dict[bytes, tuple[int, int, int]] = {}
        for path, info in listing.items():
            if not path.startswith(prefix) or path.endswith("/"):
                continue  # folder markers ("dir/" objects) are not files
            rel = path[len(prefix) :].encode("utf-8", "surrogateescape")
            if info.get("type", "file") != "file":  # a link or a FIFO of a file:// source
                log.warning("skipping %r: not a plain file", self.display(rel))
                continue
            size, mtime, _ctime, ident, _dev = _object_version(info)
            files[rel] = (size, mtime, ident)
        if not files:
            raise NotFound(f"source not found: {self.url} (no objects under it)")
        return tree_from_listing(files)

    def _fetch(self, ranges: list[tuple[bytes, int, int]]) -> list[bytes]:
        """Bytes of (relpath, start, end) ranges, fetched in parallel; SourceChanged when an
        object is gone or shorter than asked."""
        if not ranges:
            return []
        try:
            results = self.fs.cat_ranges(
                [self._key(r) for r, _, _ in ranges],
                [s for _, s, _ in ranges],
                [e for _, _, e in ranges],
                on_error="return",
            )
        except Exception as e:
            raise self._error(e, self.url) from None
        for (relpath, start, end), data in zip(ranges, results, strict=True):
            if isinstance(data, BaseException):
                err = self._error(data, self.display(relpath))
                raise SourceChanged(str(err)) if isinstance(err, NotFound) else err
            if len(data) != end - start:
                raise SourceModified(f"source object shrank: {self.display(relpath)}")
        return list(results)

    def fill(
        self,
        files: FileTable,
        layout: Layout,
        seg: int,
        out: memoryview,
        fd: int | None = None,
        done: PieceDone | None = None,
    ) -> int:
        # Ranged GETs carry no snapshot: every object is asked for its version after its bytes
        # arrived (one HEAD per file), and one replaced meanwhile fails the copy.
        pieces = layout.segment_files(seg)
        ranges, places = [], []
        for p in pieces:
            relpath = files.path(p.entry)
            for pos in range(0, p.length, FETCH_CHUNK):
                n = min(FETCH_CHUNK, p.length - pos)
                ranges.append((relpath, p.file_offset + pos, p.file_offset + pos + n))
                places.append(p.seg_offset + pos)
        for at, data in zip(places, self._fetch(ranges), strict=True):
            out[at : at + len(data)] = data
        for entry in dict.fromkeys(p.entry for p in pieces):
            self._check(files, entry, "while loading")
        if done is not None:
            for p in pieces:
                with out[p.seg_offset : p.seg_offset + p.length] as view:
                    done(p, view)
        return len(ranges)

    def _check(self, files: FileTable, i: int, when: str) -> None:
        """SourceChanged unless object i is at its listed version now."""
        relpath = files.path(i)
        key = self._key(relpath)
        try:
            self.fs.invalidate_cache(key)
            info = self.fs.info(key)
        except FileNotFoundError:
            raise SourceChanged(f"source object removed: {self.display(relpath)}") from None
        except Exception as e:
            raise self._error(e, self.display(relpath)) from None
        if info.get("type") != "file":
            raise SourceChanged(f"source object replaced by a folder: {self.display(relpath)}")
        version.check(version.listed(files, i), _object_version(info), self.display(relpath), when)

    def checksum(self, files: FileTable, i: int) -> int:
        relpath, size = files.path(i), int(files.size[i])
        hasher = xxhash.xxh3_64()
        batch = 8 * FETCH_CHUNK  # fetched in parallel, hashed in order
        for pos in range(0, size, batch):
            end = min(size, pos + batch)
            ranges = [(relpath, a, min(end, a + FETCH_CHUNK)) for a in range(pos, end, FETCH_CHUNK)]
            for data in self._fetch(ranges):
                hasher.update(data)
        self._check(files, i, "while loading")
        return hasher.intdigest()

    def read_verified(
        self, files: FileTable, i: int, offset: int, length: int, checksum: int = 0
    ) -> bytes:
        relpath, size = files.path(i), int(files.size[i])
        n = _span(offset, length, size)
        try:
            self._check(files, i, "since preload")
            data = self._fetch([(relpath, offset, offset + n)])[0] if n else b""
            self._check(files, i, "while reading")
        except SourceChanged:
            raise self._stale(relpath) from None
        if checksum and n == size and xxhash.xxh3_64_intdigest(data) != checksum:
            raise self._stale(relpath, "checksum")
        return data


def _object_version(info: dict[str, Any]) -> version.Version:
    """An object's version from its listing or HEAD: size, time and its ETag (or version id)."""
    tag = next((info[k] for k in _TAG_KEYS if info.get(k)), "")
    return int(info.get("size") or 0), _mtime_ns(info), 0, version.tag_ident(tag), 0


# Where fsspec filesystems put an object's version: S3 ETag or VersionId, GCS generation.
_TAG_KEYS = ("ETag", "etag", "VersionId", "generation", "version_id")


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


_sources: dict[tuple[str, str], Source] = {}
_sources_lock = threading.Lock()


def open_source(url: str, endpoint: str = "") -> Source:
    """The shared Source for a URL or an absolute folder (one per process and endpoint).
    Nothing is checked here: call `check()` for a one-line error when it is not usable."""
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


def diff_counts(m: Manifest, tree: Tree) -> int:
    """How many files were added, removed or changed since the manifest: another version
    (size, mtime, ctime, inode or device, as every copy is checked: a file rewritten with its
    mtime put back is changed)."""
    old = {m.path(i): version.listed(m, i) for i in m.iter_files()}
    changed = 0
    for i, mode in enumerate(tree.mode):
        if not stat.S_ISREG(mode):
            continue
        before = old.pop(tree.path(i), None)
        if before is None or version.difference(before, version.listed(tree, i)):
            changed += 1
    return changed + len(old)
