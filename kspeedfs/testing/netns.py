"""Network weather in a network namespace, for bench/bench_faults.py, tests/netns_etcd.py,
tests/netns_nemesis.py and tests/system/test_network_weather.py (needs root and iproute2).

Outside: `netns_reason` (why a namespace cannot be used here) and `namespace` (`ip netns add`,
its name, `ip netns del`). Inside: `shape_setup` shapes the namespace's own `lo` with tc: this
kernel has no sch_netem and no tc actions, so packets are dropped by u32 filters that send them
to an htb class whose leaf is the `blackhole` qdisc (`drop`/`undrop`): `partition_on`/`_off`
(every packet between one host and the others), `loss_on`/`_off` (every packet whose IP id
ends in seven 0 bits, 1/128). Then the processes (`start_node(s)`, `start_etcd`, a 3-member
cluster's `start_etcd_member`, `preload`, `stop_all`), a tree of random files (`make_tree`)
and a reader that reads it all until stopped (`read_until`).

Only the standard library and `kspeedfs.format.errors` at import time: bench_faults loads this
file by its path when PYTHONPATH points at an older tree (a "before" run).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kspeedfs.format.errors import KSpeedError

if TYPE_CHECKING:
    from kspeedfs.client.reader import ClusterReader, DatasetHandle

KSPEEDFS = [sys.executable, "-m", "kspeedfs.cli"]


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


# ---- outside: the namespace


def netns_reason() -> str:
    """Why a namespace cannot be used here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    name = f"ksprobe{uuid.uuid4().hex[:6]}"
    made = run("ip", "netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        qdisc = run(
            "ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "handle",
            "1:", "htb", "default", "1", check=False,
        )  # fmt: skip
        if qdisc.returncode != 0:
            return f"tc htb unusable: {qdisc.stderr.strip()}"
    finally:
        run("ip", "netns", "del", name, check=False)
    return ""


@contextmanager
def namespace(prefix: str) -> Iterator[str]:
    """A new network namespace named `prefix` + 6 hex digits, deleted on the way out. Run a
    command in it with `["ip", "netns", "exec", name, ...]`."""
    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    run("ip", "netns", "add", name)
    try:
        yield name
    finally:
        run("ip", "netns", "del", name, check=False)


# ---- inside: shaping our own lo


def tc(*args: str) -> None:
    run("tc", *args)


def shape_setup() -> None:
    run("ip", "link", "set", "lo", "up")
    tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1")
    tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit")
    tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:2", "htb", "rate", "100gbit")
    tc("qdisc", "add", "dev", "lo", "parent", "1:2", "handle", "20:", "blackhole")


def drop(pref: int, *match: str) -> None:
    tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "pref", str(pref),
       "u32", *match, "flowid", "1:2")  # fmt: skip


def undrop(pref: int) -> None:
    run("tc", "filter", "del", "dev", "lo", "parent", "1:", "pref", str(pref), check=False)


def loss_on() -> None:
    # IP id (bytes 4-5 of the header) ending in seven 0 bits: 1 packet in 128. An id of 0
    # (SYN-ACKs and resets carry it) passes, by a filter tried first: else no connection
    # would ever be made.
    tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "pref", "9",
       "u32", "match", "u16", "0x0000", "0xffff", "at", "4", "flowid", "1:1")  # fmt: skip
    drop(10, "match", "u16", "0x0000", "0x007f", "at", "4")


def loss_off() -> None:
    undrop(10)
    undrop(9)


def partition_on(host: str) -> None:
    """Every packet between `host` and the others dropped; what `host` sends from its own
    address to itself passes, as on a real machine cut off from the network. (Connections
    opened here to any 127.0.0.x come from 127.0.0.1, so etcd's HTTP gateway, which dials
    etcd's own address, is cut too: after a long partition it may answer only after its
    gRPC reconnect backoff, up to ~25 s; tests/netns_etcd.py times from etcd's answer.)"""
    tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "pref", "19", "u32",
       "match", "ip", "src", f"{host}/32", "match", "ip", "dst", f"{host}/32", "flowid", "1:1")  # fmt: skip
    drop(20, "match", "ip", "src", f"{host}/32")
    drop(21, "match", "ip", "dst", f"{host}/32")


def partition_off() -> None:
    undrop(20)
    undrop(21)
    undrop(19)


# ---- inside: the processes


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`cmd` started with its output appended to `log` (the child keeps its own fd)."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def start_node(
    i: int, addr: str, shm: Path, work: Path, env: dict[str, str], segment_size: str
) -> subprocess.Popen[bytes]:
    """`kspeedfs node` number `i` on `addr`: 1 GiB, its shm folder `shm`/n<i>, its log
    `work`/node<i>.log (started again on the same folder, it serves what it held)."""
    cmd = [*KSPEEDFS, "node", "--listen", addr, "--shm-dir", str(shm / f"n{i}"),
           "--memory", "1GiB", "--segment-size", segment_size]  # fmt: skip
    return spawn(cmd, work / f"node{i}.log", env)


