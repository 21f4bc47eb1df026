"""Finding (or actively loading) the cached dataset behind a path, and reading it in each process.

`attach` runs once, where the dataset object is built: it finds the dataset whose source holds
the path, preloads it with a lease when it is not there, and returns a `CacheRef`, which is
plain picklable config. `reader(ref)` opens the manifest and mappings lazily in each process
(DataLoader workers fork or spawn) and keeps one `Reader` per dataset per process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence

from kspeedfs.client import admin, on_mount
from kspeedfs.client.dataset_reader import CacheRef as CacheRef  # the fast path's names for them
from kspeedfs.client.dataset_reader import Reader as Reader
from kspeedfs.client.job_settings import client_settings as client_settings
from kspeedfs.client.loop_reports import note_dataset
from kspeedfs.client.reader import ClusterReader, local_node_for
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import DatasetEntry, List, LoadingEntry
from kspeedfs.format.errors import (
    AuthError,
    DataError,
    InvalidArgument,
    KSpeedError,
    NoSpace,
    NotFound,
)
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import parse_address
from kspeedfs.net.connection import NodeClient
from kspeedfs.sources.naming import name_from_source
from kspeedfs.sources.scan import check_source

from . import lease

log = logging.getLogger(__name__)


def process_rank() -> int:
    """This process's rank in a distributed job (0 when there is none)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def kspeed_name(source: str) -> str:
    """KSpeed's name for a dataset: its root folder's own name (`/data/imagenet/train` ->
    `train`), as `kspeedfs preload SRC` names it when no --name is given."""
    return name_from_source(os.path.abspath(source))


def derived_name(source: str) -> str:
    """A stable dataset name for an actively loaded source: its folder name and a path hash."""
    base = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(source.rstrip("/")).lower()).strip("-._")
    digest = hashlib.sha256(source.encode(errors="surrogateescape")).hexdigest()[:10]
    return f"{base[:40] or 'dataset'}-{digest}"


def _inside(path: str, folder: str) -> str | None:
    """`path` relative to `folder` ('' for the folder itself), or None when it is outside."""
    rel = os.path.relpath(path, folder)
    if rel == ".":
        return ""
    if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
        return None
    return rel


def _relative(path: str, source: str) -> str | None:
    # Compare both as written and with symlinks resolved: jobs spell paths differently.
    for p in {os.path.abspath(path), os.path.realpath(path)}:
        for s in {os.path.abspath(source), os.path.realpath(source)}:
            rel = _inside(p, s)
            if rel is not None:
                return rel
    return None


# An entry of a node's `list`: a published dataset, or a load under way (or failed).
Listed = DatasetEntry | LoadingEntry


def _match(datasets: list[Listed], path: str, objname: str | None) -> tuple[Listed, str] | None:
    """The dataset that holds `path` (the most specific source wins), and the path inside it."""
    live = [d for d in datasets if d.state != "failed"]
    if objname is not None:
        for d in live:
            if d.name == objname:
                rel = _relative(path, d.source)
                if rel is None:
                    raise InvalidArgument(
                        f"{path} is not inside dataset {objname} (loaded from {d.source})"
                    )
                return d, rel
        return None
    best: tuple[Listed, str] | None = None
    for d in live:
        rel = _relative(path, d.source)
        if rel is not None and (best is None or len(d.source) > len(best[0].source)):
            best = d, rel
    return best


def _mounted(datasets: list[Listed], on: on_mount.MountedPath, node: str) -> tuple[Listed, str]:
    """The dataset a path on a kspeedfs mount is in, as the nodes list it (by name and
    source: the mount may be a moment behind a reload), and the path inside it."""
    for d in datasets:
        if d.name == on.dataset and d.state != "failed":
            if d.source != on.source:
                break
            return d, on.rel
    raise NotFound(
        f"{on.describe()}, which the nodes of this job ({node}) do not hold: give its source"
        f" ({os.path.join(on.source, on.rel) if on.rel else on.source}) instead"
    )


