"""`kspeedfs COMMAND`: runs the command, and turns its error into one line and an exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kspeedfs.cli import datasets, jobs, kubernetes, mounts, node, security, setup
from kspeedfs.cli.parser import build_parser
from kspeedfs.format.errors import KSpeedError
from kspeedfs.system.logs import setup_logging

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "node": node.cmd_node,
    "preload": datasets.cmd_preload,
    "ls": datasets.cmd_ls,
    "status": node.cmd_status,
    "jobs": jobs.cmd_jobs,
    "top": jobs.cmd_top,
    "report": jobs.cmd_report,
    "dashboard": jobs.cmd_dashboard,
    "unload": datasets.cmd_unload,
    "rebalance": datasets.cmd_rebalance,
    "meta": datasets.cmd_meta,
    "refresh": datasets.cmd_refresh,
    "mount": mounts.cmd_mount,
    "umount": mounts.cmd_umount,
    "mounts": mounts.cmd_mounts,
    "csi": kubernetes.cmd_csi,
    "kubernetes": kubernetes.cmd_kubernetes,
    "install-systemd": setup.cmd_install_systemd,
    "shutdown": node.cmd_shutdown,
    "clean-node": node.cmd_clean_node,
    "token": security.cmd_token,
    "user": security.cmd_user,
    "tls": security.cmd_tls,
    "sample": setup.cmd_sample,
    "demo": setup.cmd_demo,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return COMMANDS[args.command](args) or 0
    except KSpeedError as e:
        print("kspeedfs:", " ".join(str(e).split()), file=sys.stderr)  # one line, always
        return e.exit_code
    except KeyboardInterrupt:
        print("kspeedfs: interrupted", file=sys.stderr)
        return 130
