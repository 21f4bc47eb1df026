"""KSpeed's PyTorch classes with KSpeed's signatures, over the fast path.

A script written for KSpeed (`from kspeed.utils.data.kspeeddataset import ...`) changes only
its import line to `from pytorch_ext.kspeed import ...`. The classes keep KSpeed's positional
arguments (`root, objname, dl_workers, kspeed_iplist, username, password`, and `device`,
`batch_size` for KSpeedDataset) and its attributes (`files`, `labels`, `classes`, `dataset`,
`load()`, `dataset.getBIN(path)`), and are built on the fast path's classes: the same read
policy, the same preload-and-wait, the same zero-copy views of local data.

- `objname` None: the dataset whose source holds `root`, else one loaded (with a lease) under
  KSpeed's name for it, the root folder's own name (`/data/imagenet/train` -> `train`); a
  dataset of that name loaded from another source is refused in one line.
- `kspeed_iplist`: a list or a comma-separated string of `host[:port]` (port 7420 when left
  out); None means the settings (KSPEEDFS_NODES, the config file, or etcd), and in a
  Kubernetes pod with none of them the node on the pod's own machine (HOST_IP from the
  downward API; docs/kubernetes.md).
- `username`/`password`: a user the operator created with `kspeedfs user add`; there is no
  built-in user, so KSpeed's default `admin`/`admin` works only where that user exists.
- `dl_workers`: KSpeed's hint for its loader processes, checked (an int >= 0) and kept; here
  every process (DataLoader or DALI worker) attaches itself after fork or spawn, so no number
  of connections has to be planned for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from kspeedfs.format.errors import InvalidArgument

from . import cache
from .array import KSpeedDataset as _ArrayDataset
from .external_source import file_batch
from .image_folder import KSpeedImageFolder as _ImageFolder
from .image_folder import ViewFile
from .index import LazyFiles, LazyTargets

PathLike = str | os.PathLike[str]
IpList = str | Sequence[str] | None


def _nodes(kspeed_iplist: IpList) -> str | None:
    """KSpeed's address list as the settings' node list (None: from the settings)."""
    if kspeed_iplist is None:
        return None
    parts = kspeed_iplist.split(",") if isinstance(kspeed_iplist, str) else list(kspeed_iplist)
    if not all(isinstance(p, str) for p in parts):
        raise InvalidArgument(f"kspeed_iplist must be addresses (host[:port]): {kspeed_iplist!r}")
    addresses = [p.strip() for p in parts if p.strip()]
    if not addresses:
        raise InvalidArgument("kspeed_iplist is empty: give host[:port] addresses, or None")
    return ",".join(addresses)


def _workers(dl_workers: Any) -> int:
    if isinstance(dl_workers, bool) or not isinstance(dl_workers, int) or dl_workers < 0:
        raise InvalidArgument(f"dl_workers must be an int >= 0, not {dl_workers!r}")
    return dl_workers


def _check_login(username: str | None, password: str | None) -> None:
    if username is not None and not (isinstance(username, str) and isinstance(password, str)):
        raise InvalidArgument("username and password must be strings")


class Fileset:
    """KSpeed's handle on a loaded file dataset: `getBIN`, `get`, `getPIL`, `size`."""

    def __init__(self, images: _ImageFolder):
        self._images = images

    def getBIN(self, path: PathLike) -> memoryview:  # noqa: N802 (KSpeed's name)
        """The file's bytes: a read-only view of shared memory where local (no copy)."""
        images = self._images
        if type(path) is str and path[:1] != "/":  # the common case: a name from `files`
            return images._bytes(images._entry_of(path))
        return images._bytes(images._entry_of(images.relative(path)))

    def get(self, path: PathLike) -> np.ndarray:
        """The file's bytes as a uint8 array (a view where local)."""
        return np.frombuffer(self.getBIN(path), dtype=np.uint8)

    def getPIL(self, path: PathLike) -> Image.Image:  # noqa: N802 (KSpeed's name)
        with Image.open(ViewFile(self.getBIN(path))) as img:  # type: ignore[arg-type]
            return img.convert("RGB")

    def size(self) -> int:
        return len(self._images)


class ArrayFileset:
    """KSpeed's handle on a loaded `.npy` dataset: its one file (`files[0]`) by `getBIN` and
    `get`, its rows by index, `size()` rows."""

    def __init__(self, rows: _Rows):
        self._rows = rows

    def getBIN(self, path: PathLike) -> memoryview:  # noqa: N802 (KSpeed's name)
        """The .npy file's bytes (its name as in `files`, or its path): a view where local."""
        rows = self._rows
        p = os.fspath(path)
        if p not in (os.path.basename(os.fspath(rows.root)), os.fspath(rows.root)):
            raise InvalidArgument(f"{p} is not the file of this dataset ({rows.root})")
        return rows._bytes(rows._entry)

    def get(self, path: PathLike) -> np.ndarray:
        return np.frombuffer(self.getBIN(path), dtype=np.uint8)

    def __getitem__(self, index: Any) -> Any:
        """A row, or the rows of a list of indices."""
        return self._rows[index]

    def size(self) -> int:
        return len(self._rows)


