"""Real NVIDIA DALI over kspeedfs: the external source (per batch, per sample), DALI's file reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MountProcess, NodeProcess, kw, preload
from torchvision import datasets

from kspeedfs.format import users
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.sample import make_sample
from pytorch_ext import KSpeedCallable, KSpeedFolder, SampleInfo, kspeed
from pytorch_ext.external_source import BatchInfo

pytestmark = pytest.mark.slow  # DALI pipelines

dali = pytest.importorskip("nvidia.dali", reason="needs NVIDIA DALI (pip install '.[dali]')")
fn = dali.fn

BATCH = 4
EPOCHS = 2


class RecipeCallable(KSpeedFolder):
    """The ResNet-50 recipe's shape: a folder dataset whose `__call__` is DALI's per-sample
    source (a KSpeedFolder has `__getitem__`, so DALI would take it as an iterable)."""

    def __init__(self, root: str, batch_size: int, **options: Any):
        super().__init__(root, **options)
        self.batch_size = batch_size
        self.classes = sorted({f.split("/")[0] for f in self.files})

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, np.ndarray]:
        if sample_info.iteration >= len(self) // self.batch_size:
            raise StopIteration
        rel = self.files[sample_info.idx_in_epoch]
        label = self.classes.index(rel.split("/")[0])
        return np.frombuffer(self.read(rel), dtype=np.uint8), np.array([label], dtype=np.int32)


@pytest.fixture
def loaded(node: NodeProcess, tmp_path: Path) -> Path:
    """18 JPEGs in 3 class folders, preloaded offline (the dataset root is a subfolder)."""
    src = tmp_path / "data" / "train"
    make_sample(src, classes=3, per_class=6, file_size=3000, bases=3)
    preload(node, src.parent, "imgs")
    return src


def external_source_pipeline(source: Any, start_method: str, device_id: int | None = None) -> Any:
    @dali.pipeline_def(
        batch_size=BATCH,
        num_threads=1,
        device_id=device_id,
        py_num_workers=2,
        py_start_method=start_method,
    )
    def pipeline() -> Any:
        data, label = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True)
        return data, label

    p = pipeline()
    p.build()
    return p


def run_epoch(p: Any) -> list[tuple[bytes, int]]:
    """Every sample of one epoch of an external-source pipeline, as (bytes, label)."""
    got: list[tuple[bytes, int]] = []
    try:
        while True:
            data, labels = p.run()
            for k in range(len(data)):
                label = np.array(labels[k])
                assert label.dtype == np.int32 and label.shape == (1,)
                got.append((np.array(data[k]).tobytes(), int(label[0])))
    except StopIteration:
        p.reset()
    return got


def batch_pipeline(source: Any, parallel: bool = False, start_method: str = "fork") -> Any:
    """The recommended feed: `KSpeedCallable.batch`, one call per batch with DALI's BatchInfo
    (in this process, or with parallel=True in DALI's workers)."""

    @dali.pipeline_def(
        batch_size=BATCH,
        num_threads=1,
        device_id=None,
        py_num_workers=2,
        py_start_method=start_method,
    )
    def pipeline() -> Any:
        data, label = fn.external_source(
            source=source.batch, num_outputs=2, batch=True, batch_info=True, parallel=parallel
        )
        return data, label

    p = pipeline()
    p.build()
    return p


def check_epochs(p: Any, source: KSpeedCallable, loaded: Path) -> None:
    """Two epochs of `p` give every sample of the callable's order, bytes and label."""
    ref = datasets.ImageFolder(str(loaded))
    orders = []
    for epoch in range(EPOCHS):
        got = run_epoch(p)
        assert len(got) == len(source) == 16  # 18 files: four full batches of 4
        order = [int(i) for i in source._order(epoch)[: len(got)]]
        for (data, label), index in zip(got, order, strict=True):
            path, target = ref.samples[index]
            assert data == Path(path).read_bytes() and label == target, path
        orders.append(order)
    assert orders[0] != orders[1]  # reshuffled per epoch


@pytest.mark.parametrize("local", [None, False], ids=["local", "over-the-network"])
def test_batch_external_source_over_kspeed_callable(
    node: NodeProcess, loaded: Path, local: bool | None
) -> None:
    source = KSpeedCallable(str(loaded), batch_size=BATCH, local=local, **kw(node))
    check_epochs(batch_pipeline(source), source, loaded)
    counts = source.folder.statistics()
    if local is False:  # one read per batch from the node, not a view of its memory
        assert counts.get("fetched", 0) == 2 * 16 and counts.get("local", 0) == 0, counts
    else:
        assert counts.get("local", 0) == 2 * 16 and counts.get("fetched", 0) == 0, counts


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_parallel_batch_external_source_over_kspeed_callable(
    node: NodeProcess, loaded: Path, start_method: str
) -> None:
    source = KSpeedCallable(str(loaded), batch_size=BATCH, **kw(node))
    check_epochs(batch_pipeline(source, parallel=True, start_method=start_method), source, loaded)


def test_a_batch_is_the_per_sample_calls_of_its_shard(node: NodeProcess, loaded: Path) -> None:
    # 18 files in 2 shards of 9: two full batches of 4 each, the same order per sample or batch.
    for shard in range(2):
        source = KSpeedCallable(str(loaded), 4, shard, 2, **kw(node))
        for epoch in range(EPOCHS):
            for it in range(2):
                data, labels = source.batch(BatchInfo(it, epoch))
                assert labels.dtype == np.int32 and labels.shape == (4, 1)
                for k in range(4):
                    one, label = source(SampleInfo(4 * it + k, k, it, epoch))
                    assert data[k].dtype == np.uint8 and data[k].tobytes() == one.tobytes()
                    assert labels[k].tolist() == label.tolist()
            with pytest.raises(StopIteration):
                source.batch(BatchInfo(2, epoch))


def test_a_batch_source_without_batch_info_is_refused(node: NodeProcess, loaded: Path) -> None:
    source = KSpeedCallable(str(loaded), batch_size=BATCH, **kw(node))
    with pytest.raises(InvalidArgument, match="pass batch_info=True"):
        source.batch(0)  # what DALI passes when batch_info is left out

    @dali.pipeline_def(batch_size=BATCH, num_threads=1, device_id=None)
    def pipeline() -> Any:
        return tuple(fn.external_source(source=source.batch, num_outputs=2, batch=True))

    p = pipeline()
    with pytest.raises(Exception, match="pass batch_info=True"):
        p.build()
        p.run()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_parallel_external_source_over_kspeed_callable(
    node: NodeProcess, loaded: Path, start_method: str
) -> None:
    source = KSpeedCallable(str(loaded), batch_size=BATCH, **kw(node))
    check_epochs(external_source_pipeline(source, start_method), source, loaded)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_folder_subclass_with_call_is_a_per_sample_source(
    node: NodeProcess, loaded: Path, start_method: str
) -> None:
    source = RecipeCallable(str(loaded), BATCH, **kw(node))
    assert source.dataset_name == "imgs"
    ref = datasets.ImageFolder(str(loaded))
    want = [(Path(path).read_bytes(), target) for path, target in ref.samples[:16]]
    p = external_source_pipeline(source, start_method)
    for _ in range(EPOCHS):
        assert run_epoch(p) == want


class KSpeedRecipeCallable(kspeed.KSpeedDataset):
    """The recipe's KSpeedCallable on `pytorch_ext.kspeed`: KSpeed's base call, `files`,
    `labels`, `dataset` attached in each DALI worker by `load()`."""

    def __init__(self, root: str, batch_size: int, kspeed_iplist: list[str]):
        super().__init__(root, None, 2, "CPU", 1, kspeed_iplist, "admin", "admin")
        self.full_iterations = len(self.files) // batch_size

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, np.ndarray]:
        if sample_info.iteration >= self.full_iterations:
            raise StopIteration
        if self.dataset is None:
            self.load()
        assert self.dataset is not None
        idx = sample_info.idx_in_epoch
        encoded = np.frombuffer(self.dataset.getBIN(self.files[idx]), dtype=np.uint8)
        return encoded, np.array([self.labels[idx]], dtype=np.int32)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_recipes_kspeed_callable_on_pytorch_ext_kspeed(
    node: NodeProcess, loaded: Path, start_method: str
) -> None:
    users.add_user(node.token_file.with_name("users"), "admin", "admin", "admin")
    source = KSpeedRecipeCallable(str(loaded), BATCH, [node.address])
    assert source.dataset is None  # attached in each worker, not pickled
    ref = datasets.ImageFolder(str(loaded))
    want = [(Path(path).read_bytes(), target) for path, target in ref.samples[:16]]
    p = external_source_pipeline(source, start_method)
    for _ in range(EPOCHS):
        assert run_epoch(p) == want


