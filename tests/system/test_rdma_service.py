"""The node's RDMA side and the RDMA transport around a stand-in for the device.

The node is real (NodeServer, its segment store, its ops, run in-process); only the verbs layer
is faked, by memory regions that refuse a deregistered key the way a device does.
"""

from __future__ import annotations

import contextvars
import gc
import logging
import os
import shutil
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import NodeProcess, make_tree, run_cli
from rdmafakes import FakeChannel, FakeDevice, FakeRegion, FakeRegistrar
from uidutil import in_child

from kspeedfs.format import auth
from kspeedfs.format.config import Settings
from kspeedfs.format.contract import Answer, Request
from kspeedfs.format.contract.node import UnloadLocal
from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.format.localdata import META_FILE, read_meta
from kspeedfs.format.units import Address
from kspeedfs.node.ops import ADMIN
from kspeedfs.node.root import RdmaFactory
from kspeedfs.node.server import NodeServer
from kspeedfs.rdma import client as rdma_client
from kspeedfs.rdma import verbs
from kspeedfs.rdma.client import RdmaTransport
from kspeedfs.rdma.registry import SegmentRegistry
from kspeedfs.rdma.server import DatasetNews, PublishedDatasets, RdmaService
from kspeedfs.system.local_dataset import LocalDataset


@pytest.fixture(autouse=True)
def fresh_verdicts() -> None:
    # What a process remembers about nodes that refused RDMA: each test starts without.
    rdma_client._verdicts.clear()


class TcpNode(NodeProcess):
    def env(self) -> dict[str, str]:
        return {**super().env(), "KSPEEDFS_TRANSPORT": "tcp"}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    """A node's shm folder holding dataset "ds" (built by a real node), its source, a token."""
    base = tmp_path_factory.mktemp("rdma")
    src = make_tree(base / "src")
    token = base / "token"
    auth.write_token(token, auth.new_admin_token())
    shm = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    node = TcpNode(shm, token, base).start()
    try:
        done = run_cli("preload", str(src), "--name", "ds", "-q", env=node.env())
        assert done.returncode == 0, done.stderr
    finally:
        node.stop()
    yield shm, src, token
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def shm(template: tuple[Path, Path, Path]) -> Iterator[Path]:
    path = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    shutil.copytree(template[0], path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def with_fake_device(registrar: FakeRegistrar) -> RdmaFactory:
    """The node's RDMA service as it is with a device, the device being the stand-in."""

    def make(store: PublishedDatasets, events: DatasetNews) -> RdmaService:
        device = FakeDevice(registrar)
        return RdmaService(store, events, device=device, registry=SegmentRegistry(registrar))  # type: ignore[arg-type]

    return make


def make_server(
    shm: Path, token: Path, registrar: FakeRegistrar, rdma: RdmaFactory | None = None
) -> NodeServer:
    settings = Settings(
        listen=Address("127.0.0.1", 0),
        nodes=[Address("127.0.0.1", 0)],
        shm_dir=shm,
        memory="1GiB",
        token_file=token,
        transport="tcp",
    )
    return NodeServer(settings, rdma=rdma or with_fake_device(registrar))


class InProcessControl:
    """One control connection to an in-process node: each request runs the node's op in the
    connection's context, as the node's connection handler does."""

    def __init__(self, server: NodeServer):
        self.server = server
        self.context = contextvars.copy_context()
        self.peers = self.context.run(server.rdma.bind_connection)
        self.ops: list[str] = []

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        self.ops.append(op)
        msg = {"op": op, **args}
        result: dict[str, Any] = self.context.run(trio.run, self.server.ops.dispatch, msg, ADMIN)
        return result

    def call(self, request: Request[Answer]) -> Answer:
        """A typed request, sent as NodeClient.call sends it: its fields off the wire."""
        fields = request.to_wire()
        return request.answer(self.request(fields.pop("op"), **fields))


class InProcessTcp:
    """The TCP transport of an in-process node: control requests, and reads from its store."""

    name = "tcp"

    def __init__(self, server: NodeServer):
        self.server = server
        self.client = InProcessControl(server)
        self.reads = 0

    def read_into(
        self, dataset: str, instance: str, ranges: list[tuple[int, int, int]], out: memoryview
    ) -> None:
        ds = self.server.store.open(dataset)
        assert ds.uuid == instance, "the TCP side was asked for another instance"
        pos = 0
        for seg, off, n in ranges:
            out[pos : pos + n] = ds.view(seg, off, n)
            pos += n
        self.reads += 1

    def close(self) -> None:
        self.client.peers.close()


def ds_uuid(shm: Path) -> str:
    return LocalDataset(shm / "datasets" / "ds").uuid


def all_files(shm: Path, src: Path) -> tuple[list[tuple[int, int, int]], bytes]:
    """Every file of dataset "ds" as one batch of ranges, and the source bytes they must give."""
    m = LocalDataset(shm / "datasets" / "ds").manifest
    ranges: list[tuple[int, int, int]] = []
    expected = []
    for i in m.iter_files():
        ranges.extend(m.ranges(i))
        expected.append((Path(os.fsdecode(src)) / os.fsdecode(m.path(i))).read_bytes())
    return ranges, b"".join(expected)


def segment_count(shm: Path) -> int:
    return len(os.listdir(shm / "datasets" / "ds" / "seg"))


def republish(server: NodeServer, template_shm: Path, name: str) -> None:
    """Publish a copy of the template's dataset under `name`, on the event loop as a preload
    commit does."""
    staging = server.store.new_staging(name)
    shutil.rmtree(staging)
    shutil.copytree(template_shm / "datasets" / "ds", staging)
    meta = dict(read_meta(staging), name=name)
    (staging / META_FILE).unlink()

    async def publish() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.rdma.run)  # as the node runs it
            server.store.publish(staging, meta)
            # Registration goes on in a worker thread while the node keeps serving.
            registry = server.rdma.registry
            assert registry is not None
            with trio.fail_after(30):
                while registry.table(name) is None:
                    await trio.sleep(0.01)  # under test: registration in a worker thread
            nursery.cancel_scope.cancel()

    trio.run(publish)


