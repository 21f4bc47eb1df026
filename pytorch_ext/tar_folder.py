"""KSpeedTarFolder: a cached tar's members as an ImageFolder, on the fast path (no FUSE).

The fast path's side of the tar view (`NAME@tar/` on the mount, `kspeedfs://NAME@tar/`):
`KSpeedTarFolder("/data/train/shard-0001.tar")` is what `DatasetFolder` gives over the tar's
extraction (classes are its top folders, samples in sorted walk order, the same loader and
transforms), read as byte ranges of the cached tar: views of the node's shared memory where
the tar is held here, else read by the cluster's read policy. The tar's tree is parsed from its
headers once (format/tarview.py: the same rules as the mount's view; a damaged tar raises
DataError in one line).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from kspeedfs.format import tarview
from kspeedfs.format.errors import InvalidArgument

from .folder import CachedPath, PathLike

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def pil_loader(data: memoryview) -> Image.Image:
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


Children = Callable[[int], Iterable[tuple[bytes, int]]]


def _folders(
    children: Children, is_dir: Callable[[int], bool], top: int, path: str
) -> list[tuple[str, list[tuple[str, int]]]]:
    """(folder path, its entries (name, node) that are not folders, sorted) of every folder
    under node `top`."""
    out: list[tuple[str, list[tuple[str, int]]]] = []
    stack = [(top, path)]
    while stack:
        number, at = stack.pop()
        files = []
        for name, child in children(number):
            if is_dir(child):
                stack.append((child, os.path.join(at, os.fsdecode(name))))
            else:
                files.append((os.fsdecode(name), child))
        out.append((at, sorted(files)))
    return out


class MemberFolder(CachedPath, Dataset[Any]):
    """DatasetFolder over members of cached tars: samples are byte ranges of tar files.
    `loader` takes the member's bytes (a memoryview) and defaults to PIL's RGB image;
    `extensions`/`is_valid_file` as torchvision's (is_valid_file gets the member's path as
    DatasetFolder would show it under `root`)."""

    def _configure(
        self,
        root: PathLike,
        loader: Callable[[memoryview], Any] | None,
        transform: Callable[[Any], Any] | None,
        target_transform: Callable[[Any], Any] | None,
    ) -> None:
        self.root = os.fspath(root)
        self.loader = loader or pil_loader
        self.transform = transform
        self.target_transform = target_transform

    def _collect(
        self,
        children: Children,
        is_dir: Callable[[int], bool],
        span: Callable[[int], tuple[int, int, int] | None],
        extensions: Sequence[str] | None,
        is_valid_file: Callable[[str], bool] | None,
    ) -> None:
        """Classes and samples as DatasetFolder finds them from node 0 down; `span(node)` is a
        file's (tar entry, offset, size), None for what is not a file (a link)."""
        if is_valid_file is None:
            exts = tuple(e.lower() for e in extensions or ())

            def is_valid_file(path: str) -> bool:
                return path.lower().endswith(exts)

        tops = {os.fsdecode(name): node for name, node in children(0) if is_dir(node)}
        classes = sorted(tops)
        self.classes = classes
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        samples: list[tuple[str, int]] = []
        spans: list[tuple[int, int, int]] = []
        for cls in classes:
            # DatasetFolder: sorted(os.walk(class folder)), each folder's files sorted.
            folders = _folders(children, is_dir, tops[cls], os.path.join(self.root, cls))
            for path, files in sorted(folders):
                for name, child in files:
                    full = os.path.join(path, name)
                    where = span(child)
                    if where is not None and is_valid_file(full):
                        samples.append((full, self.class_to_idx[cls]))
                        spans.append(where)
        if not samples:
            raise FileNotFoundError(f"Found no valid file for the classes in {self.root}.")
        self.samples = samples
        self.targets = [t for _, t in samples]
        self._spans = np.array(spans, dtype=np.int64).reshape(-1, 3)

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> memoryview:
        """Sample `index`'s bytes: a view of the node's shared memory where local."""
        entry, offset, size = (int(v) for v in self._spans[index])
        return self._reader.range_bytes(entry, offset, size)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A DataLoader batch, sample by sample (members are ranges of one file: the batch
        reads of the entry-based datasets do not apply)."""
        return [self[int(i)] for i in indices]

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        sample = self.loader(self.read(index))
        target = self.targets[index]
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


class KSpeedTarFolder(MemberFolder):
    """DatasetFolder over the members of one cached tar (see MemberFolder)."""

    def __init__(
        self,
        root: PathLike,
        loader: Callable[[memoryview], Any] | None = None,
        extensions: Sequence[str] | None = IMG_EXTENSIONS,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        *,
        objname: str | None = None,
        nodes: str | Sequence[str] | None = None,
        token: PathLike | None = None,
        local: bool | None = None,
    ):
        self._configure(root, loader, transform, target_transform)
        m = self._attach(self.root, objname, nodes, token, local)
        if not m.is_file(self._top) or not tarview.is_tar_name(m.name(self._top)):
            raise InvalidArgument(f"{self.root} is not a .tar file of a cached dataset")
        reader = self._reader
        tar = self._top

        def read(offset: int, n: int) -> memoryview:
            return reader.range_bytes(tar, offset, n)

        tree = tarview.parse(read, int(m.size[tar]))

        def span(node: int) -> tuple[int, int, int] | None:
            found = tree.nodes[node]
            return (tar, found.offset, found.size) if found.kind == tarview.FILE else None

        self._collect(
            tree.children,
            lambda node: tree.nodes[node].kind == tarview.DIR,
            span,
            extensions,
            is_valid_file,
        )
