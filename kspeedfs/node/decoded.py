"""Decoded variants on a node: each node decodes the images it holds, in a process pool sized to
its cores, into `decoded-N/` inside the dataset folder (unloaded with it, counted in the budget).

The pool reads image headers first (sizes, so the budget is checked and the pixel segments
allocated before any decoding), then decodes chunks straight into the mapped segments. Workers
keep a large malloc top pad: PIL's decode is nearly twice as slow when the heap keeps growing
and shrinking around each image.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import logging
import multiprocessing
import os
import select
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import trio
from PIL import Image

from kspeedfs.format import decoded as fmt
from kspeedfs.format.contract.decoded import (
    DatasetVariants,
    Decode,
    DecodeDrop,
    DecodeDropped,
    DecodeLocal,
    DecodeStarted,
    DecodeStatus,
    MemberVariants,
    VariantProgress,
    VariantState,
    VariantSummary,
)
from kspeedfs.format.errors import (
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
    ProtocolError,
    StaleDataset,
)
from kspeedfs.format.units import format_size
from kspeedfs.node.events import DatasetEvents
from kspeedfs.node.ops import ADMIN, JOB, READ, OpRegistry
from kspeedfs.node.peers import Ask, ask_all
from kspeedfs.node.safedir import DIR_FLAGS, remove_beneath
from kspeedfs.node.store import SegmentStore
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.system.memory import keep_freed_memory

log = logging.getLogger(__name__)

CHUNK = 32  # images per pool task
PROBE_CHUNK = 256  # images per header-reading task


def variant_key(name: str, size: int) -> str:
    """The variant's budget reservation in the store."""
    return f"{name}@{size}"


# ---- the pool's side (plain functions: they run in worker processes) ----

_worker_cache: dict[str, Any] = {}


def _init_worker(node_pid: int = 0) -> None:
    keep_freed_memory()
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    if node_pid:
        _end_with(node_pid)


def _end_with(node_pid: int) -> None:
    """Exit when the node does. A killed node's pool would otherwise live on: its workers are
    the forkserver's children and hold the pipe whose end tells the forkserver to exit."""
    try:
        pidfd = os.pidfd_open(node_pid)
    except OSError:
        return  # gone already, or no pidfd: the pool ends when the node shuts it down

    def watch() -> None:
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="node watch").start()


def _dataset(path: str) -> LocalDataset:
    ds = _worker_cache.get(path)
    if ds is None:
        ds = _worker_cache[path] = LocalDataset(path)
    assert isinstance(ds, LocalDataset)
    return ds


def probe(dataset: str, entries: list[int]) -> list[tuple[int, int] | None]:
    """(width, height) from each image's header, or None when it has none readable."""
    ds = _dataset(dataset)
    out: list[tuple[int, int] | None] = []
    for e in entries:
        try:
            with Image.open(io.BytesIO(ds.file_view(e))) as img:
                out.append(img.size)
        except Exception:  # anything PIL raises on a bad file
            out.append(None)
    return out


def fill_chunk(
    dataset: str, variant: str, size: int, work: list[tuple[int, int, int, int, int]]
) -> list[tuple[int, int]]:
    """Decode (entry, segment, offset, width, height) into the variant's mapped segments;
    returns (entry, READY or UNDECODABLE)."""
    ds = _dataset(dataset)
    out = []
    for e, seg, off, w, h in work:
        img = fmt.decode_checked(ds.file_view(e), size)
        if img is None or img.size != (w, h):
            log.debug("entry %d of %s does not decode", e, dataset)
            out.append((e, fmt.UNDECODABLE))
            continue
        header = fmt.ppm_header(w, h)
        # Written, not stored through a map: the kernel copies into the pages fallocate
        # claimed with no page fault per 4 KiB (measured: a map's faults were ~10% of a fill).
        os.pwritev(_segment(variant, seg), [header, img.tobytes()], off - len(header))
        out.append((e, fmt.READY))
    return out


