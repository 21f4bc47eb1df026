"""Whether a mount may use FUSE over io_uring (fuse_uring), decided against the real kernel:
enable_uring set only by root, a ring tried before INIT claims it, the claim made only where
the kernel offers it. Each test puts the kernel's switches back as they were."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from uidutil import NOBODY, in_child

from kspeedfs.fuse import uring
from kspeedfs.fuse.counters import SharedCounters
from kspeedfs.fuse.kernel import INIT_EXT, INIT_OUT, RequestLoop

# These change the machine's switches (enable_uring, io_uring_disabled) under the mounts of
# test_fuse_uring: each holds their lock (conftest.machine_switches).
pytestmark = pytest.mark.usefixtures("machine_switches")

IO_URING_DISABLED = Path("/proc/sys/kernel/io_uring_disabled")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="writes the kernel's switches")
needs_uring = pytest.mark.skipif(
    uring.ring_unusable() is not None, reason=f"no FUSE over io_uring: {uring.ring_unusable()}"
)


@pytest.fixture
def enable_uring() -> Iterator[Path]:
    before = uring.ENABLE_URING.read_text()
    yield uring.ENABLE_URING
    uring.ENABLE_URING.write_text(before)


@pytest.fixture
def counters() -> Iterator[SharedCounters]:
    c = SharedCounters.create(1)
    yield c
    c.close()


def init_request(offer_uring: bool) -> memoryview:
    """A fuse_init_in as kernel 6.18 sends it (64 bytes; flags2 after the first 16)."""
    flags = INIT_EXT | 1 << 13 | 1 << 22
    flags2 = (uring.FUSE_OVER_IO_URING >> 32) if offer_uring else 0
    return memoryview(struct.pack("<IIIII44x", 7, 45, 131072, flags, flags2))


def claimed(loop: RequestLoop, offer_uring: bool) -> bool:
    reply = INIT_OUT.unpack(loop._init(1, init_request(offer_uring)))
    flags = reply[3] | reply[10] << 32
    return bool(flags & uring.FUSE_OVER_IO_URING)


@needs_uring
def test_init_claims_io_uring_only_where_offered_and_a_ring_was_made(
    counters: SharedCounters,
) -> None:
    on = RequestLoop(None, -1, [counters.row(0)], use_uring=True)  # type: ignore[arg-type]
    off = RequestLoop(None, -1, [counters.row(0)])  # type: ignore[arg-type]
    assert on.uring_unusable is None
    assert claimed(on, offer_uring=True)
    assert not claimed(on, offer_uring=False)
    assert not claimed(off, offer_uring=True)  # the setting off: the classic reply as before
    for loop in (on, off):
        loop.shutdown()


@needs_root
@needs_uring
def test_no_ring_no_claim_when_io_uring_is_disabled(counters: SharedCounters) -> None:
    before = IO_URING_DISABLED.read_text()
    IO_URING_DISABLED.write_text("2\n")  # io_uring_setup fails for everyone, root too
    try:
        why = uring.ring_unusable()
        loop = RequestLoop(None, -1, [counters.row(0)], use_uring=True)  # type: ignore[arg-type]
    finally:
        IO_URING_DISABLED.write_text(before)
    assert why is not None and "io_uring cannot be used here" in why
    assert loop.uring_unusable == why
    assert not claimed(loop, offer_uring=True)
    loop.shutdown()


@needs_root
@needs_uring
def test_root_turns_enable_uring_on(enable_uring: Path) -> None:
    enable_uring.write_text("N\n")
    assert uring.enable_in_kernel(is_root=True) is None
    assert enable_uring.read_text().strip() == "Y"


@needs_root
@needs_uring
def test_a_mount_not_run_as_root_never_writes_it(enable_uring: Path) -> None:
    enable_uring.write_text("N\n")
    why = in_child(lambda: uring.enable_in_kernel(os.geteuid() == 0), uid=NOBODY)
    assert why == f"{uring.ENABLE_URING} is N and only root may set it"
    assert enable_uring.read_text().strip() == "N"
    enable_uring.write_text("Y\n")  # set by the admin: a mount of any user may use it
    assert in_child(lambda: uring.enable_in_kernel(os.geteuid() == 0), uid=NOBODY) is None


def test_one_queue_per_possible_cpu() -> None:
    assert uring.possible_cpus() >= len(os.sched_getaffinity(0))
