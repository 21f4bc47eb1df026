"""A seeded nemesis (Jepsen-style) over a 3-member etcd cluster and three kspeedfs nodes
(replicas 2), run inside a network namespace by tests/system/test_nemesis.py (issue 29).

etcd members on 127.0.0.5-7, nodes on 127.0.0.2-4 (member_ttl 2 s, heal_after 15 s, timeout
4 s), each node under libfaketime with its own offset file, so that its wall clock can jump
while it runs (its monotonic clock never does, as on a real machine). A dataset is preloaded
(its source stays: a read no node answers in time goes there, counted per step as
`from_source`; KSPEEDFS_NEMESIS_NO_SOURCE=1 moves it away, so that every byte must come from
the nodes). A fast-path reader thread
reads the whole tree again and again, checking every byte and timing every read.

Then STEPS steps drawn from SEED (random.Random(seed)): each is one fault, held 1.5-3.5 s and
healed: a node or an etcd member partitioned (every packet between it and the others dropped),
paused (SIGSTOP, then SIGCONT), killed (SIGKILL, then started again on the same data), 1% of
all packets lost, or a node's wall clock jumped (+-10 min or +-1 h; it stays there). After
each step, the checks:
- 0 wrong bytes and 0 read errors so far (one fault at a time, two copies of every segment);
- no read took longer than the documented bound, `timeout` (docs/cluster.md#failures);
- no sound copy dropped: at no moment did a node hold fewer segments than it held at the
  start (sampled every 0.3 s through the step);
- convergence within CONVERGE_S of the heal: every node a member in etcd, no down note for a
  live member, nobody declared lost, every node holding exactly its segments.
At the end `kspeedfs ls --json` and `kspeedfs status --json` must say what they said at the
start (within CONVERGE_S). The first failing step stops the run.

Usage: netns_nemesis.py OUT.json SEED STEPS. Writes JSON: the seed, each step (what, where,
how long) with its checks, and the verdict ("ok" or the first failure)."""

from __future__ import annotations

import json
import os
import random
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

NODE_HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
ETCD_HOSTS = ["127.0.0.5", "127.0.0.6", "127.0.0.7"]
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
TIMEOUT_S = 4.0  # the nodes' and the reader's `timeout`: the bound on a read
CONVERGE_S = 10.0
FAULTS = ("partition", "pause", "kill", "loss", "clock")
CLOCKS = ("+1h", "-1h", "+10m", "-10m", "+0")


class Cluster:
    def __init__(self, work: Path, shm: Path, node_pythonpath: str):
        self.work, self.shm = work, shm
        token = work / "token"
        auth.write_token(token, auth.new_admin_token())
        (work / "empty.toml").touch()
        self.env = {
            **os.environ,
            "KSPEEDFS_CONFIG": str(work / "empty.toml"),
            "KSPEEDFS_TOKEN_FILE": str(token),
            "KSPEEDFS_ETCD": ",".join(f"http://{h}:2379" for h in ETCD_HOSTS),
            "KSPEEDFS_CLUSTER": "nemesis",
            "KSPEEDFS_MEMBER_TTL": "2",
            "KSPEEDFS_HEAL_AFTER": "15",
            "KSPEEDFS_TIMEOUT": str(TIMEOUT_S),
        }
        # Readers' health table: the test's own (tests/conftest.py), else one of this run's:
        # other runs on the machine use the same addresses in their namespaces.
        self.env.setdefault("KSPEEDFS_HEALTH_TABLE", f"{shm}.health")
        self.env.pop("KSPEEDFS_NODES", None)
        self.env.pop("KSPEEDFS_LISTEN", None)
        # The nodes' code (a check that the nemesis catches a known bug runs older nodes).
        self.node_env = {**self.env, "PYTHONPATH": node_pythonpath or self.env["PYTHONPATH"]}
        if node_pythonpath:
            self.node_env["PYTHONSAFEPATH"] = "1"
        self.settings = load_settings(env=self.env)
        self.state = ClusterState.of(self.settings)
        self.addrs = [f"{h}:7420" for h in NODE_HOSTS]
        self.etcd: list[subprocess.Popen[bytes]] = []
        self.nodes: list[subprocess.Popen[bytes]] = []

    # processes

    def start_etcd(self) -> None:
        self.etcd = [netns.start_etcd_member(ETCD_HOSTS, i, self.work) for i in range(3)]

    def clock_file(self, i: int) -> Path:
        return self.work / f"clock{i}"

    def set_clock(self, i: int, offset: str) -> None:
        """Node i's wall clock at `offset` from the real one (read within a second)."""
        tmp = self.work / f"clock{i}.tmp"
        tmp.write_text(offset + "\n")
        tmp.rename(self.clock_file(i))  # whole, or libfaketime may read it empty

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        env = {
            **self.node_env,
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.clock_file(i)),
            "FAKETIME_CACHE_DURATION": "1",
            "DONT_FAKE_MONOTONIC": "1",
        }
        return netns.start_node(i, self.addrs[i], self.shm, self.work, env, "64KiB")

    def start_nodes(self) -> None:
        for i in range(3):
            self.set_clock(i, "+0")
        self.nodes = [self.start_node(i) for i in range(3)]

    def all_procs(self) -> list[subprocess.Popen[bytes]]:
        return [*self.etcd, *self.nodes]

    # what the cluster says

    def held(self, name: str) -> dict[str, list[int]]:
        return {
            a: sorted(
                int(f) for f in _listdir(self.shm / f"n{i}" / "datasets" / name / SEGMENT_DIR)
            )
            for i, a in enumerate(self.addrs)
        }

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*netns.KSPEEDFS, *args], env=self.env, capture_output=True, text=True, timeout=30
        )

    def view(self) -> dict[str, Any] | str:
        """`ls --json` and `status --json`, without what changes by itself; the error text
        when either fails."""
        ls, st = self.cli("ls", "--json"), self.cli("status", "--json")
        if ls.returncode != 0 or st.returncode != 0:
            return (ls.stderr + st.stderr).strip()
        datasets, status = json.loads(ls.stdout), json.loads(st.stdout)
        return {
            "datasets": sorted(
                [d["name"], d.get("uuid"), d.get("state"), d.get("segments"), d.get("lost") or []]
                for d in datasets
            ),
            # `suspect` (this machine's readers saw it late a moment ago; it answered) as `up`
            "nodes": sorted(
                [n.get("node"), "up" if n.get("state") == "suspect" else n.get("state")]
                for n in status["nodes"]
            ),
            "members": sorted([m["node"], m.get("state")] for m in status.get("members") or []),
        }

    def control(self, name: str) -> list[str]:
        """What keeps the control plane from being converged (empty when it is)."""
        try:
            snap = self.state.snapshot()
        except KSpeedError as e:
            return [f"etcd: {e}"]
        why = []
        missing = set(self.addrs) - set(snap.members)
        if missing:
            why.append(f"not members: {sorted(missing)}")
        if set(snap.down) & set(self.addrs) - missing:
            why.append(f"down notes for live members: {sorted(set(snap.down) & set(self.addrs))}")
        found = snap.datasets.get(name)
        if found is not None and found[0].lost_members:
            why.append(f"declared lost: {list(found[0].lost_members)}")
        return why


