"""Where a watched job's DataLoader workers spend their time: kspeedfs reads by path, and the
rest of fetching a batch (decode, transforms: CPU).

The read policy (client/reader.py) calls `done` once per read with the path that served it
(`local`: this node's map, `remote`: another node or this one over its socket, a fill it
asked for included; `source`: the source, because no copy could serve it); the worker's batch
fetch is timed around the dataset's __getitem__ calls (pytorch_ext.loop_watch). Off unless a
watched loop turned it on in this process or its parent (KSPEEDFS_WATCH_READS for spawned
workers): then a read pays one bool test. A zero-copy view of the local map is not a read
here (its page faults land in the CPU share).
"""

from __future__ import annotations

import os
from time import perf_counter

PATHS = ("local", "remote", "source")
ENV = "KSPEEDFS_WATCH_READS"

enabled = os.environ.get(ENV, "") == "1"
seconds: dict[str, float] = dict.fromkeys(PATHS, 0.0)
fetch_seconds = 0.0  # the batches' fetches, the reads inside them included


def enable() -> None:
    """Time reads in this process and in workers it starts (forked or spawned)."""
    global enabled
    enabled = True
    os.environ[ENV] = "1"


def start() -> float:
    """Before a read: its start, or 0 when reads are not timed."""
    return perf_counter() if enabled else 0.0


def done(started: float, path: str) -> None:
    """After a read that began at `started` (start()'s answer) and that `path` served."""
    if started:
        seconds[path] += perf_counter() - started


def fetched(started: float) -> None:
    """After a worker fetched a batch from `started`."""
    global fetch_seconds
    fetch_seconds += perf_counter() - started


def reset() -> None:
    """A new worker process: the counts it inherited are its parent's."""
    global fetch_seconds
    for path in PATHS:
        seconds[path] = 0.0
    fetch_seconds = 0.0


def cause(read: dict[str, float], fetch: float) -> dict[str, float]:
    """The share of the workers' fetch time per read path and `cpu` (the rest)."""
    if fetch <= 0:
        return {}
    shares = {path: read.get(path, 0.0) / fetch for path in PATHS}
    shares["cpu"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


os.register_at_fork(after_in_child=reset)
