"""Meta indexes added to a dataset cached without them (`kspeedfs meta add`, or a job's first
use): the same index as `preload --meta` builds, refusals that change nothing, counted in the
instance, gone with the unload, kept over a restart, tied to the instance, one index for two
requests, on every member of a 3-node cluster."""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from clusterutil import Cluster, running
from conftest import NodeProcess, run_cli

from kspeedfs.format import auth, metaindex
from kspeedfs.format.contract.metaindexes import MAX_INDEX_BYTES
from kspeedfs.format.errors import AuthError, InvalidArgument, KSpeedError, StaleDataset
from kspeedfs.format.metaindex import MetaIndex
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.sample import make_sample
from pytorch_ext import KSpeedMetaDataset

pytestmark = pytest.mark.slow  # a large meta file indexed, a 3-node cluster


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """Images in class folders, a text meta file and a JSON-lines one (string targets)."""
    root = tmp_path / "big"
    make_sample(root / "train", classes=3, per_class=5, file_size=3000, bases=3)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.JPEG"))
    order = files[::-1] + files[:4]
    (root / "train.txt").write_text("".join(f"{f} {i % 5}\n" for i, f in enumerate(order)))
    names = ["cat", "dog", "emu"]
    (root / "train.jsonl").write_text(
        "".join(f'{{"filename": "{f}", "label": "{names[i % 3]}"}}\n' for i, f in enumerate(order))
    )
    return root


def preload(node: NodeProcess, root: Path, name: str, *meta: str) -> None:
    args = [a for m in meta for a in ("--meta", m)]
    done = run_cli("preload", str(root), "--name", name, *args, "-q", env=node.env())
    assert done.returncode == 0, done.stderr


def meta_add(node: NodeProcess, name: str, *meta: str, env: dict[str, str] | None = None) -> Any:
    return run_cli("meta", "add", name, *meta, env=env or node.env())


def folder(node: NodeProcess, name: str) -> Path:
    return node.shm_dir / "datasets" / name


def meta_files(node: NodeProcess, name: str) -> list[str]:
    path = folder(node, name) / metaindex.INDEX_DIR
    return sorted(os.listdir(path)) if path.is_dir() else []


def on_disk(node: NodeProcess, name: str) -> int:
    """What the dataset's folder holds: segments, manifest and indexes."""
    top = folder(node, name)
    files = [*(top / "seg").iterdir(), top / "manifest.ksm"]
    if (top / metaindex.INDEX_DIR).is_dir():
        files += (top / metaindex.INDEX_DIR).iterdir()
    return sum(p.stat().st_size for p in files)


def record(node: NodeProcess, name: str) -> dict[str, Any]:
    (found,) = [d for d in node.request("list")["datasets"] if d["name"] == name]
    return found


def kw(node: NodeProcess, token: Path | None = None) -> dict[str, str]:
    return {"nodes": node.address, "token": str(token or node.token_file)}


def same_dataset(a: KSpeedMetaDataset, b: KSpeedMetaDataset) -> None:
    assert len(a) == len(b) > 0
    assert list(a.samples) == list(b.samples)
    assert list(a.targets) == list(b.targets)
    assert a.classes == b.classes
    for i in range(len(a)):
        assert torch.equal(a[i][0], b[i][0]), i


def test_added_index_is_the_one_preload_builds(node: NodeProcess, big: Path) -> None:
    preload(node, big, "indexed", "train.txt", "train.jsonl")
    preload(node, big, "plain")
    assert meta_files(node, "plain") == []
    done = meta_add(node, "plain", "train.txt", "./train.jsonl")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.rsplit(", ", 1)[0] for line in lines] == [
        "plain: train.txt indexed, 19 samples in 19 lines",
        "plain: train.jsonl indexed, 19 samples in 19 lines",
    ]
    assert meta_files(node, "plain") == meta_files(node, "indexed")
    for meta in ("train.txt", "train.jsonl"):
        kwargs: dict[str, Any] = {"decode": "tensor", **kw(node)}
        same_dataset(
            KSpeedMetaDataset(big, meta, objname="plain", **kwargs),
            KSpeedMetaDataset(big, meta, objname="indexed", **kwargs),
        )
        added = MetaIndex(folder(node, "plain") / metaindex.index_file(meta))
        built = MetaIndex(folder(node, "indexed") / metaindex.index_file(meta))
        assert added.uuid == record(node, "plain")["uuid"]
        drop = {"name", "uuid"}
        assert {k: v for k, v in added.header.items() if k not in drop} == {
            k: v for k, v in built.header.items() if k not in drop
        }
    # Counted in the instance; asked again, it is left as it is.
    assert record(node, "plain")["stored"] == on_disk(node, "plain")
    used = node.request("status")["used"]
    again = meta_add(node, "plain", "train.txt")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("plain: train.txt already indexed, 19 samples")
    assert node.request("status")["used"] == used


