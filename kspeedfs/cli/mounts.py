"""Mount commands: mount, umount, and the mounts kspeedfs-mountd keeps."""

from __future__ import annotations

import argparse
from pathlib import Path

from kspeedfs.cli.settings import settings_from
from kspeedfs.client import admin, on_mount
from kspeedfs.format.errors import InvalidArgument
from kspeedfs.format.units import parse_size


def cmd_mount(args: argparse.Namespace) -> int:
    from kspeedfs.fuse.mount import run_mount

    options = [o for o in args.options.split(",") if o]
    # The mount's own metrics_listen (default off): in the config or environment it is the
    # node's port.
    settings = settings_from(args, fuse_workers=args.workers, metrics_listen=args.metrics_listen)
    dataset = args.dataset
    on = on_mount.behind(args.source) if args.source else None
    if on is not None and on.dataset and on_mount.held_here(settings, on) is None:
        on = None  # another cluster's mount: read through it as any source
    if on is not None:  # a dataset on a kspeedfs mount: mount it, not a second copy of it
        on_mount.check_dataset(on, args.name or args.dataset)
        if on.rel or args.endpoint or _limits_given(args):
            raise InvalidArgument(
                f"{on.describe()}: mount --dataset {on.dataset}, or give its source"
                f" ({on.source}) to --source"
            )
        dataset, args.source = on.dataset, None
    if args.source:
        from kspeedfs.fuse.mount import check_mountpoint

        check_mountpoint(args.mountpoint)  # before anything is created on the node
        dataset = admin.register_source(
            settings,
            args.source,
            args.endpoint or "",
            args.name or args.dataset,
            max_memory=parse_size(args.max_memory) if args.max_memory else 0,
            max_disk=parse_size(args.max_disk) if args.max_disk else 0,
            min_memory=parse_size(args.min_memory) if args.min_memory else 0,
            weight=1 if args.weight is None else args.weight,
        )
    elif args.endpoint or args.name or _limits_given(args):
        raise InvalidArgument(
            "--endpoint, --name, --max-memory, --max-disk, --min-memory and --weight go with"
            " --source"
        )
    run_mount(
        args.mountpoint,
        settings,
        dataset=dataset,
        options=options,
        foreground=args.foreground,
        log_file=args.log_file,
    )
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from kspeedfs.fuse.mount import unmount

    unmount(args.mountpoint, lazy=args.lazy)
    return 0


def cmd_mounts(args: argparse.Namespace) -> int:
    from mountd.state import DEFAULT_STATE_FILE, print_status

    return print_status(Path(args.state_file or DEFAULT_STATE_FILE), args.json)


def _limits_given(args: argparse.Namespace) -> bool:
    """Whether any of a read-through dataset's caps, floor or weight was given."""
    return bool(args.max_memory or args.max_disk or args.min_memory or args.weight is not None)
