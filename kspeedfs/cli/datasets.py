"""Dataset commands: preload, ls, unload, meta add, refresh and rebalance."""

from __future__ import annotations

import argparse
import json
import os

from kspeedfs.cli.settings import settings_from
from kspeedfs.cli.tables import ls_table, print_table
from kspeedfs.client import admin, on_mount
from kspeedfs.client.tier_bytes import cluster_tiers
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.decoded import VariantSummary
from kspeedfs.format.contract.node import (
    DatasetListing,
    List,
    Rebalance,
    Unload,
)
from kspeedfs.format.contract.preload import PreloadStarted
from kspeedfs.format.contract.readthrough import Refresh
from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.net.connection import NodeClient
from kspeedfs.sources.naming import name_from_source


def cmd_preload(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if args.replicas < 1:
        raise InvalidArgument("--replicas must be at least 1")
    if args.decoded is not None and args.no_wait:
        raise InvalidArgument("--decoded waits for the load: leave out --no-wait")
    on = on_mount.behind(args.source)
    if on is not None:
        return _preload_mounted(args, settings, on)
    if args.name is None:  # KSpeed's offline preload: the source folder's own name
        args.name = name_from_source(args.source)
    if args.partial:
        return _preload_partial(args, settings)
    max_memory, max_disk = _caps(args)
    result = admin.preload(
        settings,
        args.source,
        args.name,
        wait=not args.no_wait,
        show_progress=not args.quiet,
        replicas=args.replicas,
        endpoint=args.endpoint or "",
        meta=args.meta,
        tier=args.tier,
        max_memory=max_memory,
        max_disk=max_disk,
        queue=args.queue,
    )
    state: str = "loading" if isinstance(result, PreloadStarted) else result.state
    if isinstance(result, PreloadStarted) and result.queued:
        state = f"queued (position {result.queued})"
    print(f"{args.name}: {state}, {result.files_total} files, {format_size(result.bytes_total)}")
    if args.decoded is not None:
        _preload_decoded(args)
    return 0


def _preload_mounted(args: argparse.Namespace, settings: Settings, on: on_mount.MountedPath) -> int:
    """`preload PATH` of a path on a kspeedfs mount: the dataset behind it is cached already
    (loading it again would read it back through FUSE into a second copy)."""
    on_mount.check_dataset(on)
    source = os.path.join(on.source, on.rel) if on.rel else on.source
    if args.name is not None and args.name != on.dataset:
        raise InvalidArgument(
            f"{on.describe()}, cached already; to make dataset {args.name} of it, preload its"
            f" source: {source}"
        )
    d = on_mount.held_here(settings, on)
    if d is None:
        raise NotFound(f"{on.describe()}, which these nodes do not hold: preload {source}")
    print(f"{on.dataset}: {d.state}, cached already ({on.describe()})")
    if args.decoded is not None:
        args.name = on.dataset
        _preload_decoded(args)
    return 0


def _preload_partial(args: argparse.Namespace, settings: Settings) -> int:
    """`preload --partial`: a read-through dataset, what fits loaded now."""
    if args.decoded is not None or args.meta or args.replicas != 1 or args.tier != "auto":
        raise InvalidArgument("--partial takes none of --decoded, --meta, --replicas, --tier")
    max_memory, max_disk = _caps(args)
    loaded, segments = admin.preload_partial(
        settings, args.source, args.name, args.endpoint or "", max_memory, max_disk
    )
    print(f"{args.name}: partial, {loaded} of {segments} segments loaded, the rest read through")
    return 0


def _caps(args: argparse.Namespace) -> tuple[int, int]:
    """--max-memory and --max-disk in bytes (0: no cap)."""
    memory = parse_size(args.max_memory) if args.max_memory else 0
    disk = parse_size(args.max_disk) if args.max_disk else 0
    return memory, disk


def _preload_decoded(args: argparse.Namespace) -> None:
    """`preload --decoded N`: every member decodes the images it holds; waits, with progress."""
    from kspeedfs.client import decoded

    with admin.connect(settings_from(args)) as client:
        decoded.start(client, args.name, args.decoded)
        label = None if args.quiet else f"decode {args.name}@{args.decoded}"
        v = decoded.wait(client, args.name, args.decoded, progress_label=label)
    print(f"{args.name}@{args.decoded}: {decoded.describe(v)}, {v.undecodable} undecodable")


def cmd_ls(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    with admin.connect(settings) as client:
        listing = client.call(List())
        variants = _decoded(client, listing)
    # The tiers over the cluster: each member's own bytes, asked of it.
    tiers = cluster_tiers(settings, listing)
    if args.json:
        shown = []
        for d in listing.datasets:
            row = d.to_wire()
            if d.name in variants:
                row["decoded_variants"] = {s: v.to_wire() for s, v in variants[d.name].items()}
            if d.name in tiers:
                row.update(tiers[d.name].to_wire())
            shown.append(row)
        print(json.dumps(shown, indent=2))
        return 0
    print_table(ls_table(listing, tiers, variants))
    return 0


def _decoded(client: NodeClient, listing: DatasetListing) -> dict[str, dict[str, VariantSummary]]:
    """The decoded variants of each ready dataset that has some, over its members."""
    from kspeedfs.client.decoded import status

    out = {}
    for d in listing.ready().values():
        if d.decoded or len(d.members) > 1:
            try:
                out[d.name] = status(client, d.name)
            except KSpeedError:
                pass
    return out


def cmd_unload(args: argparse.Namespace) -> int:
    with admin.connect(settings_from(args)) as client:
        result = client.call(Unload(name=args.name))
    print(f"{args.name}: {result.state}")
    return 0


def cmd_meta(args: argparse.Namespace) -> int:
    from kspeedfs.client import metaindexes

    with admin.connect(settings_from(args)) as client:
        for index in metaindexes.add(client, args.name, args.meta):
            print(metaindexes.describe(args.name, index))
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    # A refresh lists the whole source: it may take longer than an ordinary request.
    settings.timeout = max(settings.timeout, 600.0)
    with admin.connect(settings) as client:
        result = client.call(Refresh(name=args.name))
    if result.state == "unchanged":
        print(f"{args.name}: unchanged")
    else:
        print(
            f"{args.name}: refreshed, {result.changed} files changed, "
            f"{result.kept} of {result.segments} segments kept"
        )
    return 0


def cmd_rebalance(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if not settings.etcd:
        raise InvalidArgument("rebalance needs the etcd control plane (--etcd or KSPEEDFS_ETCD)")
    with admin.connect(settings) as client:
        reply = client.call(Rebalance(name=args.name or ""))
    done = ", ".join(reply.datasets) or "nothing"
    print(f"rebalanced {done} over {len(reply.members)} members")
    return 0