def test_first_use_by_a_job_indexes_it(node: NodeProcess, big: Path) -> None:
    preload(node, big, "plain")
    used = node.request("status")["used"]
    ds = KSpeedMetaDataset(big, "train.jsonl", **kw(node))
    assert ds.classes == ["cat", "dog", "emu"]
    lines = (big / "train.jsonl").read_text().splitlines()
    assert list(ds.targets) == [["cat", "dog", "emu"][i % 3] for i in range(len(lines))]
    assert meta_files(node, "plain") == [metaindex.index_file("train.jsonl").split("/")[1]]
    assert node.request("status")["used"] == used + os.path.getsize(
        folder(node, "plain") / metaindex.index_file("train.jsonl")
    )
    # A process that maps nothing gets it from the node, the index now there.
    remote = KSpeedMetaDataset(big, "train.jsonl", local=False, **kw(node))
    assert list(remote.targets) == list(ds.targets)


@pytest.fixture
def small_node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Any:
    n = NodeProcess(shm_dir, token_file, tmp_path, memory="4MiB").start()
    yield n
    n.stop()


def test_refusals_change_nothing(small_node: NodeProcess, big: Path) -> None:
    node = small_node
    files = sorted(str(p.relative_to(big)) for p in big.rglob("*.JPEG"))
    # ~1.5 MB of short lines: its index needs over twice that, more than the budget has left.
    (big / "huge.txt").write_text("".join(f"{files[i % 15]} 1\n" for i in range(50_000)))
    preload(node, big, "plain")
    used = node.request("status")["used"]
    cases = [  # (meta files, exit code, message): InvalidArgument 5, NoSpace 7
        (("../x",), 5, "must be a path inside the dataset"),
        (("/",), 5, "must be a path inside the dataset"),
        (("nope.txt",), 5, "meta file nope.txt is not a file in dataset plain"),
        (("train",), 5, "meta file train is not a file in dataset plain"),
        (("train.txt", "nope.txt"), 5, "meta file nope.txt is not a file in dataset plain"),
        (("huge.txt",), 7, "the index of huge.txt needs "),
    ]
    for meta, code, message in cases:
        done = meta_add(node, "plain", *meta)
        assert done.returncode == code, (meta, done.stderr)
        assert done.stdout == ""
        assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
        assert message in done.stderr, done.stderr
        assert node.request("status")["used"] == used, meta
        assert meta_files(node, "plain") == [], meta
        assert os.listdir(node.shm_dir / "staging") == []
    done = meta_add(node, "nope", "train.txt")
    assert done.returncode != 0 and "no dataset named 'nope'" in done.stderr
    # The refused reservation was given back: a meta file that fits is indexed.
    assert meta_add(node, "plain", "train.txt").returncode == 0
    assert record(node, "plain")["stored"] == on_disk(node, "plain")


def test_unload_removes_it_and_restart_keeps_it(node: NodeProcess, big: Path) -> None:
    preload(node, big, "plain")
    assert meta_add(node, "plain", "train.txt").returncode == 0
    before = record(node, "plain")
    used = node.request("status")["used"]
    node.stop()
    # A node stopped in the middle of an add leaves its temporary file: dropped at start.
    leftover = folder(node, "plain") / metaindex.INDEX_DIR / "0123.kmi.0123456789abcdef.tmp"
    leftover.write_bytes(b"partial")
    node.start()
    assert not leftover.exists()
    assert record(node, "plain")["stored"] == before["stored"] == on_disk(node, "plain")
    assert node.request("status")["used"] == used
    assert len(KSpeedMetaDataset(big, "train.txt", **kw(node))) == 19
    assert run_cli("unload", "plain", env=node.env()).returncode == 0
    assert not folder(node, "plain").exists()
    assert node.request("status")["used"] == 0


def test_a_gone_or_replaced_instance_is_refused(node: NodeProcess, big: Path) -> None:
    preload(node, big, "plain")
    first = record(node, "plain")["uuid"]
    assert run_cli("unload", "plain", env=node.env()).returncode == 0
    preload(node, big, "plain")
    with pytest.raises(StaleDataset, match="instance asked for is gone"):
        node.request("meta_add", name="plain", uuid=first, meta=["train.txt"])
    assert meta_files(node, "plain") == []
    second = record(node, "plain")["uuid"]
    assert run_cli("unload", "plain", env=node.env()).returncode == 0
    with pytest.raises(StaleDataset, match="instance asked for is gone"):
        node.request("meta_add", name="plain", uuid=second, meta=["train.txt"])
    assert node.request("status")["used"] == 0


def test_a_job_token_may_add_an_index_a_read_token_may_not(
    node: NodeProcess, big: Path, tmp_path: Path
) -> None:
    preload(node, big, "plain")
    admin_token = auth.read_token(node.token_file)
    tokens = {}
    for role in ("job", "read"):
        tokens[role] = tmp_path / f"{role}.token"
        auth.write_token(tokens[role], auth.derive_token(admin_token, role))
    with NodeClient(Address("127.0.0.1", node.port), tokens["read"], timeout=10) as c:
        with pytest.raises(AuthError, match="meta_add needs the job role"):
            c.request("meta_add", name="plain", meta=["train.txt"])
    with pytest.raises(AuthError, match="indexing it needs a job token"):
        KSpeedMetaDataset(big, "train.txt", **kw(node, tokens["read"]))
    assert meta_files(node, "plain") == []
    done = meta_add(
        node, "plain", "train.txt", env={**node.env(), "KSPEEDFS_TOKEN_FILE": str(tokens["job"])}
    )
    assert done.returncode == 0, done.stderr
    # Now indexed, a read token maps it.
    assert len(KSpeedMetaDataset(big, "train.txt", **kw(node, tokens["read"]))) == 19