def test_registered_at_start_and_deregistered_before_the_files_go(
    shm: Path, template: tuple[Path, Path, Path]
) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    server.store.recover(verify=False)
    table = server.rdma.registry.table("ds")  # type: ignore[union-attr]
    assert table is not None
    segs = shm / "datasets" / "ds" / "seg"
    assert segment_count(shm) >= 3
    for k in range(segment_count(shm)):
        on_disk = (segs / f"{k:08d}").read_bytes()
        addr, rkey = table.locate(k, 0, len(on_disk))
        assert fake.read(addr, rkey, len(on_disk)) == on_disk
    assert server.rdma.status().regions == segment_count(shm)

    # A restarted daemon registers again, with new keys.
    fake2 = FakeRegistrar()
    restarted = make_server(shm, template[2], fake2)
    restarted.store.recover(verify=False)
    table2 = restarted.rdma.registry.table("ds")  # type: ignore[union-attr]
    assert table2 is not None
    assert {k.rkey for k in table2.keys if k.length}.isdisjoint(k.rkey for k in table.keys)

    files_at_close: list[bool] = []

    def check(region: FakeRegion) -> None:
        files_at_close.append(segs.is_dir() and any(segs.iterdir()))

    fake.on_close = check
    trio.run(server.ops.call, UnloadLocal(name="ds"))
    assert files_at_close and all(files_at_close), "deregistered after the files were unlinked"
    assert not (shm / "datasets" / "ds").exists()
    assert list(fake.live) == [fake.made[0].rkey]  # the node's probe region, nothing else
    assert server.rdma.registry.table("ds") is None  # type: ignore[union-attr]
    addr, rkey = table.locate(0, 0, 1)
    assert fake.read(addr, rkey, 1) is None


