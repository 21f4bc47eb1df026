"""KSpeedWebDataset against real nodes: the samples webdataset.WebDataset yields from the
source shards, in its order and in any order, decoded as its .decode() decodes them; the tar
indexes built at preload, on first use for a dataset cached without them, refused in one line
for a damaged shard; remote samples read ahead on a cluster."""

from __future__ import annotations

import os
import random
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset as wds
from clusterutil import Cluster, running
from conftest import NodeProcess, kw, preload
from torch.utils.data import DataLoader, DistributedSampler

from kspeedfs.format import metaindex
from kspeedfs.format.errors import DataError, InvalidArgument, NotFound
from kspeedfs.sample import make_shards
from pytorch_ext import ClairvoyantSampler, KSpeedWebDataset, MiniEpochSampler, PrioritySampler


@pytest.fixture
def small_node(token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    """A node with 16 KiB segments: samples straddle segments (and their shards' ends)."""
    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    n = NodeProcess(shm, token_file, tmp_path, segment_size="16KiB").start()
    yield n
    n.stop()
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """A folder of 3 shards of 9 samples (as keys go: 11 as WebDataset counts), and a file
    that is not a shard."""
    root = tmp_path / "wds" / "train"
    make_shards(root, shards=3, per_shard=9, file_size=5000)
    (root / "README").write_text("not a shard\n")
    return root


def reference(
    root: Path, decode: str | None = None, shards: list[Path] | None = None
) -> list[dict[str, Any]]:
    """What webdataset.WebDataset yields from the source shards (all, in name order)."""
    urls = [str(p) for p in (shards or sorted(root.glob("*.tar")))]
    ds = wds.WebDataset(urls, shardshuffle=False)
    if decode is not None:
        ds = ds.decode(decode)
    return [{k: v for k, v in s.items() if k != "__local_path__"} for s in ds]


def on_disk(node: NodeProcess, name: str) -> int:
    """What the dataset's folder holds: segments, manifest and indexes."""
    top = node.shm_dir / "datasets" / name
    files = [*(top / "seg").iterdir(), top / "manifest.ksm"]
    if (top / metaindex.INDEX_DIR).is_dir():
        files += (top / metaindex.INDEX_DIR).iterdir()
    return sum(p.stat().st_size for p in files)


def stored(node: NodeProcess, name: str) -> tuple[str, int]:
    (found,) = [d for d in node.request("list")["datasets"] if d["name"] == name]
    return str(found["uuid"]), int(found["stored"])


def index_files(node: NodeProcess, name: str) -> list[str]:
    folder = node.shm_dir / "datasets" / name / metaindex.INDEX_DIR
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def test_samples_equal_webdatasets_in_its_order_and_in_any(
    small_node: NodeProcess, shards: Path
) -> None:
    preload(small_node, shards.parent, "wds")
    assert len([f for f in index_files(small_node, "wds") if f.endswith(".kti")]) == 3
    ds = KSpeedWebDataset(str(shards), **kw(small_node))
    ref = reference(shards)
    assert len(ds) == len(ref) == 33
    assert ds.shards == [str(p) for p in sorted(shards.glob("*.tar"))]
    assert [ds[i] for i in range(len(ds))] == ref
    order = list(range(len(ds)))
    random.Random(4).shuffle(order)
    assert ds.__getitems__(order) == [ref[i] for i in order]
    assert [ds[i] for i in order[:5]] == [ref[i] for i in order[:5]]
    assert ds[-1] == ref[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    # Views: the node's shared memory itself where a member lies in one segment.
    views = KSpeedWebDataset(str(shards), views=True, **kw(small_node))
    sample = views[0]
    assert {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()} == ref[0]
    assert any(isinstance(v, memoryview) and v.readonly for v in sample.values())
    # A subset of shards, in the order given.
    some = KSpeedWebDataset(
        str(shards), shards=["shard-000002.tar", "shard-000000.tar"], **kw(small_node)
    )
    by_url = {u: [s for s in ref if s["__url__"] == u] for u in ds.shards}
    assert list(some) == by_url[ds.shards[2]] + by_url[ds.shards[0]]


def test_a_dataloader_with_workers_gives_every_sample_of_a_shuffled_epoch(
    small_node: NodeProcess, shards: Path
) -> None:
    preload(small_node, shards.parent, "wds")
    ds = KSpeedWebDataset(str(shards), **kw(small_node))
    ref = reference(shards)
    sampler = ClairvoyantSampler(ds, seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=list)
    got = [s for batch in loader for s in batch]
    assert got == [ref[i] for i in sampler]
    # Any sampler: a rank's share of DistributedSampler's shuffle, read on demand.
    share = DistributedSampler(ds, num_replicas=2, rank=1, seed=7)
    loader = DataLoader(ds, batch_size=5, sampler=share, num_workers=2, collate_fn=list)
    assert [s for batch in loader for s in batch] == [ref[i] for i in share]


@pytest.mark.parametrize("spec", ["pil", "tensor"])
def test_decoded_samples_equal_webdatasets_decode(
    small_node: NodeProcess, shards: Path, spec: str
) -> None:
    preload(small_node, shards.parent, "wds")
    ds = KSpeedWebDataset(str(shards), decode=spec, **kw(small_node))
    ref = reference(shards, decode="torchrgb8" if spec == "tensor" else spec)
    assert len(ds) == len(ref)
    for i in (0, 1, 5, len(ds) - 1):
        mine, theirs = ds[i], ref[i]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.uint8 and torch.equal(mine[key], value)
            else:
                assert mine[key] == value, key  # PIL images compare by mode, size and pixels
    assert isinstance(ds[0]["cls"], int) and isinstance(ds[0]["json"], dict)
    with pytest.raises(InvalidArgument, match="decode must be one of"):
        KSpeedWebDataset(str(shards), decode="jpeg2000", **kw(small_node))


def test_a_dataset_cached_without_tar_indexes_gets_them_on_first_use(
    small_node: NodeProcess, shards: Path
) -> None:
    preload(small_node, shards.parent, "wds")
    uuid_, before = stored(small_node, "wds")
    assert before == on_disk(small_node, "wds")  # the tar indexes counted in the instance
    for shard in sorted(shards.glob("*.tar")):
        # As if the preload came before tar indexes: each one dropped from the instance.
        meta = f"train/{shard.name}"
        small_node.request("meta_abort", name="wds", uuid=uuid_, meta=meta, add="0" * 16, drop=True)
    assert not [f for f in index_files(small_node, "wds") if f.endswith(".kti")]
    assert stored(small_node, "wds") == (uuid_, on_disk(small_node, "wds")) != (uuid_, before)
    ds = KSpeedWebDataset(str(shards), **kw(small_node))
    assert [ds[i] for i in range(len(ds))] == reference(shards)
    assert len([f for f in index_files(small_node, "wds") if f.endswith(".kti")]) == 3
    assert stored(small_node, "wds") == (uuid_, before) == (uuid_, on_disk(small_node, "wds"))


def test_a_damaged_shard_is_left_out_at_preload_and_refused_in_one_line(
    small_node: NodeProcess, shards: Path
) -> None:
    good = sorted(shards.glob("*.tar"))
    raw = bytearray(good[1].read_bytes())
    raw[512 * 30 + 148] ^= 0x11  # a header's checksum, well inside the tar
    bad = shards / "shard-000009.tar"
    bad.write_bytes(raw[: len(raw) // 2])
    preload(small_node, shards.parent, "wds")  # the dataset loads; the shard has no index
    assert len([f for f in index_files(small_node, "wds") if f.endswith(".kti")]) == 3
    before = index_files(small_node, "wds")
    with pytest.raises(DataError) as e:
        KSpeedWebDataset(str(shards), **kw(small_node))
    assert "shard-000009.tar" in str(e.value) and "\n" not in str(e.value)
    assert index_files(small_node, "wds") == before  # nothing stored
    # The good shards are still served.
    ok = KSpeedWebDataset(str(shards), shards=[p.name for p in good], **kw(small_node))
    assert [ok[i] for i in range(len(ok))] == reference(shards, shards=good)
    with pytest.raises(NotFound, match="no shard"):
        KSpeedWebDataset(str(shards), shards=["shard-000077.tar"], **kw(small_node))


def priority(ds: KSpeedWebDataset) -> PrioritySampler:
    return PrioritySampler(ds, np.arange(1, len(ds) + 1, dtype=np.float64), seed=2, depth=2)


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: ClairvoyantSampler(ds, seed=1, depth=2),
        lambda ds: MiniEpochSampler(ds, mini_epochs=3, seed=1, depth=2),
        priority,
    ],
    ids=["clairvoyant", "mini-epoch", "priority"],
)
def test_on_a_three_node_cluster_remote_samples_are_read_ahead(
    token_file: Path, tmp_path: Path, shards: Path, make: Any
) -> None:
    ref = reference(shards)
    with running(Cluster(token_file, tmp_path, size=3, segment_size="16KiB")) as c:
        c.preload(shards.parent, "wds", replicas=2)
        ds = KSpeedWebDataset(str(shards), nodes=c.addresses, token=str(token_file), local=False)
        assert [ds[i] for i in range(len(ds))] == ref  # every byte over the network
        sampler = make(ds)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            before = ds.statistics()
            got = [
                s for b in DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=list) for s in b
            ]
            order = list(sampler)
            assert got == [ref[i] for i in order]
            after = ds.statistics()
            distinct = sum(len(set(order[k : k + 4])) for k in range(0, len(order), 4))
            assert after.get("prefetched", 0) - before.get("prefetched", 0) == distinct
            assert after.get("fetched", 0) == before.get("fetched", 0)  # none on demand
        # A node down: its samples come from the replicas.
        c.nodes[1].stop()
        assert ds.__getitems__(list(range(0, len(ds), 2))) == ref[::2]


def _pixels(image: Any) -> np.ndarray:
    """timm's transform in these tests: the decoded image's pixels (picklable, comparable)."""
    return np.array(image)


def timm_samples(root: str, split: str, workers: int = 0) -> list[tuple[bytes, int]]:
    """(pixels, target) of every sample timm's `wds/` reader yields from `root` (eval mode:
    every shard once, in the split's order per DataLoader worker)."""
    from timm.data import create_dataset

    ds = create_dataset("wds/test", root=root, split=split, is_training=False, transform=_pixels)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return [(np.asarray(image).tobytes(), int(target)) for image, target in loader]


def test_timms_wds_reader_over_kspeedfs_urls_gives_the_shards_samples(
    small_node: NodeProcess, shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """timm's `wds/` reader opens its info file and its shards with webdataset's gopen: over
    `kspeedfs://` (kspeedfs.stacks' handler) it yields the samples it yields from the shards
    on disk, by the info file's split and by a brace-expanded one, in the main process and
    in DataLoader workers."""
    import json

    from kspeedfs.stacks import gopen
    from kspeedfs.stacks.filesystem import KSpeedFileSystem

    tars = sorted(p.name for p in shards.glob("*.tar"))
    split = {"name": "train", "num_samples": 27, "filenames": tars, "shard_lengths": [9, 9, 9]}
    (shards / "_info.json").write_text(json.dumps({"name": "test", "splits": {"train": split}}))
    preload(small_node, shards.parent, "wds")
    monkeypatch.setenv("KSPEEDFS_NODES", small_node.address)  # gopen's filesystem: defaults
    monkeypatch.setenv("KSPEEDFS_TOKEN_FILE", str(small_node.token_file))
    KSpeedFileSystem.clear_instance_cache()
    # kspeedfs.stacks registers its scheme when webdataset.gopen is imported (webdataset's
    # package attribute `gopen` is the function: the module is in sys.modules).
    assert sys.modules["webdataset.gopen"].gopen_schemes["kspeedfs"] is gopen.gopen_kspeedfs
    url = "kspeedfs://wds/train"
    want = timm_samples(str(shards), "train")
    # 33 WebDataset samples; the 6 a key that comes back makes lack a .cls: timm drops them.
    assert len(want) == len(set(want)) == 27  # 8 base images x 10 classes: told apart
    assert timm_samples(url, "train") == want
    brace = "shard-{000002..000002}.tar"
    assert timm_samples(url, brace) == timm_samples(str(shards), brace) == want[18:]
    # Workers: each reads its share of the shards through its own (forked) filesystem.
    assert sorted(timm_samples(url, "train", workers=2)) == sorted(want)
    with pytest.raises(FileNotFoundError):
        wds.gopen("kspeedfs://wds/train/no-such.json")
    KSpeedFileSystem.clear_instance_cache()