class _Images(_ImageFolder):
    """The fast path's image folder with KSpeed's rules: its name for a dataset loaded here,
    and paths absolute under root or relative to it."""

    _name_for_load = staticmethod(cache.kspeed_name)

    def relative(self, path: PathLike) -> str:
        p = os.fspath(path)
        if not os.path.isabs(p):
            return p
        rel = os.path.relpath(p, os.fspath(self.root))
        if rel == ".." or rel.startswith("../"):
            raise InvalidArgument(f"{p} is not under {self.root}")
        return rel

    def read(self, relpath: PathLike) -> memoryview:
        return self._bytes(self._entry_of(relpath))

    def file_batch(self, indices: Sequence[int]) -> list[memoryview]:
        """The files of samples `indices`: the remote ones prefetched or read in one request
        per node, the local ones viewed in place."""
        return file_batch(self, np.asarray(indices, dtype=np.int64))


class _Rows(_ArrayDataset):
    _name_for_load = staticmethod(cache.kspeed_name)


class KSpeedFolder(torch.utils.data.Dataset[Any]):
    """KSpeed's base class of a file dataset: subclass it and define `__getitem__` (or
    `__call__`, for DALI's external source) over `files`, `labels` and `dataset.getBIN`.

    `files` are paths relative to root in ImageFolder's order, `labels` their class indices,
    `classes` the class folders. `dataset` is None until `load()`, and None again in a pickled
    copy (a DataLoader or DALI worker), which calls `load()` itself."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # DALI's external source tries iter(source) before calling it, and an object with
        # __getitem__ is iterable by the old sequence protocol: a subclass with __call__ is a
        # per-sample callable for DALI, so iterating it is refused.
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__ and "__iter__" not in cls.__dict__:
            setattr(cls, "__iter__", None)  # noqa: B010 (a class attribute, set on purpose)

    def __init__(
        self,
        root: PathLike,
        objname: str | None = None,
        dl_workers: int = 4,
        kspeed_iplist: IpList = None,
        username: str | None = "admin",
        password: str | None = "admin",
    ):
        self.root = root
        self.dl_workers = _workers(dl_workers)
        _check_login(username, password)
        self._images = _Images(
            root, objname=objname, nodes=_nodes(kspeed_iplist), user=username, password=password
        )
        self.objname = self._images.dataset_name
        self.classes = self._images.classes
        self.class_to_idx = self._images.class_to_idx
        # Built on access from the node's mapped manifest: no per-file objects per process.
        self.files: Sequence[str] = LazyFiles(self._images)
        self.labels: Sequence[int] = LazyTargets(self._images._index)
        self.dataset: Fileset | None = None

    def set_plan(self, plan: Any) -> None:
        """A sampler's epoch plan (ClairvoyantSampler, PrioritySampler): fetched ahead."""
        self._images.set_plan(plan)

    def statistics(self) -> dict[str, int]:
        return self._images.statistics()

    def load(self) -> Fileset:
        """Open the dataset in this process (after fork or spawn: each worker calls it)."""
        if self.dataset is None:
            self.dataset = Fileset(self._images)
        return self.dataset

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Any:
        """File `index` as (uint8 bytes, label); subclasses define their own."""
        data = self.load().getBIN(self.files[index])
        return np.frombuffer(data, dtype=np.uint8), self.labels[index]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["dataset"] = None
        return state


class KSpeedImageFolder(_Images):
    """`torchvision.datasets.ImageFolder` over the cache, with KSpeed's arguments: the same
    samples, targets and images."""

    def __init__(
        self,
        root: PathLike,
        objname: str | None = None,
        dl_workers: int = 4,
        kspeed_iplist: IpList = None,
        username: str | None = "admin",
        password: str | None = "admin",
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
    ):
        self.dl_workers = _workers(dl_workers)
        _check_login(username, password)
        super().__init__(
            root,
            transform,
            target_transform,
            objname=objname,
            nodes=_nodes(kspeed_iplist),
            user=username,
            password=password,
        )


def torch_device(device: Any) -> torch.device | None:
    """KSpeed's `device`: 'CPU' gives numpy (None here); 'GPU', 'cuda', 'cuda:N', 'cpu' or a
    torch.device give torch tensors there."""
    if device == "CPU":
        return None
    if device == "GPU":
        return torch.device("cuda")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgument(
            f"device must be 'CPU', 'GPU', 'cuda', 'cuda:N' or 'cpu', not {device!r}"
        ) from None