def attach(
    path: str,
    *,
    objname: str | None,
    settings: Settings,
    local: bool | None,
    source_for_preload: str | None = None,
    meta: Sequence[str] = (),
    name_rule: Callable[[str], str] = derived_name,
) -> tuple[CacheRef, str, tuple[str, str, str] | None]:
    """Find or actively load the dataset holding `path` (an active load indexes the `meta`
    files too, and is named `objname`, else `name_rule(source)`).

    Returns the ref, `path` relative to the dataset root, and the lease key when this process
    took a lease (release it with `lease.unhold`).
    """
    cluster = ClusterReader(settings, local_node_for(settings))
    # A path on a kspeedfs mount stands for the dataset behind it: read from the cache, never
    # back through FUSE into a second copy.
    on = on_mount.behind(path)
    if on is not None:
        on_mount.check_dataset(on, objname)
    preloaded = False
    for _attempt in range(5):
        node, reply = cluster.pool.live_call(List())
        listed = reply.datasets
        found = _match(listed, path, objname) if on is None else _mounted(listed, on, node)
        if found is None:
            if preloaded:
                raise DataError(f"dataset for {path} vanished right after loading it")
            source = source_for_preload or path
            _active_preload(settings, source, objname, meta, name_rule, listed)
            preloaded = True
            continue
        info, rel = found
        if not isinstance(info, DatasetEntry) or info.state != "ready":
            _wait_ready(settings, node, info.name)
            continue
        key = None
        if info.lifetime == "leased":
            members = info.members or [node]
            try:
                key = lease.hold(settings, members[0], info.name, info.uuid)
            except NotFound:
                continue  # unloaded between the listing and the lease: look again
        ref = CacheRef(
            settings=settings,
            name=info.name,
            uuid=info.uuid,
            source=info.source,
            info=info,
            local=local,
        )
        note_dataset(info.name)  # named in this process's loop reports (pytorch_ext.watch)
        return ref, rel, key
    raise KSpeedError(f"could not attach {path}: the cache kept changing under us")


def _active_preload(
    settings: Settings,
    source: str,
    objname: str | None,
    meta: Sequence[str],
    name_rule: Callable[[str], str],
    datasets: list[Listed],
) -> None:
    """Preload `source` with a leased lifetime, or join its load already under way (another job
    or rank started it); waits for it (progress shown on rank 0). A name of its own choosing
    that a dataset of another source holds is refused: it would wait for that one. A preload
    that does not fit the node's memory does not fail the job: the source is read through
    (cached as it is read, within its share of the memory), said in one line."""
    try:
        src = os.path.abspath(check_source(source))
    except KSpeedError as e:
        raise type(e)(f"{source} is not in the cache and cannot be loaded: {e}") from None
    name = objname or name_rule(src)
    taken = [d for d in datasets if d.name == name and d.state != "failed"]
    if objname is None and taken:
        raise InvalidArgument(
            f"dataset {name} is already loaded from {taken[0].source}; pass objname= to"
            f" load {source} under another name"
        )
    try:
        label = f"kspeedfs load {name}" if process_rank() == 0 else None
        admin.ensure_loaded(settings, src, name, lifetime="leased", progress_label=label, meta=meta)
    except AuthError as e:
        # The node's refusal names the role the op needs and the one this client has.
        raise AuthError(
            f"{source} is not in the cache and this client may not load it: {e}"
        ) from None
    except NoSpace as e:
        if meta:  # meta-file indexes are built by a preload only
            raise NoSpace(f"{source} is not in the cache and cannot be loaded: {e}") from None
        log.warning(
            "%s does not fit in the cache, so it is read through within its share of the"
            " memory: %s",
            source,
            e,
        )
        admin.register_source(settings, src, name=name)
    except (NotFound, InvalidArgument) as e:
        raise type(e)(f"{source} is not in the cache and cannot be loaded: {e}") from None


def _wait_ready(settings: Settings, node: str, name: str) -> None:
    """Wait for a load of `name` that `node` lists as under way."""
    client = NodeClient(
        parse_address(node), settings.credential(), settings.timeout, client_context(settings)
    )
    try:
        label = f"kspeedfs load {name}" if process_rank() == 0 else None
        admin.wait_ready(client, name, progress_label=label)
    except NotFound:
        pass  # finished (or failed) and forgotten meanwhile: the caller looks again
    finally:
        client.close()


_readers: dict[tuple[str, str, bool | None], Reader] = {}
_readers_pid = os.getpid()
_readers_lock = threading.Lock()
# Bumped in a forked child: objects that cache a reader check it instead of calling getpid.
generation = 0


def _after_fork() -> None:
    global generation
    generation += 1


os.register_at_fork(after_in_child=_after_fork)


def reader(ref: CacheRef) -> Reader:
    """This process's reader for `ref` (mappings survive fork; the cluster reader reconnects)."""
    global _readers_pid
    r = _readers.get(ref.key)
    if r is not None and _readers_pid == os.getpid():
        return r
    with _readers_lock:
        if _readers_pid != os.getpid():
            _readers_pid = os.getpid()
            for old in _readers.values():
                old._scratch = threading.local()
        r = _readers.get(ref.key)
        if r is None:
            r = _readers[ref.key] = Reader(ref)
    return r
