"""KSpeedMetaDataset over a real node: `--meta` at preload, the same samples, targets and images
as a reference Dataset that parses the meta file, bad lines by number, active loads."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NodeProcess, run_cli
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from kspeedfs.client import admin
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.sample import make_sample
from pytorch_ext import KSpeedMetaDataset

pytestmark = pytest.mark.slow  # a large meta file indexed, DataLoader workers

FIXED = transforms.Compose(
    [transforms.Resize(40), transforms.CenterCrop(32), transforms.ToTensor()]
)


class ReferenceMeta(Dataset[tuple[Any, Any]]):
    """What users write today: the meta parsed into a list, images opened from the source."""

    def __init__(self, root: Path, meta: str, parse: Callable[[bytes], tuple[str, Any]]):
        self.root = root
        lines = (root / meta).read_bytes().split(b"\n")
        self.samples = [parse(line) for line in lines if line.strip()]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        rel, target = self.samples[i]
        with Image.open(self.root / rel) as img:
            return FIXED(img.convert("RGB")), target


def parse_text(line: bytes) -> tuple[str, int]:
    path, target = line.split()
    return path.decode(), int(target)


def parse_json(line: bytes) -> tuple[str, str]:
    obj = json.loads(line)
    return obj["filename"], obj["label"]


def parse_csv(line: bytes) -> tuple[str, int]:
    """A format the node does not know: `label;caption;path`."""
    label, _caption, path = line.decode().split(";")
    return path, int(label)


def kw(node: NodeProcess) -> dict[str, str]:
    return {"nodes": node.address, "token": str(node.token_file)}


def settings(node: NodeProcess) -> Any:
    return load_settings({"nodes": node.address, "token_file": str(node.token_file)})


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """Images in class folders and three meta files over them (text, JSON lines, custom)."""
    root = tmp_path / "big"
    make_sample(root / "train", classes=3, per_class=5, file_size=3000, bases=3)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.JPEG"))
    order = files[::-1] + files[:4]  # any order, repeats allowed
    (root / "train.txt").write_text("".join(f"{f} {i % 5}\n" for i, f in enumerate(order)))
    names = ["cat", "dog", "emu"]
    jl = [json.dumps({"filename": f, "label": names[i % 3], "id": i}) for i, f in enumerate(order)]
    (root / "train.jsonl").write_text("\n".join(jl) + "\n")
    (root / "custom.csv").write_text(
        "".join(f"{i % 7};a caption;{f}\n" for i, f in enumerate(order))
    )
    return root


@pytest.fixture
def loaded(node: NodeProcess, big: Path) -> Path:
    done = run_cli(
        "preload",
        str(big),
        "--name",
        "big",
        "--meta",
        "train.txt",
        "--meta",
        "./train.jsonl",
        "--meta",
        "custom.csv",
        "-q",
        env=node.env(),
    )
    assert done.returncode == 0, done.stderr
    return big


def same_items(ds: Dataset[Any], ref: ReferenceMeta) -> None:
    assert len(ds) == len(ref)  # type: ignore[arg-type]
    for i in range(len(ref)):
        a, ta = ref[i]
        b, tb = ds[i]
        assert ta == tb, i
        assert torch.equal(a, b), f"image {i} differs"


def test_text_meta_same_samples_targets_and_images(node: NodeProcess, loaded: Path) -> None:
    ref = ReferenceMeta(loaded, "train.txt", parse_text)
    ds = KSpeedMetaDataset(loaded, "train.txt", transform=FIXED, **kw(node))
    same_items(ds, ref)
    assert list(ds.targets) == [t for _, t in ref.samples]
    assert list(ds.samples) == [(os.path.join(loaded, p), t) for p, t in ref.samples]
    assert ds.samples[3] == (os.path.join(loaded, ref.samples[3][0]), ref.samples[3][1])
    assert ds.line(0) == (loaded / "train.txt").read_bytes().split(b"\n")[0]
    got = ds.__getitems__([5, 0, 5])
    assert [t for _, t in got] == [ref.samples[5][1], ref.samples[0][1], ref.samples[5][1]]


def test_json_lines_string_targets(node: NodeProcess, loaded: Path) -> None:
    ref = ReferenceMeta(loaded, "train.jsonl", parse_json)
    ds = KSpeedMetaDataset(loaded, "train.jsonl", transform=FIXED, **kw(node))
    same_items(ds, ref)
    assert ds.classes == ["cat", "dog", "emu"]
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "emu": 2}
    assert list(ds.targets) == [t for _, t in ref.samples]


def test_custom_parse_on_a_format_the_node_does_not_know(node: NodeProcess, loaded: Path) -> None:
    ref = ReferenceMeta(loaded, "custom.csv", parse_csv)
    ds = KSpeedMetaDataset(loaded, "custom.csv", transform=FIXED, parse=parse_csv, **kw(node))
    same_items(ds, ref)
    # A parser also works on a meta the node parsed itself, and with decode="tensor".
    tensors = KSpeedMetaDataset(
        loaded, "train.jsonl", parse=parse_json, decode="tensor", **kw(node)
    )
    img, target = tensors[2]
    assert img.dtype == torch.uint8 and img.shape[0] == 3
    assert target == parse_json((loaded / "train.jsonl").read_bytes().split(b"\n")[2])[1]
    with pytest.raises(InvalidArgument, match="custom.csv"):
        # custom.csv is not in the node's format: refused with its line numbers
        KSpeedMetaDataset(loaded, "custom.csv", **kw(node))


def test_dataloader_workers_and_pickling(node: NodeProcess, loaded: Path) -> None:
    ds = KSpeedMetaDataset(loaded, "train.txt", transform=FIXED, **kw(node))
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 4096  # config, not samples
    assert clone[1][1] == ds[1][1]
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    targets = [int(t) for _, ts in loader for t in ts]
    assert targets == list(ds.targets)


def write_bad_meta(root: Path) -> list[str]:
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.JPEG"))
    lines = [
        f"{files[0]} 0",
        "just-one-field",
        f"{files[1]} 1",
        "",
        "nope/missing.jpg 2",
        f"{files[2]} 2",
    ]
    (root / "bad.txt").write_text("\n".join(lines) + "\n")
    return files


def test_bad_lines_and_missing_files_by_line_number(node: NodeProcess, big: Path) -> None:
    files = write_bad_meta(big)
    admin.preload(settings(node), str(big), "big", show_progress=False, meta=["bad.txt"])
    with pytest.raises(InvalidArgument) as err:
        KSpeedMetaDataset(big, "bad.txt", **kw(node))
    assert "line 2: expected PATH TARGET" in str(err.value)
    assert "line 5: no file nope/missing.jpg" in str(err.value)
    lenient = KSpeedMetaDataset(big, "bad.txt", strict=False, **kw(node))
    assert [(os.path.relpath(p, big), t) for p, t in lenient.samples] == [
        (files[0], 0),
        (files[1], 1),
        (files[2], 2),
    ]
    # With a parser, a bad line is found when asked for (strict) or skipped in one pass.
    parsed = KSpeedMetaDataset(big, "bad.txt", parse=parse_text, **kw(node))
    assert len(parsed) == 5  # the blank line is never a sample
    assert parsed[0][1] == 0
    with pytest.raises(InvalidArgument, match="bad.txt line 2: parse failed"):
        parsed[1]
    with pytest.raises(NotFound, match="bad.txt line 5: no file nope/missing.jpg"):
        parsed[3]
    skipping = KSpeedMetaDataset(big, "bad.txt", parse=parse_text, strict=False, **kw(node))
    assert list(skipping.targets) == [0, 1, 2]


def test_preload_refuses_a_meta_file_not_in_the_source(node: NodeProcess, big: Path) -> None:
    done = run_cli("preload", str(big), "--name", "big", "--meta", "nope.txt", "-q", env=node.env())
    assert done.returncode != 0
    assert "meta file nope.txt is not a file in the source" in done.stderr
    done = run_cli("preload", str(big), "--name", "big", "--meta", "../x", "-q", env=node.env())
    assert done.returncode != 0 and "inside the dataset" in done.stderr
    with admin.connect(settings(node)) as client:
        assert client.request("list")["datasets"] == []


def test_index_lives_in_the_dataset_and_goes_with_it(node: NodeProcess, loaded: Path) -> None:
    folder = node.shm_dir / "datasets" / "big"
    indexes = sorted((folder / "meta").iterdir())
    assert len(indexes) == 3
    with admin.connect(settings(node)) as client:
        (record,) = client.request("list")["datasets"]
        segs = sum(p.stat().st_size for p in (folder / "seg").iterdir())
        manifest = (folder / "manifest.ksm").stat().st_size
        assert record["stored"] == segs + manifest + sum(p.stat().st_size for p in indexes)
        # A job on a machine without the dataset's folder gets the index from the node.
        remote = KSpeedMetaDataset(loaded, "train.txt", local=False, **kw(node))
        assert list(remote.targets) == list(
            KSpeedMetaDataset(loaded, "train.txt", **kw(node)).targets
        )
        client.request("unload", name="big")
    assert not folder.exists()
    # Loaded again without --meta: the first dataset over it has the node index it.
    admin.preload(settings(node), str(loaded), "big", show_progress=False)
    assert not (folder / "meta").exists()
    again = KSpeedMetaDataset(loaded, "train.txt", **kw(node))
    assert list(again.targets) == [
        t for _, t in ReferenceMeta(loaded, "train.txt", parse_text).samples
    ]
    assert len(list((folder / "meta").iterdir())) == 1


def test_active_load_indexes_the_meta_file(node: NodeProcess, big: Path) -> None:
    ds = KSpeedMetaDataset(big, "train.txt", transform=FIXED, **kw(node))
    ref = ReferenceMeta(big, "train.txt", parse_text)
    assert list(ds.targets) == [t for _, t in ref.samples]
    with admin.connect(settings(node)) as client:
        (record,) = client.request("list")["datasets"]
    assert record["lifetime"] == "leased"
    assert (Path(record["path"]) / "meta").is_dir()


def test_root_must_be_the_dataset_root(node: NodeProcess, loaded: Path) -> None:
    with pytest.raises(InvalidArgument, match="not its root"):
        KSpeedMetaDataset(loaded / "train", "labels.txt", objname="big", **kw(node))
