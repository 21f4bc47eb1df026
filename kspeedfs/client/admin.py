"""Client-side admin operations shared by the CLI, the demo, the fast path and mountd."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import NodeStatus, Status, Unload
from kspeedfs.format.contract.preload import (
    LoadProgress,
    Preload,
    PreloadStarted,
    Progressing,
    Published,
)
from kspeedfs.format.contract.readthrough import FillSegment, RegisterSource
from kspeedfs.format.errors import (
    AlreadyExists,
    DataError,
    KSpeedError,
    NodeUnreachable,
    NotFound,
)
from kspeedfs.format.names import validate_name
from kspeedfs.format.tls import client_context
from kspeedfs.net.connection import SCAN_TIMEOUT, NodeClient
from kspeedfs.sources.naming import name_from_source, normalize_source
from kspeedfs.system.progress import ProgressBar

log = logging.getLogger(__name__)

# The longest a waiting client goes without an answer to `progress` (it is long-polled: a
# change of state is answered at once); its progress bar moves that often.
PROGRESS_WAIT_S = 0.5
# How often a client waiting for a starting node tries again.
RETRY_S = 0.5


def connect(settings: Settings) -> NodeClient:
    """A connection to the first node of the list that answers."""
    error: KSpeedError | None = None
    for address in settings.nodes:
        client = NodeClient(
            address, settings.credential(), settings.timeout, client_context(settings)
        )
        try:
            client.connect()
            return client
        except NodeUnreachable as e:
            error = e
    assert error is not None
    raise error


def connect_within(settings: Settings, seconds: float) -> NodeClient:
    """connect(), tried again while no node listens, for up to `seconds`: a node that is still
    starting (at boot, or restarting) answers within them; else the last NodeUnreachable."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return connect(settings)
        except NodeUnreachable as e:
            if time.monotonic() + RETRY_S > deadline:
                raise
            log.debug("waiting for a node: %s", e)
        time.sleep(RETRY_S)


def load_status(
    client: NodeClient, name: str, wait_for_change_after: int = -1, wait_s: float = 0.0
) -> Progressing | Published:
    """`progress` of `name`: its load's progress, or its record once published; long-polled
    past `wait_for_change_after` (a version seen before) for up to `wait_s` seconds."""
    request = LoadProgress(name=name, wait_for_change_after=wait_for_change_after, wait_s=wait_s)
    return client.call(request)


def preload_done(progress: Progressing | Published, what: str) -> bool:
    """The one reading of a `progress` answer: True once ready, False while loading; a failed
    load raises DataError ("{what} failed: why")."""
    if progress.state == "ready":
        return True
    if progress.state == "failed":
        raise DataError(f"{what} failed: {progress.error}")
    return False


def wait_ready(
    client: NodeClient,
    name: str,
    what: str | None = None,
    progress_label: str | None = None,
    wait_s: float = PROGRESS_WAIT_S,
) -> Progressing | Published:
    """Wait for `name` to be ready (returns the last `progress` answer) or failed (DataError):
    `progress` is long-polled, answered when the load's state changes or after `wait_s`.

    `progress_label` shows a progress bar with that label.
    """
    what = what or f"preload of {name}"
    bar = ProgressBar(progress_label) if progress_label else None
    try:
        p = load_status(client, name)
        while True:
            if bar is not None:
                bar.update(p.files_done, p.files_total, p.bytes_done, p.bytes_total)
            if preload_done(p, what):
                return p
            p = load_status(client, name, wait_for_change_after=p.version, wait_s=wait_s)
    finally:
        if bar is not None:
            bar.close()


def start_preload(
    client: NodeClient,
    name: str,
    src: str,
    lifetime: str,
    replicas: int = 1,
    endpoint: str = "",
    meta: Sequence[str] = (),
    tier: str = "auto",
    max_memory: int = 0,
    max_disk: int = 0,
    queue: bool = False,
) -> PreloadStarted:
    """Ask for a load of `src` (normalized) as `name`; answers once the node has scanned it.
    `meta`: meta files in it (relative paths) to index as well; `tier`: where its segments
    go (memory, disk, or auto: memory first); `max_memory`, `max_disk`: the most bytes of
    its segments in each node's memory and disk tier (0: no cap); `queue`: wait for room
    rather than be refused when it does not fit."""
    fields = {"name": name, "source": src, "lifetime": lifetime, "replicas": replicas}
    caps = {"max_memory": max_memory, "max_disk": max_disk, "queue": queue}
    request = Preload.from_wire(
        {**fields, "endpoint": endpoint, "meta": list(meta), "tier": tier, **caps}
    )
    return client.call(request, answer_within=SCAN_TIMEOUT)


