"""The node's op table and its connections to other members, on real nodes on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from clusterutil import Cluster, running
from conftest import NodeProcess, make_tree, wait_for

from kspeedfs.format import auth
from kspeedfs.format.contract.pieces import BlobPiece
from kspeedfs.format.errors import AuthError, DataError, InvalidArgument
from kspeedfs.format.units import Address
from kspeedfs.net.aconnection import AsyncNodeClient


@pytest.fixture
def read_token(token_file: Path, tmp_path: Path) -> Path:
    path = tmp_path / "read-token"
    auth.write_token(path, auth.derive_read_token(auth.read_token(token_file)))
    return path


def test_a_read_client_is_refused_admin_ops_in_one_line_and_keeps_its_connection(
    node: NodeProcess, read_token: Path
) -> None:
    async def main() -> None:
        client = AsyncNodeClient(Address("127.0.0.1", node.port), read_token)
        try:
            assert (await client.request("ping"))["node"] == node.address
            assert client.role == "read"
            for op, args in (
                ("unload", {"name": "anything"}),
                ("shutdown", {}),
                ("stage", {"name": "x", "uuid": "u", "source": "/", "segments": []}),
                ("register_source", {"name": "x", "source": "/"}),
            ):
                with pytest.raises(AuthError) as refused:
                    await client.request(op, **args)
                assert str(refused.value) == f"{op} needs the admin role; this client has read"
                # The same connection answers the next request.
                assert (await client.request("list"))["node"] == node.address
            assert client.stats["connects"] == 1
        finally:
            await client.aclose()

    trio.run(main)
    assert node.proc is not None and node.proc.poll() is None


def test_an_unknown_op_is_refused_and_the_connection_stays(node: NodeProcess) -> None:
    with node.client() as c:
        before = c.request("status")["stats"]["connections"]
        for op in ("no_such_op", "_serve", ""):
            with pytest.raises(InvalidArgument, match="unknown operation"):
                c.request(op)
        assert c.request("status")["stats"]["connections"] == before


@pytest.fixture
def two_nodes(token_file: Path, tmp_path: Path) -> Iterator[Cluster]:
    with running(Cluster(token_file, tmp_path, size=2)) as cluster:
        yield cluster


def preload(coordinator: NodeProcess, source: Path, name: str) -> dict[str, Any]:
    """Preload through one node's op directly (no CLI: it would open connections of its own)."""
    with coordinator.client() as c:
        started = c.request("preload", name=name, source=str(source))
        deadline = time.monotonic() + 60
        while (state := c.request("progress", name=name)["state"]) != "ready":
            assert state != "failed" and time.monotonic() < deadline, state
            time.sleep(0.05)
    return started


def test_node_to_node_calls_reuse_connections(two_nodes: Cluster, tmp_path: Path) -> None:
    coordinator, member = two_nodes.nodes
    src = make_tree(tmp_path / "src")
    with member.client() as watch:
        before = watch.request("status")["stats"]["connections"]
        for name in ("one", "two"):
            started = preload(coordinator, src, name)
            assert sorted(started["nodes"]) == sorted(two_nodes.addresses)
        after = watch.request("status")["stats"]["connections"]
    peers = coordinator.request("status")["peers"]
    # ping, stage, stage_status (polled), stage_result, stage_manifest, commit: per preload
    assert peers["requests"] >= 12
    # One connection carries them all (a second only if two calls overlapped).
    assert after - before <= 2, (before, after, peers)
    assert peers["connects"] <= 2, peers
    assert "one" in two_nodes.listing(member) and "two" in two_nodes.listing(member)


def test_a_connection_that_died_with_a_restart_is_retried_once(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    coordinator, member = two_nodes.nodes
    src = make_tree(tmp_path / "src")
    preload(coordinator, src, "before")
    assert coordinator.request("status")["peers"]["idle"] >= 1  # a connection kept to member

    member.stop()
    member.start()
    wait_for(lambda: "before" in two_nodes.listing(member), what="the member's datasets back")

    # The pooled connection is dead; the first call on it (a ping that decides who is live)
    # is sent again on a new one, so the member still gets its share of the new dataset.
    started = preload(coordinator, src, "after")
    assert sorted(started["nodes"]) == sorted(two_nodes.addresses)
    peers = coordinator.request("status")["peers"]
    assert peers["retries"] >= 1, peers
    assert "after" in two_nodes.listing(member)
    assert "is down" not in coordinator.log()


def piece(offset: int, total: int, data: bytes) -> dict[str, Any]:
    return BlobPiece.of(offset, total, data).to_wire()


def test_pushed_pieces_out_of_bounds_or_order_are_refused_and_write_nothing(
    node: NodeProcess,
) -> None:
    """A member's pushed segment and manifest pieces (stage_put, stage_manifest), as a
    confused or hostile coordinator might send them: each refused in one line."""
    ident = {"name": "pushed", "uuid": "u1"}
    with node.client() as c:
        c.request("stage_push", **ident, source="/nowhere", segments=[0], lengths=[10])
        refusals = [
            ("stage_put", {"segment": 0, "piece": piece(0, 5, b"abc")}, "5-byte segment"),
            ("stage_put", {"segment": 0, "piece": piece(8, 10, b"abcd")}, "past its total"),
            ("stage_put", {"segment": 1, "piece": piece(0, 10, b"a")}, "not expected here"),
            (
                "stage_put",
                {"segment": 0, "piece": {"offset": 0, "total": 10, "data": "%"}},
                "base64",
            ),
            ("stage_manifest", {"piece": piece(0, 3, b"abc")}, "is receiving, not staged"),
        ]
        for op, args, why in refusals:
            with pytest.raises(InvalidArgument, match=why) as refused:
                c.request(op, **ident, **args)
            assert "\n" not in str(refused.value)
        c.request("stage_put", **ident, segment=0, piece=piece(0, 10, b"0123456789"))
        c.request("stage_done", **ident)
        with pytest.raises(InvalidArgument, match="piece at 5, expected 0"):
            c.request("stage_manifest", **ident, piece=piece(5, 10, b"abc"))
        with pytest.raises(DataError, match="corrupt manifest"):  # not a manifest at all
            c.request("stage_manifest", **ident, piece=piece(0, 3, b"abc"))
        staged = node.shm_dir / "staging"
        assert not any(staged.glob("*/manifest.ksm")), "a refused manifest was put in place"
        c.request("abort", **ident)
        assert c.request("ping")["node"] == node.address
