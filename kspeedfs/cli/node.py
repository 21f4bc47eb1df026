"""Node commands: run the daemon, show the nodes (status), stop the daemon, remove a stopped
node's folders."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from kspeedfs.cli.settings import settings_from
from kspeedfs.cli.tables import print_table
from kspeedfs.client import admin
from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.contract.node import NodeStatus, Shutdown, Status
from kspeedfs.format.errors import AuthError, KSpeedError
from kspeedfs.format.units import format_size


def cmd_node(args: argparse.Namespace) -> int:
    settings = settings_from(
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


STATUS_WAIT_S = 2.0  # the most `status` waits for any one node (they are asked together)


@dataclasses.dataclass
class NodeView:
    """One node as `kspeedfs status` shows it: its answer when it gave one, and its state
    judged from that, etcd and this machine's readers (`_judge`)."""

    node: str
    status: NodeStatus | None  # None: it did not answer
    error: str = ""  # why it did not
    state: str = ""
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        """Its row in `status --json`: the answer's fields (or the error), up, state, why."""
        if self.status is None:
            row: dict[str, Any] = {"up": False, "node": self.node, "error": self.error}
        else:
            row = {"up": True, **self.status.to_wire()}
        return {**row, "state": self.state, "why": self.why}


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    nodes = _ask_status(settings)
    members, etcd_error = None, ""
    try:
        members = _etcd_members(settings)
    except KSpeedError as e:  # etcd away: the nodes' own answers are still the truth
        if isinstance(e, AuthError):
            raise
        etcd_error = str(e)
    _judge(nodes, members, settings)
    datasets = _residency(nodes)
    if args.json:
        out: dict[str, Any] = {
            "nodes": [n.to_json() for n in nodes],
            "datasets": datasets,
            "members": members,
        }
        if etcd_error:
            out["etcd_error"] = etcd_error
        print(json.dumps(out, indent=2))
        return 0
    if etcd_error:
        print(f"etcd: {etcd_error}\n")
    if members is not None:
        _print_members(members, nodes)
    rows = [
        ("NODE", "STATE", "MEMORY USED / BUDGET", "DISK TIER", "DATASETS", "SEGMENTS", "TRANSPORT")
        + ("SHM DIR",)
    ]
    for n in nodes:
        s = n.status
        if s is None:
            rows.append((n.node, n.state, "-", "-", "-", "-", "-", n.why))
            continue
        mem = f"{format_size(s.used)} / {format_size(s.budget)}"
        tier = s.disk_tier
        disk = f"{format_size(tier.used)} / {format_size(tier.budget)}" if tier else "-"
        loading = f" (+{len(s.loading)} loading)" if s.loading else ""
        rows.append(
            (
                n.node,
                n.state if n.state == "up" else f"{n.state}: {n.why}",
                mem,
                disk,
                f"{s.datasets}{loading}",
                str(s.segments),
                s.transport,
                s.shm_dir,
            )
        )
    print_table(rows)
    if datasets:
        print()
        table = [("DATASET", "SEGMENTS", "RESIDENT")]
        for name, d in sorted(datasets.items()):
            table.append((name, str(d["segments"]), f"{d['resident_pct']:.0f}%"))
        print_table(table)
    from kspeedfs.cli.tables import cache_table, decoded_table, spill_lines

    variants = decoded_table(nodes)
    if variants:
        print()
        print_table(variants)

    cache = cache_table(nodes)
    if cache:
        print()
        print_table(cache)
    for line in spill_lines(nodes):
        print(line)
    return 0


def _ask_status(settings: Settings) -> list[NodeView]:
    """Every node's status, asked together, each given STATUS_WAIT_S (a partitioned node
    costs that once, never the sum); a node that does not answer is a row saying why."""
    from concurrent.futures import ThreadPoolExecutor

    from kspeedfs.format.tls import client_context
    from kspeedfs.net.connection import NodeClient
    from kspeedfs.net.transport import CONNECT_TIMEOUT

    tls = client_context(settings)
    wait = min(settings.timeout, STATUS_WAIT_S)

    def ask(addr: Any) -> NodeView:
        try:
            with NodeClient(
                addr, settings.credential(), wait, tls, connect_timeout=CONNECT_TIMEOUT
            ) as client:
                status = client.call(Status())
                return NodeView(status.node, status)
        except KSpeedError as e:
            # A refused token is this client's problem, not a node that is down.
            if len(settings.nodes) == 1 or isinstance(e, AuthError):
                raise
            return NodeView(str(addr), None, error=str(e))

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(settings.nodes)))) as pool:
        return list(pool.map(ask, settings.nodes))


def _judge(nodes: list[NodeView], members: list[dict[str, Any]] | None, settings: Settings) -> None:
    """Each node's state and why: up; suspect (it answers, but this machine's readers saw it
    miss a hedge delay: client/health.py); partitioned (etcd has its lease, so it is alive,
    but it does not answer here); down (neither); lost (a catalog record declared it)."""
    from kspeedfs.client.health import NodeHealth

    health = NodeHealth(settings.health_table).view([n.node for n in nodes])
    in_etcd = {m["node"]: m for m in members or []}
    for n in nodes:
        seen = health.get(n.node, {})
        member = in_etcd.get(n.node, {})
        if n.status is not None:
            if seen.get("down") or seen.get("suspect"):
                n.state = "suspect"
                n.why = "readers on this machine saw it late; probing it"
            else:
                n.state, n.why = "up", ""
        elif member.get("state") == "up":
            n.state = "partitioned"
            n.why = f"etcd holds its lease, but from here: {n.error}"
        elif member.get("state") == "lost":
            n.state, n.why = "lost", f"declared lost: {n.error}"
        else:
            n.state, n.why = "down", n.error


def _residency(nodes: list[NodeView]) -> dict[str, dict[str, Any]]:
    """Per dataset: the share of its segments that at least one up node holds."""
    held: dict[str, set[int]] = {}
    total: dict[str, int] = {}
    for n in nodes:
        if n.status is None:
            continue
        for name, h in n.status.held.items():
            held.setdefault(name, set()).update(h.held)
            total[name] = max(total.get(name, 0), h.segments)
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

    return ClusterState.of(settings, STATUS_WAIT_S).member_table()


def _print_members(members: list[dict[str, Any]], nodes: list[NodeView]) -> None:
    rows = [("MEMBER (etcd)", "STATE", "SINCE", "HEAL")]
    control = {n.node: n.status.control for n in nodes if n.status is not None}
    for m in members:
        since = "-"
        if m["since"]:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["since"]))
        seen = control.get(m["node"])
        text = "-"
        if seen is not None:
            under = sum(seen.under_replicated.values())
            heal = seen.heal
            text = f"{heal.segments} copied, {heal.pending} pending, {under} under-replicated"
        rows.append((m["node"], m["state"], since, text))
    print_table(rows)
    print()


def cmd_shutdown(args: argparse.Namespace) -> int:
    with admin.connect(settings_from(args)) as client:
        client.call(Shutdown())
    return 0


def cmd_clean_node(args: argparse.Namespace) -> int:
    """Remove a stopped node's folders: those named, else its configured shm and spill folders
    (refused in one line while a node runs on one, or for a folder that is not a node's)."""
    from kspeedfs.node.nodefolders import remove_stopped

    folders = [Path(f) for f in (args.shm_dir, args.spill_dir) if f]
    if not folders:
        settings = load_settings({}, config_file=args.config)
        folders = [f for f in (settings.shm_dir, settings.spill_dir) if f is not None]
    for line in remove_stopped(folders):
        print(line)
    return 0