def start_nodes(
    addrs: list[str], shm: Path, work: Path, env: dict[str, str], segment_size: str
) -> list[subprocess.Popen[bytes]]:
    """One `start_node` per address."""
    return [start_node(i, a, shm, work, env, segment_size) for i, a in enumerate(addrs)]


def start_etcd(host: str, work: Path) -> subprocess.Popen[bytes]:
    """A one-member etcd on `host`:2379 (peers on 2380), data in `work`/etcd, log in
    `work`/etcd.log."""
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    endpoint, peer = f"http://{host}:2379", f"http://{host}:2380"
    cmd = [etcd, "--name", "w", "--data-dir", str(work / "etcd"),
           "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
           "--initial-cluster", f"w={peer}", "--log-level", "warn"]  # fmt: skip
    return spawn(cmd, work / "etcd.log")


def start_etcd_member(hosts: list[str], i: int, work: Path) -> subprocess.Popen[bytes]:
    """Member `i` of an etcd cluster with one member per host of `hosts` (clients on :2379,
    peers on :2380, named e0, e1...), data in `work`/etcd<i>, log `work`/etcd<i>.log. Started
    again on its data, it rejoins as the same member."""
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    cluster = ",".join(f"e{k}=http://{h}:2380" for k, h in enumerate(hosts))
    endpoint, peer = f"http://{hosts[i]}:2379", f"http://{hosts[i]}:2380"
    cmd = [etcd, "--name", f"e{i}", "--data-dir", str(work / f"etcd{i}"),
           "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
           "--initial-cluster", cluster, "--initial-cluster-state", "new",
           "--initial-cluster-token", "kspeedfs-nemesis", "--log-level", "warn"]  # fmt: skip
    return spawn(cmd, work / f"etcd{i}.log")


def preload(src: Path, name: str, env: dict[str, str]) -> None:
    """`kspeedfs preload src --name name --replicas 2`; SystemExit when it fails."""
    cmd = [*KSPEEDFS, "preload", str(src), "--name", name, "--replicas", "2", "-q"]
    pre = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if pre.returncode != 0:
        raise SystemExit(f"preload failed: {pre.stderr}")


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the processes, last started first; kill those that do not stop in 10 s."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def clean_up(procs: list[subprocess.Popen[bytes]], shm: Path, work: Path) -> None:
    """After a run: the processes woken (none left frozen) and stopped, the nodes' folders
    removed (their sealed segments too), and `work` unless KSPEEDFS_KEEP_WORK asks to keep it."""
    # (here, not at the top: bench_faults loads this file over an older tree's package too)
    from kspeedfs.testing.node import remove_tree

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    stop_all(procs)
    remove_tree(shm)
    Path(f"{shm}.health").unlink(missing_ok=True)
    if os.environ.get("KSPEEDFS_KEEP_WORK"):
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


class DropWatch:
    """From its start until `stop()`, what each node holds (`held_now()`, sampled every
    0.3 s) compared with `held`: the segments a node stopped holding at any moment (a drop
    healed by the end would not show in a last look)."""

    def __init__(self, held_now: Callable[[], dict[str, list[int]]], held: dict[str, list[int]]):
        self.held_now, self.held = held_now, held
        self.dropped: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for a, segs in self.held_now().items():
                gone = sorted(set(self.held[a]) - set(segs))
                if gone:
                    self.dropped.setdefault(a, gone)
            self._stop.wait(0.3)

    def stop(self) -> dict[str, list[int]]:
        """The segments dropped, by node."""
        self._stop.set()
        self._thread.join()
        return self.dropped


# ---- inside: the data and its readers


def make_tree(root: Path, files: int) -> dict[str, bytes]:
    """`files` random files of 20-120 kB in ten folders under `root`: {relative path: bytes}."""
    out = {}
    for i in range(files):
        rel = f"c{i % 10}/f{i:05d}.bin"
        data = os.urandom(20_000 + (i * 7919) % 100_000)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def wrong_bytes(got: bytes, want: bytes) -> int:
    """Bytes that differ, a missing or extra byte counting as one."""
    if got == want:
        return 0
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


def read_until(
    reader: ClusterReader,
    ds: DatasetHandle,
    want: Callable[[str], bytes],
    stop: threading.Event,
    counts: dict[str, int],
) -> None:
    """Read every file of `ds` with `reader` (a ClusterReader) again and again until `stop`,
    counting "reads", "wrong" bytes (against `want(relative path)`) and "errors"."""
    m = ds.manifest
    files = [i for i in range(len(m.size)) if m.is_file(i)]
    while not stop.is_set():
        for i in files:
            try:
                got = reader.read(ds, i, 0, int(m.size[i]))
            except KSpeedError:
                counts["errors"] += 1
                continue
            counts["wrong"] += wrong_bytes(got, want(os.fsdecode(m.path(i))))
            counts["reads"] += 1
