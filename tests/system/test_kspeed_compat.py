"""KSpeed's own calls, verbatim but for the import line, against a real node with a user."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import KSPEEDFS, NodeProcess, run_cli
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
from torchvision import datasets, transforms

from kspeedfs.format.errors import AuthError, InvalidArgument
from kspeedfs.sample import make_sample
from pytorch_ext.kspeed import KSpeedDataset, KSpeedFolder, KSpeedImageFolder

pytestmark = pytest.mark.slow  # DataLoader workers (fork and spawn)

TRANSFORMS = [transforms.Resize(40), transforms.CenterCrop(32), transforms.ToTensor()]


def add_user(node: NodeProcess, name: str, role: str, password: str) -> None:
    argv = [*KSPEEDFS, "user", "add", name, "--role", role, "--password-stdin"]
    done = subprocess.run(
        argv, env=node.env(), input=password + "\n", capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture
def imagenet(tmp_path: Path) -> Path:
    root = tmp_path / "imagenet"
    make_sample(root / "train", classes=3, per_class=6, file_size=5000, bases=3)
    make_sample(root / "val", classes=3, per_class=2, file_size=5000, bases=3)
    np.save(root / "features.npy", np.random.default_rng(0).standard_normal((40, 8)))
    return root


@pytest.fixture
def kspeed_iplist(node: NodeProcess) -> list[str]:
    add_user(node, "admin", "admin", "admin")
    return [node.address]


def collect(loader: DataLoader) -> tuple[torch.Tensor, list[int]]:  # type: ignore[type-arg]
    xs, ys = [], []
    for x, y in loader:
        xs.append(x)
        ys += y.tolist()
    return torch.cat(xs), ys


def test_the_resnet50_recipes_image_folders(imagenet: Path, kspeed_iplist: list[str]) -> None:
    traindir, valdir, workers = str(imagenet / "train"), str(imagenet / "val"), 2
    transforms_list = TRANSFORMS
    train_dataset = KSpeedImageFolder(
        traindir,
        None,
        workers,
        kspeed_iplist,
        "admin",
        "admin",
        transforms.Compose(transforms_list),
    )
    val_dataset = KSpeedImageFolder(
        valdir, None, workers, kspeed_iplist, "admin", "admin", transforms.Compose(transforms_list)
    )
    for ds, folder in ((train_dataset, traindir), (val_dataset, valdir)):
        ref = datasets.ImageFolder(folder, transforms.Compose(transforms_list))
        assert ds.samples == ref.samples and ds.targets == ref.targets
        got = collect(DataLoader(ds, batch_size=4, num_workers=2))
        want = collect(DataLoader(ref, batch_size=4))
        assert got[1] == want[1] and torch.equal(got[0], want[0])
    assert train_dataset.dataset_name == "train"  # KSpeed's name: the root folder's own


def test_the_short_array_form_gives_numpy_batches(imagenet: Path, kspeed_iplist: list[str]) -> None:
    filename = str(imagenet / "features.npy")
    batch_size, in_main_process = 8, False
    ds = KSpeedDataset(kspeed_iplist, filename, batch_size, in_main_process)
    want = np.load(filename)
    assert len(ds) == len(want)
    sampler = BatchSampler(SequentialSampler(range(len(ds))), batch_size, drop_last=False)
    got = list(DataLoader(ds, sampler=sampler, batch_size=None, num_workers=2))
    assert torch.equal(torch.cat(got), torch.from_numpy(want))


class SeedFolder(KSpeedFolder):
    """A seed-style subclass: KSpeed's attributes, the dataset opened in the worker."""

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        if self.dataset is None:
            self.load()
        assert self.dataset is not None
        return bytes(self.dataset.getBIN(self.files[index])), self.labels[index]


class RecipeCallable(KSpeedDataset):
    """The ResNet-50 recipe's KSpeedCallable base call, then its attribute use."""

    def __init__(
        self, root: str, object_name: str | None, dl_workers: int, kspeed_iplist, username, password
    ):  # type: ignore[no-untyped-def]
        super().__init__(root, object_name, dl_workers, "CPU", 1, kspeed_iplist, username, password)

    def __call__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if self.dataset is None:
            self.load()
        assert self.dataset is not None
        data = np.frombuffer(self.dataset.getBIN(self.files[i]), dtype=np.uint8)
        return data, np.array([self.labels[i]], dtype=np.int32)


class SeedRows(KSpeedDataset):
    """Seed 000's custom dataset: KSpeed's base call, the dataset opened on first use."""

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if self.dataset is None:
            self.load()
        assert self.dataset is not None
        return super().__getitem__(index), self.dataset.get(self.files[0])[:6]