def _segment(variant: str, seg: int) -> int:
    """An open descriptor of the variant's segment `seg`, kept for the worker's life."""
    key = f"{variant}\0{seg}"
    fd = _worker_cache.get(key)
    if fd is None:
        path = fmt.segment_path(Path(variant), seg)
        fd = _worker_cache[key] = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    assert isinstance(fd, int)
    return fd


# ---- the node's side ----


@dataclasses.dataclass
class VariantFill:
    """One variant on this node: filling, ready, or failed."""

    name: str
    uuid: str
    size: int
    folder: Path
    files_total: int = 0
    files_done: int = 0
    undecodable: int = 0
    bytes_total: int = 0  # pixels + index
    state: VariantState = "probing"
    error: str = ""
    started: float = dataclasses.field(default_factory=time.monotonic)
    elapsed: float = 0.0
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    # (entry, segment, offset, width, height) of each image to decode
    work: list[tuple[int, int, int, int, int]] = dataclasses.field(default_factory=list)

    def progress(self) -> VariantProgress:
        return VariantProgress(
            size=self.size,
            state=self.state,
            error=self.error,
            files_total=self.files_total,
            files_done=self.files_done,
            undecodable=self.undecodable,
            bytes=self.bytes_total,
            elapsed=self.elapsed if self.finished.is_set() else time.monotonic() - self.started,
        )


