"""etcd outages under readers and an in-flight preload (issue 29), run inside a network
namespace by tests/system/test_etcd_weather.py (and, with one partition only, by
tests/system/test_network_weather.py): etcd on 127.0.0.5, nodes on 127.0.0.2-4 (member_ttl and
heal_after 2 s, so every lease lapses many times over), a reader thread reading a ready
dataset from the nodes the whole time.

Each outage (`partition`: every packet to and from etcd dropped; `freeze`: etcd SIGSTOPped)
starts while a preload of a second tree is in flight and lasts OUTAGE seconds. Then, within
10 s of etcd's return, `kspeedfs ls --json` and `kspeedfs status --json` must say what they
said before the outage (plus the new dataset when its preload finished), no down note may
name a live member, nobody may be lost, and every node must hold exactly the segments it
held. The in-flight preload must finish, or fail with one line and leave nothing behind (no
catalog record, no node holding it); a retry after etcd's return must work.

Usage: netns_etcd.py OUT.json PARTITION_S [FREEZE_S [--preload]]. Writes JSON: per outage
what happened, and the reader's counts (wrong bytes, errors, reads during each outage,
longest read)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kspeedfs.client.clusterstate import ClusterState, resolve_nodes
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import auth
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import KSpeedError
from kspeedfs.format.localdata import SEGMENT_DIR
from kspeedfs.testing import netns

ETCD = "127.0.0.5"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
CONVERGE_S = 10.0  # the bound on convergence after etcd's return
# The preload in flight: 48 MB, staged in a few seconds here (with 64 KiB segments).
PRELOAD_FILES, PRELOAD_FILE_BYTES = 48, 1 << 20


class World:
    def __init__(self, work: Path, shm: Path):
        self.work, self.shm = work, shm
        self.procs: list[subprocess.Popen[bytes]] = []
        token = work / "token"
        auth.write_token(token, auth.new_admin_token())
        (work / "empty.toml").touch()
        self.env = {
            **os.environ,
            "KSPEEDFS_CONFIG": str(work / "empty.toml"),
            "KSPEEDFS_TOKEN_FILE": str(token),
            "KSPEEDFS_ETCD": f"http://{ETCD}:2379",
            "KSPEEDFS_CLUSTER": "weather",
            "KSPEEDFS_MEMBER_TTL": "2",
            "KSPEEDFS_HEAL_AFTER": "2",
            "KSPEEDFS_TIMEOUT": "4",
        }
        # Readers' health table: the test's own (tests/conftest.py), else one of this run's:
        # other runs on the machine use the same addresses in their namespaces.
        self.env.setdefault("KSPEEDFS_HEALTH_TABLE", f"{shm}.health")
        self.env.pop("KSPEEDFS_NODES", None)
        self.env.pop("KSPEEDFS_LISTEN", None)
        self.settings = load_settings(env=self.env)
        self.state = ClusterState.of(self.settings)
        self.addrs = [f"{h}:7420" for h in HOSTS]
        self.last_error = ""  # the last CLI failure of `view`

    def held(self, name: str) -> dict[str, list[int]]:
        return {
            a: sorted(
                int(f) for f in _listdir(self.shm / f"n{i}" / "datasets" / name / SEGMENT_DIR)
            )
            for i, a in enumerate(self.addrs)
        }

    def holders(self, name: str) -> list[str]:
        """The nodes with a folder for `name` (a staged or published part of it)."""
        return [
            a for i, a in enumerate(self.addrs) if (self.shm / f"n{i}" / "datasets" / name).exists()
        ]

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*netns.KSPEEDFS, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def view(self) -> dict[str, Any] | None:
        """What `ls --json` and `status --json` say, without what changes by itself (bytes
        used, times, latencies); None when either fails."""
        ls, st = self.cli("ls", "--json", timeout=20), self.cli("status", "--json", timeout=20)
        if ls.returncode != 0 or st.returncode != 0:
            self.last_error = (ls.stderr + st.stderr).strip()
            return None
        try:
            datasets, status = json.loads(ls.stdout), json.loads(st.stdout)
        except ValueError:
            return None
        return {
            "datasets": sorted(
                (
                    d["name"],
                    d.get("uuid"),
                    d.get("state"),
                    d.get("segments"),
                    tuple(d.get("members") or ()),
                    tuple(d.get("lost") or ()),
                )
                for d in datasets
            ),
            # `suspect`: this machine's readers saw the node late a moment ago (a hedge on a busy
            # machine); it answered: as `up` here, a transient opinion, not the cluster's state.
            "nodes": sorted(
                (n.get("node"), n.get("up"), _settled_state(n.get("state")))
                for n in status["nodes"]
            ),
            "members": sorted(
                (m["node"], m.get("state"), bool(m.get("lost")))
                for m in status.get("members") or []
            ),
            "etcd_error": status.get("etcd_error", ""),
        }

    def down_live(self) -> list[str]:
        return sorted(set(self.state.snapshot().down) & set(self.addrs))

    def lost(self) -> list[str]:
        snap = self.state.snapshot()
        return sorted({m for rec, _rev in snap.datasets.values() for m in rec.lost_members})


def main(out: Path, partition_s: float, freeze_s: float, with_preload: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-netns-etcd-"))
    shm = Path("/dev/shm") / f"kspeedfs-netns-etcd-{uuid.uuid4().hex[:8]}"
    w = World(work, shm)
    reader: ClusterReader | None = None
    stop = threading.Event()
    t: threading.Thread | None = None
    try:
        netns.shape_setup()
        etcd = netns.start_etcd(ETCD, work)
        w.procs.append(etcd)
        _wait(lambda: _etcd_up(w.state), 30, "etcd")
        w.procs += netns.start_nodes(w.addrs, shm, work, w.env, "64KiB")
        _wait(lambda: len(w.state.snapshot().members) == 3, 60, "three members")
        src = work / "src"
        want = netns.make_tree(src, 120)
        netns.preload(src, "w", w.env)
        more = work / "more"
        for i in range(PRELOAD_FILES):  # big files: staging takes a few seconds here
            (more / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
            (more / f"d{i % 4}" / f"m{i:03d}.bin").write_bytes(os.urandom(PRELOAD_FILE_BYTES))

        counts = {"reads": 0, "wrong": 0, "errors": 0}
        reader = ClusterReader(resolve_nodes(w.settings))
        ds = reader.open_dataset("w")
        t = threading.Thread(
            target=netns.read_until, args=(reader, ds, want.__getitem__, stop, counts), daemon=True
        )
        t.start()
        _wait(lambda: counts["reads"] > 0, 30, "the first reads")
        outages: list[dict[str, Any]] = []
        plan = [("partition", partition_s), ("freeze", freeze_s)]
        for n, (kind, seconds) in enumerate(plan):
            if seconds <= 0:
                continue
            outages.append(_outage(w, etcd, kind, seconds, f"p{n}", more, with_preload, counts))
        stop.set()
        t.join(10)
        result: dict[str, Any] = {**counts, "outages": outages}
        if (
            outages
        ):  # the first outage's figures at the top, as tests/system/test_network_weather reads
            first = outages[0]
            result["reads_during_partition"] = first["reads_during"]
            for key in (
                "converged_s",
                "still_sound",
                "lost",
                "down_live",
                "held_before",
                "held_after",
            ):
                result[key] = first[key]
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
        return 0
    finally:
        stop.set()
        if t is not None:
            t.join(10)
        if reader is not None:
            reader.close()
        netns.partition_off()
        netns.clean_up(w.procs, shm, work)


def _outage(
    w: World,
    etcd: subprocess.Popen[bytes],
    kind: str,
    seconds: float,
    name: str,
    more: Path,
    with_preload: bool,
    counts: dict[str, int],
) -> dict[str, Any]:
    """One outage of etcd (`kind`: partition or freeze) lasting `seconds`, a preload of `more`
    as `name` in flight at its start: what the cluster said and did."""
    before = w.view()
    held = w.held("w")
    # No healthy node drops a copy at any moment (a drop healed by the end would not show in
    # held_after): the folders sampled every 0.3 s through the outage and the convergence.
    drops = netns.DropWatch(lambda: w.held("w"), held)
    pre: subprocess.Popen[str] | None = None
    if with_preload:
        cmd = [*netns.KSPEEDFS, "preload", str(more), "--name", name, "--replicas", "2", "-q"]
        pre = subprocess.Popen(
            cmd, env=w.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        # In flight: its name claimed in the catalog, its members staging.
        _wait(
            lambda: _claimed(w.state, name) or pre.poll() is not None, 30, f"{name} claimed", 0.05
        )
    at = counts["reads"]
    if kind == "partition":
        netns.partition_on(ETCD)
    else:
        etcd.send_signal(signal.SIGSTOP)
    in_flight = pre is not None and pre.poll() is None
    # under test: the outage lasts `seconds`
    time.sleep(seconds)
    reads_during = counts["reads"] - at
    if kind == "partition":
        netns.partition_off()
    else:
        etcd.send_signal(signal.SIGCONT)
    healed = time.monotonic()
    # etcd's return: when it answers a new client again. After a partition that can lag the
    # heal by its gateway's gRPC reconnect backoff (up to ~25 s): the gateway dials etcd's own
    # address from 127.0.0.1, like every client here, so the partition cuts it too (on a real
    # machine it is loopback); the nodes are timed from etcd's return, the lag is recorded.
    _wait(lambda: _etcd_up(w.state), 60, "etcd answering again", 0.1)
    back = time.monotonic()
    etcd_back_s = round(back - healed, 1)
    preload: dict[str, Any] = {}
    if pre is not None:
        try:
            stdout, stderr = pre.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pre.kill()
            stdout, stderr = pre.communicate()
            stderr += "\n(still running 60 s after etcd came back: killed)"
        preload = {
            "in_flight_at_start": in_flight,
            "rc": pre.returncode,
            "stdout": stdout.strip(),
            "stderr": stderr.strip(),
            "ended_after_return_s": round(time.monotonic() - back, 1),
        }

    def published() -> bool:
        return preload.get("rc") == 0

    def settled() -> bool:
        """etcd and the nodes' folders, read directly (a fraction of a second): every node a
        member, no down note for one, nobody lost, `w` held as before, and the new dataset
        ready on two copies of each segment, or gone from the catalog and from every node."""
        try:
            snap = w.state.snapshot()
        except KSpeedError:
            return False
        if set(snap.members) != set(w.addrs) or set(snap.down) & set(w.addrs):
            return False
        if any(rec.lost_members for rec, _rev in snap.datasets.values()) or w.held("w") != held:
            return False
        found = snap.datasets.get(name)
        if published():
            copies = sum(len(v) for v in w.held(name).values())
            return found is not None and found[0].ready and copies == 2 * found[0].segments
        return found is None and not w.holders(name)

    def sound() -> bool:
        """`settled`, and `ls --json` and `status --json` as before (plus the new dataset,
        ready; or its failed load, listed by its coordinator with no instance for
        FAILED_KEPT_S, so that whoever waits on it reads why)."""
        now = w.view()
        if now is None or before is None or not settled():
            return False
        rest = [d for d in now["datasets"] if d[0] != name]
        mine = [d for d in now["datasets"] if d[0] == name]
        if {**now, "datasets": rest} != before:
            return False
        if published():
            return len(mine) == 1 and mine[0][2] == "ready"
        return all(d[1] is None and d[2] == "failed" for d in mine)

    # converged_s: when etcd and the nodes' folders first show it settled (polled every 0.2 s);
    # seen_s: when the CLI's views first say the same as before (each check runs two commands,
    # a few seconds here).
    converged_s = seen_s = None
    while time.monotonic() - back < CONVERGE_S + 5:
        if settled():
            converged_s = round(time.monotonic() - back, 1)
            break
        time.sleep(0.2)
    while converged_s is not None and time.monotonic() - back < CONVERGE_S + 10:
        if sound():
            seen_s = round(time.monotonic() - back, 1)
            break
        time.sleep(0.3)
    dropped = drops.stop()
    last = w.view()
    time.sleep(3)  # under test: past heal_after again, nothing changes later either
    still = sound()
    retry: dict[str, Any] = {}
    if pre is not None and not published():
        again = w.cli("preload", str(more), "--name", name, "--replicas", "2", "-q", timeout=120)
        retry = {"rc": again.returncode, "stderr": again.stderr.strip()}
        copies = sum(len(v) for v in w.held(name).values())
        retry["copies"] = copies
    if pre is not None:  # the next outage starts from the same catalog
        w.cli("unload", name, timeout=60)
        _wait(lambda: not w.holders(name), 30, f"{name} unloaded everywhere")
    logs = {}
    if converged_s is None or seen_s is None:  # what etcd and a node said, for the record
        for log_name in ("etcd.log", "node0.log"):
            text = (w.work / log_name).read_text(errors="replace").splitlines()
            logs[log_name] = [line for line in text if "not held" not in line][-15:]
    return {
        "logs": logs,
        "kind": kind,
        "etcd_back_s": etcd_back_s,
        "seconds": seconds,
        "reads_during": reads_during,
        "preload": preload,
        "converged_s": converged_s,
        "seen_s": seen_s,
        "still_sound": still,
        "before": before,
        "after": last,
        "cli_error": w.last_error if last is None else "",
        "down_live": w.down_live(),
        "lost": w.lost(),
        "dropped": dropped,
        "held_before": held,
        "held_after": w.held("w"),
        "retry": retry,
    }


def _settled_state(state: str | None) -> str | None:
    return "up" if state == "suspect" else state


def _claimed(state: ClusterState, name: str) -> bool:
    try:
        return state.dataset(name) is not None
    except KSpeedError:
        return False


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _etcd_up(state: ClusterState) -> bool:
    try:
        state.snapshot()
        return True
    except KSpeedError:
        return False


def _wait(predicate: Any, timeout: float, what: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout:.0f}s")
        time.sleep(every)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(
        main(
            Path(args[0]),
            float(args[1]) if len(args) > 1 else 8.0,
            float(args[2]) if len(args) > 2 else 0.0,
            "--preload" in sys.argv,
        )
    )
