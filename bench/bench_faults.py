"""Reads in real network weather (issue 29): a fast-path reader (2 DataLoader workers) and a
mount (2 workers) read a whole tree from three nodes (replicas 2; the source moved away, so
every byte comes from the nodes) while the network is quiet, loses ~1% of its packets, cuts
one node off (its process alive), and is healed.

Everything runs in a network namespace of its own (`ip netns add`; nodes on 127.0.0.2-4), its
`lo` shaped with tc: this kernel has no sch_netem and no tc actions, so packets are dropped by
u32 filters that send them to an htb class whose leaf is the `blackhole` qdisc: every packet
from or to the cut-off node, or (loss) every packet whose IP id ends in seven 0 bits (1/128,
0.8%; a retransmission has a new id, so it is not dropped again). Needs root.

Prints, for each reader and phase: reads, p50 / p99 / max read latency, the longest stall (the
longest time no read of that reader completed), wrong bytes and errors, and the share of
duplicate (hedged) reads among the reads that went to a node (`dup`; the quiet phase's is the
one the issue bounds, at most 5%); then the p99 under loss over the quiet p99, and the
namespace's TCP counters per phase (retransmissions, timer expiries, tail loss probes,
spurious timeouts: what held the reads up). `--json FILE` writes the same figures (tests/system/test_network_weather.py
runs this script with short phases and checks them).

    .venv/bin/python bench/bench_faults.py                        # this tree
    PYTHONPATH=/work/base .venv/bin/python bench/bench_faults.py     # before: the old code
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _harness() -> Any:
    """kspeedfs.testing.netns: imported, or (a "before" run, PYTHONPATH at an older tree that
    has no such module) loaded from the tree this script is in."""
    try:
        from kspeedfs.testing import netns

        return netns
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "kspeedfs" / "testing" / "netns.py"
        spec = importlib.util.spec_from_file_location("kspeedfs_testing_netns", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


netns = _harness()

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
VICTIM = HOSTS[1]
TIMEOUT_S = 4.0  # the clients' `timeout`: a read's documented bound (docs/cluster.md)


def outside(args: argparse.Namespace) -> int:
    why = netns.netns_reason()
    if why:
        print(f"bench_faults: {why}", file=sys.stderr)
        return 2
    with netns.namespace("ksfaults") as name:
        cmd = [
            "ip", "netns", "exec", name, sys.executable, os.path.abspath(__file__), "--inside",
            "--quiet-s", str(args.quiet_s), "--loss-s", str(args.loss_s),
            "--partition-s", str(args.partition_s), "--healed-s", str(args.healed_s),
            "--files", str(args.files),
        ]  # fmt: skip
        if args.json:
            cmd += ["--json", args.json]
        return subprocess.run(cmd, check=False).returncode


# ---- inside: the cluster and the readers


class Readers:
    """Completed reads of one reader: (start, end, wrong bytes) and errors (at, message)."""

    def __init__(self, name: str):
        self.name = name
        self.reads: list[tuple[float, float, int]] = []
        self.errors: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.hedged = 0
        self.remote = 0

    def add(self, start: float, end: float, wrong: int) -> None:
        with self.lock:
            self.reads.append((start, end, wrong))


def mount_loop(
    mnt: Path, rels: list[str], want: dict[str, bytes], r: Readers, stop: threading.Event
) -> None:  # noqa: E501
    while not stop.is_set():
        for rel in rels:
            if stop.is_set():
                return
            t0 = time.monotonic()
            try:
                fd = os.open(mnt / rel, os.O_RDONLY)
                try:
                    got = os.read(fd, len(want[rel]) + 1)
                    # Its pages leave the page cache: the next pass reads the nodes again.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError as e:
                with r.lock:
                    r.errors.append((time.monotonic(), f"{rel}: {e}"))
                continue
            t1 = time.monotonic()
            r.add(t0, t1, netns.wrong_bytes(got, want[rel]))


def fast_path_loop(
    src: Path,
    rels: list[str],
    want: dict[str, bytes],
    r: Readers,
    stop: threading.Event,
    ready: threading.Event,
    env: dict[str, str],
) -> None:  # noqa: E501
    import torch.utils.data

    from pytorch_ext.folder import KSpeedFolder

    class Timed(KSpeedFolder):
        def __getitem__(self, index: int) -> Any:
            t0 = time.monotonic()
            try:
                data = bytes(self.read_index(index))
                err = ""
            except Exception as e:  # counted, the loop goes on
                data, err = b"", f"{type(e).__name__}: {e}"
            t1 = time.monotonic()
            stats = self._reader.cluster.stats
            return (
                index,
                data,
                t0,
                t1,
                err,
                os.getpid(),
                stats.get("hedged", 0),
                stats.get("remote", 0),
            )  # noqa: E501

    ds = Timed(str(src), nodes=env["KSPEEDFS_NODES"], token=env["KSPEEDFS_TOKEN_FILE"], local=False)
    files = list(ds.files)
    per_worker: dict[int, tuple[int, int]] = {}
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, prefetch_factor=4
    )
    while not stop.is_set():
        for index, data, t0, t1, err, pid, hedged, remote in loader:
            rel = str(files[index])
            if err:
                with r.lock:
                    r.errors.append((t1, f"{rel}: {err}"))
            else:
                r.add(t0, t1, netns.wrong_bytes(data, want[rel]))
            per_worker[pid] = (hedged, remote)
            # Its workers are forked by now: the main thread may start processes again
            # (a fork while another thread forks can hang the child before its exec).
            ready.set()
            r.hedged = sum(h for h, _ in per_worker.values())
            r.remote = sum(n for _, n in per_worker.values())
            if stop.is_set():
                break


def summarize(r: Readers, start: float, end: float) -> dict[str, Any]:
    with r.lock:
        reads = [x for x in r.reads if start <= x[1] < end]
        errors = [e for e in r.errors if start <= e[0] < end]
    lat = sorted(t1 - t0 for t0, t1, _ in reads)
    ends = sorted([start, *(t1 for _t0, t1, _ in reads), end])
    stall = max((b - a for a, b in zip(ends, ends[1:], strict=False)), default=end - start)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {
        "reads": len(reads),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": lat[-1] * 1000 if lat else float("nan"),
        "stall_s": stall,
        "wrong": sum(w for _, _, w in reads),
        "errors": len(errors),
        "first_errors": [e[1] for e in errors[:3]],
    }


def inside(args: argparse.Namespace) -> int:
    # The code under test: PYTHONPATH's first entry (a "before" run points it at another
    # tree), else the tree this script is in.
    repo = os.environ.get("PYTHONPATH", "").split(":")[0] or Path(__file__).resolve().parents[1]
    kspeedfs = netns.KSPEEDFS
    work = Path(tempfile.mkdtemp(prefix="kspeedfs-faults-"))
    shm = Path("/dev/shm") / f"kspeedfs-faults-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen[bytes]] = []
    mnt = work / "mnt"
    mounted = False
    try:
        netns.shape_setup()
        from kspeedfs.format import auth

        token = work / "token"
        auth.write_token(token, auth.new_admin_token())
        (work / "empty.toml").touch()
        port = 7420
        addrs = [f"{h}:{port}" for h in HOSTS]
        env = {
            **os.environ,
            "PYTHONPATH": str(repo),
            # `python -m kspeedfs.cli` must not import the tree of the current folder first
            # (a "before" run started from another tree would run nodes of that one).
            "PYTHONSAFEPATH": "1",
            "KSPEEDFS_CONFIG": str(work / "empty.toml"),
            "KSPEEDFS_TOKEN_FILE": str(token),
            "KSPEEDFS_NODES": ",".join(addrs),
            "KSPEEDFS_TIMEOUT": str(TIMEOUT_S),
        }
        env.pop("KSPEEDFS_LISTEN", None)
        procs += netns.start_nodes(addrs, shm, work, env, "256KiB")
        deadline = time.monotonic() + 60
        while True:
            done = subprocess.run([*kspeedfs, "status"], env=env, capture_output=True, text=True)
            if done.returncode == 0 and done.stdout.count(" up ") >= 3:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"nodes did not start: {done.stderr}")
            time.sleep(0.5)
        src = work / "src"
        want = netns.make_tree(src, args.files)
        rels = sorted(want)
        netns.preload(src, "faults", env)
        fast = Readers("fast path")
        mnt_r = Readers("mount")
        stop = threading.Event()
        ready = threading.Event()
        os.environ.update({k: v for k, v in env.items() if k.startswith("KSPEEDFS_")})
        fp = threading.Thread(
            target=fast_path_loop, args=(src, rels, want, fast, stop, ready, env), daemon=True
        )
        fp.start()
        if not ready.wait(60):
            raise SystemExit("the fast-path dataset did not open")
        # Every byte from the nodes from now on: the source is moved away.
        src.rename(work / "src.away")
        mnt.mkdir()
        mount = [*kspeedfs, "mount", str(mnt), "--foreground", "--workers", "2",
                 "--dataset", "faults"]  # fmt: skip
        procs.append(netns.spawn(mount, work / "mount.log", env))
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if time.monotonic() > deadline:
                raise SystemExit("the mount did not come up")
            time.sleep(0.2)
        mounted = True
        threads = [
            threading.Thread(
                target=mount_loop, args=(mnt, rels[k::2], want, mnt_r, stop), daemon=True
            )
            for k in range(2)
        ]
        for t in threads:
            t.start()
        time.sleep(3)  # warm: connections made, first latencies seen
        phases: list[tuple[str, float, float]] = []
        # Duplicate reads per phase: (hedged, remote) of each reader at each phase's ends.
        dup: dict[str, dict[str, tuple[int, int]]] = {fast.name: {}, mnt_r.name: {}}

        tcp: dict[str, dict[str, int]] = {}

        def phase(name: str, seconds: float) -> None:
            before = {fast.name: (fast.hedged, fast.remote), mnt_r.name: mount_counters(mnt)}
            kernel = tcp_counters()
            t0 = time.monotonic()
            time.sleep(seconds)
            phases.append((name, t0, time.monotonic()))
            tcp[name] = {k: v - kernel.get(k, 0) for k, v in tcp_counters().items()}
            after = {fast.name: (fast.hedged, fast.remote), mnt_r.name: mount_counters(mnt)}
            for reader, (h, n) in after.items():
                dup[reader][name] = (h - before[reader][0], n - before[reader][1])

        phase("quiet", args.quiet_s)
        if args.loss_s > 0:
            netns.loss_on()
            phase("1% loss", args.loss_s)
            netns.loss_off()
        if args.partition_s > 0:
            netns.partition_on(VICTIM)
            phase("partition", args.partition_s)
            netns.partition_off()
        phase("healed", args.healed_s)
        stop.set()
        # The figures are what completed within the phases: a reader still stuck (old code)
        # is not waited for, nor is a mount that does not answer its counters.
        for t in threads:
            t.join(2)
        fp.join(2)
        result: dict[str, Any] = {"timeout_s": TIMEOUT_S, "readers": {}, "tcp": tcp}
        for r, (hedged, remote) in (
            (fast, (fast.hedged, fast.remote)),
            (mnt_r, mount_counters(mnt, 5)),
        ):
            figures = {n: summarize(r, a, b) for n, a, b in phases}
            for n, s in figures.items():
                s["hedged"], s["remote"] = dup[r.name][n]
            result["readers"][r.name] = {"phases": figures, "hedged": hedged, "remote": remote}
        report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return 0
    finally:
        if mounted:
            netns.run("fusermount3", "-u", "-z", str(mnt), check=False)
        netns.stop_all(procs)
        # The nodes' sealed segments (the immutable flag) first; chattr, so that a "before" run
        # of a tree without kspeedfs.testing.node.remove_tree cleans up the same way.
        subprocess.run(["chattr", "-R", "-i", str(shm)], check=False, capture_output=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# The namespace's own TCP counters (/proc/net/netstat and snmp are per network namespace):
# what delayed the reads of a phase. Timeouts: retransmission timer expiries; LossProbes: tail
# loss probes sent; SpuriousRTOs: expiries found needless (F-RTO) afterwards.
TCP_COUNTERS = (
    "RetransSegs",
    "TCPTimeouts",
    "TCPLossProbes",
    "TCPLossProbeRecovery",
    "TCPSpuriousRTOs",
    "TCPSynRetrans",
    "TCPFastRetrans",
)


def tcp_counters() -> dict[str, int]:
    out: dict[str, int] = {}
    for name in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            for k, v in zip(head.split()[1:], values.split()[1:], strict=False):
                if k in TCP_COUNTERS and v.lstrip("-").isdigit():
                    out[k] = int(v)
    return out


def mount_counters(mnt: Path, wait_s: float = 2.0) -> tuple[int, int]:
    """The mount's (hedged, remote) read counters (0, 0 when it does not answer in time: the
    old code's mount may be stuck on a partitioned node)."""
    sources: dict[str, Any] = {}

    def ask() -> None:
        try:
            sources.update(json.loads(os.getxattr(mnt, "user.kspeedfs.sources")))
        except (OSError, ValueError):
            pass

    asked = threading.Thread(target=ask, daemon=True)
    asked.start()
    asked.join(wait_s)
    return int(sources.get("hedged", 0)), int(sources.get("remote", 0))


