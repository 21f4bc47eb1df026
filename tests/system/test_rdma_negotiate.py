"""Picking the transport: the setting, the device probe, the node's answer; TCP when not RDMA."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, run_cli
from rdmafakes import FakeChannel, FakeRegistrar

from kspeedfs.client import transport as client_transport
from kspeedfs.client.transport import open_transport
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.units import Address, parse_address
from kspeedfs.net.transport import TcpTransport
from kspeedfs.rdma import client as rdma_client
from kspeedfs.rdma import verbs
from kspeedfs.rdma.client import RdmaTransport
from kspeedfs.rdma.verbs import DeviceProbe
from kspeedfs.system.local_dataset import LocalDataset

ADDR = Address("127.0.0.1", 7420)


@pytest.fixture(autouse=True)
def fresh_process_state() -> Iterator[None]:
    rdma_client._verdicts.clear()
    client_transport._logged_local.clear()
    verbs._probe_cache.clear()
    yield
    verbs._probe_cache.clear()


def test_transport_settings() -> None:
    assert load_settings(env={}).transport == "auto"
    s = load_settings(env={"KSPEEDFS_TRANSPORT": " RDMA ", "KSPEEDFS_RDMA_GID_INDEX": "3"})
    assert (s.transport, s.rdma_gid_index) == ("rdma", 3)
    assert (
        load_settings({"transport": "tcp"}, env={"KSPEEDFS_TRANSPORT": "rdma"}).transport == "tcp"
    )
    with pytest.raises(
        InvalidArgument,
        match=r"transport from the environment \(KSPEEDFS_TRANSPORT\): 'infiniband'",
    ):
        load_settings(env={"KSPEEDFS_TRANSPORT": "infiniband"})
    with pytest.raises(InvalidArgument, match="rdma_gid_index"):
        load_settings(env={"KSPEEDFS_RDMA_GID_INDEX": "-2"})
    with pytest.raises(InvalidArgument, match="rdma_gid_index"):
        load_settings(env={"KSPEEDFS_RDMA_GID_INDEX": "one"})


def test_toml_transport_section(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('[transport]\ntransport = "tcp"\nrdma-device = "mlx5_0"\n')
    s = load_settings(env={}, config_file=cfg)
    assert (s.transport, s.rdma_device) == ("tcp", "mlx5_0")


def fake_pyverbs(devices: Any, port_state: int = 4) -> types.SimpleNamespace:
    """Just enough of pyverbs for the probe: a device list and a port state."""

    class Context:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> Context:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def query_port(self, port: int) -> types.SimpleNamespace:
            return types.SimpleNamespace(state=port_state)

    def get_device_list() -> list[types.SimpleNamespace]:
        if isinstance(devices, Exception):
            raise devices
        return [types.SimpleNamespace(name=n.encode()) for n in devices]

    return types.SimpleNamespace(
        device=types.SimpleNamespace(get_device_list=get_device_list, Context=Context),
        enums=types.SimpleNamespace(IBV_PORT_ACTIVE=4),
    )


def test_probe_says_why_rdma_is_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pyverbs'")

    monkeypatch.setattr(verbs, "_pyverbs", missing)
    assert verbs.probe() == DeviceProbe(
        False, "pyverbs is not installed (No module named 'pyverbs'; see `make rdma`)"
    )
    verbs._probe_cache.clear()
    cases = [
        (
            RuntimeError("Failed to get devices list"),
            4,
            "",
            "no RDMA device (Failed to get devices list)",
        ),
        ([], 4, "", "no RDMA device"),
        (["rxe0"], 4, "mlx5_0", "no RDMA device named 'mlx5_0' (found rxe0)"),
        (["rxe0", "rxe1"], 1, "", "rxe0 port 1 is not active; rxe1 port 1 is not active"),
    ]
    for devices, state, wanted, reason in cases:
        monkeypatch.setattr(verbs, "_pyverbs", lambda d=devices, s=state: fake_pyverbs(d, s))
        assert verbs._probe(wanted, 1) == DeviceProbe(False, reason)
    monkeypatch.setattr(verbs, "_pyverbs", lambda: fake_pyverbs(["rxe0", "rxe1"]))
    assert verbs._probe("rxe1", 1) == DeviceProbe(True, "", "rxe1", 1)
    assert verbs._probe("", 1) == DeviceProbe(True, "", "rxe0", 1)


def test_no_pyverbs_or_no_device_means_tcp_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(verbs, "_pyverbs", lambda: fake_pyverbs([]))
    caplog.set_level(logging.INFO, logger="kspeedfs")
    for port in (7420, 7421):
        t = open_transport(Address("127.0.0.1", port), load_settings(env={}))
        assert isinstance(t, TcpTransport)
    # One line says why, not one per node or per connection.
    assert [r.getMessage() for r in caplog.records] == ["using TCP: no RDMA device"]

    def no_pyverbs() -> Any:
        raise ImportError("No module named 'pyverbs'")

    verbs._probe_cache.clear()
    monkeypatch.setattr(verbs, "_pyverbs", no_pyverbs)
    assert isinstance(open_transport(ADDR, load_settings(env={})), TcpTransport)
    assert "pyverbs is not installed" in caplog.records[-1].getMessage()


def test_forced_rdma_without_a_device_is_a_clear_error() -> None:
    settings = load_settings(env={"KSPEEDFS_TRANSPORT": "rdma"})
    with pytest.raises(InvalidArgument) as e:
        open_transport(ADDR, settings, probe=lambda name: DeviceProbe(False, "no RDMA device"))
    assert str(e.value) == "transport is rdma, but RDMA is unusable here: no RDMA device"
    assert "\n" not in str(e.value)


def test_tcp_setting_never_touches_the_device() -> None:
    def probe(name: str) -> DeviceProbe:
        raise AssertionError("probed the device although transport is tcp")

    t = open_transport(ADDR, load_settings(env={"KSPEEDFS_TRANSPORT": "tcp"}), probe=probe)
    assert isinstance(t, TcpTransport)


def test_a_tcp_reader_never_loads_the_rdma_package() -> None:
    """The choice lives in the client: with transport tcp nothing of kspeedfs.rdma is imported
    (so the verbs layer is neither loaded nor probed), from the read path down."""
    code = """