def concurrently(calls: list[tuple[NodeProcess, str]], name: str) -> list[str]:
    """meta_add of each (node, meta) at once; the states the replies give."""
    states: list[str] = []
    errors: list[KSpeedError] = []

    def one(n: NodeProcess, meta: str) -> None:
        try:
            reply = n.request("meta_add", name=name, meta=[meta])
            states.extend(i["state"] for i in reply["indexes"])
        except KSpeedError as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return sorted(states)


def test_two_requests_end_with_one_index(node: NodeProcess, big: Path) -> None:
    files = sorted(str(p.relative_to(big)) for p in big.rglob("*.JPEG"))
    (big / "long.txt").write_text("".join(f"{files[i % 15]} {i % 7}\n" for i in range(100_000)))
    preload(node, big, "plain")
    assert concurrently([(node, "long.txt"), (node, "long.txt")], "plain") == ["added", "present"]
    assert meta_files(node, "plain") == [metaindex.index_file("long.txt").split("/")[1]]
    assert record(node, "plain")["stored"] == on_disk(node, "plain")


def test_every_member_of_a_cluster_gets_it(token_file: Path, tmp_path: Path, big: Path) -> None:
    files = sorted(str(p.relative_to(big)) for p in big.rglob("*.JPEG"))
    (big / "long.txt").write_text("".join(f"{files[i % 15]} {i % 7}\n" for i in range(50_000)))
    with running(Cluster(token_file, tmp_path, segment_size="16KiB")) as c:
        c.preload(big, "plain")
        held = [bool(os.listdir(folder(n, "plain") / "seg")) for n in c.nodes]
        assert sum(held) >= 2  # spread over the nodes
        # Asked through two nodes at once (neither of them the one that builds): one index.
        requests = [(c.nodes[1], "long.txt"), (c.nodes[2], "long.txt")]
        assert concurrently(requests, "plain") == ["added", "present"]
        index = metaindex.index_file("long.txt")
        copies = {(folder(n, "plain") / index).read_bytes() for n in c.nodes}
        assert len(copies) == 1
        for n in c.nodes:
            assert meta_files(n, "plain") == [index.split("/")[1]]
            assert c.listing(n)["plain"]["stored"] == on_disk(n, "plain")
        # A job's first use through another node: every member has it after.
        env = c.env(first=c.nodes[2])
        ds = KSpeedMetaDataset(big, "train.txt", nodes=env["KSPEEDFS_NODES"], token=str(token_file))
        assert list(ds.targets) == [i % 5 for i in range(19)]
        for n in c.nodes:
            assert len(meta_files(n, "plain")) == 2
        assert run_cli("unload", "plain", env=c.env()).returncode == 0
        assert not any(folder(n, "plain").exists() for n in c.nodes)


def test_a_piece_that_does_not_fit_its_index_is_refused_and_writes_nothing(
    node: NodeProcess, big: Path
) -> None:
    """meta_put's piece is checked once off the wire (format.contract.pieces): past its total, not
    base64, over the index limit or for an add with no reservation, it is refused in one line
    and no byte lands in the instance's meta folder."""
    preload(node, big, "plain")
    uuid = record(node, "plain")["uuid"]
    add = "0123456789abcdef"
    ident = {"name": "plain", "uuid": uuid, "meta": "train.txt", "add": add}
    with node.client() as c:
        c.request("meta_reserve", **ident, bytes=1000)
        used = c.request("status")["used"]

        @hypothesis.settings(
            max_examples=60,
            deadline=None,
            suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
        )
        @hypothesis.given(
            offset=st.integers(0, 2**40),
            total=st.integers(0, 2**40),
            data=st.binary(max_size=64),
            garbled=st.booleans(),
        )
        def refused(offset: int, total: int, data: bytes, garbled: bool) -> None:
            text = base64.b64encode(data).decode()
            if garbled:
                text += "!"
            elif offset + len(data) <= total <= MAX_INDEX_BYTES:
                offset = total + 1  # past the end: the only way left to be out of range
            piece = {"offset": offset, "total": total, "data": text}
            with pytest.raises(InvalidArgument) as e:
                c.request("meta_put", **ident, piece=piece)
            assert str(e.value).startswith("op meta_put: ") and "\n" not in str(e.value)

        refused()
        # A piece that fits, for an add this node holds no reservation for.
        other = {**ident, "add": "fedcba9876543210"}
        piece = {"offset": 0, "total": 2, "data": "aGk="}
        with pytest.raises(InvalidArgument, match="no reservation here"):
            c.request("meta_put", **other, piece=piece)
        assert meta_files(node, "plain") == []
        c.request("meta_abort", **ident)
        assert c.request("status")["used"] == used - 1000