def report(result: dict[str, Any]) -> None:
    print(f"client timeout {result['timeout_s']:.0f} s; 3 nodes, replicas 2, source moved away")
    print(
        f"{'reader':<10} {'phase':<10} {'reads':>6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'stall s':>8} {'wrong':>6} {'errors':>6} {'dup':>6}"
    )
    for name, r in result["readers"].items():
        quiet = r["phases"].get("quiet", {}).get("p99_ms", float("nan"))
        for phase, s in r["phases"].items():
            dup = s["hedged"] / s["remote"] if s.get("remote") else 0.0
            print(
                f"{name:<10} {phase:<10} {s['reads']:>6} {s['p50_ms']:>8.1f} {s['p99_ms']:>8.1f} "
                f"{s['max_ms']:>8.1f} {s['stall_s']:>8.2f} {s['wrong']:>6} {s['errors']:>6} "
                f"{dup:>6.1%}"
            )
        if "1% loss" in r["phases"]:
            loss = r["phases"]["1% loss"]["p99_ms"]
            print(f"{name:<10} p99 under loss / quiet p99: {loss / quiet:.1f}x (target 3x)")
        q = r["phases"].get("quiet", {})
        if q.get("remote"):
            print(
                f"{name:<10} duplicate (hedged) reads in the quiet phase: {q['hedged']} of "
                f"{q['remote']} ({q['hedged'] / q['remote']:.1%}; target at most 5%)"
            )
        share = r["hedged"] / r["remote"] if r["remote"] else 0.0
        print(
            f"{name:<10} duplicate (hedged) reads, whole run: {r['hedged']} of {r['remote']} ({share:.1%})"
        )
        for phase, s in r["phases"].items():
            for e in s["first_errors"]:
                print(f"{name:<10} {phase}: {e}")
    tcp = result.get("tcp", {})
    if tcp:
        print(f"{'TCP (readers and nodes)':<24}" + "".join(f"{k:>21}" for k in TCP_COUNTERS))
        for phase, counts in tcp.items():
            print(f"{phase:<24}" + "".join(f"{counts.get(k, 0):>21}" for k in TCP_COUNTERS))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quiet-s", type=float, default=10)
    p.add_argument("--loss-s", type=float, default=10)
    p.add_argument("--partition-s", type=float, default=20)
    p.add_argument("--healed-s", type=float, default=10)
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    if not args.inside:
        return outside(args)
    code = inside(args)
    sys.stdout.flush()
    os._exit(code)  # not waiting for readers stuck on a node (DataLoader workers, threads)


if __name__ == "__main__":
    sys.exit(main())