def preload(
    settings: Settings,
    source: str,
    name: str,
    wait: bool = True,
    show_progress: bool = True,
    lifetime: str = "offline",
    replicas: int = 1,
    endpoint: str = "",
    meta: Sequence[str] = (),
    tier: str = "auto",
    max_memory: int = 0,
    max_disk: int = 0,
    queue: bool = False,
) -> PreloadStarted | Progressing | Published:
    """Ask the node to load `source` (a folder or an s3:// URL) as `name`; with `wait`, poll
    until ready or failed (Ctrl-C cancels the load) and return the last `progress` answer,
    else the load's start. The caps hold on each node (0: none). With `queue`, a preload
    that does not fit waits in the node's queue for room."""
    validate_name(name)
    src = normalize_source(source)
    with connect(settings) as client:
        started = start_preload(
            client, name, src, lifetime, replicas, endpoint, meta, tier, max_memory, max_disk, queue
        )
        if started.queued and show_progress:
            print(f"{name}: queued for room, position {started.queued}", file=sys.stderr)
        if not wait:
            return started
        try:
            return wait_ready(
                client, name, progress_label=f"preload {name}" if show_progress else None
            )
        except KeyboardInterrupt:
            client.call(Unload(name=name))
            raise KSpeedError(f"preload of {name} interrupted and cancelled") from None


def ensure_loaded(
    settings: Settings,
    source: str,
    name: str,
    lifetime: str = "offline",
    progress_label: str | None = None,
    meta: Sequence[str] = (),
) -> Progressing | Published:
    """Make sure `name` is loaded: wait for it when the node holds it or is loading it (the
    source is not even looked at then), else preload it from `source` and wait."""
    validate_name(name)
    with connect(settings) as client:
        try:
            current: Progressing | Published | None = load_status(client, name)
        except NotFound:
            current = None
        if current is None or current.state == "failed":
            try:
                start_preload(client, name, normalize_source(source), lifetime, meta=meta)
                log.info("preloading %s as %s (%s)", source, name, lifetime)
            except AlreadyExists:
                pass  # another job (or rank) started it meanwhile: wait for theirs
        what = f"preload of {name} from {source}"
        return wait_ready(client, name, what=what, progress_label=progress_label)


def preload_partial(
    settings: Settings,
    source: str,
    name: str,
    endpoint: str = "",
    max_memory: int = 0,
    max_disk: int = 0,
) -> tuple[int, int]:
    """`preload --partial`: the source's read-through dataset on the node (with its caps, when
    it is created), its segments filled now, in order, while they fit the node's free memory
    and the dataset's cap; the rest is read through from the source when asked. Every byte is
    filled as any read-through fill is (checked against the version listed, SourceChanged
    when a file changed). Returns its segments resident now, and its segments in all."""
    register_source(settings, source, endpoint, name, max_memory, max_disk)
    with connect(settings) as client:
        record = load_status(client, name)
        if not isinstance(record, Published):  # unloaded and loading again meanwhile
            raise DataError(f"partial preload of {name}: it is {record.state} again")
        segments = record.segments
        typical = -(-record.bytes // max(segments, 1))  # a segment, rounded up
        held: set[int] = set()
        for seg in range(segments):
            status = client.call(Status())
            held = _resident(status, name)
            if seg in held:
                continue
            if status.budget - status.used < typical:
                break  # full: the rest is read through
            while True:
                fill = FillSegment(name=name, segment=seg, uuid=record.uuid)
                filled = client.call(fill)
                if filled.state != "filling":
                    break
            if filled.state == "failed":
                raise DataError(f"partial preload of {name}: segment {seg}: {filled.error}")
            if filled.state == "source":
                break  # not kept: its cap (its share of memory) is full
            before, held = held, _resident(client.call(Status()), name)
            if len(held) <= len(before):
                break  # kept in place of one of its own (an lru node at the cap): full
    return len(held), segments


def _resident(status: NodeStatus, name: str) -> set[int]:
    """The segments of `name` in the node's memory, from its `status`."""
    part = status.held.get(name)
    return set(part.held) if part is not None else set()


def register_source(
    settings: Settings,
    source: str,
    endpoint: str = "",
    name: str | None = None,
    max_memory: int = 0,
    max_disk: int = 0,
    min_memory: int = 0,
    weight: int = 1,
) -> str:
    """Make (or find) the read-through dataset of a source on the node, with its caps in
    memory and on the spill folder (0: none), its floor in memory (0: none) and its weight
    in the shares, when it is created; returns its name."""
    source = normalize_source(source)
    name = validate_name(name) if name else validate_name(name_from_source(source))
    request = RegisterSource(
        name=name,
        source=source,
        endpoint=endpoint,
        max_memory=max_memory,
        max_disk=max_disk,
        min_memory=min_memory,
        weight=weight,
    )
    with connect(settings) as client:
        registered = client.call(request)
        if registered.state != "ready":
            wait_ready(client, name, what=f"listing {source}")
    return name