def test_a_published_dataset_is_registered(shm: Path, template: tuple[Path, Path, Path]) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    server.store.recover(verify=False)
    republish(server, template[0], "copy")
    table = server.rdma.registry.table("copy")  # type: ignore[union-attr]
    assert table is not None
    assert sum(1 for k in table.keys if k.length) == segment_count(shm)


def new_transport(
    server: NodeServer, fake: FakeRegistrar, transport: str = "auto"
) -> tuple[RdmaTransport, list[FakeChannel], list[InProcessTcp]]:
    channels: list[FakeChannel] = []
    controls: list[InProcessTcp] = []

    def channel() -> FakeChannel:
        channels.append(FakeChannel(fake, pool_size=256 * 1024, depth=32, seed=len(channels)))
        return channels[-1]

    def control() -> InProcessTcp:
        controls.append(InProcessTcp(server))
        return controls[-1]

    settings = Settings(transport=transport, timeout=10)
    t = RdmaTransport(Address("127.0.0.1", 1), settings, channel, control)
    return t, channels, controls


def test_reads_over_rdma_are_byte_equal_and_need_no_tcp_reads(
    shm: Path, template: tuple[Path, Path, Path]
) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    server.store.recover(verify=False)
    t, channels, controls = new_transport(server, fake)
    ranges, expected = all_files(shm, template[1])
    out = bytearray(len(expected))
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    assert bytes(out) == expected
    assert t.name == "rdma"
    assert controls[0].reads == 0
    assert controls[0].client.ops == ["rdma_connect", "rdma_segments"]
    assert channels[0].remote is not None  # connected to the node's queue pair
    assert channels[0].max_outstanding > 1
    assert server.rdma.status().peers == 1
    # Closing the transport closes its control connection: the node drops the queue pair.
    t.close()
    assert channels[0].closed
    assert server.rdma.status().peers == 0
    assert all(qp.closed for qp in server.rdma.device.qps)  # type: ignore[union-attr]


def test_a_stale_key_is_an_error_then_a_new_table_never_a_read_of_freed_memory(
    shm: Path, template: tuple[Path, Path, Path]
) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    server.store.recover(verify=False)
    t, channels, controls = new_transport(server, fake)
    ranges, expected = all_files(shm, template[1])
    out = bytearray(len(expected))
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    old_keys = {r.rkey for r in fake.made if r.closed is False and r.length > 64}

    # Unloaded and loaded again under the same name: the client still holds the old keys.
    trio.run(server.ops.call, UnloadLocal(name="ds"))
    republish(server, template[0], "ds")
    out = bytearray(len(expected))
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    assert bytes(out) == expected
    assert controls[0].client.ops == ["rdma_connect", "rdma_segments"] * 2
    assert len(channels) == 2 and channels[0].closed and not channels[1].closed
    assert not old_keys & {r.rkey for r in channels[1].posted}, "read with a revoked key"
    assert server.rdma.status().peers == 1  # the reconnect replaced the queue pair
    assert controls[0].reads == 0

    # Unloaded for good: the fresh table is refused like a TCP read would be.
    trio.run(server.ops.call, UnloadLocal(name="ds"))
    with pytest.raises(NotFound):
        t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))


