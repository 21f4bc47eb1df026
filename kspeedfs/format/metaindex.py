"""Meta-file indexes: a meta file (one sample per line) parsed once into compact mapped arrays.

A meta file names one sample per line: `relative/path.jpg 3` (text), or a JSON object per line
(JSON lines: `{"filename": "a.jpg", "label": 3, ...}`). Its index holds, per line, the manifest
entry of the file it names (or a negative code: missing, bad line, blank), its target (an int,
or a reference into a string table) and the byte range of the raw line, followed by the meta
file's own bytes, so that a line can be handed to a parser without reading anything else.
Every process on a node maps the same file: memory per process O(1), not O(lines).

File layout: an 8-byte magic, 64-byte aligned little-endian arrays, a JSON header listing
them, then a trailer (u64 header offset, u32 header length, the magic). One pass to write.
"""

from __future__ import annotations

import json
import mmap
import os
import posixpath
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kspeedfs.format.errors import DataError, InvalidArgument, NotFound
from kspeedfs.format.manifest import Manifest

MAGIC = b"KSPDMIX1"
FORMAT_VERSION = 1
INDEX_DIR = "meta"  # the indexes' folder inside a dataset folder
TAR_SUFFIX = ".tar"
_ALIGN = 64
_TRAILER = struct.Struct("<QI8s")
MAX_PROBLEMS = 20  # bad lines whose number and reason the header keeps
CHUNK_LINES = 1 << 20  # lines parsed per batch: bounds the transient Python objects

# Negative entries: why a line names no sample.
MISSING = -1  # the file it names is not in the dataset
BAD_LINE = -2  # it could not be parsed
BLANK = -3  # empty or whitespace only (never a sample, never an error)
NOT_A_FILE = -4  # it names a folder or a link

PATH_KEYS = ("filename", "path", "file", "image", "img")
TARGET_KEYS = ("label", "target", "class", "category")


def meta_name(name: str | os.PathLike[str]) -> str:
    """A meta file's path relative to the dataset root, normalized; refuses an escaping one."""
    raw = os.fsdecode(name).strip()
    norm = posixpath.normpath(raw.lstrip("/")) if raw else ""
    if not raw or raw.startswith("/") or norm in ("", ".") or norm.split("/")[0] == "..":
        raise InvalidArgument(f"meta file must be a path inside the dataset, not {raw!r}")
    return norm


def is_tar_shard(meta: str) -> bool:
    """A `.tar` file is indexed as a tar shard (kspeedfs.format.tarindex), not as lines."""
    return meta.endswith(TAR_SUFFIX)


def index_file(meta: str) -> str:
    """Where a meta file's index (or a tar shard's) lives inside a dataset folder."""
    digest = xxhash.xxh3_64_hexdigest(meta.encode(errors="surrogateescape"))
    return f"{INDEX_DIR}/{digest}.{'kti' if is_tar_shard(meta) else 'kmi'}"


def index_size_estimate(meta_bytes: int) -> int:
    """Memory to reserve for a meta file's index before it is built: its bytes, and 24 bytes of
    arrays per line of typically 24 bytes or more (the real size is counted once built)."""
    return 2 * meta_bytes + 64 * 1024


class _Resolver:
    """Line path -> manifest entry. Folders' children are looked up in a dict built once per
    folder (a few per dataset); folders too big for one go to binary search instead."""

    DICT_LIMIT = 1 << 20

    def __init__(self, m: Manifest):
        self.m = m
        # folder -> {name: entry or NOT_A_FILE}, or the folder's entry (binary search), or None
        self._folders: dict[bytes, dict[bytes, int] | int | None] = {}

    def entry(self, path: bytes) -> int:
        if path.startswith(b"/") or b"//" in path or b"./" in path or path.endswith(b"/."):
            parts = [p for p in path.split(b"/") if p not in (b"", b".")]
            if b".." in parts:
                return MISSING
            path = b"/".join(parts)
        folder, _, name = path.rpartition(b"/")
        kids = self._folders.get(folder, 0)
        if kids == 0:
            kids = self._folders[folder] = self._children(folder)
        if kids is None:
            return MISSING
        if isinstance(kids, dict):
            return kids.get(name, MISSING)
        i = self.m.lookup(kids, name)
        if i is None:
            return MISSING
        return i if self.m.is_file(i) else NOT_A_FILE

    def _children(self, folder: bytes) -> dict[bytes, int] | int | None:
        try:
            d = self.m.resolve(folder)
        except NotFound:
            return None
        if not self.m.is_dir(d):
            return None
        kids = self.m.children(d)
        if len(kids) > self.DICT_LIMIT:
            return d
        files = (self.m.mode[kids.start : kids.stop] & 0o170000) == stat.S_IFREG
        return {
            self.m.name(i): i if is_file else NOT_A_FILE
            for i, is_file in zip(kids, files.tolist(), strict=True)
        }


