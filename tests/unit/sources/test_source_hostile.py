"""Hostile sources, as a property: whatever happens to the files while a preload copies them
(rewritten in place, truncated, extended, touched back to their old mtime, replaced by a
symlink, a FIFO or a folder, removed), every staged file is the version the scan listed, or
the load fails with one line and its staging is removed.

The node's own stager code runs in-process (`load_segments` into a `SegmentStore`'s staging,
two fill threads), a node per example being far too slow for thousands of examples. A
mutation fires when the copy has landed a chosen number of bytes: from the progress counter
the loader updates after each piece, so the other fill thread may be mid-copy of any file.
KSPEEDFS_HOSTILE_EXAMPLES sets the example count (the suite runs 100).
"""

from __future__ import annotations

import functools
import mmap
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kspeedfs.format.errors import KSpeedError, SourceChanged
from kspeedfs.format.layout import Layout, plan_layout
from kspeedfs.format.localdata import segment_path
from kspeedfs.format.tree import Tree
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.loader import Progress, load_segments
from kspeedfs.sources.source import LocalSource

SEGMENT = 4096
EXAMPLES = int(os.environ.get("KSPEEDFS_HOSTILE_EXAMPLES", "100"))
KINDS = ("rewrite", "restore-mtime", "truncate", "extend", "symlink", "fifo", "folder", "remove")


def _mutate(path: Path, kind: str) -> None:
    if path.is_symlink() or not path.is_file():
        return  # replaced or removed by an earlier mutation
    if kind in ("rewrite", "restore-mtime"):
        before = path.stat()
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(bytes(b ^ 0xFF for b in data) or b"")
        if kind == "restore-mtime":  # only ctime tells
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif kind == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "extend":
        with open(path, "ab") as f:
            f.write(b"more")
    else:
        path.unlink()
        if kind == "symlink":
            os.symlink("elsewhere", path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()


class _Mutating(Progress):
    """The loader's progress, which applies each (bytes landed, mutation) once the copy has
    landed that many bytes."""

    def __init__(self, plan: list[tuple[int, Callable[[], None]]]):
        self._plan = sorted(plan, key=lambda p: p[0])
        self._landed = 0
        super().__init__()

    @property  # type: ignore[override]
    def bytes_done(self) -> int:
        return self._landed

    @bytes_done.setter
    def bytes_done(self, value: int) -> None:
        self._landed = value
        while self._plan and self._plan[0][0] <= value:
            self._plan.pop(0)[1]()


@pytest.fixture(scope="module")
def store() -> Iterator[SegmentStore]:
    root = Path("/dev/shm") / f"kspeedfs-test-{uuid.uuid4().hex[:10]}"
    s = SegmentStore(root, 1 << 30, events=DatasetEvents())
    s.recover(verify=False)
    yield s
    shutil.rmtree(root, ignore_errors=True)


def _staged(staging: Path, layout: Layout, i: int) -> bytes:
    out = bytearray()
    for seg, off, n in layout.ranges(i):
        with (
            open(segment_path(staging, seg), "rb") as f,
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m,
        ):
            out += m[off : off + n]
    return bytes(out)


def _files(tree: Tree) -> list[int]:
    return [i for i, m in enumerate(tree.mode) if stat.S_ISREG(m)]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(st.integers(0, 3 * SEGMENT), min_size=1, max_size=6),
    mutations=st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from(KINDS), st.floats(0, 1.1)), max_size=3
    ),
)
def test_a_hostile_source_yields_listed_versions_or_one_line_and_nothing(
    store: SegmentStore,
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    mutations: list[tuple[int, str, float]],
) -> None:
    root = tmp_path_factory.mktemp("src")
    for k, size in enumerate(sizes):
        (root / f"f{k}.bin").write_bytes(os.urandom(size))
    src = LocalSource(str(root))
    tree = src.scan()
    listed = {i: (root / os.fsdecode(tree.path(i))).read_bytes() for i in _files(tree)}
    offsets, seg_len = plan_layout(tree, SEGMENT)
    layout = Layout.of_tree(tree, offsets, seg_len, SEGMENT)
    total = sum(sizes)
    plan = [
        (int(at * total), functools.partial(_mutate, root / f"f{k % len(sizes)}.bin", kind))
        for k, kind, at in mutations
    ]
    before = [f for at, f in plan if at == 0]  # after the scan, before the first copy
    for f in before:
        f()
    progress = _Mutating([p for p in plan if p[0] > 0])
    staging = store.new_staging("hostile")
    try:
        checksums = load_segments(src, tree, layout, range(len(seg_len)), staging, progress)
    except KSpeedError as e:
        assert isinstance(e, SourceChanged), e
        assert "\n" not in str(e) and str(e)
        store.discard_staging(staging)
        assert not staging.exists() and not store.datasets
        event("failed in one line")
        return
    for i, data in listed.items():
        assert _staged(staging, layout, i) == data, tree.path(i)
        if i in checksums:
            assert checksums[i] == xxhash.xxh3_64_intdigest(data)
    store.discard_staging(staging)
    event("staged the listed versions")
