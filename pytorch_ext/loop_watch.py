"""Is this loop waiting for data? Time blocked in `next(loader)` against time between calls.

`watch(loader)` wraps a DataLoader (or any iterable of batches); `KSPEEDFS_WATCH=1` does the
same to every DataLoader with no change to the script (pytorch_ext.watch_hook). Per process
(one rank) one LoopMeter adds up the time blocked in next() and the time between a batch's
return and the next call (busy: the step). The stall is blocked / (blocked + busy); at the end
of each pass over the loader and at exit, one table on stderr says the verdict on TF
Profiler's scale and the accelerator utilisation against MLPerf Storage's 90%. The figures go
to the node once a second (kspeedfs.client.loop_reports), where `kspeedfs jobs` shows them.

A next() costs two clock reads and a few additions (bench/bench_stall.py measures it).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from time import perf_counter
from typing import Any, Generic, TypeVar

from kspeedfs.client import job_identity, read_times
from kspeedfs.format import stall

T = TypeVar("T")


class LoopMeter:
    """One process's training loop: seconds blocked and busy, batches and samples drawn."""

    __slots__ = ("blocked", "busy", "batches", "samples", "last", "printed", "pid", "report")

    def __init__(self) -> None:
        self.blocked = 0.0
        self.busy = 0.0
        self.batches = 0
        self.samples = 0
        self.last: float | None = None  # when the last batch was returned (None: no loop)
        self.printed = 0  # batches when the table was last printed
        self.pid = os.getpid()
        self.report: Any = None  # the reporter to the node, once the first batch came

    def enter(self) -> float:
        """At a call of next() (or iter()): the time since the last batch was busy."""
        now = perf_counter()
        if self.last is not None:
            self.busy += now - self.last
        return now

    def batch(self, since: float, samples: int) -> None:
        """A batch came after waiting since `since`."""
        if self.report is None:  # before the clock: the loop waits for this too
            self._first_batch()
        now = perf_counter()
        self.blocked += now - since
        self.batches += 1
        self.samples += samples
        self.last = now

    def started(self, since: float) -> None:
        """A pass began (iter() returned): starting the workers was waiting too."""
        self.last = perf_counter()
        self.blocked += self.last - since

    def exhausted(self, since: float) -> None:
        """The loader ran out: the wait counts, the time until the next pass does not."""
        self.blocked += perf_counter() - since
        self.last = None
        printing = perf_counter()
        self.print_table()
        self.blocked += perf_counter() - printing  # the loop waits for the table too

    def _first_batch(self) -> None:
        from kspeedfs.client.loop_reports import LoopReporter

        self.report = LoopReporter(self.figures)
        self.report.start()

    def figures(self) -> dict[str, Any]:
        """What a report sends: the loop's, and the batches fetched here (no workers)."""
        return {
            "blocked": self.blocked,
            "busy": self.busy,
            "batches": self.batches,
            "samples": self.samples,
            **worker_figures(),
        }

    def print_table(self) -> None:
        """The table on stderr, when batches came since it was last printed."""
        if self.batches == self.printed:
            return
        self.printed = self.batches
        try:
            sys.stderr.write(table(self.blocked, self.busy, self.batches, self.samples))
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed at exit
            pass


def table(blocked: float, busy: float, batches: int, samples: int) -> str:
    """The exit table: the verdict line, then the waiting, computing and rates."""
    share = stall.stall(blocked, busy)
    total = blocked + busy
    who = f"job {job_identity.this_job()} rank {job_identity.this_rank()}"

    def per_s(n: int) -> float:
        return n / total if total > 0 else 0.0

    return (
        f"kspeedfs watch ({who}): {stall.summary(blocked, busy)}\n"
        f"  waiting    {stall.duration(blocked):>10}  {share:6.1%}   "
        f"(TF Profiler: not input-bound < 5%, moderately 5-20%, highly > 20%)\n"
        f"  computing  {stall.duration(busy):>10}  {1 - share:6.1%}   {stall.au_verdict(share)}\n"
        f"  batches    {batches:>10,}  {per_s(batches):8.1f}/s   samples {samples:,} "
        f"({per_s(samples):.1f}/s)\n"
    )


