"""Kubernetes commands: `kspeedfs csi` (the CSI node plugin) and `kspeedfs kubernetes manifests`."""

from __future__ import annotations

import argparse
from pathlib import Path

from kspeedfs.cli.settings import settings_from
from kspeedfs.format.errors import InvalidArgument


def cmd_csi(args: argparse.Namespace) -> int:
    from kspeedfs.csi.server import NodePlugin, serve

    plugin = NodePlugin(
        node_id=args.node_id,
        settings=settings_from(args),
        state_dir=Path(args.state_dir),
        mounts_dir=Path(args.mounts_dir),
        mountd_state=Path(args.mountd_state),
        publish_timeout=args.publish_timeout,
        kubelet_dir=Path(args.kubelet_dir),
        policy=Path(args.policy) if args.policy else None,
    )
    serve(plugin, args.endpoint)
    return 0


def cmd_kubernetes(args: argparse.Namespace) -> int:
    from kspeedfs.csi.fluid import fluid_profile
    from kspeedfs.csi.manifests import render, to_yaml, write_kustomize
    from kspeedfs.csi.values import load_values

    flags = (
        "image namespace image_pull_secrets registrar_image livenessprobe_image kubelet_dir "
        "data_dir cache_memory priority_class metrics_port cluster_domain"
    )
    values = load_values(
        Path(args.values) if args.values else None,
        {name: getattr(args, name) for name in flags.split()},
    )
    if args.kustomize:
        if args.examples or args.fluid:
            raise InvalidArgument("--kustomize writes the install only (not --examples or --fluid)")
        for path in write_kustomize(values, Path(args.kustomize)):
            print(path)
        return 0
    if args.fluid:
        print(to_yaml(fluid_profile(values)), end="")
    else:
        print(render(values, args.examples), end="")
    return 0