@pytest.mark.fuse
def test_dali_file_reader_over_a_mount(loaded: Path, mount_all: MountProcess) -> None:
    root = mount_all.mountpoint / "imgs" / "train"
    ref = datasets.ImageFolder(str(loaded))

    @dali.pipeline_def(batch_size=6, num_threads=1, device_id=None, seed=7)
    def pipeline() -> Any:
        jpegs, labels = fn.readers.file(
            file_root=str(root), shuffle_after_epoch=True, name="reader"
        )
        return jpegs, labels, fn.get_property(jpegs, key="source_info")

    p = pipeline()
    p.build()
    assert p.epoch_size("reader") == len(ref) == 18
    for _ in range(EPOCHS):
        seen = []
        for _batch in range(3):
            jpegs, labels, infos = p.run()
            for k in range(len(jpegs)):
                rel = Path(np.array(infos[k]).tobytes().decode())  # relative to file_root
                assert np.array(jpegs[k]).tobytes() == (loaded / rel).read_bytes(), rel
                assert int(np.array(labels[k])[0]) == ref.class_to_idx[rel.parts[0]], rel
                seen.append(rel)
        assert len(set(seen)) == 18  # each file once per epoch


@pytest.mark.parametrize("per_batch", [False, True], ids=["per-sample", "per-batch"])
def test_external_source_decodes_on_the_gpu(
    node: NodeProcess, loaded: Path, per_batch: bool
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (DALI's mixed decoder)")
    source = KSpeedCallable(str(loaded), batch_size=BATCH, shuffle=False, **kw(node))
    ref = datasets.ImageFolder(str(loaded))

    @dali.pipeline_def(
        batch_size=BATCH, num_threads=1, device_id=0, py_num_workers=2, py_start_method="spawn"
    )
    def pipeline() -> Any:
        if per_batch:
            data, label = fn.external_source(
                source=source.batch, num_outputs=2, batch=True, batch_info=True
            )
        else:
            data, label = fn.external_source(
                source=source, num_outputs=2, batch=False, parallel=True
            )
        return fn.decoders.image(data, device="mixed"), label

    p = pipeline()
    p.build()
    images, labels = p.run()
    for k in range(BATCH):
        pic, target = ref[k]
        assert images.as_cpu().at(k).shape == (pic.height, pic.width, 3)
        assert int(labels.at(k)[0]) == target
