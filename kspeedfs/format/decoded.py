"""Decoded variants of a dataset instance: RGB pixels of its images, resized, in mapped segments.

A variant `decoded-N/` lives inside a dataset folder (so it is unloaded with the instance):
    index.kdi      per manifest entry: state, height, width, pixel segment, offset
    seg/NNNNNNNN   images back to back (each at most a segment, or one image), each a binary
                   PPM: a short header (`P6\nW H\n255\n`), then its uint8 HWC pixels, so that
                   the mount serves a `.ppm` file as one view of the segment; `off` in the index
                   is where the pixels start, the header lies just before
The node writes the whole index before it decodes anything (sizes come from the image headers),
then flips each entry's state byte once its pixels are in place, so a reader mapping the index
while the fill runs sees every sample either ready or still to be decoded by itself.
N is the shorter side after `torchvision.transforms.Resize(N)` (bilinear, antialiased PIL);
N = 0 keeps the decoded size.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kspeedfs.format.contract.decoded import check_size
from kspeedfs.format.errors import DataError, InvalidArgument, NotFound

MAGIC = b"KSPDDEC1"
FORMAT_VERSION = 2  # 2: a PPM header before each image's pixels
INDEX_FILE = "index.kdi"
SEGMENT_DIR = "seg"
HEADER_BYTES = 4096  # magic, complete flag, header length, JSON header; arrays follow
_COMPLETE_AT = 8  # one byte: 1 once every planned entry was tried
_HEADER_LEN = struct.Struct("<I")
_ALIGN = 64

# torchvision.datasets.folder.IMG_EXTENSIONS (kept here: the format layer imports no torch)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# Entry states.
ABSENT = 0  # not decoded here yet (the reader decodes it itself)
READY = 1  # pixels in place
UNDECODABLE = 2  # the file does not decode: served as its original bytes
NOT_HERE = 3  # not an image, or not held by this node

_ARRAYS = (("state", "u1"), ("height", "<u4"), ("width", "<u4"), ("seg", "<u4"), ("off", "<u8"))


def variant_dir(size: int) -> str:
    """The variant's folder name inside a dataset folder."""
    return f"decoded-{check_size(size)}"


def is_image(name: bytes | str) -> bool:
    """An image by ImageFolder's rule (the extension, case-insensitive)."""
    text = os.fsdecode(name).lower()
    return text.endswith(IMAGE_EXTENSIONS)


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after `torchvision.transforms.Resize(size)` (size 0: unchanged); the same
    float arithmetic as torchvision's `_compute_resized_output_size`."""
    if size == 0:
        return width, height
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def _decoded(
    data: bytes | bytearray | memoryview, size: int
) -> tuple[Image.Image, tuple[int, int]]:
    """(the image decoded to RGB and resized, the size its header announced). An image that
    decodes to RGB is resized (or returned) as decoded: `convert("RGB")` of an RGB image is a
    copy of the full-size pixels (6-8% of a 110 KB JPEG's decode and resize), the same pixels.
    Not opened in a `with`: closing an image drops its pixels, and the file is a BytesIO."""
    img = Image.open(io.BytesIO(data))
    announced = resized_size(img.width, img.height, size)
    img.load()
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    w, h = resized_size(rgb.width, rgb.height, size)
    if (w, h) != rgb.size:
        rgb = rgb.resize((w, h), Image.Resampling.BILINEAR)
    return rgb, announced


def decode_image(data: bytes | memoryview, size: int) -> Image.Image:
    """What `Resize(size)(pil_loader(path))` gives: decode, convert to RGB, resize the shorter
    side with PIL's antialiased bilinear filter (size 0: as is)."""
    return _decoded(data, size)[0]


def decode_checked(data: bytes | bytearray | memoryview, size: int) -> Image.Image | None:
    """`decode_image`, or None when the file does not decode. The one rule of what is
    undecodable, for the node's fill and the mount alike: no readable header, a failing decode,
    or a decoded size other than its header announced."""
    try:
        rgb, announced = _decoded(data, size)
    except Exception:  # anything PIL raises on a bad file
        return None
    return rgb if rgb.size == announced else None


def pixel_bytes(width: int, height: int) -> int:
    return width * height * 3


def ppm_header(width: int, height: int) -> bytes:
    """The binary PPM header stored before an image's pixels (PIL reads the pixels as raw)."""
    return b"P6\n%d %d\n255\n" % (width, height)


def stored_bytes(width: int, height: int) -> int:
    """An image's bytes in a segment: the PPM header and the pixels."""
    return len(ppm_header(width, height)) + pixel_bytes(width, height)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def index_bytes(entries: int) -> int:
    """Size of an index over `entries` manifest entries."""
    pos = HEADER_BYTES
    for _key, dtype in _ARRAYS:
        pos = _align(pos + entries * np.dtype(dtype).itemsize)
    return pos


def pack(sizes: Sequence[int], segment_size: int) -> tuple[list[int], list[int], list[int]]:
    """Place images of `sizes` bytes back to back in segments of at most `segment_size` (an image
    larger gets one of its own). Returns (segment, offset) per image and each segment's length."""
    segs: list[int] = []
    offs: list[int] = []
    lengths: list[int] = []
    for n in sizes:
        if not lengths or (lengths[-1] + n > segment_size and lengths[-1] > 0):
            lengths.append(0)
        segs.append(len(lengths) - 1)
        offs.append(lengths[-1])
        lengths[-1] += n
    return segs, offs, lengths


def segment_path(variant: Path, seg: int) -> Path:
    return variant / SEGMENT_DIR / f"{seg:08d}"


