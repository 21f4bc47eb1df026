"""The `kspeedfs` command: argument parsing and one-line errors with documented exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kspeedfs import __version__
from kspeedfs.client import admin
from kspeedfs.format import auth
from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.errors import EXIT_CODES_DOC, AuthError, InvalidArgument, KSpeedError
from kspeedfs.format.units import format_size, parse_size
from kspeedfs.sources.source import name_from_source
from kspeedfs.system.logs import setup_logging

log = logging.getLogger("kspeedfs")


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", help="HOST:PORT[,...] of the cache nodes (env KSPEEDFS_NODES)")
    p.add_argument("--config", help="TOML config file (env KSPEEDFS_CONFIG)")
    p.add_argument("--token-file", help="cluster token file (env KSPEEDFS_TOKEN_FILE)")
    p.add_argument(
        "--user",
        help="log in as this user instead of the token (password: KSPEEDFS_PASSWORD, else asked)",
    )
    p.add_argument("--timeout", help="seconds to wait for a node")
    p.add_argument("--etcd", help="URL[,...] of etcd for members and catalog (env KSPEEDFS_ETCD)")
    p.add_argument("--cluster", help="the cluster's name in etcd (default 'default')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kspeedfs",
        description="Dataset cache for deep-learning training.",
        epilog=EXIT_CODES_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kspeedfs {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("node", help="run the cache daemon of this node")
    _client_options(p)
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:7420)")
    p.add_argument("--shm-dir", help="tmpfs folder for segments (default /dev/shm/kspeedfs)")
    p.add_argument("--memory", help="memory budget, e.g. 8GiB or 50%% (default 50%% of shm)")
    p.add_argument("--segment-size", help="segment size, e.g. 64MiB")
    p.add_argument("--no-verify", action="store_true", help="skip checksums of datasets at start")
    p.add_argument("--spill-dir", help="disk folder for read-through segments evicted from memory")
    p.add_argument("--spill", help="spill budget, e.g. 512GiB (with --spill-dir)")
    p.add_argument(
        "--eviction",
        help="read-through eviction: stable (default), plan (the samplers' order) or lru",
    )

    p.add_argument("--metrics-listen", help="HOST:PORT for Prometheus /metrics (default: off)")

    p = sub.add_parser(
        "rebalance", help="with etcd: place datasets over the members live now (one, or all)"
    )
    _client_options(p)
    p.add_argument("name", nargs="?", help="the dataset (default: all)")

    p = sub.add_parser("preload", help="load a dataset into the cache (kept until unload)")
    _client_options(p)
    p.add_argument("source", help="source folder, or s3://bucket/prefix")
    p.add_argument(
        "--name",
        help="dataset name: [a-z0-9][a-z0-9._-]{0,63} (default: the source folder's own name)",
    )
    p.add_argument("--endpoint", help="object store endpoint URL of an s3:// source")
    p.add_argument("--no-wait", action="store_true", help="return once the node accepted it")
    p.add_argument("--replicas", type=int, default=1, help="copies of each segment (default 1)")
    p.add_argument(
        "--meta",
        action="append",
        default=[],
        metavar="FILE",
        help="a meta file in the source (one sample per line) to index too; repeatable",
    )
    p.add_argument(
        "--decoded",
        type=int,
        metavar="N",
        help="also keep the images decoded, shorter side N pixels (0: as is)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    for name, help_text in (("ls", "list datasets"), ("status", "show the nodes")):
        p = sub.add_parser(name, help=help_text)
        _client_options(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("meta", help="meta-file indexes of a cached dataset")
    msub = p.add_subparsers(dest="meta_command", required=True, metavar="ACTION")
    t = msub.add_parser(
        "add", help="index meta files of a dataset cached without them (see preload --meta)"
    )
    _client_options(t)
    t.add_argument("name", help="the cached dataset")
    t.add_argument("meta", nargs="+", help="a meta file in it (path relative to its root)")

    p = sub.add_parser("refresh", help="re-list a read-through dataset's source, re-read changes")
    _client_options(p)
    p.add_argument("name")

    p = sub.add_parser("unload", help="remove a dataset from the cache")
    _client_options(p)
    p.add_argument("name")

    p = sub.add_parser("mount", help="mount the cache as a read-only filesystem")
    _client_options(p)
    p.add_argument("mountpoint")
    p.add_argument("--dataset", help="serve one dataset at the root")
    p.add_argument("--source", help="read-through: serve this folder or s3:// URL, cached as read")
    p.add_argument("--endpoint", help="object store endpoint URL of an s3:// --source")
    p.add_argument("--name", help="dataset name for --source (default: from the source)")
    p.add_argument(
        "--max-memory", help="with --source: the most memory the dataset takes, e.g. 16GiB"
    )
    p.add_argument(
        "--max-disk", help="with --source: the most of the spill folder it takes, e.g. 64GiB"
    )
    p.add_argument("-f", "--foreground", action="store_true", help="do not go to the background")
    p.add_argument("-o", dest="options", default="", help="FUSE options: allow_other,...")
    p.add_argument("--log-file", help="where the background mount logs")
    p.add_argument(
        "--metrics-listen",
        default="",
        metavar="HOST:PORT",
        help="serve Prometheus /metrics of this mount there (off by default)",
    )
    p.add_argument("--workers", help="serving processes (default: one per CPU, at most 8)")

    p = sub.add_parser("umount", help="unmount a kspeedfs mount")
    p.add_argument("mountpoint")
    p.add_argument("-z", "--lazy", action="store_true", help="lazy unmount (also if stale)")

    p = sub.add_parser("mounts", help="the mounts kspeedfs-mountd keeps, and their state")
    p.add_argument("--state-file", help="mountd's status file (default /run/kspeedfs-mountd/...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("install-systemd", help="install the systemd units and mount helpers")
    p.add_argument("--prefix", default="/", help="install under DIR instead of / (default /)")
    p.add_argument("--exec-prefix", help="where the kspeedfs scripts are (default: this venv)")
    p.add_argument("--example-mount", action="store_true", help="also mnt-imagenet.mount")

    p = sub.add_parser("shutdown", help="stop the node daemon")
    _client_options(p)

    p = sub.add_parser("token", help="cluster tokens")
    tsub = p.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    t = tsub.add_parser(
        "new", help="write a new admin token, or the job or read token of the current one"
    )
    t.add_argument("--role", choices=auth.ROLES, default="admin")
    t.add_argument("--token-file", help="the admin token file (default ~/.config/kspeedfs/token)")
    t.add_argument("--output", help="where to write (default: the token file itself for admin)")
    t.add_argument("--force", action="store_true", help="replace an existing file")

    p = sub.add_parser("user", help="users with passwords (kept by the node, scrypt-hashed)")
    usub = p.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    u = usub.add_parser("add", help="add a user, or set an existing user's role and password")
    u.add_argument("name")
    u.add_argument("--role", choices=auth.ROLES, required=True)
    u.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    u = usub.add_parser("list", help="the users and their roles")
    u = usub.add_parser("del", help="delete a user")
    u.add_argument("name")
    for u in usub.choices.values():
        u.add_argument("--users-file", help="default: users beside the token file")

    p = sub.add_parser("tls", help="certificates for mutual TLS between nodes and clients")
    tsub = p.add_subparsers(dest="tls_command", required=True, metavar="ACTION")
    t = tsub.add_parser("new-ca", help="make the cluster's CA in DIR (ca.crt, ca.key)")
    t.add_argument("dir")
    t.add_argument("--days", type=int, default=3650, help="validity (default 3650)")
    t.add_argument("--force", action="store_true", help="replace an existing CA")
    t = tsub.add_parser(
        "issue", help="a certificate and key for HOST (a node's address or a client's name)"
    )
    t.add_argument("host", help="IP address or DNS name the node is dialled by")
    t.add_argument("--ca", required=True, help="the CA's folder (from new-ca)")
    t.add_argument("--alt", action="append", default=[], help="another name or address")
    t.add_argument("--out", default=".", help="folder for HOST.crt and HOST.key (default .)")
    t.add_argument("--days", type=int, default=825, help="validity (default 825)")
    t.add_argument("--force", action="store_true", help="replace existing files")

    p = sub.add_parser(
        "sample", help="generate an ImageNet-like sample dataset (class folders of JPEGs)"
    )
    p.add_argument("dest")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=50)
    p.add_argument("--size", default="110KiB", help="approximate file size")

    p = sub.add_parser(
        "demo", help="the built-in end-to-end run: node, sample, preload, mount, epoch"
    )
    p.add_argument("--workdir", default="/tmp/kspeedfs-demo")
    # 400 images: four epochs in well under a minute on two cores.
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    return parser


# Settings whose flag is not --the-setting, for the error that names the flag.
_FLAGS = {"fuse_workers": "--workers", "verify_on_start": "--no-verify"}

# Commands that talk to no node: a KSPEEDFS_USER in the environment asks for no password there.
LOCAL_COMMANDS = frozenset({"node", "user", "token", "tls", "sample", "install-systemd"})


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
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


def cmd_node(args: argparse.Namespace) -> int:
    settings = _settings(
        args,
        listen=args.listen,
        shm_dir=args.shm_dir,
        memory=args.memory,
        segment_size=args.segment_size,
        verify_on_start=False if args.no_verify else None,
        spill_dir=args.spill_dir,
        spill=args.spill,
        eviction=args.eviction,
        metrics_listen=args.metrics_listen,
    )
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else settings.log_level)
    from kspeedfs.node.server import run_node  # after the settings: a bad one fails fast

    run_node(settings)
    return 0


def cmd_preload(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.replicas < 1:
        raise InvalidArgument("--replicas must be at least 1")
    if args.decoded is not None and args.no_wait:
        raise InvalidArgument("--decoded waits for the load: leave out --no-wait")
    if args.name is None:  # KSpeed's offline preload: the source folder's own name
        args.name = name_from_source(args.source)
    result = admin.preload(
        settings,
        args.source,
        args.name,
        wait=not args.no_wait,
        show_progress=not args.quiet,
        replicas=args.replicas,
        endpoint=args.endpoint or "",
        meta=args.meta,
    )
    state = result.get("state", "loading")
    print(
        f"{args.name}: {state}, {result['files_total']} files, {format_size(result['bytes_total'])}"
    )
    if args.decoded is not None:
        _preload_decoded(args)
    return 0


def _preload_decoded(args: argparse.Namespace) -> None:
    """`preload --decoded N`: every member decodes the images it holds; waits, with progress."""
    from kspeedfs.client import decoded

    with admin.connect(_settings(args)) as client:
        decoded.start(client, args.name, args.decoded)
        label = None if args.quiet else f"decode {args.name}@{args.decoded}"
        v = decoded.wait(client, args.name, args.decoded, progress_label=label)
    print(f"{args.name}@{args.decoded}: {decoded.describe(v)}, {v['undecodable']} undecodable")


def cmd_ls(args: argparse.Namespace) -> int:
    with admin.connect(_settings(args)) as client:
        datasets = client.request("list")["datasets"]
        _add_decoded(client, datasets)
    if args.json:
        print(json.dumps(datasets, indent=2))
        return 0
    rows: list[tuple[str, ...]] = [("NAME", "FILES", "BYTES", "STATE", "LIFETIME", "SOURCE")]
    for d in datasets:
        files = d.get("files", d.get("files_total", 0))
        size = d.get("bytes", d.get("bytes_total", 0))
        state = d["state"]
        if state == "loading" and d.get("bytes_total"):
            state = f"loading {100 * d['bytes_done'] / d['bytes_total']:.0f}%"
        if state == "failed":
            state = f"failed: {d.get('error', '')}"
        rows.append(
            (
                d["name"],
                str(files),
                format_size(size),
                state,
                d.get("lifetime", "-"),
                d.get("source", ""),
            )
        )
        if d.get("decoded_variants"):
            from kspeedfs.client.decoded import describe

            variants = d["decoded_variants"].values()
            rows[-1] += (", ".join(describe(v) for v in variants),)
    if any(len(r) > len(rows[0]) for r in rows):
        cols = len(rows[0])
        rows = [rows[0] + ("DECODED",)] + [r + ("-",) * (cols + 1 - len(r)) for r in rows[1:]]
    _print_table(rows)
    return 0


def _add_decoded(client: Any, datasets: list[dict[str, Any]]) -> None:
    """Each ready dataset with decoded variants gets their state over its members."""
    from kspeedfs.client.decoded import status

    for d in datasets:
        if d.get("state") == "ready" and (d.get("decoded") or len(d.get("members") or []) > 1):
            try:
                d["decoded_variants"] = status(client, d["name"])
            except KSpeedError:
                pass


def cmd_status(args: argparse.Namespace) -> int:
    from kspeedfs.format.tls import client_context
    from kspeedfs.net.connection import NodeClient

    settings = _settings(args)
    tls = client_context(settings)
    nodes = []
    for addr in settings.nodes:
        try:
            with NodeClient(addr, settings.credential(), settings.timeout, tls) as client:
                nodes.append({"up": True, **client.request("status")})
        except KSpeedError as e:
            # A refused token is this client's problem, not a node that is down.
            if len(settings.nodes) == 1 or isinstance(e, AuthError):
                raise
            nodes.append({"up": False, "node": str(addr), "error": str(e)})
    datasets = _residency(nodes)
    members = _etcd_members(settings)
    if args.json:
        print(json.dumps({"nodes": nodes, "datasets": datasets, "members": members}, indent=2))
        return 0
    if members is not None:
        _print_members(members, nodes)
    rows = [
        ("NODE", "STATE", "MEMORY USED / BUDGET", "DATASETS", "SEGMENTS", "TRANSPORT", "SHM DIR")
    ]
    for s in nodes:
        if not s["up"]:
            rows.append((s["node"], "down", "-", "-", "-", "-", s["error"]))
            continue
        mem = f"{format_size(s['used'])} / {format_size(s['budget'])}"
        loading = f" (+{len(s['loading'])} loading)" if s["loading"] else ""
        rows.append(
            (
                s["node"],
                "up",
                mem,
                f"{s['datasets']}{loading}",
                str(s["segments"]),
                str(s.get("transport", "tcp")),
                s["shm_dir"],
            )
        )
    _print_table(rows)
    if datasets:
        print()
        table = [("DATASET", "SEGMENTS", "RESIDENT")]
        for name, d in sorted(datasets.items()):
            table.append((name, str(d["segments"]), f"{d['resident_pct']:.0f}%"))
        _print_table(table)
    from kspeedfs.tables import cache_table, decoded_table, spill_lines

    variants = decoded_table(nodes)
    if variants:
        print()
        _print_table(variants)

    cache = cache_table(nodes)
    if cache:
        print()
        _print_table(cache)
    for line in spill_lines(nodes):
        print(line)
    return 0


def _residency(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dataset: the share of its segments that at least one up node holds."""
    held: dict[str, set[int]] = {}
    total: dict[str, int] = {}
    for s in nodes:
        if not s["up"]:
            continue
        for name, h in s.get("held", {}).items():
            held.setdefault(name, set()).update(h["held"])
            total[name] = max(total.get(name, 0), int(h["segments"]))
    return {
        name: {
            "segments": total[name],
            "resident": len(held[name]),
            "resident_pct": 100.0 * len(held[name]) / total[name] if total[name] else 100.0,
        }
        for name in held
    }


