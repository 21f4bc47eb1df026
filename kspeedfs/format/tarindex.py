"""Tar-shard indexes: a WebDataset shard's members grouped into samples, for random access.

A shard is read sequentially by WebDataset: members in tar order, grouped into a sample while
their key (the name up to the first dot of its last path part) stays the same. Its index holds
that grouping once, built from the shard's checksummed bytes: per sample its key and the range
of its members; per member its extension (lowercased) and the offset and size of its data in
the tar. A sample is then one read of known byte ranges, in any order. The grouping follows
webdataset's own rules (webdataset/tariterators.py, `tar_file_iterator`, `base_plus_ext`,
`group_by_keys`); tests check it against webdataset itself.

The file is a meta index's container (kspeedfs.format.metaindex: aligned arrays, a JSON
header, a trailer), named after the shard and kept in the instance's meta/ folder, so it is
built, sent, stored, counted and unloaded exactly as a meta index is.
"""

from __future__ import annotations

import io
import os
import re
import struct
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from kspeedfs.format import metaindex
from kspeedfs.format.errors import DataError

KIND = "tar"
_NAMES = "surrogatepass"  # str <-> bytes for any name tarfile gives, and back
# webdataset's base_plus_ext, and the metadata members tar_file_iterator skips.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")


def index_size_estimate(tar_bytes: int) -> int:
    """Memory to reserve before the index is built. A member costs ~45 bytes of index (its
    offsets, extension and a share of its sample's key) and at least 1 KiB of the tar (header
    and padded data): 1/32 of the tar holds the index of members of 1.5 KB or more on average.
    Reserving for the worst case (1/4: empty members) would refuse most large shard sets; a
    preload's real index bytes replace the estimate when it publishes, an added index's before
    it is kept."""
    return tar_bytes // 32 + 64 * 1024