def write_index(path: Path, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> None:
    """Write a new index (not complete) atomically; `arrays` keyed as _ARRAYS, one per entry."""
    entries = int(header["entries"])
    layout: dict[str, list[Any]] = {}
    pos = HEADER_BYTES
    for key, dtype in _ARRAYS:
        layout[key] = [pos, dtype]
        pos = _align(pos + entries * np.dtype(dtype).itemsize)
    blob = json.dumps(dict(header, format=FORMAT_VERSION, arrays=layout), sort_keys=True).encode()
    if len(MAGIC) + 1 + _HEADER_LEN.size + len(blob) > HEADER_BYTES:
        raise InvalidArgument("decoded index header too long")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb", opener=_nofollow_create) as f:
        f.write(MAGIC + b"\0" + _HEADER_LEN.pack(len(blob)) + blob)
        for key, dtype in _ARRAYS:
            f.seek(layout[key][0])
            f.write(np.ascontiguousarray(arrays[key], dtype=dtype).tobytes())
        f.truncate(pos)
    os.replace(tmp, path)


class VariantIndex:
    """A mapped index: writable by the node that fills it, read-only for everyone else."""

    def __init__(self, path: str | os.PathLike[str], writable: bool = False):
        self.file = Path(path)
        try:
            with open(self.file, "r+b" if writable else "rb", opener=_nofollow) as f:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                self._map = mmap.mmap(f.fileno(), 0, prot=prot)
        except FileNotFoundError:
            raise NotFound(f"no decoded variant index {self.file}") from None
        except (OSError, ValueError) as e:
            raise DataError(f"cannot map decoded index {self.file}: {e}") from None
        try:
            if self._map[: len(MAGIC)] != MAGIC:
                raise ValueError("bad magic")
            (length,) = _HEADER_LEN.unpack_from(self._map, len(MAGIC) + 1)
            start = len(MAGIC) + 1 + _HEADER_LEN.size
            self.header: dict[str, Any] = json.loads(self._map[start : start + length])
            if self.header.get("format") != FORMAT_VERSION:
                raise ValueError(f"unsupported format {self.header.get('format')!r}")
            n = self.entries = int(self.header["entries"])
            arrays = {
                key: np.frombuffer(self._map, dtype=dtype, count=n, offset=offset)
                for key, (offset, dtype) in self.header["arrays"].items()
            }
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise DataError(f"corrupt decoded index {self.file}: {e!r}") from None
        self.state = arrays["state"]
        self.height = arrays["height"]
        self.width = arrays["width"]
        self.seg = arrays["seg"]
        self.off = arrays["off"]

    @property
    def uuid(self) -> str:
        """The dataset instance it was built for."""
        return str(self.header["uuid"])

    @property
    def size(self) -> int:
        return int(self.header["size"])

    @property
    def complete(self) -> bool:
        return self._map[_COMPLETE_AT] == 1

    def set_complete(self) -> None:
        self._map[_COMPLETE_AT] = 1

    def mark(self, entry: int, state: int) -> None:
        self.state[entry] = state  # pixels were written before: a reader sees them complete

    def counts(self) -> dict[str, int]:
        """Entries per state among the planned ones (the images held here)."""
        bins = np.bincount(self.state, minlength=4)
        return {
            "ready": int(bins[READY]),
            "undecodable": int(bins[UNDECODABLE]),
            "pending": int(bins[ABSENT]),
        }


class DecodedVariant:
    """A reader's view of one variant: the index and the pixel segments, mapped copy-on-write so
    that the arrays handed out are writable without copying (a write copies that page only)."""

    def __init__(self, folder: str | os.PathLike[str], uuid: str):
        self.folder = Path(folder)
        self.index = VariantIndex(self.folder / INDEX_FILE)
        if self.index.uuid != uuid:
            raise DataError(f"decoded variant in {self.folder} belongs to another instance")
        self._segs: dict[int, memoryview] = {}

    def state(self, entry: int) -> int:
        return int(self.index.state[entry])

    def pixels(self, entry: int) -> tuple[memoryview, int, int]:
        """(HWC uint8 bytes, height, width) of a READY entry: a view of the mapped segment."""
        ix = self.index
        seg, off = int(ix.seg[entry]), int(ix.off[entry])
        h, w = int(ix.height[entry]), int(ix.width[entry])
        return self._segment(seg)[off : off + h * w * 3], h, w

    def ppm(self, entry: int) -> memoryview:
        """The binary PPM of a READY entry (header, then pixels): a view of the mapped segment."""
        ix = self.index
        seg, off = int(ix.seg[entry]), int(ix.off[entry])
        h, w = int(ix.height[entry]), int(ix.width[entry])
        start = off - len(ppm_header(w, h))
        return self._segment(seg)[start : off + h * w * 3]

    def stored_size(self, entry: int) -> int:
        """Bytes of the entry's PPM (header and pixels), from the index."""
        return stored_bytes(int(self.index.width[entry]), int(self.index.height[entry]))

    def close(self) -> None:
        """Stop using the variant (its instance was unloaded): the maps are dropped, each
        unmapping when the last view of it goes."""
        self._segs = {}

    def _segment(self, seg: int) -> memoryview:
        mv = self._segs.get(seg)
        if mv is None:
            try:
                with open(segment_path(self.folder, seg), "rb", opener=_nofollow) as f:
                    m = mmap.mmap(
                        f.fileno(),
                        0,
                        flags=mmap.MAP_PRIVATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    )
            except (OSError, ValueError) as e:
                raise DataError(f"cannot map decoded segment {seg} in {self.folder}: {e}") from None
            mv = self._segs[seg] = memoryview(m)
        return mv


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def _nofollow_create(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
