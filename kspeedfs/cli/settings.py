"""The settings of one command: its flags over the environment, the config file and defaults."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kspeedfs.format.config import Settings, load_settings

# Settings whose flag is not --the-setting, for the error that names the flag.
_FLAGS = {"fuse_workers": "--workers", "verify_on_start": "--no-verify"}

# Commands that talk to no node: a KSPEEDFS_USER in the environment asks for no password there.
LOCAL_COMMANDS = frozenset(
    {"node", "user", "token", "tls", "sample", "install-systemd", "clean-node"}
)


def settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    """Settings for `args` (what its command was given) and `extra` (flags of that command);
    asks for the password of a user login, and with etcd finds the live members."""
    cli = {
        "nodes": getattr(args, "nodes", None),
        "token_file": getattr(args, "token_file", None),
        "timeout": getattr(args, "timeout", None),
        "etcd": getattr(args, "etcd", None),
        "cluster": getattr(args, "cluster", None),
        "user": getattr(args, "user", None),
        **extra,
    }
    settings = load_settings(cli, config_file=getattr(args, "config", None), cli_names=_FLAGS)
    if settings.user and not settings.password and args.command not in LOCAL_COMMANDS:
        import getpass

        settings.password = getpass.getpass(f"password for {settings.user}: ")
    if settings.etcd and args.command != "node":  # control plane: the live members in etcd
        from kspeedfs.client.clusterstate import resolve_nodes

        given = getattr(args, "nodes", None) is not None or "KSPEEDFS_NODES" in os.environ
        resolve_nodes(settings, explicit=given)
    return settings