def key_and_ext(name: str) -> tuple[str, str] | None:
    """A member's (sample key, extension) as webdataset splits it, or None when it has no
    extension (webdataset skips it). The extension is lowercased, as group_by_keys does."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    if _SKIP_META.match(name):
        return None
    found = _KEY_EXT.match(name)
    if not found:
        return None
    return found.group(1), found.group(2).lower()


def _members(raw: bytes | memoryview) -> list[tuple[str, str, int, int]]:
    """(key, ext, data offset, size) of each sample member in tar order; DataError in one line
    for a tar that is not whole and well-formed."""
    size = len(raw)
    out: list[tuple[str, str, int, int]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for info in tar:
                if info.offset_data + info.size > size:
                    raise DataError(
                        f"member {info.name!r} runs past the end of the tar ({info.size} bytes)"
                    )
                if not info.isreg():
                    continue
                if info.issparse():
                    raise DataError(f"member {info.name!r} is a sparse file")
                split = key_and_ext(info.name)
                if split is not None:
                    out.append((split[0], split[1], info.offset_data, info.size))
                tar.members = []  # type: ignore[attr-defined]  # one TarInfo at a time
            end = tar.offset
    except tarfile.TarError as e:
        raise DataError(f"not a readable tar: {e}") from None
    except (UnicodeError, ValueError, OverflowError, struct.error, EOFError) as e:
        raise DataError(f"not a readable tar: {e!r}") from None
    # tarfile ends quietly at a damaged header: what follows the last member must be the
    # zero blocks that end an archive (or nothing).
    tail = memoryview(raw)[min(end, size) :]
    if np.count_nonzero(np.frombuffer(tail, dtype=np.uint8)):
        raise DataError(f"unreadable tar header at byte {end} (damaged or not a tar)")
    return out


def _strings(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [v.encode("utf-8", _NAMES) for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype="<u8")
    offsets[1:] = np.cumsum([len(b) for b in encoded], dtype=np.uint64)
    return offsets, np.frombuffer(b"".join(encoded), dtype="u1")


def build_index(
    raw: bytes | memoryview, path: str | os.PathLike[str], header: dict[str, Any]
) -> dict[str, Any]:
    """Index the tar `raw` into `path` (atomically); `header` names it (uuid, meta, ...).
    Returns the header written. DataError (nothing written) for a damaged or hostile tar."""
    members = _members(raw)
    keys: list[str] = []
    first: list[int] = []
    exts_of_sample: set[str] = set()
    for k, (key, ext, _off, _size) in enumerate(members):
        if not keys or key != keys[-1]:
            keys.append(key)
            first.append(k)
            exts_of_sample = set()
        if ext in exts_of_sample:
            # webdataset stops on it too (group_by_keys: duplicate file name)
            raise DataError(f"sample {key!r} has two members with extension {ext!r}")
        exts_of_sample.add(ext)
    first.append(len(members))
    key_off, key_blob = _strings(keys)
    ext_off, ext_blob = _strings([m[1] for m in members])
    arrays = {
        "sample_first": np.array(first, dtype="<u8"),
        "key_off": key_off,
        "keys": key_blob,
        "ext_off": ext_off,
        "exts": ext_blob,
        "offset": np.array([m[2] for m in members], dtype="<u8"),
        "size": np.array([m[3] for m in members], dtype="<u8"),
    }
    full = dict(
        header,
        format=metaindex.FORMAT_VERSION,
        kind=KIND,
        tar_size=len(raw),
        rows=len(members),
        samples=len(keys),
        bad=0,
        missing=0,
    )
    metaindex.write_index(Path(path), arrays, full)
    return full


class TarIndex:
    """A read-only view of a shard's index; the arrays are views of one shared mapping."""

    def __init__(self, path: str | os.PathLike[str]):
        self.file = Path(path)
        self._map = metaindex.map_index(self.file, "tar index")
        try:
            self.header = metaindex.parse_header(self._map)
            if self.header.get("kind") != KIND:
                raise ValueError(f"not a tar index ({self.header.get('kind')!r})")
            arrays = {
                key: np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
                for key, (offset, dtype, count) in self.header["arrays"].items()
            }
            self.samples = int(self.header["samples"])
            self.members = int(self.header["rows"])
            first, offset, size = arrays["sample_first"], arrays["offset"], arrays["size"]
            if first.size != self.samples + 1 or offset.size != self.members != size.size:
                raise ValueError("arrays of the wrong length")
            if first[0] != 0 or first[-1] != self.members or np.any(np.diff(first) < 1):
                raise ValueError("bad sample ranges")
            if self.members and int((offset + size).max()) > int(self.header["tar_size"]):
                raise ValueError("a member runs past the tar")
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise DataError(f"corrupt tar index {self.file}: {e!r}") from None
        self._first, self._offset, self._size = first, offset, size
        self._key_off, self._keys = self._strings(arrays, "key_off", "keys", self.samples)
        self._ext_off, self._exts = self._strings(arrays, "ext_off", "exts", self.members)

    def _strings(
        self, arrays: dict[str, np.ndarray], off_key: str, blob_key: str, count: int
    ) -> tuple[np.ndarray, int]:
        """A string table's offsets and where its bytes start in the map (decoded on use:
        a process holds no Python object per sample)."""
        offsets, blob = arrays[off_key], arrays[blob_key]
        if (
            offsets.size != count + 1
            or int(offsets[-1]) > blob.size
            or np.any(np.diff(offsets) < 0)
        ):
            raise DataError(f"corrupt tar index {self.file}: bad string table {off_key}")
        return offsets, int(self.header["arrays"][blob_key][0])

    def _string(self, offsets: np.ndarray, base: int, k: int) -> str:
        a, b = int(offsets[k]), int(offsets[k + 1])
        return self._map[base + a : base + b].decode("utf-8", _NAMES)

    @property
    def uuid(self) -> str:
        """The dataset instance it was built for."""
        return str(self.header["uuid"])

    @property
    def meta(self) -> str:
        """The shard's path in the dataset."""
        return str(self.header["meta"])

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def key(self, sample: int) -> str:
        return self._string(self._key_off, self._keys, sample)

    def parts(self, sample: int) -> list[tuple[str, int, int]]:
        """(extension, data offset in the tar, size) of each member of `sample`, in tar order."""
        a, b = int(self._first[sample]), int(self._first[sample + 1])
        offsets, sizes = self._offset[a:b].tolist(), self._size[a:b].tolist()
        return [
            (self._string(self._ext_off, self._exts, a + k), offsets[k], sizes[k])
            for k in range(b - a)
        ]
