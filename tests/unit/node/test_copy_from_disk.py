"""The copy of a segment from the disk tier into memory (node/segments.py), which a preload's
promotion and a read-through promotion share: in process, on real files."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kspeedfs.format.localdata import DamagedSegment
from kspeedfs.node.segments import SegmentPlaces


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder on the shm filesystem, where promoted segments land."""
    root = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def disk_segment(folder: Path, data: bytes) -> Path:
    path = folder / "00000007"
    path.write_bytes(data)
    return path


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=70_000))
def test_a_sound_segment_arrives_whole(tmp_path: Path, shm: Path, data: bytes) -> None:
    src = disk_segment(tmp_path, data)
    dest = shm / f"promote.{uuid.uuid4().hex[:8]}"
    SegmentPlaces.copy_from_disk(src, dest, 7, len(data), xxhash.xxh3_64_intdigest(data), "seg 7")
    assert dest.read_bytes() == data
    assert os.stat(dest).st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    ("stored", "why"),
    [
        (b"x" * 999, "seg 7 is short"),
        (b"x" * 1001, "seg 7 is too long"),
        (b"y" * 1000, "seg 7 fails its checksum"),
    ],
)
def test_a_damaged_segment_is_refused_naming_it(
    tmp_path: Path, shm: Path, stored: bytes, why: str
) -> None:
    """Cut short, grown or changed on disk: refused in one line, the segment named."""
    src = disk_segment(tmp_path, stored)
    with pytest.raises(DamagedSegment) as refused:
        SegmentPlaces.copy_from_disk(
            src, shm / "dest", 7, 1000, xxhash.xxh3_64_intdigest(b"x" * 1000), "seg 7"
        )
    assert str(refused.value) == why
    assert refused.value.segments == [7]


def test_no_checksum_checks_only_the_length(tmp_path: Path, shm: Path) -> None:
    src = disk_segment(tmp_path, b"z" * 100)
    SegmentPlaces.copy_from_disk(src, shm / "dest", 7, 100, 0, "seg 7")
    assert (shm / "dest").read_bytes() == b"z" * 100