def line_bounds(raw: bytes | memoryview) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each line, without its newline; no empty last line after a final one."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    ends = np.flatnonzero(buf == 0x0A)
    if buf.size and (ends.size == 0 or ends[-1] != buf.size - 1):
        ends = np.append(ends, buf.size)
    starts = np.empty_like(ends)
    if ends.size:
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
    return starts, ends - starts


def detect_kind(raw: bytes) -> str:
    """'jsonl' when the first non-blank line is a JSON object, else 'text'."""
    for line in raw[: 1 << 16].split(b"\n"):
        if line.strip():
            return "jsonl" if line.lstrip().startswith(b"{") else "text"
    return "text"


def _text_fields(line: bytes) -> tuple[bytes, Any] | str:
    parts = line.rsplit(None, 1)
    if len(parts) != 2:
        return "expected PATH TARGET"
    return parts[0].strip(), parts[1]


def _json_fields(line: bytes) -> tuple[bytes, Any] | str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    except ValueError:
        return "not JSON"
    if not isinstance(obj, dict):
        return "not a JSON object"
    path = next((obj[k] for k in PATH_KEYS if k in obj), None)
    if not isinstance(path, str):
        return f"no file name (one of {', '.join(PATH_KEYS)})"
    target = next((obj[k] for k in TARGET_KEYS if k in obj), None)
    if isinstance(target, bool) or not isinstance(target, int | str):
        return f"no int or string target (one of {', '.join(TARGET_KEYS)})"
    return path.encode(errors="surrogateescape"), target


def build_index(
    raw: bytes, m: Manifest, path: str | os.PathLike[str], header: dict[str, Any]
) -> dict[str, Any]:
    """Parse the meta file `raw`, resolve its lines in `m`, write the index to `path` (atomically).
    `header` names it (uuid, meta, ...). Returns the header written."""
    starts, lengths = line_bounds(raw)
    rows = int(starts.size)
    kind = detect_kind(raw)
    fields = _json_fields if kind == "jsonl" else _text_fields
    resolve = _Resolver(m).entry
    entry = np.empty(rows, dtype="<i4")
    target_id = np.full(rows, -1, dtype="<i8")
    ids: dict[Any, int] = {}
    problems: list[list[Any]] = []
    for first in range(0, rows, CHUNK_LINES):
        last = min(rows, first + CHUNK_LINES)
        lo = int(starts[first])
        hi = int(starts[last - 1] + lengths[last - 1])
        chunk_entries: list[int] = []
        chunk_targets: list[int] = []
        add_entry, add_target = chunk_entries.append, chunk_targets.append
        for row, line in enumerate(raw[lo:hi].split(b"\n"), first):
            if not line or line.isspace():
                add_entry(BLANK)
                add_target(-1)
                continue
            got = fields(line)
            if type(got) is tuple:
                rel, token = got
                e = resolve(rel)
                if e >= 0:
                    tid = ids.get(token)
                    if tid is None:
                        tid = ids[token] = len(ids)
                    add_entry(e)
                    add_target(tid)
                    continue
                what = "no file" if e == MISSING else "not a file"
                why = f"{what} {rel.decode(errors='replace')}"
            else:
                e, why = BAD_LINE, str(got)
            add_entry(e)
            add_target(-1)
            if len(problems) < MAX_PROBLEMS:
                problems.append([row + 1, why])
        entry[first:last] = chunk_entries
        target_id[first:last] = chunk_targets
    target, strings, target_kind = _targets(list(ids), target_id)
    arrays: dict[str, np.ndarray] = {
        "start": starts.astype("<u8"),
        "length": lengths.astype("<u4"),
        "entry": entry,
        "target": target,
        "raw": np.frombuffer(raw, dtype="u1"),
    }
    if strings is not None:
        offsets, blob = strings
        arrays["string_off"] = offsets
        arrays["strings"] = blob
    good = np.flatnonzero(entry >= 0)
    if good.size != rows:
        arrays["good"] = good.astype("<u8")  # the samples when bad lines are skipped
    nonblank = np.flatnonzero(entry != BLANK)
    if nonblank.size != rows:
        arrays["nonblank"] = nonblank.astype("<u8")  # every line a parser gets
    counts = {
        "rows": rows,
        "samples": int(good.size),
        "blank": int(np.count_nonzero(entry == BLANK)),
        "bad": int(np.count_nonzero(entry == BAD_LINE)),
        "missing": int(np.count_nonzero((entry == MISSING) | (entry == NOT_A_FILE))),
    }
    full = dict(
        header,
        format=FORMAT_VERSION,
        kind=kind,
        target_kind=target_kind,
        problems=problems,
        **counts,
    )
    write_index(Path(path), arrays, full)
    return full


