"""The client's read engine: pool space, many reads in flight, every byte where it belongs."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rdmafakes import FakeChannel, FakeRegistrar

from kspeedfs.format.errors import DataError, NodeUnreachable, ProtocolError
from kspeedfs.rdma.client import PoolRing, StaleKey, plan_pieces, run_reads
from kspeedfs.rdma.registry import SegmentRegistry
from kspeedfs.rdma.verbs import Completion
from kspeedfs.rdma.wire import SegmentTable


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 100)), max_size=200))
def test_pool_ring_never_hands_out_space_still_in_use(ops: list[tuple[bool, int]]) -> None:
    ring = PoolRing(256)
    held: list[tuple[int, int]] = []
    for free, length in ops:
        if free and held:
            assert ring.free_oldest() == held.pop(0)
            continue
        pos = ring.alloc(length)
        if pos is None:
            assert held, "an empty pool must take any piece that fits in it"
            continue
        assert pos >= 0 and pos + length <= 256
        for p, n in held:
            assert pos + length <= p or p + n <= pos, "overlaps a piece still in flight"
        held.append((pos, length))
    assert len(ring) == len(held)
    with pytest.raises(ValueError):
        ring.alloc(257)


def make_memory(seg_sizes: list[int]) -> tuple[FakeRegistrar, dict[int, bytes], SegmentTable]:
    fake = FakeRegistrar()
    data = {k: os.urandom(n) for k, n in enumerate(seg_sizes)}
    table = SegmentRegistry(fake).register("ds", "ab" * 16, len(data), data)
    assert table is not None
    return fake, data, table


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), max_piece=st.sampled_from([1000, 4096, 1 << 16]))
def test_batched_reads_land_byte_exact(seed: int, max_piece: int) -> None:
    rand = random.Random(seed)
    fake, data, table = make_memory([50_000, 7, 120_000, 3000])
    ranges = []
    for _ in range(rand.randint(1, 60)):
        seg = rand.randrange(4)
        off = rand.randrange(len(data[seg]) + 1)
        ranges.append((seg, off, rand.randint(0, len(data[seg]) - off)))
    expected = b"".join(data[s][o : o + n] for s, o, n in ranges)
    out = bytearray(len(expected))
    channel = FakeChannel(fake, pool_size=16 * 1024, depth=8, seed=seed)
    pieces = plan_pieces(ranges, table, min(max_piece, channel.pool_size))
    assert all(p.length <= max_piece for p in pieces)
    run_reads(channel, pieces, memoryview(out), timeout=10)
    assert bytes(out) == expected


def test_reads_of_a_batch_are_posted_many_at_once() -> None:
    fake, data, table = make_memory([200_000])
    ranges = [(0, k * 1000, 1000) for k in range(100)]
    out = bytearray(100_000)
    channel = FakeChannel(fake, pool_size=64 * 1024, depth=32)
    run_reads(channel, plan_pieces(ranges, table, 1 << 20), memoryview(out), timeout=10)
    assert bytes(out) == data[0][:100_000]
    assert channel.max_outstanding > 1
    assert len(channel.posted) == 100


def test_a_range_outside_the_registration_is_refused_before_any_read() -> None:
    fake, data, table = make_memory([1000])
    with pytest.raises(DataError, match="past the end"):
        plan_pieces([(0, 0, 10), (0, 990, 11)], table, 1 << 20)


def test_a_refused_key_is_stale_and_a_dead_peer_unreachable() -> None:
    fake, data, table = make_memory([10_000])
    pieces = plan_pieces([(0, 0, 10_000)], table, 1000)
    fake.live.clear()  # deregistered behind the client's back
    with pytest.raises(StaleKey):
        run_reads(FakeChannel(fake), pieces, memoryview(bytearray(10_000)), timeout=10)

    class DeadPeer(FakeChannel):
        def poll(self, max_entries: int) -> list[Completion]:
            return [Completion(r.wr_id, False, 12, "retry exceeded", False) for r in self.posted]

    with pytest.raises(NodeUnreachable, match="retry exceeded"):
        run_reads(DeadPeer(fake), pieces, memoryview(bytearray(10_000)), timeout=10)

    class Silent(FakeChannel):
        def poll(self, max_entries: int) -> list[Completion]:
            return []

    with pytest.raises(NodeUnreachable, match="no RDMA completion"):
        run_reads(Silent(fake), pieces, memoryview(bytearray(10_000)), timeout=0.01)


def test_completions_out_of_order_are_a_protocol_error() -> None:
    fake, data, table = make_memory([10_000])

    class Reordering(FakeChannel):
        def poll(self, max_entries: int) -> list[Completion]:
            if len(self.posted) < 2:
                return []
            return [Completion(self.posted[1].wr_id, True, 0, "success", False)]

    pieces = plan_pieces([(0, 0, 2000)], table, 1000)
    with pytest.raises(ProtocolError, match="out of order"):
        run_reads(Reordering(fake), pieces, memoryview(bytearray(2000)), timeout=10)
