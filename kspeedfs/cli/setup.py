"""Setting up and trying out: install-systemd, sample and demo."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kspeedfs.format.units import format_size


def cmd_install_systemd(args: argparse.Namespace) -> int:
    from kspeedfs.cli.systemd_units import install

    exec_prefix = Path(args.exec_prefix) if args.exec_prefix else None
    for path in install(Path(args.prefix), exec_prefix, args.example_mount):
        print(f"wrote {path}")
    print("next: systemctl daemon-reload && systemctl enable --now kspeedfs-node kspeedfs-mountd")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from kspeedfs.format.units import parse_size
    from kspeedfs.sample import make_sample

    started = time.monotonic()
    n, nbytes = make_sample(Path(args.dest), args.classes, args.per_class, parse_size(args.size))
    print(
        f"wrote {n} files, {format_size(nbytes)} to {args.dest} in {time.monotonic() - started:.1f}s"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kspeedfs.demo import run_demo

    return run_demo(Path(args.workdir), args.classes, args.per_class, args.workers)