def _targets(
    tokens: list[Any], target_id: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None, str]:
    """Per-line targets: ints when every target is an int, else indices into a sorted table."""
    try:
        values = np.array([t if isinstance(t, int) else int(t) for t in tokens] or [0], dtype="<i8")
        return np.where(target_id >= 0, values[np.maximum(target_id, 0)], -1), None, "int"
    except (ValueError, OverflowError):
        pass
    texts = [t.decode(errors="surrogateescape") if isinstance(t, bytes) else str(t) for t in tokens]
    table = sorted(set(texts))
    pos = {s: k for k, s in enumerate(table)}
    remap = np.array([pos[s] for s in texts] or [0], dtype="<i8")
    target = np.where(target_id >= 0, remap[np.maximum(target_id, 0)], -1).astype("<i8")
    encoded = [s.encode(errors="surrogateescape") for s in table]
    offsets = np.zeros(len(encoded) + 1, dtype="<u8")
    offsets[1:] = np.cumsum([len(b) for b in encoded])
    blob = np.frombuffer(b"".join(encoded), dtype="u1")
    return target, (offsets, blob), "str"


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_index(path: Path, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> None:
    """The file layout of the module docstring, written atomically (a rename)."""
    layout: dict[str, list[Any]] = {}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        pos = _ALIGN
        for key, arr in arrays.items():
            layout[key] = [pos, arr.dtype.str, int(arr.size)]
            f.seek(pos)
            f.write(np.ascontiguousarray(arr).tobytes())
            pos = _align(pos + arr.nbytes)
        blob = json.dumps(dict(header, arrays=layout), sort_keys=True).encode()
        f.seek(pos)
        f.write(blob + _TRAILER.pack(pos, len(blob), MAGIC))
    os.replace(tmp, path)


class MetaIndex:
    """A read-only view of an index file; the arrays are views of one shared mapping."""

    def __init__(self, path: str | os.PathLike[str]):
        self.file = Path(path)
        self._map = map_index(self.file, "meta index")
        try:
            self.header = self._parse_header()
            arrays = {
                key: np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
                for key, (offset, dtype, count) in self.header["arrays"].items()
            }
            self.rows: int = int(self.header["rows"])
            for key in ("start", "length", "entry", "target"):
                if arrays[key].size != self.rows:
                    raise ValueError(f"{key} has the wrong length")
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise DataError(f"corrupt meta index {self.file}: {e!r}") from None
        self.start = arrays["start"]
        self.length = arrays["length"]
        self.entry = arrays["entry"]
        self.target = arrays["target"]
        self.good: np.ndarray | None = arrays.get("good")
        self.nonblank: np.ndarray | None = arrays.get("nonblank")
        self._raw_base = int(self.header["arrays"]["raw"][0])
        self._raw_size = int(self.header["arrays"]["raw"][2])
        self._string_off = arrays.get("string_off")
        self._strings_base = int(self.header["arrays"].get("strings", [0])[0])
        self._string_cache: list[str] | None = None
        self.target_kind = str(self.header["target_kind"])  # "int", or "str": table indices

    def _parse_header(self) -> dict[str, Any]:
        return parse_header(self._map)

    @property
    def uuid(self) -> str:
        """The dataset instance it was built for."""
        return str(self.header["uuid"])

    @property
    def meta(self) -> str:
        return str(self.header["meta"])

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def line(self, row: int) -> bytes:
        """Line `row` (0-based) as in the meta file, without its newline."""
        off = self._raw_base + int(self.start[row])
        return self._map[off : off + int(self.length[row])]

    def strings(self) -> list[str]:
        """The string table (sorted): string targets are indices into it."""
        if self._string_cache is None:
            out = []
            if self._string_off is not None:
                base = self._strings_base
                offs = self._string_off.tolist()
                for a, b in zip(offs, offs[1:], strict=False):
                    out.append(self._map[base + a : base + b].decode(errors="surrogateescape"))
            self._string_cache = out
        return self._string_cache

    def target_of(self, row: int) -> int | str:
        t = int(self.target[row])
        return self.strings()[t] if self.target_kind == "str" else t

    def problems(self) -> Iterator[tuple[int, str]]:
        """(line number, reason) of the first bad lines."""
        for line_no, why in self.header.get("problems", []):
            yield int(line_no), str(why)

    def describe_problems(self) -> str:
        """One line: how many lines are bad, and the first few with their numbers."""
        h = self.header
        shown = "; ".join(f"line {n}: {why}" for n, why in list(self.problems())[:5])
        return f"{h['bad']} unparsable lines and {h['missing']} missing files ({shown})"


def parse_header(buf: mmap.mmap) -> dict[str, Any]:
    """The JSON header of a mapped index file (ValueError when it is not one)."""
    if len(buf) < _ALIGN + _TRAILER.size or buf[: len(MAGIC)] != MAGIC:
        raise ValueError("bad magic")
    pos, length, magic = _TRAILER.unpack_from(buf, len(buf) - _TRAILER.size)
    if magic != MAGIC or pos + length + _TRAILER.size != len(buf):
        raise ValueError("bad trailer")
    header: dict[str, Any] = json.loads(buf[pos : pos + length])
    if header.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported format {header.get('format')!r}")
    return header


def map_index(path: Path, what: str) -> mmap.mmap:
    """A read-only map of an index file (not following a link); NotFound or DataError."""
    try:
        with open(path, "rb", opener=_nofollow) as f:
            return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    except FileNotFoundError:
        raise NotFound(f"{what} not found: {path}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot map {what} {path}: {e}") from None


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
