"""Decoded variants on a node: `preload --decoded N` fills them pixel-identical to
`Resize(N)(pil_loader(path))`, the budget refuses one that does not fit, unload removes them, a
node killed mid-fill leaves no variant and no process behind."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import NodeProcess, run_cli, wait_for
from decoded_images import _noise, make_images
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import Resize

from kspeedfs.format import decoded as fmt
from kspeedfs.format.manifest import Manifest

pytestmark = pytest.mark.slow  # image folders decoded on a node


@pytest.fixture
def images(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "images"
    return root, make_images(root)


def expected(path: Path, size: int) -> np.ndarray:
    img = pil_loader(str(path))
    if size:
        img = Resize(size)(img)
    return np.asarray(img)


def check_variant(
    node: NodeProcess, name: str, src: Path, kinds: dict[str, str], size: int
) -> None:
    folder = node.shm_dir / "datasets" / name
    m = Manifest(folder / "manifest.ksm")
    variant = fmt.DecodedVariant(folder / fmt.variant_dir(size), m.uuid)
    assert variant.index.complete
    for rel, kind in kinds.items():
        e = m.resolve(rel)
        state = variant.state(e)
        if kind == "text":
            assert state == fmt.NOT_HERE, rel
        elif kind == "corrupt":
            assert state == fmt.UNDECODABLE, rel
        else:
            assert state == fmt.READY, rel
            data, h, w = variant.pixels(e)
            got = np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3)
            want = expected(src / rel, size)
            assert got.shape == want.shape, rel
            assert np.array_equal(got, want), rel


@pytest.mark.parametrize("size", [0, 64])
def test_preload_decoded_is_pixel_identical(
    node: NodeProcess, images: tuple[Path, dict[str, str]], size: int
) -> None:
    src, kinds = images
    r = run_cli("preload", str(src), "--name", "imgs", "--decoded", str(size), "-q", env=node.env())
    assert r.returncode == 0, r.stderr
    assert f"imgs@{size}: {size}: 100%" in r.stdout
    assert "1 undecodable" in r.stdout
    check_variant(node, "imgs", src, kinds, size)
    listing = run_cli("ls", env=node.env())
    assert f"{size}: 100%" in listing.stdout
    status = run_cli("status", env=node.env())
    assert f"imgs@{size}" in status.stdout


def test_variant_counted_kept_over_restart_and_unloaded(
    node: NodeProcess, images: tuple[Path, dict[str, str]]
) -> None:
    src, kinds = images
    assert run_cli("preload", str(src), "--name", "imgs", "-q", env=node.env()).returncode == 0
    before = node.request("status")["used"]
    r = run_cli("preload", str(src), "--name", "imgs2", "--decoded", "32", "-q", env=node.env())
    assert r.returncode == 0, r.stderr
    # the variant of a second instance: a dataset and its variant in the budget
    variant = node.shm_dir / "datasets" / "imgs2" / fmt.variant_dir(32)
    variant_bytes = sum(p.stat().st_size for p in variant.rglob("*") if p.is_file())
    used = node.request("status")["used"]
    assert used >= 2 * before - 4096 + variant_bytes - 4096
    node.stop()
    node.start()
    assert node.request("status")["used"] == used  # found again, counted again
    check_variant(node, "imgs2", src, kinds, 32)
    assert run_cli("unload", "imgs2", env=node.env()).returncode == 0
    assert not variant.exists()
    assert node.request("status")["used"] == before


def test_budget_refuses_a_variant_before_decoding(
    shm_dir: Path, token_file: Path, tmp_path: Path, images: tuple[Path, dict[str, str]]
) -> None:
    src, _kinds = images
    node = NodeProcess(shm_dir, token_file, tmp_path, memory="1MiB").start()
    try:
        r = run_cli("preload", str(src), "--name", "imgs", "--decoded", "0", "-q", env=node.env())
        assert r.returncode != 0
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and "budget" in err[0], r.stderr
        assert not (shm_dir / "datasets" / "imgs" / fmt.variant_dir(0)).exists()
        assert "decoding" not in node.log()  # refused before any decoding
        assert node.request("status")["used"] < 1 << 20
    finally:
        node.stop()


def descendants(pid: int) -> set[int]:
    """Every process under `pid` (the fill's forkserver and pool workers under a node)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def one_decoder_node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    """A node that fills variants with one decode process (setting `decode_workers`)."""
    env = {**os.environ, "KSPEEDFS_DECODE_WORKERS": "1"}
    n = NodeProcess(shm_dir, token_file, tmp_path, base_env=env).start()
    yield n
    n.stop()


def test_node_killed_mid_fill_leaves_the_variant_complete_or_absent(
    one_decoder_node: NodeProcess, tmp_path: Path
) -> None:
    # 80 full-size decodes of ~2 Mpx noise in one process: the fill takes seconds on any
    # machine, so the kill lands mid-fill.
    node = one_decoder_node
    src = tmp_path / "big"
    for i in range(8):
        _noise(1600, 1200, "RGB", i).save(tmp_path / f"{i}.jpg", "JPEG", quality=90)
    for i in range(80):
        folder = src / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / f"{i % 8}.jpg", folder / f"{i:03d}.jpg")
    assert run_cli("preload", str(src), "--name", "big", "-q", env=node.env()).returncode == 0
    used = node.request("status")["used"]
    variant = node.shm_dir / "datasets" / "big" / fmt.variant_dir(0)
    node.request("decode", name="big", size=0)

    def filling() -> bool:
        v = node.request("decode_status", name="big")["variants"]["0"]
        assert v["state"] != "ready", "the fill ended before the node could be killed"
        return bool(v["files_done"])

    wait_for(filling, what="the fill under way")
    assert node.proc is not None
    workers = descendants(node.proc.pid)
    assert workers  # the forkserver and the pool's workers
    forked = [p for p in workers if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(forked) == 2  # the forkserver and the one worker `decode_workers` allows
    node.proc.kill()
    node.proc.wait()
    assert not fmt.VariantIndex(variant / fmt.INDEX_FILE).complete  # killed mid-fill
    wait_for(lambda: not any(alive(p) for p in workers), what="the fill's processes to end")
    node.start()  # the incomplete variant is removed, its budget not counted
    assert not variant.exists()
    assert node.request("status")["used"] == used
    assert node.request("decode_status", name="big")["variants"] == {}
    assert "removing decoded variant big/decoded-0" in node.log()