class Placer:
    """Moves numpy samples to a torch device through one staging buffer per process (pinned
    for CUDA, so the copy is asynchronous); the buffer is reused once the last copy out of it
    has finished."""

    def __init__(self, device: torch.device):
        self.device = device
        self._staging: torch.Tensor | None = None
        self._pid = 0
        self._copied: Any = None  # the CUDA event of the last copy out of the staging buffer

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        staging = self._buffer(len(flat))[: len(flat)]
        staging.numpy()[:] = flat
        typed = staging.view(torch.from_numpy(array[:0].copy()).dtype).view(array.shape)
        if self.device.type != "cuda":
            return typed.clone()  # the staging buffer is reused for the next sample
        out = typed.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._pid != os.getpid():  # a forked worker gets its own buffer
            self._staging, self._copied, self._pid = None, None, os.getpid()
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging is None or len(self._staging) < nbytes:
            pin = self.device.type == "cuda"
            self._staging = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=pin)
        return self._staging

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "_staging": None, "_pid": 0, "_copied": None}


class KSpeedDataset(KSpeedFolder):
    """KSpeed's dataset: `KSpeedDataset(root, objname, dl_workers, device, batch_size,
    kspeed_iplist, username, password)`, or the short form `KSpeedDataset(kspeed_iplist,
    filename, batch_size, in_main_process)` (a list of addresses or None first).

    A `.npy` file gives its rows; a folder gives its files (as `KSpeedFolder`: `files`,
    `labels`, `dataset.getBIN`), each as a uint8 array. With `batch_size=1` an index gives one
    sample; otherwise a list of indices gives one batch, read with one request per node: an
    array of rows for a `.npy` file, a list of arrays for a folder. For
    `DataLoader(ds, sampler=BatchSampler(...), batch_size=None)`. `device` other than 'CPU'
    gives torch tensors on that device (see `torch_device`)."""

    def __init__(
        self,
        root: Any,
        objname: Any = None,
        dl_workers: Any = 4,
        device: Any = "CPU",
        batch_size: int = 1,
        kspeed_iplist: IpList = None,
        username: str | None = "admin",
        password: str | None = "admin",
        *args: Any,
    ):
        if args:
            raise TypeError(f"KSpeedDataset takes at most 8 arguments, got {8 + len(args)}")
        if root is None or isinstance(root, (list, tuple)):
            # The short form: (kspeed_iplist, filename, batch_size, in_main_process).
            root, objname, kspeed_iplist, batch_size = objname, None, root, dl_workers
            self.in_main_process = bool(device)
            dl_workers, device = 0, "CPU"
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be an int >= 1, not {batch_size!r}")
        self.batch_size = batch_size
        self.device = device
        target = torch_device(device)
        self._place = Placer(target) if target is not None else None
        if os.fspath(root).endswith(".npy"):
            self.root = root
            self.dl_workers = _workers(dl_workers)
            _check_login(username, password)
            self._rows: _Rows | None = _Rows(
                root, objname=objname, nodes=_nodes(kspeed_iplist), user=username, password=password
            )
            self.objname = self._rows.dataset_name
            self.files, self.labels, self.classes = [os.path.basename(root)], [], []
            self.dataset = None
        else:
            self._rows = None
            super().__init__(root, objname, dl_workers, kspeed_iplist, username, password)

    def load(self) -> Any:
        """Open the dataset in this process: a `Fileset` over a folder's files, an
        `ArrayFileset` over a .npy file's rows."""
        if self._rows is None:
            return super().load()
        if self.dataset is None:
            self.dataset = ArrayFileset(self._rows)  # type: ignore[assignment]
        return self.dataset

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self.files)

    def __getitem__(self, index: Any) -> Any:
        if self.batch_size == 1 and not isinstance(index, (list, tuple, np.ndarray)):
            return self._out(self._sample(int(index)))
        indices = [int(i) for i in index]
        if self._rows is not None:
            return self._out(self._rows.read_rows(indices))
        return [self._out(np.frombuffer(b, dtype=np.uint8)) for b in self._files(indices)]

    def _sample(self, index: int) -> np.ndarray:
        if self._rows is not None:
            return np.asarray(self._rows[index])
        return np.frombuffer(self.load().getBIN(self.files[index]), dtype=np.uint8)

    def _files(self, indices: list[int]) -> list[memoryview]:
        return self._images.file_batch(indices)

    def set_plan(self, plan: Any) -> None:
        (self._rows if self._rows is not None else self._images).set_plan(plan)

    def statistics(self) -> dict[str, int]:
        return (self._rows if self._rows is not None else self._images).statistics()

    def _out(self, array: np.ndarray) -> Any:
        return array if self._place is None else self._place(array)