class Reader:
    """A fast-path reader thread: every file, again and again; wrong bytes, errors, and the
    longest read."""

    def __init__(self, cluster: Cluster, name: str, want: dict[str, bytes]):
        self.reader = ClusterReader(resolve_nodes(cluster.settings))  # timeout: TIMEOUT_S
        self.ds = self.reader.open_dataset(name)
        self.want = want
        self.stop = threading.Event()
        self.reads = self.wrong = 0
        self.errors: list[str] = []
        self.longest = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        m = self.ds.manifest
        files = [i for i in range(len(m.size)) if m.is_file(i)]
        while not self.stop.is_set():
            for i in files:
                if self.stop.is_set():
                    return
                started = time.monotonic()
                try:
                    got = self.reader.read(self.ds, i, 0, int(m.size[i]))
                except KSpeedError as e:
                    self.errors.append(str(e))
                    continue
                finally:
                    self.longest = max(self.longest, time.monotonic() - started)
                self.wrong += netns.wrong_bytes(got, self.want[os.fsdecode(m.path(i))])
                self.reads += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(3 * TIMEOUT_S)
        self.reader.close()


def draw(seed: int, steps: int) -> list[dict[str, Any]]:
    """The schedule: `steps` faults drawn from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        fault = rng.choice(FAULTS)
        step: dict[str, Any] = {"fault": fault, "hold_s": round(rng.uniform(1.5, 3.5), 1)}
        if fault in ("partition", "pause", "kill"):
            step["target"] = rng.choice(("node", "etcd"))
            step["index"] = rng.randrange(3)
        elif fault == "clock":
            step["index"] = rng.randrange(3)
            step["offset"] = rng.choice(CLOCKS)
        out.append(step)
    return out


def describe(step: dict[str, Any]) -> str:
    if step["fault"] == "clock":
        return f"node {step['index']}'s clock to {step['offset']}"
    if step["fault"] == "loss":
        return f"1% loss for {step['hold_s']}s"
    return f"{step['fault']} {step['target']} {step['index']} for {step['hold_s']}s"


def inflict(c: Cluster, step: dict[str, Any]) -> None:
    """The fault, held `hold_s` seconds, then healed."""
    fault, hold = step["fault"], step["hold_s"]
    target, i = step.get("target"), step.get("index", 0)
    hosts = NODE_HOSTS if target == "node" else ETCD_HOSTS
    procs = c.nodes if target == "node" else c.etcd
    if fault == "clock":
        c.set_clock(i, step["offset"])
        time.sleep(hold)  # under test: the other faults come with this clock
    elif fault == "loss":
        netns.loss_on()
        time.sleep(hold)  # under test: the loss lasts hold_s
        netns.loss_off()
    elif fault == "partition":
        netns.partition_on(hosts[i])
        time.sleep(hold)  # under test: the partition lasts hold_s
        netns.partition_off()
    elif fault == "pause":
        procs[i].send_signal(signal.SIGSTOP)
        time.sleep(hold)  # under test: the pause lasts hold_s
        procs[i].send_signal(signal.SIGCONT)
    elif fault == "kill":
        procs[i].kill()
        procs[i].wait()
        time.sleep(hold)  # under test: down for hold_s
        if target == "node":
            c.nodes[i] = c.start_node(i)
        else:
            c.etcd[i] = netns.start_etcd_member(ETCD_HOSTS, i, c.work)


def main(out: Path, seed: int, steps: int) -> int:
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-nemesis-"))
    shm = Path("/dev/shm") / f"kspeedfs-nemesis-{uuid.uuid4().hex[:8]}"
    c = Cluster(work, shm, os.environ.get("KSPEEDFS_NEMESIS_NODE_PYTHONPATH", ""))
    schedule = draw(seed, steps)
    print(f"nemesis seed {seed} ({steps} steps): replay with KSPEEDFS_NEMESIS_SEED={seed}")
    result: dict[str, Any] = {"seed": seed, "steps": [], "verdict": "ok"}
    reader: Reader | None = None
    try:
        netns.shape_setup()
        c.start_etcd()
        _wait(lambda: not c.control("-") or c.control("-")[0].startswith("not members"), 60, "etcd")
        c.start_nodes()
        _wait(lambda: not c.control("-"), 60, "three members")
        src = work / "src"
        want = netns.make_tree(src, 120)
        netns.preload(src, "n", c.env)
        if os.environ.get("KSPEEDFS_NEMESIS_NO_SOURCE"):
            src.rename(work / "moved")  # every byte from the nodes, or a read error
        held = c.held("n")
        start_view = c.view()
        result["start"] = start_view
        reader = Reader(c, "n", want)
        reader.thread.start()
        _wait(lambda: reader.reads > 0, 30, "the first reads")
        for k, step in enumerate(schedule):
            print(f"step {k}: {describe(step)}", flush=True)
            failure, record = _step(c, step, reader, held)
            record["step"] = k
            result["steps"].append(record)
            if failure:
                result["verdict"] = f"step {k} ({describe(step)}): {failure}"
                break
        if result["verdict"] == "ok":  # the CLI says the same within CONVERGE_S (a node
            # paused a moment ago may be `suspect` to this machine's readers until probed)
            deadline = time.monotonic() + CONVERGE_S
            end_view = c.view()
            while end_view != start_view and time.monotonic() < deadline:
                time.sleep(0.5)
                end_view = c.view()
            result["end"] = end_view
            if end_view != start_view:
                result["verdict"] = f"ls/status differ: {start_view} then {end_view}"
        result["reads"] = reader.reads
        out.write_text(json.dumps(result, indent=2))
        print(f"nemesis seed {seed}: {result['verdict']}")
        return 0
    finally:
        if reader is not None:
            reader.close()
        netns.clean_up(c.all_procs(), shm, work)


def _step(
    c: Cluster, step: dict[str, Any], reader: Reader, held: dict[str, list[int]]
) -> tuple[str, dict[str, Any]]:
    """One fault and the checks after it: (the first failed check or "", what was seen)."""
    drops = netns.DropWatch(lambda: c.held("n"), held)
    reads = reader.reads
    from_source, hedged = reader.reader.stats["source"], reader.reader.stats["hedged"]
    inflict(c, step)
    healed = time.monotonic()
    converged_s = None
    why: list[str] = []
    while time.monotonic() - healed < CONVERGE_S:
        why = c.control("n")
        if not why and c.held("n") == held:
            converged_s = round(time.monotonic() - healed, 1)
            break
        if not why:
            why = ["segments held differ from the start"]
        time.sleep(0.3)
    dropped = drops.stop()
    record = {
        **step,
        "reads": reader.reads - reads,
        "converged_s": converged_s,
        "longest_read_s": round(reader.longest, 2),
        "from_source": reader.reader.stats["source"] - from_source,
        "hedged": reader.reader.stats["hedged"] - hedged,
        "wrong": reader.wrong,
        "errors": reader.errors[:3],
        "dropped": dropped,
    }
    if reader.wrong:
        return f"{reader.wrong} wrong bytes", record
    if reader.errors:
        return f"{len(reader.errors)} read errors: {reader.errors[0]}", record
    if reader.longest > TIMEOUT_S:
        return f"a read took {reader.longest:.1f}s (bound {TIMEOUT_S}s)", record
    if dropped:
        return f"sound copies dropped: { {a: len(s) for a, s in dropped.items()} }", record
    if converged_s is None:
        return f"no convergence within {CONVERGE_S:.0f}s: {'; '.join(why)}", record
    return "", record


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout:.0f}s")
        time.sleep(0.3)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
