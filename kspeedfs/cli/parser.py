"""The `kspeedfs` command line: every command, its options and the exit codes it documents."""

from __future__ import annotations

import argparse

from kspeedfs import __version__
from kspeedfs.cli.tables import LS_COLUMNS
from kspeedfs.format import auth
from kspeedfs.format.errors import EXIT_CODES_DOC


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
    p.add_argument(
        "--queue",
        action="store_true",
        help="when it does not fit, wait in the node's queue for room instead of failing",
    )
    p.add_argument("--replicas", type=int, default=1, help="copies of each segment (default 1)")
    p.add_argument(
        "--tier",
        choices=("auto", "memory", "disk"),
        default="auto",
        help="where segments go: auto (memory, the rest on the disk tier), memory or disk",
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="load what fits in memory, read the rest through from the source",
    )
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="per node: the most memory its segments take on each node, e.g. 16GiB (auto:"
        " the rest goes to the disk tier); refused when more than a node has free",
    )
    p.add_argument(
        "--max-disk",
        metavar="SIZE",
        help="per node: the most of each node's disk tier its segments take, e.g. 200GiB"
        " (default: the tier's budget; with --partial: of the spill folder)",
    )
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

    for name, help_text, epilog in (
        ("ls", "list datasets", LS_COLUMNS),
        ("status", "show the nodes", None),
    ):
        p = sub.add_parser(name, help=help_text, epilog=epilog)
        _client_options(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "jobs", help="the jobs whose training loops report: whether each waits on its data"
    )
    _client_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("top", help="`jobs`, refreshed in place until Ctrl-C")
    _client_options(p)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument(
        "--iterations", type=int, default=0, metavar="N", help="stop after N screens (0: never)"
    )

    p = sub.add_parser("report", help="one job's stall over time (and a picture of it)")
    _client_options(p)
    p.add_argument("job", help="the job (as `kspeedfs jobs` names it)")
    p.add_argument("--svg", metavar="FILE", help="draw the stall and hit rate over time here")
    p.add_argument("--png", metavar="FILE", help="the same picture as PNG (needs rsvg-convert)")

    p = sub.add_parser("dashboard", help="print a Grafana dashboard (JSON) of the job metrics")
    p.add_argument(
        "--datasource", default="Prometheus", help="the Prometheus data source's name in Grafana"
    )

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
    p.add_argument(
        "--dataset", help="serve one dataset at the root (NAME@N: its decoded variant of size N)"
    )
    p.add_argument("--source", help="read-through: serve this folder or s3:// URL, cached as read")
    p.add_argument("--endpoint", help="object store endpoint URL of an s3:// --source")
    p.add_argument("--name", help="dataset name for --source (default: from the source)")
    p.add_argument(
        "--max-memory", help="with --source: the most memory the dataset takes, e.g. 16GiB"
    )
    p.add_argument(
        "--max-disk", help="with --source: the most of the spill folder it takes, e.g. 64GiB"
    )
    p.add_argument(
        "--min-memory",
        help="with --source: its floor, memory no other dataset's miss or preload takes, e.g. 8GiB",
    )
    p.add_argument(
        "--weight",
        type=int,
        help="with --source: its weight in the shares of memory (a whole number, default 1)",
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

    p = sub.add_parser(
        "csi", help="the Kubernetes CSI node plugin (driver csi.kspeedfs.io), on a unix socket"
    )
    _client_options(p)
    p.add_argument(
        "--endpoint", required=True, help="unix:///PATH/csi.sock (kubelet's CSI_ENDPOINT)"
    )
    p.add_argument("--node-id", required=True, help="this node's name (the downward NODE_NAME)")
    p.add_argument(
        "--state-dir",
        default="/var/lib/kspeedfs-csi",
        help="the records of published volumes, kept across restarts (default /var/lib/kspeedfs-csi)",
    )
    p.add_argument(
        "--mounts-dir",
        default="/run/kspeedfs-csi/mounts.d",
        help="mountd's folder of declarations, where volumes are declared (default /run/kspeedfs-csi/mounts.d)",
    )
    p.add_argument(
        "--mountd-state",
        default="/run/kspeedfs-csi/mountd.json",
        help="mountd's status file (default /run/kspeedfs-csi/mountd.json)",
    )
    p.add_argument(
        "--publish-timeout",
        type=float,
        default=110.0,
        help="seconds a publish waits for a warm load and its mount (default 110: kubelet waits 120)",
    )
    p.add_argument(
        "--kubelet-dir",
        default="/var/lib/kubelet",
        help="kubelet's root folder: targets outside it are refused (default /var/lib/kubelet)",
    )
    p.add_argument(
        "--policy",
        help="the admin's volume policy (TOML): which namespaces may use which datasets; "
        "without it every publish is allowed",
    )

    p = sub.add_parser("kubernetes", help="Kubernetes: print the manifests to install kspeedfs")
    ksub = p.add_subparsers(dest="kubernetes_command", required=True, metavar="ACTION")
    t = ksub.add_parser(
        "manifests",
        help="DaemonSet, CSIDriver, RBAC, ConfigMap, Service and examples, as one YAML stream",
    )
    t.add_argument(
        "--image",
        help="the kspeedfs image your machines pull (required: in --values or here; none is published)",
    )
    t.add_argument("--values", help="a YAML file of install values (docs/kubernetes.md, Values)")
    t.add_argument("--namespace", help="namespace (default kspeedfs)")
    t.add_argument(
        "--image-pull-secret",
        action="append",
        dest="image_pull_secrets",
        metavar="SECRET",
        help="a Secret to pull the images with (repeatable)",
    )
    t.add_argument("--registrar-image", help="the node-driver-registrar image")
    t.add_argument("--livenessprobe-image", help="the CSI livenessprobe image")
    t.add_argument("--kubelet-dir", help="kubelet's root folder (default /var/lib/kubelet)")
    t.add_argument("--data-dir", help="the host's folder of sources (default /data)")
    t.add_argument(
        "--cache-memory",
        help="the node's memory request, and so its cache budget (default 8Gi)",
    )
    t.add_argument("--priority-class", help="default system-node-critical")
    t.add_argument(
        "--metrics-port", type=int, help="the node's /metrics port (default 9420, 0 off)"
    )
    t.add_argument("--cluster-domain", help="the cluster's DNS domain (default cluster.local)")
    t.add_argument(
        "--kustomize",
        metavar="DIR",
        help="write a Kustomize base (one file per part, values.yaml) into DIR instead",
    )
    t.add_argument(
        "--examples",
        action="store_true",
        help="also a pod with an inline volume, a PV and PVC, and a preload Job",
    )
    t.add_argument(
        "--fluid",
        action="store_true",
        help="instead: a Fluid ThinRuntimeProfile, Dataset and ThinRuntime of kspeedfs",
    )

    p = sub.add_parser("install-systemd", help="install the systemd units and mount helpers")
    p.add_argument("--prefix", default="/", help="install under DIR instead of / (default /)")
    p.add_argument("--exec-prefix", help="where the kspeedfs scripts are (default: this venv)")
    p.add_argument("--example-mount", action="store_true", help="also mnt-imagenet.mount")

    p = sub.add_parser("shutdown", help="stop the node daemon")
    _client_options(p)

    p = sub.add_parser(
        "clean-node",
        help="remove a stopped node's folders (shm folder, spill folder), sealed segments too",
    )
    p.add_argument("--config", help="TOML config file (env KSPEEDFS_CONFIG)")
    p.add_argument("--shm-dir", help="its shm folder (default: the config's shm_dir)")
    p.add_argument("--spill-dir", help="its spill folder (default: the config's spill_dir)")

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