_meter: LoopMeter | None = None
hooked: list[type] = []  # the DataLoader class KSPEEDFS_WATCH=1 patched (pytorch_ext.watch_hook)
_lock = threading.Lock()


def meter() -> LoopMeter:
    """This process's meter (a forked child starts its own)."""
    global _meter
    found = _meter
    if found is not None and found.pid == os.getpid():
        return found
    with _lock:
        if _meter is None or _meter.pid != os.getpid():
            _meter = LoopMeter()
            atexit.register(_meter.print_table)
        return _meter


def worker_figures() -> dict[str, Any]:
    """A process's batch fetches and the kspeedfs reads inside them (read_times)."""
    return {
        "fetch": read_times.fetch_seconds,
        "reads": {p: s for p, s in read_times.seconds.items() if s},
    }


_worker_reporter: Any = None  # this worker's reporter (one per process)
_worker_pid = -1


def _worker_fetched(started: float) -> None:
    """After a batch was fetched (in a worker, or in the loop's process without workers)."""
    global _worker_reporter, _worker_pid
    read_times.fetched(started)
    if _worker_pid != os.getpid():
        _worker_pid = os.getpid()
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:  # else the loop's own reports carry the fetches
            from kspeedfs.client.loop_reports import LoopReporter

            def figures() -> dict[str, Any]:
                return {"blocked": 0.0, "busy": 0.0, "batches": 0, "samples": 0} | {
                    **worker_figures(),
                    "worker": True,
                }

            _worker_reporter = LoopReporter(figures)
            _worker_reporter.start()


def time_workers() -> None:
    """Before a watched DataLoader starts its workers: their fetches and reads timed (the
    fetchers patched once; forked workers inherit it, spawned ones import it again through
    KSPEEDFS_WATCH's hook)."""
    read_times.enable()
    fetch_module = sys.modules.get("torch.utils.data._utils.fetch")
    if fetch_module is None:
        return
    for cls in (fetch_module._MapDatasetFetcher, fetch_module._IterableDatasetFetcher):
        if getattr(cls, "_kspeedfs_timed", False):
            continue
        original = cls.fetch

        def fetch(self: Any, index: Any, original: Any = original) -> Any:
            started = perf_counter()
            try:
                return original(self, index)
            finally:
                _worker_fetched(started)

        cls.fetch = fetch
        cls._kspeedfs_timed = True


def note_datasets(loader: object) -> None:
    """The dataset behind a loader's dataset folder, when it is on a kspeedfs mount (stock
    ImageFolder over the mount): named in the loop's reports. Fast-path datasets name theirs
    when they attach."""
    from kspeedfs.client import loop_reports, on_mount

    root = getattr(getattr(loader, "dataset", None), "root", None)
    if isinstance(root, (str, os.PathLike)):
        try:
            on = on_mount.behind(root)
        except (OSError, ValueError):
            return
        if on is not None:
            loop_reports.note_dataset(on.dataset)


class WatchedLoader(Generic[T]):
    """`loader`, each pass timed by this process's meter; everything else is the loader's."""

    def __init__(self, loader: Iterable[T]):
        self.loader = loader
        note_datasets(loader)
        self._samples = getattr(loader, "batch_size", None) or 1

    def __iter__(self) -> Iterator[T]:
        time_workers()
        m = meter()
        since = m.enter()
        it = iter(self.loader)  # starting the workers is waiting too
        while True:
            try:
                batch = next(it)
            except StopIteration:
                m.exhausted(since)
                return
            m.batch(since, self._samples)
            yield batch
            since = m.enter()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def watch(loader: Iterable[T]) -> Iterable[T]:
    """`loader` timed: its stall reported at the end of each pass, at exit and to the node.
    A DataLoader already watched by KSPEEDFS_WATCH=1 is returned as it is (timed once)."""
    if any(isinstance(loader, cls) for cls in hooked):
        return loader
    return WatchedLoader(loader)
