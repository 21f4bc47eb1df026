"""KSpeedImageFolder: torchvision's ImageFolder, reading from the cache instead of the filesystem."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import IO, Any, cast

import numpy as np
import torch
from PIL import Image
from torchvision.datasets import VisionDataset
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, pil_loader
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from kspeedfs.client import admin
from kspeedfs.client import decoded as decoded_client
from kspeedfs.format import decoded as variants
from kspeedfs.format.errors import DataError, InvalidArgument, NotFound
from kspeedfs.system.local_dataset import LocalDataset

from . import cache
from .folder import CachedPath, PathLike
from .index import (
    IndexBuilder,
    LazySamples,
    LazyTargets,
    SampleIndex,
    build_folder_index,
    class_folders,
    extension_check,
)

_PIL_LOADERS = (default_loader, pil_loader)
_warned_readonly = False


class ViewFile(io.RawIOBase):
    """A read-only binary file over a memoryview: decoders read the cached bytes in place."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        data = bytes(self._view[self._pos : end])
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def decode_tensor(data: memoryview) -> torch.Tensor:
    """Decode to a uint8 CHW RGB tensor straight from the buffer (no copy of the bytes)."""
    global _warned_readonly
    if not _warned_readonly:
        # torch warns once per process that a read-only buffer makes a read-only tensor;
        # the decoder only reads it.
        _warned_readonly = True
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(data, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(data, dtype=torch.uint8)
    if bytes(data[:2]) == b"\xff\xd8":
        return decode_jpeg(raw, mode=ImageReadMode.RGB)
    return decode_image(raw, mode=ImageReadMode.RGB)


def _path_check(
    is_valid_file: Callable[[str], bool], root: PathLike, folder: str
) -> tuple[Callable[[int, str], bool], Callable[[str, str], str]]:
    """The `is_valid_file` check on the source path, as ImageFolder calls it."""
    base = os.path.join(root, folder)

    def valid(_entry: int, path: str) -> bool:
        return is_valid_file(path)

    def path_of(rel: str, name: str) -> str:
        return os.path.join(base, rel, name)

    return valid, path_of


class CachedImages(CachedPath, VisionDataset):
    """ImageFolder's sample interface over a sample index: lazy `samples`/`targets` (a list may
    be assigned to either), the same sample for the same index and transform, `decode`."""

    loader: Callable[..., Any]
    decode: str
    _samples: list[tuple[str, int]] | None = None
    _targets: list[int] | None = None

    # ImageFolder's attributes: lazy views unless a list was assigned.

    @property
    def samples(self) -> Sequence[tuple[str, int]]:
        return self._samples if self._samples is not None else LazySamples(self)

    @samples.setter
    def samples(self, value: Sequence[tuple[str, int]]) -> None:
        self._samples = list(value)

    @property
    def imgs(self) -> Sequence[tuple[str, int]]:
        return self.samples

    @imgs.setter
    def imgs(self, value: Sequence[tuple[str, int]]) -> None:
        self.samples = value

    @property
    def targets(self) -> Sequence[int]:
        if self._targets is not None:
            return self._targets
        if self._samples is not None:
            return [t for _, t in self._samples]
        return LazyTargets(self._index)

    @targets.setter
    def targets(self, value: Sequence[int]) -> None:
        self._targets = list(value)

    def __len__(self) -> int:
        return len(self._samples) if self._samples is not None else len(self._index)

    def _sample(self, index: int) -> tuple[int, int]:
        """(manifest entry, target) of sample `index`, honouring an assigned `samples` list."""
        if self._samples is None:
            return self._index.entry(index), self._index.target(index)
        path, target = self._samples[index]
        rel = os.path.relpath(os.fspath(path), os.fspath(self.root))
        if rel.startswith(".."):
            raise NotFound(f"sample {path} is not under {self.root}")
        return self._entry_of(rel), target

    def _entries(self, indices: np.ndarray) -> np.ndarray:
        if self._samples is None:
            return self._index.entries_of(indices)
        return np.array([self._sample(int(i))[0] for i in indices], dtype=np.int64)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        entry, target = self._sample(index)
        sample = self._load(entry)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def _load(self, entry: int) -> Any:
        if self.decoded is not None:
            return self._load_decoded(entry, self.decoded)
        if self.decode == "tensor":
            return decode_tensor(self._bytes(entry, scratch=True))
        if self.loader in _PIL_LOADERS:
            # The decoded image is complete before the next read reuses the buffer.
            with Image.open(cast(IO[bytes], ViewFile(self._bytes(entry, scratch=True)))) as img:
                return img.convert("RGB")
        return self.loader(ViewFile(self._bytes(entry)))

    # The decoded variant (`decoded=N`): pixels the node decoded, handed out without a copy.

    decoded: int | None = None

    def _variant(self) -> variants.DecodedVariant | None:
        """This process's view of the variant on this node (None: none here, or not mappable)."""
        held = self.__dict__.get("_held_variant")
        if held is not None and held[0] == cache.generation:
            return cast("variants.DecodedVariant | None", held[1])
        v = None
        local = self._reader.local
        if isinstance(local, LocalDataset) and self.decoded is not None:
            try:
                folder = local.path / variants.variant_dir(self.decoded)
                v = variants.DecodedVariant(folder, self._ref.uuid)
            except (NotFound, DataError):
                v = None  # this node holds none of it: the workers decode
        self._held_variant = (cache.generation, v)
        return v

    def _load_decoded(self, entry: int, size: int) -> Any:
        v = self._variant()
        state = v.state(entry) if v is not None else variants.ABSENT
        if state == variants.READY:
            assert v is not None
            data, h, w = v.pixels(entry)
            if self.decode == "tensor":  # uint8 CHW: a view of the stored HWC pixels
                return torch.frombuffer(data, dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
            return Image.frombuffer("RGB", (w, h), cast(Any, data), "raw", "RGB", 0, 1)
        if state == variants.UNDECODABLE:
            # The original bytes, decoded as ImageFolder does: it fails the same way.
            with Image.open(cast(IO[bytes], ViewFile(self._bytes(entry, scratch=True)))) as img:
                return img.convert("RGB")
        pic = variants.decode_image(self._bytes(entry, scratch=True), size)  # not decoded yet
        if self.decode == "tensor":
            return torch.from_numpy(np.asarray(pic).copy()).permute(2, 0, 1)
        return pic

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_held_variant", None)
        return state

    def extra_repr(self) -> str:
        shown = "" if self.decoded is None else f", decoded={self.decoded}"
        return f"Cached dataset: {self._ref.name} (decode={self.decode}{shown})"


class KSpeedImageFolder(CachedImages):
    """A drop-in for `torchvision.datasets.ImageFolder` over the cache.

    Same `classes`, `class_to_idx`, `samples` (source paths), `targets` and `imgs`, and the same
    sample for the same index and transform. `samples` and `targets` are built on access from
    the node's shared manifest (no per-file objects per process); assigning a list to either
    works as with ImageFolder. `decode="tensor"` gives uint8 CHW tensors decoded by
    torchvision.io straight from the zero-copy buffer. A custom `loader` is called with a
    binary file object over the cached bytes instead of a path.

    `decoded=N` serves the pixels the nodes decoded once (`preload --decoded N`, started here
    when the dataset lacks that variant): the sample is `Resize(N)(pil_loader(path))` (N = 0:
    the decoded size) as a PIL image over the mapped pixels (no copy), or with
    `decode="tensor"` a uint8 CHW tensor viewing the stored HWC pixels. Samples not decoded yet
    are decoded by the worker; files that do not decode fail as ImageFolder fails.
    """

    def __init__(
        self,
        root: PathLike,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        loader: Callable[..., Any] = default_loader,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        decode: str = "pil",
        local: bool | None = None,
        decoded: int | None = None,
        user: str | None = None,
        password: str | None = None,
    ):
        if decode not in ("pil", "tensor"):
            raise InvalidArgument(f"decode must be 'pil' or 'tensor', not {decode!r}")
        if decoded is not None:
            variants.check_size(decoded)
            if loader not in _PIL_LOADERS:
                raise InvalidArgument("decoded=N serves decoded pixels: it takes no custom loader")
        VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)
        m = self._attach(self.root, objname, nodes, token, local, user=user, password=password)
        if not m.is_dir(self._top):
            raise InvalidArgument(f"{self.root} is a file, not a folder")
        self.loader = loader
        self.decode = decode
        if decoded is not None:
            self._start_variant(decoded)
        self.decoded = decoded
        self.extensions = IMG_EXTENSIONS if is_valid_file is None else None
        folders = class_folders(m, self._top)
        if not folders:
            raise FileNotFoundError(f"Couldn't find any class folder in {self.root}.")
        self.classes = [name for name, _ in folders]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        builder = IndexBuilder()
        empty = []
        for target, (name, entry) in enumerate(folders):
            if is_valid_file is None:
                added = build_folder_index(
                    m, entry, target, builder, extension_check(m, IMG_EXTENSIONS)
                )
            else:
                added = build_folder_index(
                    m, entry, target, builder, *_path_check(is_valid_file, self.root, name)
                )
            if not added:
                empty.append(name)
        if empty and not allow_empty:
            msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
            if self.extensions is not None:
                msg += f"Supported extensions are: {', '.join(self.extensions)}"
            raise FileNotFoundError(msg)
        self._index: SampleIndex = builder.build()
        self._samples: list[tuple[str, int]] | None = None
        self._targets: list[int] | None = None

    def _start_variant(self, size: int) -> None:
        """Have every member decode its part of the dataset at `size` (nothing when the variant
        is there or filling); the job starts at once, its workers decode what is not done yet."""
        with admin.connect(self._ref.settings) as client:
            decoded_client.start(client, self._ref.name, size, self._ref.uuid)