def _etcd_members(settings: Settings) -> list[dict[str, Any]] | None:
    """Control plane: every member etcd knows, up or down and since when (None: no etcd)."""
    if not settings.etcd:
        return None
    from kspeedfs.client.clusterstate import ClusterState

    return ClusterState.of(settings).member_table()


def _print_members(members: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> None:
    rows = [("MEMBER (etcd)", "STATE", "SINCE", "HEAL")]
    control = {s["node"]: s.get("control") or {} for s in nodes if s.get("up")}
    for m in members:
        since = "-"
        if m["since"]:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["since"]))
        heal = control.get(m["node"], {}).get("heal")
        under = sum((control.get(m["node"], {}).get("under_replicated") or {}).values())
        text = "-"
        if heal:
            text = f"{heal['segments']} copied, {heal['pending']} pending, {under} under-replicated"
        rows.append((m["node"], m["state"], since, text))
    _print_table(rows)
    print()


def cmd_rebalance(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not settings.etcd:
        raise InvalidArgument("rebalance needs the etcd control plane (--etcd or KSPEEDFS_ETCD)")
    with admin.connect(settings) as client:
        reply = client.request("rebalance", name=args.name or "")
    done = ", ".join(reply["datasets"]) or "nothing"
    print(f"rebalanced {done} over {len(reply['members'])} members")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    with admin.connect(_settings(args)) as client:
        result = client.request("unload", name=args.name)
    print(f"{args.name}: {result['state']}")
    return 0


def cmd_meta(args: argparse.Namespace) -> int:
    from kspeedfs.client import meta

    with admin.connect(_settings(args)) as client:
        for index in meta.add(client, args.name, args.meta):
            print(meta.describe(args.name, index))
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    settings = _settings(args)
    # A refresh lists the whole source: it may take longer than an ordinary request.
    settings.timeout = max(settings.timeout, 600.0)
    with admin.connect(settings) as client:
        result = client.request("refresh", name=args.name)
    if result["state"] == "unchanged":
        print(f"{args.name}: unchanged")
    else:
        print(
            f"{args.name}: refreshed, {result['changed']} files changed, "
            f"{result['kept']} of {result['segments']} segments kept"
        )
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from kspeedfs.fuse.mount import run_mount

    options = [o for o in args.options.split(",") if o]
    # The mount's own metrics_listen (default off): in the config or environment it is the
    # node's port.
    settings = _settings(args, fuse_workers=args.workers, metrics_listen=args.metrics_listen)
    dataset = args.dataset
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
        )
    elif args.endpoint or args.name or args.max_memory or args.max_disk:
        raise InvalidArgument("--endpoint, --name, --max-memory and --max-disk go with --source")
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


