"""An etcd partitioned from three nodes that stay up (issue 29), run inside a network namespace
by tests/test_network_weather.py: etcd on 127.0.0.5, nodes on 127.0.0.2-4 (member_ttl and
heal_after 2 s), a reader thread reading the whole tree from the nodes; every packet to and
from etcd dropped for 8 s (every lease lapses meanwhile), then healed. Writes JSON: wrong bytes,
errors, reads during the partition, and whether (and when) membership and the catalog came
back with no node lost and every node holding exactly the segments it held before."""

from __future__ import annotations

import json
import os
import shutil
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


def main(out: Path, partition_s: float) -> int:
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-netns-etcd-"))
    shm = Path("/dev/shm") / f"kspeedfs-netns-etcd-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        netns.shape_setup()
        token = work / "token"
        auth.write_token(token, auth.new_admin_token())
        (work / "empty.toml").touch()
        endpoint = f"http://{ETCD}:2379"
        procs.append(netns.start_etcd(ETCD, work))
        env = {
            **os.environ,
            "KSPEEDFS_CONFIG": str(work / "empty.toml"),
            "KSPEEDFS_TOKEN_FILE": str(token),
            "KSPEEDFS_ETCD": endpoint,
            "KSPEEDFS_CLUSTER": "weather",
            "KSPEEDFS_MEMBER_TTL": "2",
            "KSPEEDFS_HEAL_AFTER": "2",
            "KSPEEDFS_TIMEOUT": "4",
        }
        env.pop("KSPEEDFS_NODES", None)
        env.pop("KSPEEDFS_LISTEN", None)
        settings = load_settings(env=env)
        state = ClusterState.of(settings)
        _wait(lambda: _etcd_up(state), 30, "etcd")
        addrs = [f"{h}:7420" for h in HOSTS]
        procs += netns.start_nodes(addrs, shm, work, env, "64KiB")
        _wait(lambda: len(state.snapshot().members) == 3, 60, "three members")
        src = work / "src"
        want = netns.make_tree(src, 120)
        netns.preload(src, "w", env)

        def held() -> dict[str, list[int]]:
            return {
                a: sorted(int(f) for f in _listdir(shm / f"n{i}" / "datasets" / "w" / SEGMENT_DIR))
                for i, a in enumerate(addrs)
            }

        before = held()
        counts = {"reads": 0, "wrong": 0, "errors": 0}
        stop = threading.Event()
        reader = ClusterReader(resolve_nodes(settings))
        ds = reader.open_dataset("w")
        t = threading.Thread(
            target=netns.read_until, args=(reader, ds, want.__getitem__, stop, counts), daemon=True
        )
        t.start()
        # under test: the readers run a second before the partition
        time.sleep(1)
        netns.partition_on(ETCD)
        at = counts["reads"]
        # under test: the partition lasts partition_s
        time.sleep(partition_s)
        reads_during = counts["reads"] - at
        netns.partition_off()
        healed = time.monotonic()

        def sound() -> bool:
            try:
                snap = state.snapshot()
            except KSpeedError:
                return False
            record = snap.datasets.get("w", ({}, 0))[0]
            return (
                set(snap.members) == set(addrs)
                and not (set(snap.down) & set(addrs))
                and not record.get("lost")
                and held() == before
            )

        converged_s = None
        while time.monotonic() - healed < 15:
            if sound():
                converged_s = time.monotonic() - healed
                break
            time.sleep(0.2)
        time.sleep(4)  # under test: past heal_after again
        still = sound()
        stop.set()
        t.join(10)
        snap = state.snapshot()
        result = {
            **counts,
            "reads_during_partition": reads_during,
            "converged_s": converged_s,
            "still_sound": still,
            "lost": snap.datasets.get("w", ({}, 0))[0].get("lost", []),
            "down_live": sorted(set(snap.down) & set(addrs)),
            "held_before": before,
            "held_after": held(),
        }
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if not k.startswith("held")}))
        return 0
    finally:
        netns.stop_all(procs)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


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


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout:.0f}s")
        time.sleep(0.3)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 8.0))
