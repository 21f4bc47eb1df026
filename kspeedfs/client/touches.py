"""A process's reads of a read-through dataset through its maps, reported to the node.

The node sees a read of one of its segments only when it serves it (a fill, another node's
read); a read of its shared memory through a process's map is invisible to its eviction policy
and its hit counters. The mount reports its processes' reads (`touch`, every second, from its
supervisor); this is the same report for a fast-path or fsspec reader: the segments read and
the reads that hit, sent by one thread per process and dataset, at most once per REPORT_READS
reads or REPORT_EVERY_S seconds, never on the read path (a read only counts and, past
REPORT_READS, wakes the thread). A report that fails is dropped: its reads go uncounted, the
data is not affected.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import weakref
from dataclasses import dataclass

from kspeedfs.client.handle import DatasetHandle
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.contract.readthrough import Touch
from kspeedfs.format.errors import KSpeedError
from kspeedfs.system.readthrough_view import ReadThroughDataset

log = logging.getLogger(__name__)

REPORT_READS = 1024  # a report as soon as this many reads wait...
REPORT_EVERY_S = 1.0  # ...else at most this long after the last one (the mount's interval)


@dataclass
class _Target:
    """What a report needs, apart from the reporter (its thread and exit hook hold this)."""

    cluster: ClusterReader
    node: str
    name: str
    uuid: str
    local: ReadThroughDataset
    logged: bool = False  # a failed report was logged: later ones are not, at warning level
    last_failed: bool = False

    def send(self) -> None:
        """One report of the reads since the last one (nothing when there were none)."""
        segments, hits = self.local.drain_touches()
        if not segments and not hits:
            return
        request = Touch(name=self.name, uuid=self.uuid, segments=segments, hits=hits)
        try:
            self.cluster.pool.call(self.node, request)
            self.last_failed = False
        except KSpeedError as e:
            self.last_failed = True
            level = logging.DEBUG if self.logged else logging.WARNING
            self.logged = True
            log.log(level, "%s: reads not reported to %s (dropped): %s", self.name, self.node, e)

    def send_at_exit(self) -> None:
        """The last report, unless the one before failed: exit waits for no node that is
        down."""
        if not self.last_failed:
            self.send()


class TouchReporter:
    """Reports of one dataset's reads through this process's maps, sent to the local node."""

    def __init__(self, cluster: ClusterReader, node: str, handle: DatasetHandle):
        assert isinstance(handle.local, ReadThroughDataset)
        self._target = _Target(cluster, node, handle.name, handle.uuid, handle.local)
        self._pid = -1  # the process whose thread reports (none yet)
        self._wake = threading.Event()
        _reporters.add(self)

    def note(self) -> None:
        """After a read (on the read path, which counted its hits): the thread starts with the
        first read in each process, and wakes early once REPORT_READS reads wait."""
        if self._pid != os.getpid():
            self._start()
        if self._target.local.hits >= REPORT_READS:
            self._wake.set()

    def _start(self) -> None:
        with _start_lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            thread = threading.Thread(
                target=_report_loop,
                args=(weakref.ref(self), self._wake, self._target),
                name=f"kspeedfs-touch-{self._target.name}",
                daemon=True,
            )
            thread.start()
            # At exit (a DataLoader worker's too: multiprocessing runs these), the last reads.
            multiprocessing.util.Finalize(self, self._target.send_at_exit, exitpriority=10)

    def _forked(self) -> None:
        """In a child process: no thread yet, and the counts it inherited are the parent's."""
        self._pid = -1
        self._wake = threading.Event()
        self._target.local.drain_touches()


def _report_loop(
    reporter: weakref.ref[TouchReporter], wake: threading.Event, target: _Target
) -> None:
    """The reporting thread: a report per wake-up or REPORT_EVERY_S, until the reporter goes."""
    while reporter() is not None:
        wake.wait(REPORT_EVERY_S)
        wake.clear()
        target.send()


_reporters: weakref.WeakSet[TouchReporter] = weakref.WeakSet()
_start_lock = threading.Lock()


def _after_fork() -> None:
    global _start_lock
    _start_lock = threading.Lock()  # a thread of the parent may have held it
    for reporter in list(_reporters):
        reporter._forked()


os.register_at_fork(after_in_child=_after_fork)