def cmd_install_systemd(args: argparse.Namespace) -> int:
    from kspeedfs.systemd_units import install

    exec_prefix = Path(args.exec_prefix) if args.exec_prefix else None
    for path in install(Path(args.prefix), exec_prefix, args.example_mount):
        print(f"wrote {path}")
    print("next: systemctl daemon-reload && systemctl enable --now kspeedfs-node kspeedfs-mountd")
    return 0


def cmd_shutdown(args: argparse.Namespace) -> int:
    with admin.connect(_settings(args)) as client:
        client.request("shutdown")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    settings = _settings(args)
    token_file = settings.token_file
    if args.role == "admin":
        dest = Path(args.output) if args.output else token_file
        auth.write_token(dest, auth.new_admin_token(), overwrite=args.force)
    else:
        if not args.output:
            raise InvalidArgument(f"--output is required for a {args.role} token")
        dest = Path(args.output)
        token = auth.derive_token(auth.read_token(token_file), args.role)
        auth.write_token(dest, token, overwrite=args.force)
    print(f"wrote a {args.role} token to {dest} (mode 0600)")
    return 0


def cmd_user(args: argparse.Namespace) -> int:
    from kspeedfs.format import users

    settings = _settings(args, users_file=args.users_file)
    path = settings.users_path()
    if args.user_command == "list":
        known = users.load_users(path)
        for u in sorted((known.users if known else {}).values(), key=lambda u: u.name):
            print(f"{u.name}  {u.role}")
        return 0
    if args.user_command == "del":
        users.delete_user(path, args.name)
        print(f"deleted user {args.name} from {path}")
        return 0
    users.validate_user(args.name)
    password = _new_password(args.password_stdin)
    users.add_user(path, args.name, args.role, password)
    print(f"user {args.name} ({args.role}) in {path} (mode 0600)")
    return 0


