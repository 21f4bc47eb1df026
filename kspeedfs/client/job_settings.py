"""A job's client settings: the config file and environment, with the caller's own arguments on top."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.errors import InvalidArgument


def client_settings(
    nodes: str | Sequence[str] | None,
    token: str | os.PathLike[str] | None,
    user: str | None = None,
    password: str | None = None,
    origin: str = "dataset's arguments",
) -> Settings:
    """Settings from the config file and environment, with the caller's own arguments on top
    (a user and password replace the token); with `etcd` set and no node list given, the nodes
    are the live members found there."""
    cli: dict[str, Any] = {}
    if nodes is not None:
        cli["nodes"] = nodes if isinstance(nodes, str) else ",".join(str(n) for n in nodes)
    if token is not None:
        cli["token_file"] = os.fspath(token)
    if user is not None:
        if password is None:
            raise InvalidArgument(f"user {user!r} needs a password")
        cli["user"], cli["password"] = user, password
    settings = load_settings(
        cli,
        cli_origin=origin,
        cli_names={"nodes": "nodes=", "token_file": "token=", "user": "user="},
    )
    if settings.etcd:  # control plane: the live members in etcd, unless `nodes` names them
        from kspeedfs.client.clusterstate import resolve_nodes

        resolve_nodes(settings, explicit=nodes is not None or "KSPEEDFS_NODES" in os.environ)
    return settings