class DecodedVariants:
    """The variants this node holds: fills them, lists them, drops them with their dataset."""

    def __init__(
        self,
        store: SegmentStore,
        events: DatasetEvents,
        address: str,
        ask: Ask,
        workers: int | None = None,
    ):
        self.store = store
        self.address = address
        self._ask = ask  # a request on a member (this node's own answered in process)
        self.workers = workers or os.cpu_count() or 1
        self.fills: dict[tuple[str, int], VariantFill] = {}
        self._lock = threading.Lock()
        events.follow(self)

    def register_ops(self, ops: OpRegistry) -> None:
        ops.add(Decode, self.op_decode, JOB)
        ops.add(DecodeLocal, self.op_decode_local, ADMIN)
        ops.add(DecodeDrop, self.op_decode_drop, ADMIN)
        ops.add(DecodeStatus, self.op_decode_status, READ)

    def local_status(self, name: str) -> dict[str, VariantProgress]:
        """{size: fill state} of a dataset's variants here (for `list`)."""
        return {str(s): f.progress() for (n, s), f in list(self.fills.items()) if n == name}

    async def after_preload(self, name: str, uuid: str, size: Any) -> None:
        """`preload --decoded N`: start the variant once the dataset is published (a refusal
        is logged and shown by the variant's state; the dataset stays)."""
        try:
            await self.op_decode(Decode.from_wire({"name": name, "uuid": uuid, "size": size}))
        except KSpeedError as e:
            log.error("decoded variant %s@%s not started: %s", name, size, e)

    # -- ops --

    async def op_decode(self, request: Decode) -> DecodeStarted:
        """Start the variant on every member of the dataset; a member that refuses (budget)
        makes it be dropped everywhere."""
        name, size = request.name, request.size
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        if request.uuid and request.uuid != record.uuid:
            raise StaleDataset(f"dataset {name!r} was loaded again: the instance asked for is gone")
        members = record.members or [self.address]
        fill = DecodeLocal(name=name, uuid=record.uuid, size=size)
        answers, errors = await ask_all(self._ask, members, fill)
        if errors:
            for member in members:
                try:
                    await self._ask(member, DecodeDrop(name=name, size=size))
                except KSpeedError as e:
                    log.warning("dropping the variant %s@%d on %s: %s", name, size, member, e)
            raise errors[0]
        parts = {member: a for member, a in answers.items()}
        return DecodeStarted(
            name=name,
            uuid=record.uuid,
            size=size,
            files_total=sum(p.files_total for p in parts.values()),
            bytes=sum(p.bytes for p in parts.values()),
            nodes=parts,
        )

    async def op_decode_local(self, request: DecodeLocal) -> VariantProgress:
        fill = await trio.to_thread.run_sync(self.start, request.name, request.uuid, request.size)
        return fill.progress()

    async def op_decode_drop(self, request: DecodeDrop) -> DecodeDropped:
        await trio.to_thread.run_sync(self.drop, request.name, request.size)
        return DecodeDropped(node=self.address)

    async def op_decode_status(self, request: DecodeStatus) -> MemberVariants | DatasetVariants:
        """This node's variants of a dataset (`local`), or every member's."""
        name = request.name
        if request.local:
            return MemberVariants(node=self.address, variants=self.local_status(name))
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        here = DecodeStatus(name=name, local=True)
        held: list[dict[str, VariantProgress]] = []
        nodes: dict[str, dict[str, Any]] = {}
        for member in record.members or [self.address]:
            try:
                answer = await self._ask(member, here)
                if not isinstance(
                    answer, MemberVariants
                ):  # (every member's, asked without `local`)
                    raise ProtocolError(f"{member} answered decode_status for every member")
                variants = answer.variants
            except KSpeedError as e:
                nodes[member] = {"error": str(e)}
                continue
            held.append(variants)
            nodes[member] = {size: v.to_wire() for size, v in variants.items()}
        return DatasetVariants(name=name, uuid=record.uuid, nodes=nodes, variants=summarize(held))

    # -- work --

    def start(self, name: str, uuid: str, size: int) -> VariantFill:
        """Probe the held images, reserve the budget (NoSpace before any decoding), allocate
        the variant, then fill it in the background. An existing variant is returned as is."""
        record = self.store.datasets.get(name)
        if record is None or (uuid and record.uuid != uuid):
            raise NotFound(f"no dataset {name!r} of that instance on {self.address}")
        with self._lock:
            current = self.fills.get((name, size))
            if current is not None and current.uuid == record.uuid and current.state != "failed":
                return current
            fill = VariantFill(name, record.uuid, size, record.path / fmt.variant_dir(size))
            self.fills[(name, size)] = fill
        pool = self._pool()  # one for the header pass and the fill: its workers start once
        try:
            self._plan(fill, pool)
        except BaseException as e:
            pool.shutdown(cancel_futures=True)
            self._failed(fill, e)
            self._remove(fill)
            raise
        threading.Thread(
            target=self._run, args=(fill, pool), daemon=True, name=f"decode {name}"
        ).start()
        return fill

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # forkserver: the node has threads (trio's, loaders'), fork would copy their locks.
        # The server imports this module once, so a pool's workers start in milliseconds
        # instead of importing it each (~0.35 s of a core per worker, per pool).
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        return concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=context, initializer=_init_worker, initargs=(os.getpid(),)
        )

    def _plan(self, fill: VariantFill, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        ds = self.store.open(fill.name)
        m = ds.manifest
        files = [
            i for i in m.iter_files() if fmt.is_image(m.name(i)) and m.size[i] and ds.holds_file(i)
        ]
        dims: list[tuple[int, int] | None] = []
        if files:
            step = max(1, min(PROBE_CHUNK, len(files) // (4 * self.workers)))
            chunks = [files[k : k + step] for k in range(0, len(files), step)]
            for got in pool.map(probe, [str(ds.path)] * len(chunks), chunks):
                dims.extend(got)
        state = np.full(m.entries, fmt.NOT_HERE, dtype="u1")
        height = np.zeros(m.entries, dtype="<u4")
        width = np.zeros(m.entries, dtype="<u4")
        planned: list[int] = []
        for e, d in zip(files, dims, strict=True):
            if d is None:
                state[e] = fmt.UNDECODABLE
                continue
            w, h = fmt.resized_size(d[0], d[1], fill.size)
            state[e], width[e], height[e] = fmt.ABSENT, w, h
            planned.append(e)
        headers = [len(fmt.ppm_header(int(width[e]), int(height[e]))) for e in planned]
        sizes = [
            n + fmt.pixel_bytes(int(width[e]), int(height[e]))
            for e, n in zip(planned, headers, strict=True)
        ]
        segs, offs, seg_len = fmt.pack(sizes, m.segment_size)
        seg = np.zeros(m.entries, dtype="<u4")
        off = np.zeros(m.entries, dtype="<u8")
        seg[planned] = segs
        off[planned] = np.asarray(offs, dtype="<u8") + np.asarray(headers, dtype="<u8")
        fill.files_total = len(files)
        fill.undecodable = len(files) - len(planned)
        fill.files_done = fill.undecodable  # no header: nothing to decode
        fill.bytes_total = sum(seg_len) + fmt.index_bytes(m.entries)
        allocated = [0]  # the variant's files are allocated here, before any decoding
        self.store.budgets.reserve(
            variant_key(fill.name, fill.size), fill.bytes_total, written=lambda: allocated[0]
        )
        try:
            fill.folder.mkdir(mode=0o750)
            (fill.folder / fmt.SEGMENT_DIR).mkdir(mode=0o750)
            for k, length in enumerate(seg_len):
                path = fmt.segment_path(fill.folder, k)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
                try:
                    if length:
                        os.posix_fallocate(fd, 0, length)  # memory claimed now: ENOSPC now
                        allocated[0] += length
                finally:
                    os.close(fd)
            header = {"uuid": fill.uuid, "name": fill.name, "size": fill.size, "entries": m.entries}
            arrays = {"state": state, "height": height, "width": width, "seg": seg, "off": off}
            fmt.write_index(fill.folder / fmt.INDEX_FILE, arrays, header)
        except OSError as e:
            raise NoSpace(f"cannot allocate the decoded variant on {self.address}: {e}") from None
        fill.work = [(e, int(seg[e]), int(off[e]), int(width[e]), int(height[e])) for e in planned]
        fill.state = "filling"
        log.info(
            "decoding %d images of %s at %d on %s: %s",
            len(planned),
            fill.name,
            fill.size,
            self.address,
            format_size(fill.bytes_total),
        )

    def _run(self, fill: VariantFill, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        work = fill.work
        try:
            index = fmt.VariantIndex(fill.folder / fmt.INDEX_FILE, writable=True)
            dataset = str(fill.folder.parent)
            with pool:
                pending: set[concurrent.futures.Future[list[tuple[int, int]]]] = set()
                chunks = iter(range(0, len(work), CHUNK))
                for k in chunks:
                    if fill.cancel.is_set():
                        break
                    pending.add(
                        pool.submit(
                            fill_chunk, dataset, str(fill.folder), fill.size, work[k : k + CHUNK]
                        )
                    )
                    if len(pending) < 4 * self.workers:
                        continue
                    done, pending = concurrent.futures.wait(
                        pending, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    self._mark(fill, index, done)
                while pending and not fill.cancel.is_set():
                    done, pending = concurrent.futures.wait(
                        pending, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    self._mark(fill, index, done)
                for f in pending:
                    f.cancel()
            if fill.cancel.is_set():
                raise KSpeedError("cancelled")
            index.set_complete()
            fill.state = "ready"
            fill.elapsed = time.monotonic() - fill.started
            log.info(
                "decoded %d images of %s at %d on %s in %.1fs (%d undecodable)",
                fill.files_done,
                fill.name,
                fill.size,
                self.address,
                fill.elapsed,
                fill.undecodable,
            )
        except BaseException as e:
            self._failed(fill, e)
            if not fill.cancel.is_set():
                self._remove(fill)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # done already, unless it failed early
            fill.finished.set()

    def _mark(
        self,
        fill: VariantFill,
        index: fmt.VariantIndex,
        done: set[concurrent.futures.Future[list[tuple[int, int]]]],
    ) -> None:
        for f in done:
            for e, state in f.result():
                index.mark(e, state)
                fill.files_done += 1
                fill.undecodable += state == fmt.UNDECODABLE

    def _failed(self, fill: VariantFill, e: BaseException) -> None:
        fill.state = "failed"
        fill.error = str(e) if isinstance(e, KSpeedError) else f"{type(e).__name__}: {e}"
        fill.elapsed = time.monotonic() - fill.started
        fill.finished.set()
        if not fill.cancel.is_set():
            log.error("decoded variant %s@%d failed: %s", fill.name, fill.size, fill.error)

    def _remove(self, fill: VariantFill) -> None:
        """Remove the variant's folder and release its budget."""
        self.store.budgets.release(variant_key(fill.name, fill.size))
        record = self.store.datasets.get(fill.name)
        if record is None or record.uuid != fill.uuid:
            return  # the dataset went, and the variant with it
        try:
            fd = os.open(record.path, DIR_FLAGS)
        except OSError:
            return
        try:
            remove_beneath(fd, fill.folder.name)
        finally:
            os.close(fd)

    def drop(self, name: str, size: int) -> None:
        """Stop and remove a variant (a member refused it, or an admin asked)."""
        with self._lock:
            fill = self.fills.pop((name, size), None)
        if fill is None:
            return
        fill.cancel.set()
        fill.finished.wait(60)
        self._remove(fill)

    def unloading(self, name: str) -> None:
        """Before the dataset's files go: stop its fills, release their budget."""
        with self._lock:
            fills = [(k, f) for k, f in self.fills.items() if k[0] == name]
            for k, _f in fills:
                del self.fills[k]
        for k, f in fills:
            f.cancel.set()
            self.store.budgets.release(variant_key(*k))

    def published(self, name: str) -> None:
        """A dataset became visible (published, or found at start): take its complete variants
        back into the budget; an incomplete one (the node stopped mid-fill) is removed."""
        record = self.store.datasets.get(name)
        if record is None or not record.path.is_dir():
            return
        for folder in sorted(record.path.glob("decoded-*")):
            try:
                size = int(folder.name.split("-", 1)[1])
                index = fmt.VariantIndex(folder / fmt.INDEX_FILE)
                if index.uuid != record.uuid or not index.complete:
                    raise InvalidArgument("incomplete")
                counts = index.counts()
                nbytes = sum(p.stat().st_size for p in (folder / fmt.SEGMENT_DIR).iterdir())
                nbytes += (folder / fmt.INDEX_FILE).stat().st_size
                fill = VariantFill(name, record.uuid, size, folder, state="ready")
                fill.files_total = counts["ready"] + counts["undecodable"]
                fill.files_done = fill.files_total
                fill.undecodable = counts["undecodable"]
                fill.bytes_total = nbytes
                fill.finished.set()
                # Found complete: all of it is on the filesystem.
                on_disk = functools.partial(int, nbytes)
                self.store.budgets.reserve(variant_key(name, size), nbytes, written=on_disk)
                self.fills[(name, size)] = fill
                log.info("found decoded variant %s@%d: %s", name, size, format_size(nbytes))
            except (KSpeedError, OSError, ValueError) as e:
                log.warning("removing decoded variant %s/%s: %s", name, folder.name, e)
                fd = os.open(record.path, DIR_FLAGS)
                try:
                    remove_beneath(fd, folder.name)
                finally:
                    os.close(fd)


def summarize(members: list[dict[str, VariantProgress]]) -> dict[str, VariantSummary]:
    """Per size, over the members' variants: files done / total, bytes, the worst state."""
    out: dict[str, VariantSummary] = {}
    rank = {"ready": 0, "filling": 1, "probing": 2, "failed": 3}
    for variants in members:
        for size, v in variants.items():
            s = out.get(size) or VariantSummary(size=int(size), state="ready")
            worst = rank[v.state] > rank[s.state]
            out[size] = dataclasses.replace(
                s,
                state=v.state if worst else s.state,
                error=v.error if worst else s.error,
                files_total=s.files_total + v.files_total,
                files_done=s.files_done + v.files_done,
                undecodable=s.undecodable + v.undecodable,
                bytes=s.bytes + v.bytes,
                nodes=s.nodes + 1,
            )
    return out
