"""Cluster benchmark: node daemons on 127.0.0.1, figures and ratios side by side in one run.

    .venv/bin/python bench/bench_cluster.py [--files 3000] [--cache /var/tmp/kspeedfs-bench-cluster]

1. remote bulk read (large ranges) over TcpTransport vs a plain Python socket loopback
   transfer of the same bytes: GB/s and ratio (target >= 0.7)
2. ~110 KB files from a remote node: one read_ranges with many ranges vs one file at a time
3. preload rate with 1, 2 and 3 nodes loading the same source: MB/s and scaling
4. FUSE read of a dataset spread over 3 nodes vs the same dataset on 1 node: files/s ratio
5. mutual TLS off vs on: remote bulk read (target: on >= 0.6 of off) and ~110 KB files one by
   one and batched, side by side with the ratio
6. fd passing: time per worker to attach a dataset through the node's Unix socket (passed
   descriptors) vs mapping it by path, W workers at once
7. placement over 10, 100 and 1,000 simulated members (pure computation) for a 1.28-million-file
   dataset: max/mean segments per member (target: within 5% at 1,000), and the share moved
   when one member joins vs the ideal 1/N
8. etcd control plane, 3 nodes with --replicas 2: heal rate (MB/s) after a node is killed beside
   the remote bulk read rate in the same run (target: heal >= 0.5 of it)
9. catalog latency: a preload's ready record to every node listing it; an unload to every node
   dropping it (`--control-plane` runs 7-9 alone)

Every node is a separate process; so is the plain socket server. On one machine "remote" means
another process over loopback TCP, so the figures measure the software, not a network.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.cli import tlsca
from kspeedfs.client import admin, passed
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format import placement
from kspeedfs.format.config import Settings
from kspeedfs.format.localdata import MANIFEST_FILE
from kspeedfs.format.manifest import Manifest
from kspeedfs.format.tls import client_context
from kspeedfs.format.units import Address, format_size, parse_address, parse_size
from kspeedfs.net.connection import NodeClient
from kspeedfs.net.transport import TcpTransport
from kspeedfs.system.local_dataset import LocalDataset
from kspeedfs.testing.cluster import LocalCluster
from kspeedfs.testing.mount import MountProcess
from kspeedfs.testing.node import NodeProcess, remove_tree
from kspeedfs.testing.process import ensure_token, private_env

BULK_TARGET = 0.7
TLS_TARGET = 0.6
BULK_RANGE = 8 << 20  # one range: a whole segment
BULK_CALL = 64 << 20  # bytes per read call (8 ranges), and per plain-socket request


class BenchCluster(LocalCluster):
    """`size` node daemons that know each other, with a private token and empty config."""

    def __init__(
        self,
        workdir: Path,
        tag: str,
        size: int,
        segment_size: str,
        memory: str,
        tls: tuple[Path, Path, Path] | None = None,
    ):
        config_file = workdir / "empty.toml"
        config_file.write_text("")
        self.tls = tls  # (cert, key, CA certificate): mutual TLS on every connection
        tls_env = (
            dict(
                zip(
                    ("KSPEEDFS_TLS_CERT", "KSPEEDFS_TLS_KEY", "KSPEEDFS_TLS_CA"),
                    map(str, tls),
                    strict=True,
                )
            )
            if tls
            else {}
        )
        super().__init__(
            ensure_token(workdir / "token"),
            workdir,
            size=size,
            segment_size=segment_size,
            memory=memory,
            base_env={**private_env(config_file), "KSPEEDFS_TRANSPORT": "tcp", **tls_env},
            own_session=True,
            tag=f"bench-{tag}",
        )
        self.workdir = workdir
        self.mounts: list[MountProcess] = []

    def settings(self) -> Settings:
        cert, key, ca = self.tls or (None, None, None)
        return Settings(
            nodes=[parse_address(a) for a in self.addresses],
            token_file=self.token_file,
            timeout=60.0,
            transport="tcp",
            tls_cert=cert,
            tls_key=key,
            tls_ca=ca,
        )

    def request(self, address: str, op: str, **args: Any) -> dict[str, Any]:
        tls = client_context(self.settings())
        with NodeClient(parse_address(address), self.token_file, 60.0, tls) as c:
            return c.request(op, **args)

    def preload(self, source: Path, name: str) -> float:
        """Seconds from the request to the dataset being ready on every node."""
        started = time.perf_counter()
        with admin.connect(self.settings()) as client:
            admin.start_preload(client, name, str(source), "offline")
            admin.wait_ready(client, name)  # long-polled: ready is seen at once
        return time.perf_counter() - started

    def shm_of(self, i: int) -> Path:
        return self.nodes[i].shm_dir

    def mount(self, mountpoint: Path, local: NodeProcess) -> None:
        m = MountProcess(mountpoint, self.env(local=local), self.workdir, own_session=True)
        self.mounts.append(m)
        m.start()

    def unmount_all(self) -> None:
        for m in self.mounts:
            m.stop()
        self.mounts = []

    def close(self) -> None:
        self.unmount_all()
        self.stop()


def make_sources(cache: Path, files: int, size: int, big: int) -> tuple[Path, Path]:
    """small/: `files` files of about `size` bytes in 50 folders; big/: files of 64 MiB."""
    small, bulk = cache / f"small-{files}x{size}", cache / f"big-{big}"
    rng = random.Random(0)
    if not small.exists():
        tmp = small.with_suffix(".tmp")
        remove_tree(tmp)
        block = os.urandom(4 << 20)
        for i in range(files):
            folder = tmp / f"c{i % 50:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            n = size + rng.randint(-size // 5, size // 5)
            k = rng.randrange(len(block) - n)
            (folder / f"img{i:06d}.jpg").write_bytes(block[k : k + n])
        tmp.rename(small)
    if not bulk.exists():
        tmp = bulk.with_suffix(".tmp")
        remove_tree(tmp)
        tmp.mkdir(parents=True)
        for i in range(max(1, big // (64 << 20))):
            (tmp / f"part{i}.bin").write_bytes(os.urandom(64 << 20))
        tmp.rename(bulk)
    return small, bulk


def warm(root: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += len(f.read())
    return total


# 1. Bulk reads.


def _plain_server(sock: socket.socket, size: int) -> None:
    """The baseline: a Python process that sendall()s slices of one buffer on request."""
    data = memoryview(os.urandom(size))
    conn, _ = sock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            req = conn.recv(8)
            if len(req) < 8:
                return
            conn.sendall(data[: int.from_bytes(req, "big")])


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise SystemExit("plain server closed the connection")
        got += n


def plain_loopback(calls: int) -> float:
    """Seconds for `calls` transfers of BULK_CALL bytes, client in this process."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ctx = multiprocessing.get_context("fork")
    server = ctx.Process(target=_plain_server, args=(listener, BULK_CALL))
    server.start()
    out = memoryview(bytearray(BULK_CALL))
    try:
        with socket.create_connection(listener.getsockname()) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(2):  # warm up
                s.sendall(BULK_CALL.to_bytes(8, "big"))
                recv_exact_into(s, out)
            started = time.perf_counter()
            for _ in range(calls):
                s.sendall(BULK_CALL.to_bytes(8, "big"))
                recv_exact_into(s, out)
            return time.perf_counter() - started
    finally:
        listener.close()
        server.join(10)
        if server.is_alive():
            server.kill()