import sys
from kspeedfs.client.reader import ClusterReader
from kspeedfs.client.transport import open_transport
from kspeedfs.format.config import load_settings
from kspeedfs.format.units import Address
settings = load_settings(env={"KSPEEDFS_TRANSPORT": "tcp"})
print(type(open_transport(Address("127.0.0.1", 7420), settings)).__name__)
print(sorted(m for m in sys.modules if m.startswith("kspeedfs.rdma")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["TcpTransport", "[]"]


class TcpNode(NodeProcess):
    def env(self) -> dict[str, str]:
        return {**super().env(), "KSPEEDFS_TRANSPORT": "tcp"}


@pytest.fixture
def tcp_node(shm_dir: Path, token_file: Path, tmp_path: Path) -> Iterator[NodeProcess]:
    n = TcpNode(shm_dir, token_file, tmp_path).start()
    yield n
    n.stop()


def test_a_node_without_rdma_is_read_over_tcp_even_with_a_device_here(
    tcp_node: NodeProcess, tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    done = run_cli("preload", str(tree), "--name", "ds", "-q", env=tcp_node.env())
    assert done.returncode == 0, done.stderr
    settings = load_settings({"transport": "auto"}, env=tcp_node.env())
    made: list[FakeChannel] = []

    def channel() -> FakeChannel:
        made.append(FakeChannel(FakeRegistrar()))
        return made[-1]

    caplog.set_level(logging.INFO, logger="kspeedfs")
    t = open_transport(
        parse_address(tcp_node.address),
        settings,
        probe=lambda name: DeviceProbe(True, "", "rxe0", 1),
        channel_factory=channel,
    )
    assert isinstance(t, RdmaTransport)
    m = LocalDataset(tcp_node.shm_dir / "datasets" / "ds").manifest
    files = list(m.iter_files())
    ranges = [r for i in files for r in m.ranges(i)]
    expected = b"".join((tree / os.fsdecode(m.path(i))).read_bytes() for i in files)
    out = bytearray(len(expected))
    t.read_into("ds", m.uuid, ranges, memoryview(out))
    assert bytes(out) == expected
    assert t.name == "tcp"
    assert made[0].closed and made[0].posted == []
    assert [r.getMessage() for r in caplog.records if "using TCP" in r.getMessage()] == [
        f"node {tcp_node.address}: using TCP: node has no RDMA: "
        "RDMA disabled by the transport setting"
    ]
    t.close()

    forced = load_settings({"transport": "rdma"}, env=tcp_node.env())
    rdma_client._verdicts.clear()
    t = open_transport(
        parse_address(tcp_node.address),
        forced,
        probe=lambda name: DeviceProbe(True, "", "rxe0", 1),
        channel_factory=channel,
    )
    with pytest.raises(InvalidArgument, match="transport is rdma, but node .* has no RDMA"):
        t.read_into("ds", m.uuid, ranges, memoryview(out))
    t.close()


def test_status_shows_the_transport_of_each_node(tcp_node: NodeProcess) -> None:
    status = tcp_node.request("status")
    assert status["transport"] == "tcp"
    rdma = status["rdma"]
    assert (rdma["enabled"], rdma["reason"]) == (False, "RDMA disabled by the transport setting")
    done = run_cli("status", env=tcp_node.env())
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[:2]
    column = header.index("TRANSPORT")
    assert row[column:].split()[0] == "tcp"


def test_a_node_forced_to_rdma_without_a_device_refuses_to_start(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "KSPEEDFS_TOKEN_FILE": str(token_file),
        "KSPEEDFS_TRANSPORT": "rdma",
        # A device no machine has, so that this holds with or without RDMA hardware.
        "KSPEEDFS_RDMA_DEVICE": "kspeedfs-test-nodev",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kspeedfs.cli",
            "node",
            "--listen",
            "127.0.0.1:0",
            "--shm-dir",
            str(shm_dir),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 5, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kspeedfs: transport is rdma, but this node cannot use RDMA: ")
    assert "kspeedfs-test-nodev" in last or "pyverbs" in last or "no RDMA device" in last