def test_a_subclass_over_an_array_loads_its_dataset(
    imagenet: Path, kspeed_iplist: list[str]
) -> None:
    filename = imagenet / "features.npy"
    want = np.load(filename)
    ds = SeedRows(str(filename), None, 2, "CPU", 1, kspeed_iplist, "admin", "admin")
    assert ds.dataset is None
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    got = list(loader)
    assert len(got) == len(want)
    for i, (row, magic) in enumerate(got):
        assert np.array_equal(np.asarray(row), want[i])
        assert bytes(np.asarray(magic)) == b"\x93NUMPY"
    handle = ds.load()
    assert handle.size() == len(want)
    assert bytes(handle.getBIN(str(filename))) == filename.read_bytes()
    assert np.array_equal(handle[[2, 5]], want[[2, 5]])
    with pytest.raises(InvalidArgument, match="not the file"):
        handle.getBIN("other.npy")
    assert pickle.loads(pickle.dumps(ds)).dataset is None


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_subclass_pickles_and_attaches_in_each_worker(
    imagenet: Path, kspeed_iplist: list[str], start_method: str
) -> None:
    root = imagenet / "train"
    ds = SeedFolder(str(root), None, 2, ",".join(kspeed_iplist), "admin", "admin")
    ref = datasets.ImageFolder(str(root))
    assert [str(root / f) for f in ds.files] == [p for p, _ in ref.samples]
    assert ds.labels == ref.targets and ds.classes == ref.classes
    assert ds.dataset is None
    ds.load()
    assert pickle.loads(pickle.dumps(ds)).dataset is None  # a worker attaches itself
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=start_method)
    got = [tuple(sample) for sample in loader]  # batch_size=None: samples as the dataset gave
    assert got == [(Path(p).read_bytes(), t) for p, t in ref.samples]
    # getBIN takes an absolute path under root too, and is a view (no copy) on this node.
    view = ds.dataset.getBIN(str(root / ds.files[3]))  # type: ignore[union-attr]
    assert isinstance(view, memoryview) and view.readonly
    assert bytes(view) == (root / ds.files[3]).read_bytes()


def test_the_recipes_callable_base(imagenet: Path, kspeed_iplist: list[str]) -> None:
    cb = RecipeCallable(str(imagenet / "train"), None, 2, kspeed_iplist, "admin", "admin")
    ref = datasets.ImageFolder(str(imagenet / "train"))
    for i in (0, 7, len(ref) - 1):
        data, label = cb(i)
        assert data.tobytes() == Path(ref.samples[i][0]).read_bytes()
        assert label.tolist() == [ref.targets[i]]


def test_batches_of_files_and_devices(imagenet: Path, kspeed_iplist: list[str]) -> None:
    root = imagenet / "train"
    files = KSpeedDataset(str(root), None, 0, "CPU", 4, kspeed_iplist, "admin", "admin")
    batch = files[[5, 0, 2]]
    assert [b.tobytes() for b in batch] == [(root / files.files[i]).read_bytes() for i in (5, 0, 2)]
    rows = KSpeedDataset(
        str(imagenet / "features.npy"), None, 0, "cpu", 1, kspeed_iplist, "admin", "admin"
    )
    want = np.load(imagenet / "features.npy")
    row = rows[3]
    assert isinstance(row, torch.Tensor) and torch.equal(row, torch.from_numpy(want[3]))
    rows4 = KSpeedDataset(
        str(imagenet / "features.npy"), None, 0, "cpu", 4, kspeed_iplist, "admin", "admin"
    )
    assert torch.equal(rows4[[1, 2, 9]], torch.from_numpy(want[[1, 2, 9]]))
    with pytest.raises(InvalidArgument, match="device"):
        KSpeedDataset(str(root), None, 0, "TPU", 1, kspeed_iplist, "admin", "admin")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_cuda_gives_tensors_on_the_gpu(imagenet: Path, kspeed_iplist: list[str]) -> None:
    want = np.load(imagenet / "features.npy")
    rows = KSpeedDataset(
        str(imagenet / "features.npy"), None, 0, "cuda:0", 4, kspeed_iplist, "admin", "admin"
    )
    got = rows[[0, 3, 5]]
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), torch.from_numpy(want[[0, 3, 5]]))


def test_objname_follows_kspeeds_rule(
    node: NodeProcess, imagenet: Path, tmp_path: Path, kspeed_iplist: list[str]
) -> None:
    other = tmp_path / "elsewhere" / "train"
    make_sample(other, classes=2, per_class=2, file_size=3000, bases=2)
    # Held: a job's dataset is unloaded when its last dataset object goes.
    held = KSpeedFolder(str(imagenet / "train"), None, 2, kspeed_iplist, "admin", "admin")
    assert held.objname == "train"
    with pytest.raises(InvalidArgument, match="pass objname"):
        KSpeedFolder(str(other), None, 2, kspeed_iplist, "admin", "admin")
    ds = KSpeedFolder(str(other), "train2", 2, kspeed_iplist, "admin", "admin")
    assert ds.objname == "train2" and len(ds) == 4
    # The offline preload follows the same rule when --name is left out.
    done = run_cli("preload", str(imagenet / "val"), "-q", env=node.env())
    assert done.returncode == 0, done.stderr
    names = {d["name"] for d in node.request("list")["datasets"]}
    assert {"train", "train2", "val"} <= names


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"dl_workers": -1}, "dl_workers"),
        ({"dl_workers": "4"}, "dl_workers"),
        ({"kspeed_iplist": []}, "kspeed_iplist"),
        ({"kspeed_iplist": [7420]}, "kspeed_iplist"),
    ],
)
def test_bad_arguments_are_one_clear_error(
    imagenet: Path, kspeed_iplist: list[str], args: dict, message: str
) -> None:
    kwargs = {"dl_workers": 2, "kspeed_iplist": kspeed_iplist, **args}
    with pytest.raises(InvalidArgument, match=message):
        KSpeedFolder(str(imagenet / "train"), None, username="admin", password="admin", **kwargs)


def test_a_wrong_password_is_refused(imagenet: Path, kspeed_iplist: list[str]) -> None:
    with pytest.raises(AuthError) as e:
        KSpeedFolder(str(imagenet / "train"), None, 2, kspeed_iplist, "admin", "wrong")
    assert "\n" not in str(e.value)
    with pytest.raises(AuthError) as e2:
        KSpeedFolder(str(imagenet / "train"), None, 2, kspeed_iplist, "nobody", "admin")
    assert str(e2.value) == str(e.value)  # no hint of which part was wrong
