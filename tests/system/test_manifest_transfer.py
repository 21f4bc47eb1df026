"""The manifest travels in pieces (it outgrows one frame), and a remote reader can use it."""

from __future__ import annotations

from pathlib import Path

from conftest import NodeProcess, make_tree, run_cli

from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import load_settings
from kspeedfs.format.contract.pieces import BlobPiece


def test_manifest_fetched_in_pieces_equals_the_file(node: NodeProcess, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    assert run_cli("preload", str(src), "--name", "pieces", "-q", env=node.env()).returncode == 0
    expected = (node.shm_dir / "datasets" / "pieces" / "manifest.ksm").read_bytes()
    got = b""
    with node.client() as c:
        while True:
            reply = c.request("manifest", name="pieces", offset=len(got), length=1000)
            piece = BlobPiece.from_wire(reply["piece"])
            assert piece.total == len(expected) and piece.offset == len(got)
            assert piece.size <= 1000
            got += piece.raw
            if not piece.size or len(got) >= piece.total:
                break
    assert got == expected


def test_reader_without_local_copy_reads_every_file(node: NodeProcess, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    assert run_cli("preload", str(src), "--name", "remote", "-q", env=node.env()).returncode == 0
    settings = load_settings({"nodes": node.address, "token_file": str(node.token_file)}, env={})
    reader = ClusterReader(settings, local_node=None)  # no local node: manifest over TCP
    ds = reader.open_dataset("remote")
    assert ds.local is None
    for i in ds.manifest.iter_files():
        rel = ds.manifest.path(i)
        size = int(ds.manifest.size[i])
        assert (
            reader.read(ds, i, 0, size)
            == (src / rel.decode("utf-8", "surrogateescape")).read_bytes()
        )
    assert reader.stats["remote"] > 0 and reader.stats["source"] == 0
    reader.close()
