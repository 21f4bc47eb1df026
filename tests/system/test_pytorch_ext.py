"""The fast-path datasets against torchvision and the source: same data, zero copy where local."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NodeProcess, kw, node_in, preload
from imagefolders import FIXED, make_images
from torchvision import datasets, transforms
from torchvision.io import ImageReadMode, decode_image, read_file

from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.sample import make_sample
from pytorch_ext import (
    KSpeedCallable,
    KSpeedDataset,
    KSpeedFolder,
    KSpeedImageFolder,
    SampleInfo,
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the module: the tests only read, each dataset under a name of its own."""
    with node_in(tmp_path_factory.mktemp("fastpath")) as n:
        yield n


@pytest.fixture(scope="module")
def loaded(node: NodeProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The images preloaded offline (the parent folder: the dataset root is a subfolder)."""
    images = make_images(tmp_path_factory.mktemp("imgs") / "data")
    preload(node, images.parent, "imgs")
    return images


def test_same_classes_samples_targets_and_tensors(node: NodeProcess, loaded: Path) -> None:
    ref = datasets.ImageFolder(str(loaded), transform=FIXED)
    ds = KSpeedImageFolder(str(loaded), transform=FIXED, **kw(node))
    assert ds.dataset_name == "imgs"
    assert len(ds) == len(ref) == 19
    assert ds.classes == ref.classes
    assert ds.class_to_idx == ref.class_to_idx
    assert list(ds.samples) == ref.samples
    assert ds.samples == ref.samples and ds.imgs == ref.imgs
    assert list(ds.targets) == ref.targets
    assert np.array_equal(np.asarray(ds.targets), ref.targets)
    assert ds.samples[-1] == ref.samples[-1] and ds.samples[2:5] == ref.samples[2:5]
    for i in range(len(ref)):
        a, ta = ds[i]
        b, tb = ref[i]
        assert ta == tb
        assert torch.equal(a, b), f"sample {i} ({ref.samples[i][0]}) differs"


def test_random_transform_same_result_for_same_seed(node: NodeProcess, loaded: Path) -> None:
    tfm = transforms.Compose([transforms.RandomResizedCrop(32), transforms.ToTensor()])
    ref = datasets.ImageFolder(str(loaded), transform=tfm)
    ds = KSpeedImageFolder(str(loaded), transform=tfm, **kw(node))
    for i in (0, 7, 18):
        torch.manual_seed(i)
        a = ds[i][0]
        torch.manual_seed(i)
        assert torch.equal(a, ref[i][0])


def test_is_valid_file_allow_empty_and_assigned_samples(node: NodeProcess, loaded: Path) -> None:
    def only_jpeg(path: str) -> bool:
        return path.endswith(".JPEG")

    ref = datasets.ImageFolder(str(loaded), is_valid_file=only_jpeg)
    ds = KSpeedImageFolder(str(loaded), is_valid_file=only_jpeg, **kw(node))
    assert ds.samples == ref.samples and len(ds) == 15

    ref.samples = ref.samples[3:9]
    ds.samples = ds.samples[3:9]
    assert len(ds) == 6 and list(ds.targets) == [t for _, t in ref.samples]
    for i in range(6):
        assert np.array_equal(np.asarray(ds[i][0]), np.asarray(ref[i][0]))

    with pytest.raises(FileNotFoundError, match="n00000000"):
        KSpeedImageFolder(str(loaded), is_valid_file=lambda p: "n00000000" not in p, **kw(node))
    ds = KSpeedImageFolder(
        str(loaded), is_valid_file=lambda p: "n00000000" not in p, allow_empty=True, **kw(node)
    )
    assert set(ds.targets) == {1, 2}


def test_tensor_decode_matches_torchvision_io(node: NodeProcess, loaded: Path) -> None:
    ds = KSpeedImageFolder(str(loaded), decode="tensor", **kw(node))
    for i, (path, target) in enumerate(ds.samples):
        img, t = ds[i]
        assert t == target
        assert torch.equal(img, decode_image(read_file(path), mode=ImageReadMode.RGB)), path


def test_local_reads_are_zero_copy(node: NodeProcess, loaded: Path) -> None:
    ds = KSpeedFolder(str(loaded), **kw(node))
    r = ds._reader
    assert r.local is not None
    rel = "n00000001/sub/deeper/x.jpg"
    assert rel in list(ds.files)
    view = ds.read(rel)
    assert bytes(view) == (loaded / rel).read_bytes()
    entry = ds._entry_of(rel)
    [(seg, off, n)] = r.manifest.ranges(entry)
    segment = np.frombuffer(r.local.segment(seg), dtype=np.uint8)
    arr = np.frombuffer(view, dtype=np.uint8)
    assert np.shares_memory(arr, segment)
    assert arr.ctypes.data == segment.ctypes.data + off
    # The tensor handed to the JPEG decoder is the same memory.
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    assert segment.ctypes.data <= tensor.data_ptr() < segment.ctypes.data + len(segment)
    assert ds[list(ds.files).index(rel)].ctypes.data == arr.ctypes.data


def test_remote_reads_are_byte_correct(node: NodeProcess, loaded: Path) -> None:
    ds = KSpeedFolder(str(loaded), local=False, **kw(node))
    assert ds._reader.local is None
    files = list(ds.files)
    for i, rel in enumerate(files):
        assert bytes(ds.read(rel)) == (loaded / rel).read_bytes()
        assert bytes(ds[i]) == (loaded / rel).read_bytes()
    batch = ds.__getitems__(list(range(len(files))))
    assert [bytes(b) for b in batch] == [(loaded / f).read_bytes() for f in files]
    stats = ds.statistics()
    assert stats["fetched"] == 3 * len(files) and not stats.get("local")
    ref = datasets.ImageFolder(str(loaded), transform=FIXED)
    img = KSpeedImageFolder(str(loaded), transform=FIXED, local=False, **kw(node))
    for i in range(len(ref)):
        assert torch.equal(img[i][0], ref[i][0])


def test_folder_lists_files_like_a_sorted_walk(node: NodeProcess, loaded: Path) -> None:
    class Sizes(KSpeedFolder):
        def __getitem__(self, index: int) -> int:
            return len(self.read_index(index))

    ds = Sizes(str(loaded), **kw(node))
    expect = [
        os.path.relpath(os.path.join(d, f), loaded)
        for d, _, fs in sorted(os.walk(loaded))
        for f in sorted(fs)
    ]
    assert list(ds.files) == expect
    assert [ds[i] for i in range(len(ds))] == [os.path.getsize(loaded / f) for f in expect]
    jpegs = KSpeedFolder(str(loaded), extensions=(".jpeg",), **kw(node))
    assert list(jpegs.files) == [f for f in expect if f.lower().endswith(".jpeg")]
    with pytest.raises(InvalidArgument):
        ds.read("n00000001")


@pytest.fixture(scope="module")
def arrays(node: NodeProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two .npy files, preloaded as "feats"."""
    folder = tmp_path_factory.mktemp("features")
    rng = np.random.default_rng(0)
    # 1.2 MB: with 1 MiB segments some rows straddle a segment boundary.
    np.save(folder / "x.npy", rng.standard_normal((1000, 3, 100)).astype(np.float32))
    np.save(folder / "y.npy", np.arange(1000, dtype=np.int64) * 7)
    preload(node, folder, "feats")
    return folder


def test_npy_rows_and_batches(node: NodeProcess, arrays: Path) -> None:
    x = np.load(arrays / "x.npy")
    for local in (None, False):
        ds = KSpeedDataset(str(arrays / "x.npy"), batch_size=8, local=local, **kw(node))
        assert len(ds) == 1000 and ds.shape == x.shape and ds.dtype == x.dtype
        for i in (0, 1, 873, 874, 999, -1):
            assert np.array_equal(ds[i], x[i])
        idx = [5, 874, 3, 873, 999, 0, 5]
        assert np.array_equal(ds[idx], x[idx])
        assert np.array_equal(ds[np.array(idx)], x[idx])
        assert np.array_equal(ds[torch.tensor(idx)], x[idx])
        assert np.array_equal(ds[10:20], x[10:20])
        with pytest.raises(IndexError):
            ds[1000]
    y = KSpeedDataset(str(arrays / "y.npy"), **kw(node))
    assert y[3] == 21 and np.array_equal(y[[1, 2]], [7, 14])


def test_npy_row_is_a_view_of_shared_memory(node: NodeProcess, arrays: Path) -> None:
    ds = KSpeedDataset(str(arrays / "x.npy"), **kw(node))
    r = ds._reader
    assert r.local is not None
    row = ds[2]
    [(seg, _off, _n)] = r.manifest.ranges(ds._entry, ds._offset + 2 * ds._row_bytes, ds._row_bytes)
    assert np.shares_memory(row, np.frombuffer(r.local.segment(seg), dtype=np.uint8))
    assert not row.flags.writeable


def test_bad_npy_files_are_refused_at_construction(node: NodeProcess, tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "junk.npy").write_bytes(b"not numpy at all")
    np.save(folder / "f.npy", np.asfortranarray(np.ones((4, 5), dtype=np.float32)))
    preload(node, folder, "bad")
    with pytest.raises(KSpeedError, match="bad magic"):
        KSpeedDataset(str(folder / "junk.npy"), **kw(node))
    with pytest.raises(InvalidArgument, match="Fortran"):
        KSpeedDataset(str(folder / "f.npy"), **kw(node))


def test_callable_shards_cover_each_epoch_once(node: NodeProcess, loaded: Path) -> None:
    shards = [
        KSpeedCallable(str(loaded), batch_size=3, shard_id=s, num_shards=2, **kw(node))
        for s in range(2)
    ]
    ref = datasets.ImageFolder(str(loaded))
    orders = []
    for epoch in range(2):
        seen: list[int] = []
        for src in shards:
            assert len(src) == 9  # 19 // 2 = 9 per shard: three full batches of 3
            for k in range(len(src)):
                data, label = src(SampleInfo(k, k % 3, k // 3, epoch))
                index = int(src._order(epoch)[src.shard_offset + k])
                path, target = ref.samples[index]
                assert data.dtype == np.uint8 and data.tobytes() == Path(path).read_bytes()
                assert label.dtype == np.int32 and label.tolist() == [target]
                seen.append(index)
            with pytest.raises(StopIteration):
                src(SampleInfo(9, 0, 3, epoch))
        assert len(set(seen)) == 18  # the two shards are disjoint
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled per epoch


def test_missing_source_fails_at_construction(node: NodeProcess, tmp_path: Path) -> None:
    with pytest.raises(NotFound) as err:
        KSpeedImageFolder(str(tmp_path / "nowhere"), **kw(node))
    msg = str(err.value)
    assert "nowhere" in msg and "cannot be loaded" in msg and "\n" not in msg


def test_over_budget_fails_at_construction(
    shm_dir: Path, token_file: Path, tmp_path: Path, loaded: Path
) -> None:
    small = NodeProcess(shm_dir, token_file, tmp_path, memory="20KiB").start()
    try:
        with pytest.raises(KSpeedError) as err:
            KSpeedImageFolder(str(loaded), nodes=small.address, token=str(token_file))
        assert "budget" in str(err.value) and "\n" not in str(err.value)
        listing = small.request("list")["datasets"]
        assert [d["state"] for d in listing] in ([], ["failed"])
    finally:
        small.stop()


def test_paths_outside_or_missing_in_a_dataset(node: NodeProcess, loaded: Path) -> None:
    with pytest.raises(NotFound, match="no such file"):
        KSpeedImageFolder(str(loaded / "n00000000" / "missing"), objname="imgs", **kw(node))
    with pytest.raises(InvalidArgument, match="not inside dataset imgs"):
        KSpeedImageFolder("/usr/share", objname="imgs", **kw(node))
    with pytest.raises(InvalidArgument, match="decode"):
        KSpeedImageFolder(str(loaded), decode="gpu", **kw(node))


def test_pickles_config_not_per_file_lists(node: NodeProcess, tmp_path: Path) -> None:
    import pickle

    roots = []
    for name, per_class in (("few", 4), ("lot", 80)):
        root = tmp_path / name / "train"
        make_sample(root, classes=3, per_class=per_class, file_size=1500, bases=2)
        preload(node, root.parent, name)
        roots.append(root)
    few, lot = (KSpeedImageFolder(str(r), transform=FIXED, **kw(node)) for r in roots)
    assert (len(few), len(lot)) == (12, 240)
    # 20 times the files, the same pickle (what spawned workers receive) within a few bytes.
    assert abs(len(pickle.dumps(lot)) - len(pickle.dumps(few))) < 64
    copy = pickle.loads(pickle.dumps(lot))
    assert torch.equal(copy[200][0], lot[200][0]) and copy.samples == lot.samples