def test_a_failed_handshake_falls_back_to_tcp_with_one_log_line(
    shm: Path, template: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    server.store.recover(verify=False)
    probe_rkey = fake.made[0].rkey  # the node's probe region is registered first
    real_read = fake.read

    def corrupt_probe(addr: int, rkey: int, length: int) -> bytes | None:
        data = real_read(addr, rkey, length)
        return bytes(length) if rkey == probe_rkey else data

    fake.read = corrupt_probe  # type: ignore[method-assign]
    ranges, expected = all_files(shm, template[1])
    caplog.set_level(logging.INFO, logger="kspeedfs.rdma")
    t, channels, controls = new_transport(server, fake)
    out = bytearray(len(expected))
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    assert bytes(out) == expected
    assert t.name == "tcp" and controls[0].reads == 1
    assert channels[0].closed
    lines = [r.getMessage() for r in caplog.records if "using TCP" in r.getMessage()]
    assert len(lines) == 1 and "probe region read back wrong" in lines[0]

    # The verdict holds for the next transport to that node: no second handshake, no log line.
    t2, channels2, _ = new_transport(server, fake)
    t2.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    assert t2.name == "tcp" and channels2 == []
    assert len([r for r in caplog.records if "using TCP" in r.getMessage()]) == 1


def test_forced_rdma_refuses_a_node_without_it(
    shm: Path, template: tuple[Path, Path, Path]
) -> None:
    fake = FakeRegistrar()
    server = make_server(
        shm,
        template[2],
        fake,
        rdma=lambda store, events: RdmaService(store, events, "no RDMA device"),
    )
    server.store.recover(verify=False)
    t, _, _ = new_transport(server, fake, transport="rdma")
    ranges, expected = all_files(shm, template[1])
    with pytest.raises(InvalidArgument, match="transport is rdma, but node .*no RDMA device"):
        t.read_into("ds", ds_uuid(shm), ranges, memoryview(bytearray(len(expected))))


def test_a_dataset_the_node_cannot_register_is_read_over_tcp(
    shm: Path, template: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    fake.fail_after = 1  # the probe region only: no room for any segment
    caplog.set_level(logging.INFO)
    server.store.recover(verify=False)
    assert "served over TCP only" in caplog.text
    t, channels, controls = new_transport(server, fake)
    ranges, expected = all_files(shm, template[1])
    out = bytearray(len(expected))
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    assert bytes(out) == expected
    assert t.name == "rdma" and controls[0].reads == 1
    assert "reading ds over TCP" in caplog.text


def test_a_forked_child_makes_its_own_queue_pair_and_leaves_the_parents_alone(
    shm: Path, template: tuple[Path, Path, Path]
) -> None:
    fake = FakeRegistrar()
    server = make_server(shm, template[2], fake)
    server.store.recover(verify=False)
    t, channels, controls = new_transport(server, fake)
    ranges, expected = all_files(shm, template[1])
    out = bytearray(len(expected))
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))

    def child() -> dict[str, Any]:
        mine = bytearray(len(expected))
        t.read_into("ds", ds_uuid(shm), ranges, memoryview(mine))
        t.close()
        return {
            "equal": bytes(mine) == expected,
            "channels": len(channels),
            "controls": len(controls),
            "inherited_closed": channels[0].closed,
            "inherited_ops": controls[0].client.ops,
            "own_posted": len(channels[-1].posted) > 0,
        }

    report = in_child(child)
    assert report == {
        "equal": True,
        "channels": 2,
        "controls": 2,
        "inherited_closed": False,
        "inherited_ops": ["rdma_connect", "rdma_segments"],
        "own_posted": True,
    }
    # The parent goes on with its own queue pair.
    posted = len(channels[0].posted)
    t.read_into("ds", ds_uuid(shm), ranges, memoryview(out))
    assert bytes(out) == expected
    assert len(channels) == 1 and len(channels[0].posted) > posted


def test_a_forked_child_never_destroys_the_parents_verbs_objects() -> None:
    class VerbsObject:
        """Stands for a pyverbs object, whose destructor would destroy the kernel object."""

    holder = [verbs._own(VerbsObject())]
    ref = weakref.ref(holder[0])

    def child() -> dict[str, Any]:
        holder.clear()
        gc.collect()
        return {"alive": ref() is not None, "owned": len(verbs._owned)}

    assert in_child(child) == {"alive": True, "owned": 0}
    assert holder[0] in verbs._owned  # the parent still owns and may close it
    holder.clear()
    gc.collect()
    assert ref() is None
