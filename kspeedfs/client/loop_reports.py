"""A watched training loop's figures sent to this machine's node once a second.

The loop (pytorch_ext.watch) counts; this sends its running totals (a lost report loses
nothing) with the job's identity and the datasets this process opened, from one daemon thread
per process, never from the loop. Without a node to report to (none configured, none
listening, a refusal) the loop goes on and its exit table still prints; the failure is logged
once. KSPEEDFS_WATCH_REPORT=0 turns the reports off.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
from collections.abc import Callable
from typing import Any

from kspeedfs.client import job_identity
from kspeedfs.format.config import load_settings
from kspeedfs.format.contract.jobs import MAX_DATASETS, LoopReport
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient

log = logging.getLogger(__name__)

REPORT_EVERY_S = 1.0
Figures = Callable[[], dict[str, Any]]  # a LoopReport's figures: blocked, busy, ...

_datasets: dict[str, None] = {}  # the datasets this process opened, in order


def note_dataset(name: str) -> None:
    """A dataset this process reads (a fast-path dataset when it attaches, a mounted folder's
    dataset when a watched loader's dataset sits on a mount)."""
    if name and len(_datasets) < MAX_DATASETS:
        _datasets.setdefault(name, None)


def datasets() -> list[str]:
    return list(_datasets)


class LoopReporter:
    """One process's reports: a thread sending `figures()` (LoopReport's fields but the job's
    identity and datasets) every REPORT_EVERY_S, and once more at exit (a DataLoader worker's
    too: multiprocessing runs its finalizers)."""

    def __init__(self, figures: Figures):
        self._figures = figures
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread and the exit share one connection
        self._client: NodeClient | None = None
        self._identity = (job_identity.this_job(), job_identity.this_rank(), os.getpid())
        self.sent = 0
        self.failed = 0

    def start(self) -> None:
        if os.environ.get("KSPEEDFS_WATCH_REPORT", "1") == "0":
            return
        thread = threading.Thread(target=self._run, name="kspeedfs-loop-report", daemon=True)
        thread.start()
        multiprocessing.util.Finalize(self, self.send, exitpriority=10)

    def _connect(self) -> NodeClient:
        settings = load_settings({}, cli_origin="the watched loop")
        nodes = [str(a) for a in settings.nodes]
        me = str(settings.listen)
        address = me if me in nodes else nodes[0]
        client = NodeClient(
            parse_address(address),
            settings.credential(),
            settings.timeout,
            client_context(settings),
        )
        client.connect()
        return client

    def send(self) -> None:
        """One report of the figures so far (a failure is logged once, tried again next time)."""
        job, rank, pid = self._identity
        report = LoopReport(job=job, rank=rank, pid=pid, datasets=datasets(), **self._figures())
        with self._lock:
            try:
                self._client = self._client or self._connect()
                self._client.call(report)
                self.sent += 1
            except (KSpeedError, OSError, IndexError) as e:
                level = logging.DEBUG if self.sent or self.failed else logging.INFO
                log.log(level, "the loop's figures reach no node (tried again): %s", e)
                self.failed += 1
                if self._client is not None:
                    self._client.close()
                self._client = None

    def _run(self) -> None:
        while True:  # the first report at once: the node's seconds start with the loop
            self.send()
            if self._stop.wait(REPORT_EVERY_S):
                return