def _new_password(from_stdin: bool) -> str:
    import getpass

    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass("password: ")
    if getpass.getpass("again: ") != first:
        raise InvalidArgument("the two passwords differ")
    return first


def cmd_tls(args: argparse.Namespace) -> int:
    from kspeedfs import tlsca

    if args.tls_command == "new-ca":
        cert, key = tlsca.new_ca(Path(args.dir), args.days, args.force)
        print(f"wrote {cert} and its key {key} (0600); set tls_ca = {cert.resolve()} everywhere")
        return 0
    ca = Path(args.ca)
    cert, key = tlsca.issue(args.host, ca, Path(args.out), args.alt, args.days, args.force)
    print(
        f"wrote {cert} and its key {key} (0600); set tls_cert = {cert.resolve()}, "
        f"tls_key = {key.resolve()}, tls_ca = {(ca / tlsca.CA_CERT).resolve()}"
    )
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


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


COMMANDS = {
    "node": cmd_node,
    "preload": cmd_preload,
    "ls": cmd_ls,
    "status": cmd_status,
    "unload": cmd_unload,
    "rebalance": cmd_rebalance,
    "meta": cmd_meta,
    "refresh": cmd_refresh,
    "mount": cmd_mount,
    "umount": cmd_umount,
    "mounts": cmd_mounts,
    "install-systemd": cmd_install_systemd,
    "shutdown": cmd_shutdown,
    "token": cmd_token,
    "user": cmd_user,
    "tls": cmd_tls,
    "sample": cmd_sample,
    "demo": cmd_demo,
}

if __name__ == "__main__":
    sys.exit(main())
