"""Kubernetes commands: `kspeedfs csi` (the CSI node plugin) and `kspeedfs kubernetes manifests`."""

from __future__ import annotations

import argparse
from pathlib import Path

from kspeedfs.cli.settings import settings_from


def cmd_csi(args: argparse.Namespace) -> int:
    from kspeedfs.csi.server import NodePlugin, serve

    plugin = NodePlugin(
        node_id=args.node_id,
        settings=settings_from(args),
        state_dir=Path(args.state_dir),
        mounts_dir=Path(args.mounts_dir),
        mountd_state=Path(args.mountd_state),
        publish_timeout=args.publish_timeout,
    )
    serve(plugin, args.endpoint)
    return 0


def cmd_kubernetes(args: argparse.Namespace) -> int:
    from kspeedfs.csi.manifests import render

    print(render(args.namespace, args.image, args.examples, args.fluid), end="")
    return 0