def kspeedfs_bulk(cluster: BenchCluster, name: str, segments: int, calls: int) -> float:
    """Seconds for `calls` TcpTransport reads of BULK_CALL bytes in 8 MiB ranges."""
    per_call = BULK_CALL // BULK_RANGE
    transport = TcpTransport(
        Address("127.0.0.1", int(cluster.addresses[0].split(":")[1])), cluster.settings()
    )
    out = memoryview(bytearray(BULK_CALL))
    instance = Manifest(cluster.shm_of(0) / "datasets" / name / MANIFEST_FILE).uuid
    try:
        # Warm up over every segment: the node maps each page once, then serves from the map.
        for k in range(-(-segments // per_call)):
            ranges = [((k * per_call + j) % segments, 0, BULK_RANGE) for j in range(per_call)]
            transport.read_into(name, instance, ranges, out)
        started = time.perf_counter()
        for k in range(calls):
            ranges = [((k * per_call + j) % segments, 0, BULK_RANGE) for j in range(per_call)]
            transport.read_into(name, instance, ranges, out)
        return time.perf_counter() - started
    finally:
        transport.close()


# 2. Small files, batched or not.


def small_file_rates(cluster: BenchCluster, name: str, batch: int) -> tuple[float, float, int]:
    m = Manifest(cluster.shm_of(0) / "datasets" / name / MANIFEST_FILE)
    files = [m.ranges(i) for i in m.iter_files()]
    node = cluster.addresses[0]
    reader = ClusterReader(cluster.settings(), local_node=None)
    buf = memoryview(
        bytearray(
            max(
                sum(r[2] for f in files[i : i + batch] for r in f)
                for i in range(0, len(files), batch)
            )
        )
    )
    try:
        for ranges in files[:20]:  # warm up the connection
            reader.pool.read_ranges(node, name, m.uuid, ranges, buf[: sum(r[2] for r in ranges)])
        started = time.perf_counter()
        for ranges in files:
            reader.pool.read_ranges(node, name, m.uuid, ranges, buf[: sum(r[2] for r in ranges)])
        one = len(files) / (time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(0, len(files), batch):
            ranges = [r for f in files[i : i + batch] for r in f]
            reader.pool.read_ranges(node, name, m.uuid, ranges, buf[: sum(r[2] for r in ranges)])
        batched = len(files) / (time.perf_counter() - started)
    finally:
        reader.close()
    return one, batched, len(files)


# 5. TLS.


def make_pki(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1, as `kspeedfs tls new-ca` / `tls issue` make them."""
    ca_cert, _ = tlsca.new_ca(folder / "ca")
    cert, key = tlsca.issue("127.0.0.1", folder / "ca", folder / "certs")
    return cert, key, ca_cert


# 6. fd passing.


def _attach_passed(settings: Settings, path: Path, name: str, uuid: str) -> float:
    started = time.perf_counter()
    ds = passed.attach(settings, str(path), name, uuid)
    seconds = time.perf_counter() - started
    del ds  # closes the descriptors
    return seconds


def _map_by_path(path: Path) -> float:
    started = time.perf_counter()
    ds = LocalDataset(path)
    seconds = time.perf_counter() - started
    del ds
    return seconds


def attach_times(cluster: BenchCluster, name: str, workers: int) -> tuple[list[float], list[float]]:
    """Seconds per worker (forked, as DataLoader workers are) to attach through the node's
    socket, and to map the same dataset by path."""
    path = cluster.shm_of(0) / "datasets" / name
    uuid = Manifest(path / MANIFEST_FILE).uuid
    settings = Settings(shm_dir=cluster.shm_of(0), token_file=cluster.token_file, timeout=60.0)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers) as pool:
        pool.starmap(_attach_passed, [(settings, path, name, uuid)] * workers)  # warm up
        by_fds = pool.starmap(_attach_passed, [(settings, path, name, uuid)] * workers)
        by_path = pool.map(_map_by_path, [path] * workers)
    return by_fds, by_path


# 4. FUSE reads.


def read_tree(root: Path) -> tuple[int, float]:
    paths = sorted(os.path.join(d, f) for d, _dirs, names in os.walk(root) for f in names)
    buf = bytearray(1 << 20)
    random.Random(1).shuffle(paths)
    started = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]) == len(buf):
                pass
        finally:
            os.close(fd)
    return len(paths), time.perf_counter() - started


# 7. Placement balance and movement (pure computation).

IMAGENET_FILES = 1_281_167
IMAGENET_FILE_BYTES = 110 * 1024


def placement_figures(members: int, segments: int) -> tuple[float, float]:
    """(max/mean segments per member, share of segments whose owner changed when one member
    joins)."""
    nodes = [f"10.{i // 250}.{i % 250}.1:7420" for i in range(members)]
    before = placement.Placement("imagenet", segments, nodes)
    counts = [len(v) for v in before.assignment().values()]
    after = placement.Placement("imagenet", segments, [*nodes, "10.255.255.1:7420"])
    moved = sum(before.owners(s) != after.owners(s) for s in range(segments))
    return max(counts) / (segments / members), moved / segments


# 8 and 9. The etcd control plane: healing and the catalog.


def _etcd_env(workdir: Path, endpoint: str) -> dict[str, str]:
    config = workdir / "empty.toml"
    config.write_text("")
    return {
        **private_env(config),
        "KSPEEDFS_ETCD": endpoint,
        "KSPEEDFS_CLUSTER": "bench",
        "KSPEEDFS_MEMBER_TTL": "2",
        "KSPEEDFS_HEAL_AFTER": "2",
        "KSPEEDFS_TOKEN_FILE": str(ensure_token(workdir / "token")),
        "KSPEEDFS_TRANSPORT": "tcp",
    }


def _listed(node: NodeProcess, name: str) -> bool:
    return any(d["name"] == name for d in node.request("list")["datasets"])


def _lost(state: Any, name: str) -> tuple[str, ...]:
    """The members the catalog entry of `name` declares lost (state: a ClusterState)."""
    found = state.dataset(name)
    return found[0].lost_members if found else ()


def _ready(state: Any, name: str) -> bool:
    found = state.dataset(name)
    return found is not None and found[0].ready


def _wait(predicate: Any, timeout: float = 120.0) -> float:
    """Seconds until predicate() holds (polled every 5 ms)."""
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError("the control plane did not converge")
        time.sleep(0.005)
    return time.perf_counter() - started


def control_plane(workdir: Path, bulk: Path, segment_size: str, memory: str) -> None:
    from kspeedfs.client.clusterstate import ClusterState
    from kspeedfs.testing.etcd import EtcdProcess

    etcd = EtcdProcess(workdir).start()
    env = _etcd_env(workdir, etcd.endpoint)
    state = ClusterState([etcd.endpoint], "bench")
    token = Path(env["KSPEEDFS_TOKEN_FILE"])
    nodes = [
        NodeProcess(
            Path("/dev/shm") / f"kspeedfs-bench-etcd-{os.getpid()}-{i}",
            token,
            workdir,
            memory=memory,
            segment_size=segment_size,
            base_env=env,
            own_session=True,
            client_timeout=60.0,
        )
        for i in range(3)
    ]
    try:
        for n in nodes:
            n.start()
        _wait(lambda: len(state.live_members()) == 3)
        client = Settings(
            nodes=[parse_address(n.address) for n in nodes], token_file=token, timeout=60.0
        )
        with admin.connect(client) as c:
            admin.start_preload(c, "bulk", str(bulk), "offline", replicas=2)
            admin.wait_ready(c, "bulk")
        found = state.dataset("bulk")
        assert found is not None, "bulk is not in the catalog"
        record = found[0]
        victim, survivors = nodes[2], nodes[:2]
        # The remote bulk rate, as healing reads: whole segments in 8 MiB reads from one node.
        held = LocalDataset(survivors[1].shm_dir / "datasets" / "bulk").held
        seg_len = Manifest(survivors[1].shm_dir / "datasets" / "bulk" / MANIFEST_FILE).seg_len
        moved, started = 0, time.perf_counter()
        with NodeClient(parse_address(survivors[1].address), token, 60.0) as c:
            for seg in held:
                length = int(seg_len[seg])
                for pos in range(0, length, 8 << 20):
                    piece = (seg, pos, min(8 << 20, length - pos))
                    moved += len(c.read("bulk", record.uuid, [piece]))
        bulk_mbs = moved / (time.perf_counter() - started) / 1e6

        victim.kill9()
        _wait(lambda: victim.address in _lost(state, "bulk"))
        placed = [m for m in record.members if m != victim.address]
        segments = record.segments

        def healed() -> bool:
            counts = [0] * segments
            for n in survivors:
                for f in os.listdir(n.shm_dir / "datasets" / "bulk" / "seg"):
                    counts[int(f)] += 1
            return min(counts) == len(placed)

        wall = _wait(healed, timeout=600)
        heal = [n.request("status")["control"]["heal"] for n in survivors]
        healed_bytes = sum(h["bytes"] for h in heal)
        heal_mbs = healed_bytes / wall / 1e6
        per_node = [h["bytes"] / h["seconds"] / 1e6 for h in heal if h["seconds"]]
        from_source = sum(h.get("from_source", 0) for h in heal)
        ratio = heal_mbs / bulk_mbs
        print(
            f"\n8. healing after a node is killed (3 nodes, --replicas 2, heal_after 2 s), "
            f"{format_size(healed_bytes)} copied"
        )
        print(f"   remote bulk read, 8 MiB reads:  {bulk_mbs:8.0f} MB/s")
        print(
            f"   heal, wall clock (2 survivors): {heal_mbs:8.0f} MB/s   ratio {ratio:.2f} "
            f"(target >= 0.5, {'meets' if ratio >= 0.5 else 'MISSES'}); per node while "
            f"copying: {', '.join(f'{r:.0f}' for r in per_node)} MB/s; "
            f"{sum(h['segments'] for h in heal)} segments, {from_source} from the source"
        )

        # 9. Catalog latency over the survivors.
        small = workdir / "catalog-src"
        small.mkdir(exist_ok=True)
        (small / "one.bin").write_bytes(os.urandom(100_000))
        visible, gone = [], []
        for k in range(5):
            with admin.connect(client) as c:
                admin.start_preload(c, f"cat{k}", str(small), "offline")
            _wait(lambda k=k: _ready(state, f"cat{k}"))
            visible.append(_wait(lambda k=k: all(_listed(n, f"cat{k}") for n in survivors)))
            started = time.perf_counter()
            with NodeClient(parse_address(survivors[0].address), token, 60.0) as c:
                c.request("unload", name=f"cat{k}")
            _wait(lambda k=k: not any(_listed(n, f"cat{k}") for n in survivors))
            gone.append(time.perf_counter() - started)
        print("\n9. catalog latency, median of 5 (2 live nodes)")
        print(f"   ready record -> every node lists it:  {sorted(visible)[2] * 1e3:7.1f} ms")
        print(f"   unload request -> no node lists it:   {sorted(gone)[2] * 1e3:7.1f} ms")
    finally:
        for n in nodes:
            n.stop()
            remove_tree(n.shm_dir)
        etcd.stop()


def placement_section(segment_size: int) -> None:
    segments = -(-IMAGENET_FILES * IMAGENET_FILE_BYTES // segment_size)
    print(
        f"\n7. placement of a {IMAGENET_FILES:,}-file dataset (~110 KiB files) in "
        f"{segments:,} segments of {format_size(segment_size)}, 1 replica (pure computation)"
    )
    print("   members   segments/member   max/mean   moved on join   ideal 1/N   moved/ideal")
    for members in (10, 100, 1000):
        worst, moved = placement_figures(members, segments)
        ideal = 1 / (members + 1)
        print(
            f"   {members:7d}   {segments / members:15.1f}   {worst:8.3f}   {moved:13.4f}   "
            f"{ideal:9.4f}   {moved / ideal:11.3f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=3000, help="small files (default 3000)")
    p.add_argument("--size", default="110KiB", help="small file size (default 110KiB)")
    p.add_argument("--bulk", default="512MiB", help="bulk dataset size (default 512MiB)")
    p.add_argument("--bulk-gb", type=float, default=2.0, help="GB moved per bulk round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each figure (best kept)")
    p.add_argument("--batch", type=int, default=64, help="files per batched read (default 64)")
    p.add_argument("--segment-size", default="8MiB")
    p.add_argument("--workers", type=int, default=8, help="workers attaching at once (6.)")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench-cluster")
    p.add_argument("--control-plane", action="store_true", help="run sections 7-9 alone")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.control_plane:
        placement_section(parse_size(args.segment_size))
        cache = Path(args.cache)
        _small, bulk = make_sources(cache, 10, 1000, parse_size(args.bulk))
        workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-etcd-"))
        try:
            memory = str(2 * warm(bulk) + (256 << 20))
            control_plane(workdir, bulk, args.segment_size, memory)
        finally:
            remove_tree(workdir)
        return 0

    cache = Path(args.cache)
    small, bulk = make_sources(cache, args.files, parse_size(args.size), parse_size(args.bulk))
    small_bytes, bulk_bytes = warm(small), warm(bulk)
    memory = str(small_bytes + bulk_bytes + (512 << 20))
    print(
        f"sources: {args.files} files of ~{args.size} ({format_size(small_bytes)}), "
        f"{format_size(bulk_bytes)} in 64 MiB files; segments {args.segment_size}; "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-cluster-"))
    clusters: dict[int, BenchCluster] = {}
    try:
        # 3. Preload with 1, 2, 3 nodes (the 1- and 3-node clusters are kept for 1, 2 and 4).
        rates = {}
        for n in (1, 2, 3):
            c = clusters[n] = BenchCluster(workdir, f"n{n}", n, args.segment_size, memory).start()
            best = float("inf")
            for r in range(args.rounds):
                if r:
                    c.request(c.addresses[0], "unload", name="small")
                best = min(best, c.preload(small, "small"))
            rates[n] = small_bytes / best / 1e6
            if n == 2:
                c.close()
        solo, trio = clusters[1], clusters[3]

        calls = max(4, int(args.bulk_gb * 1e9 / BULK_CALL))
        solo.preload(bulk, "bulk")
        segments = Manifest(solo.shm_of(0) / "datasets" / "bulk" / MANIFEST_FILE).segments
        # Interleaved rounds, best of each: other load on the machine hits both sides alike.
        moved = calls * BULK_CALL
        plain_gbs = ks_gbs = 0.0
        for _ in range(args.rounds):
            plain_gbs = max(plain_gbs, moved / plain_loopback(calls) / 1e9)
            ks_gbs = max(ks_gbs, moved / kspeedfs_bulk(solo, "bulk", segments, calls) / 1e9)
        ratio = ks_gbs / plain_gbs
        verdict = "meets" if ratio >= BULK_TARGET else "MISSES"
        print(
            f"\n1. remote bulk read, {format_size(BULK_CALL)} per call in "
            f"{format_size(BULK_RANGE)} ranges, {format_size(moved)} a round, "
            f"best of {args.rounds} interleaved rounds"
        )
        print(f"   plain Python socket loopback: {plain_gbs:6.2f} GB/s")
        print(
            f"   kspeedfs TcpTransport:        {ks_gbs:6.2f} GB/s   ratio {ratio:.2f} "
            f"(target >= {BULK_TARGET}, {verdict})"
        )

        one = batched = 0.0
        for _ in range(args.rounds):
            r1, rb, nfiles = small_file_rates(solo, "small", args.batch)
            one, batched = max(one, r1), max(batched, rb)
        print(
            f"\n2. {nfiles} files of ~{args.size} from a remote node (read_ranges), best of {args.rounds}"
        )
        print(f"   one file per round trip:      {one:8.0f} files/s")
        print(
            f"   {args.batch} files per round trip:     {batched:8.0f} files/s   "
            f"x{batched / one:.1f}"
        )

        print(
            f"\n3. preload of {format_size(small_bytes)} ({args.files} files), each node "
            f"loading its own segments from the source (page cache warm), best of {args.rounds}"
        )
        for n, rate in rates.items():
            print(
                f"   {n} node{'s' if n > 1 else ' '}: {rate:8.0f} MB/s   "
                f"scaling x{rate / rates[1]:.2f}"
            )

        held = [len(os.listdir(trio.shm_of(i) / "datasets" / "small" / "seg")) for i in range(3)]
        # Fresh mounts each round: the kernel keeps a mount's pages, a new mount starts cold.
        rate1 = rate3 = 0.0
        for _ in range(args.rounds):
            for c, mnt in ((solo, workdir / "mnt-1"), (trio, workdir / "mnt-3")):
                c.mount(mnt, c.nodes[0])
                nfiles, seconds = read_tree(mnt / "small")
                c.unmount_all()
                if c is solo:
                    rate1 = max(rate1, nfiles / seconds)
                else:
                    rate3 = max(rate3, nfiles / seconds)
        print(
            f"\n4. FUSE read of every file once (fresh mount, random order), best of "
            f"{args.rounds}; the 3-node mount runs on node 1 (segments per node {held})"
        )
        print(f"   dataset on 1 node (all local): {rate1:8.0f} files/s")
        print(f"   spread over 3 nodes:           {rate3:8.0f} files/s   ratio {rate3 / rate1:.2f}")
        trio.close()

        # 5. The same reads of a one-node cluster with mutual TLS, interleaved with TLS off.
        secure = clusters[0] = BenchCluster(
            workdir, "tls", 1, args.segment_size, memory, tls=make_pki(workdir / "pki")
        ).start()
        secure.preload(bulk, "bulk")
        secure.preload(small, "small")
        bulk_gbs = {"off": 0.0, "on": 0.0}
        one_rate = {"off": 0.0, "on": 0.0}
        batch_rate = {"off": 0.0, "on": 0.0}
        for _ in range(args.rounds):
            for mode, c in (("off", solo), ("on", secure)):
                seconds = kspeedfs_bulk(c, "bulk", segments, calls)
                bulk_gbs[mode] = max(bulk_gbs[mode], moved / seconds / 1e9)
                r1, rb, nfiles = small_file_rates(c, "small", args.batch)
                one_rate[mode] = max(one_rate[mode], r1)
                batch_rate[mode] = max(batch_rate[mode], rb)
        ratio = bulk_gbs["on"] / bulk_gbs["off"]
        verdict = "meets" if ratio >= TLS_TARGET else "MISSES"
        print(
            f"\n5. mutual TLS (1.3, ECDSA P-256) off vs on, reads from a remote node, best of "
            f"{args.rounds} interleaved rounds"
        )
        print("                                    TLS off      TLS on   ratio")
        print(
            f"   bulk read ({format_size(BULK_RANGE)} ranges):   {bulk_gbs['off']:8.2f}    "
            f"{bulk_gbs['on']:8.2f}    {ratio:.2f} GB/s (target >= {TLS_TARGET}, {verdict})"
        )
        for label, rates_by_mode in (
            (f"~{args.size} files, one per trip:", one_rate),
            (f"~{args.size} files, {args.batch} per trip: ", batch_rate),
        ):
            print(
                f"   {label} {rates_by_mode['off']:8.0f}    {rates_by_mode['on']:8.0f}    "
                f"{rates_by_mode['on'] / rates_by_mode['off']:.2f} files/s"
            )

        # 6. fd passing.
        by_fds, by_path = attach_times(solo, "small", args.workers)
        segs_held = len(LocalDataset(solo.shm_of(0) / "datasets" / "small").held)
        print(
            f"\n6. attaching a dataset ({segs_held} segments, {args.files} files) in each of "
            f"{args.workers} forked workers at once"
        )
        for label, times in (("passed fds (Unix socket)", by_fds), ("mapped by path", by_path)):
            times = sorted(times)
            print(
                f"   {label:26s} median {times[len(times) // 2] * 1e3:7.2f} ms, "
                f"max {times[-1] * 1e3:7.2f} ms per worker"
            )
    finally:
        for c in clusters.values():
            c.close()
        remove_tree(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
