"""Discovery as in a Kubernetes cluster: a headless Service's DNS name answered by dnsmasq in a
network namespace of the test's own, three nodes on 127.0.0.1-3 that find each other through
it, and a job with kspeed_iplist=None that finds its host's node from the downward API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from kspeedfs.format import auth
from kspeedfs.format.config import load_settings
from kspeedfs.format.discovery import NodeWatch, ResolvedNodes
from kspeedfs.format.errors import NodeUnreachable
from kspeedfs.format.units import Address
from kspeedfs.sample import make_sample

SERVICE = "kspeedfs-nodes.kspeedfs.svc.cluster.local"
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def test_settings_without_a_cluster() -> None:
    """The rules, without DNS: a pod with no nodes setting gets its host's node; a nodes
    setting wins over it; a name that does not resolve is one line."""
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOST_IP": "10.1.2.3"}
    assert load_settings({}, env=pod).nodes == [Address("10.1.2.3", 7420)]
    assert load_settings({}, env={**pod, "KSPEEDFS_NODES": "10.9.9.9"}).nodes == [
        Address("10.9.9.9", 7420)
    ]
    assert load_settings({}, env={"HOST_IP": "10.1.2.3"}).nodes == [Address("127.0.0.1", 7420)]
    assert load_settings({"nodes": "dns:localhost:7000,10.0.0.5"}, env={}).nodes[-1] == Address(
        "10.0.0.5", 7420
    )
    with pytest.raises(NodeUnreachable, match="does not resolve"):
        load_settings({"nodes": "dns:no-such-name.invalid:7420"}, env={})
    # A dns: name overridden by the environment or the command line is not looked up.
    overridden = {"KSPEEDFS_NODES": "dns:no-such-name.invalid:7420"}
    assert load_settings({"nodes": "10.0.0.9"}, env=overridden).nodes == [Address("10.0.0.9", 7420)]


def test_node_watch_without_dns() -> None:
    """A static list is never looked up; a dns: list whose lookup fails keeps the last one
    (one warning), and follows again once the name answers."""
    static = load_settings({"nodes": "10.0.0.1,10.0.0.2"}, env={})
    assert not NodeWatch(static.nodes, 0.01).follows
    named = load_settings({"nodes": "dns:localhost:7000", "dns_refresh": "0.01"}, env={})
    assert isinstance(named.nodes, ResolvedNodes) and named.nodes.entries == ("dns:localhost:7000",)
    assert Address("127.0.0.1", 7000) in named.nodes
    assert not NodeWatch(named.nodes, 0).follows  # dns_refresh 0: at start only
    last = [Address("10.0.0.9", 7420)]
    watch = NodeWatch(ResolvedNodes(last, ["dns:no-such-name.invalid:7420"]), 0.01)
    for _ in range(3):
        time.sleep(0.02)
        assert watch.current() == last
        wait_for(lambda: not watch._looking, what="the lookup")
    assert watch.current() == last and "does not resolve" in watch._error
    watch._given = named.nodes  # the name answers again
    # under test: the refresh interval (0.01 s) passes before the next look
    time.sleep(0.02)
    watch.current()
    wait_for(lambda: watch.current() == list(named.nodes), what="the list followed")


NETNS_SCRIPT = r"""
import json, os, subprocess, sys, time
from kspeedfs.format.contract.node import List
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.format.errors import KSpeedError
from kspeedfs.testing.process import is_users_setting

root, service, src, JOB = sys.argv[1:5]
hosts = sys.argv[5:]
token = os.path.join(root, "token")
base = {k: v for k, v in os.environ.items() if not is_users_setting(k)}
base.update(KSPEEDFS_CONFIG=os.path.join(root, "empty.toml"), KSPEEDFS_TOKEN_FILE=token)
cli = [sys.executable, "-m", "kspeedfs.cli"]
procs = []

def client(host):
    return NodeClient(Address(host, 7420), token, 10.0)

def answers(host):
    try:
        with client(host) as c:
            c.request("ping")
        return True
    except KSpeedError:
        return False

out = {}
try:
    for i, host in enumerate(hosts):
        env = {**base, "KSPEEDFS_NODES": f"dns:{service}:7420", "KSPEEDFS_LISTEN": f"{host}:7420"}
        log = open(os.path.join(root, f"node-{host}.log"), "ab")
        procs.append(subprocess.Popen(
            [*cli, "node", "--shm-dir", f"/dev/shm/{os.path.basename(root)}-{i}",
             "--memory", "256MiB", "--segment-size", "64KiB"],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.time() + 60
    while not all(answers(h) for h in hosts):
        assert time.time() < deadline, "nodes did not start"
        assert all(p.poll() is None for p in procs), "a node exited"
        time.sleep(0.2)
    # A preload through one node: placed over the members it found by DNS.
    done = subprocess.run([*cli, "preload", src, "--name", "train", "-q", "--nodes", f"{hosts[0]}:7420"],
                          env=base, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listed = {}
    for h in hosts:
        with client(h) as c:
            reply = c.call(List())
        listed[h] = [d.members for d in reply.datasets if d.name == "train"]
    out["members"] = listed
    # The job: a pod on the host of 127.0.0.2, kspeed_iplist=None, no nodes setting.
    job_env = {**base, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOST_IP": hosts[1],
               "POD_IP": "10.244.1.7", "NODE_NAME": "host-2"}
    job = subprocess.run([sys.executable, "-c", JOB, src], env=job_env, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr[-3000:]
    out["job"] = json.loads(job.stdout)
finally:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)
print(json.dumps(out))
"""

JOB = r"""
import hashlib, json, sys
from kspeedfs.client.job_settings import client_settings
from kspeedfs.client.reader import local_node_for
from pytorch_ext.kspeed import KSpeedImageFolder
from torchvision.datasets import ImageFolder
settings = client_settings(None, None)
ds = KSpeedImageFolder(sys.argv[1], None, 0, None, None, None)
ref = ImageFolder(sys.argv[1])
same = len(ds) == len(ref) and all(
    ds[i][1] == ref[i][1] and ds[i][0].tobytes() == ref[i][0].tobytes()
    for i in range(len(ref))
)
print(json.dumps({"nodes": [str(a) for a in settings.nodes], "local": local_node_for(settings),
                  "samples": len(ds), "same": same}))
"""


class NetNamespace:
    """A network namespace with its loopback up, and dnsmasq on its 127.0.0.1:53 answering
    `name` with `hosts` (a headless Service's A records); `ip netns exec` gives its processes
    /etc/netns/NAME/resolv.conf as /etc/resolv.conf."""

    def __init__(self, root: Path, name: str, hosts: list[str], hosts_file: Path | None = None):
        self.name = f"ks-{uuid.uuid4().hex[:8]}"
        self.etc = Path("/etc/netns") / self.name
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.exec(["ip", "link", "set", "lo", "up"])
        self.etc.mkdir(parents=True)
        (self.etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1\n")
        records = [f"--address=/{name}/{h}" for h in hosts]
        if hosts_file is not None:  # records dnsmasq reads again on SIGHUP
            hosts_file.write_text("".join(f"{h} {name}\n" for h in hosts))
            records = [f"--addn-hosts={hosts_file}"]
        self.dnsmasq = subprocess.Popen(
            self.command(
                [
                    "dnsmasq",
                    "--keep-in-foreground",
                    "--no-resolv",
                    "--no-hosts",
                    "--bind-interfaces",
                    "--listen-address=127.0.0.1",
                    "--port=53",
                    "--user=root",
                    f"--pid-file={root / 'dnsmasq.pid'}",
                    f"--log-facility={root / 'dnsmasq.log'}",
                    *records,
                ]
            )
        )
        self.dnsmasq_log = root / "dnsmasq.log"
        # Ready once its socket is bound: a query before that is refused at once (CI saw it).
        wait_for(self.dnsmasq_is_listening, 20, "dnsmasq to listen on 127.0.0.1:53")

    def dnsmasq_is_listening(self) -> bool:
        if self.dnsmasq.poll() is not None:
            log = self.dnsmasq_log.read_text() if self.dnsmasq_log.exists() else ""
            raise AssertionError(f"dnsmasq exited {self.dnsmasq.returncode}: {log[-500:]}")
        bound = self.exec(["ss", "-Hlun", "sport = :53"], capture_output=True).stdout
        return "127.0.0.1:53" in bound

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def exec(self, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv), check=True, text=True, **kw)  # type: ignore[call-overload,no-any-return]

    def close(self) -> None:
        self.dnsmasq.terminate()
        self.dnsmasq.wait(10)
        subprocess.run(["ip", "netns", "del", self.name], check=False)
        shutil.rmtree(self.etc, ignore_errors=True)


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[NetNamespace]:
    for tool in ("ip", "dnsmasq"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (make test installs it)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    ns = NetNamespace(tmp_path, SERVICE, HOSTS)
    yield ns
    ns.close()


@pytest.mark.slow
def test_nodes_and_a_job_find_each_other_by_dns(netns: NetNamespace, tmp_path: Path) -> None:
    # The Service's name answers with the three nodes, inside the namespace only.
    resolve = (
        f"import socket; print(sorted({{a[4][0] for a in socket.getaddrinfo({SERVICE!r}, 7420)}}))"
    )
    got = netns.exec([sys.executable, "-c", resolve], capture_output=True).stdout
    assert json.loads(got.replace("'", '"')) == HOSTS

    (tmp_path / "empty.toml").write_text("")
    auth.write_token(tmp_path / "token", auth.new_admin_token())
    src = tmp_path / "train"
    make_sample(src, classes=3, per_class=8, file_size=20000, bases=4)
    root = Path("/tmp") / f"ks-dns-{uuid.uuid4().hex[:8]}"  # short: the shm folders' names
    shutil.copytree(tmp_path, root, ignore=shutil.ignore_patterns("train"))
    try:
        done = subprocess.run(
            netns.command(
                [sys.executable, "-c", NETNS_SCRIPT, str(root), SERVICE, str(src), JOB, *HOSTS]
            ),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for i in range(len(HOSTS)):
            shutil.rmtree(f"/dev/shm/{root.name}-{i}", ignore_errors=True)
            shutil.rmtree(f"/dev/shm/{root.name}-{i}.run", ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    everyone = [f"{h}:7420" for h in HOSTS]
    # Every node lists the dataset, placed over the three members DNS named.
    for host in HOSTS:
        assert [sorted(m) for m in result["members"][host]] == [everyone], result["members"]
    job = result["job"]
    assert job["nodes"] == ["127.0.0.2:7420"] and job["local"] == "127.0.0.2:7420"
    assert job["samples"] == 24 and job["same"] is True


FOLLOW_SCRIPT = r"""
import json, os, signal, subprocess, sys, time
from kspeedfs.client.reader import ClusterReader
from kspeedfs.format.config import load_settings
from kspeedfs.format.discovery import NodeWatch, ResolvedNodes
from kspeedfs.format.contract.node import List
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.format.errors import KSpeedError
from kspeedfs.testing.process import is_users_setting

root, service, src, hosts_file, dnsmasq_pid = sys.argv[1:6]
hosts = sys.argv[6:]
token = os.path.join(root, "token")
base = {k: v for k, v in os.environ.items() if not is_users_setting(k)}
base.update(KSPEEDFS_CONFIG=os.path.join(root, "empty.toml"), KSPEEDFS_TOKEN_FILE=token)
dns = {"KSPEEDFS_NODES": f"dns:{service}:7420", "KSPEEDFS_DNS_REFRESH": "1"}
cli = [sys.executable, "-m", "kspeedfs.cli"]
procs = {}

def start(i, host):
    log = open(os.path.join(root, f"node-{host}.log"), "ab")
    procs[host] = subprocess.Popen(
        [*cli, "node", "--shm-dir", f"/dev/shm/{os.path.basename(root)}-{i}",
         "--memory", "256MiB", "--segment-size", "64KiB"],
        env={**base, **dns, "KSPEEDFS_LISTEN": f"{host}:7420"}, stdout=log, stderr=subprocess.STDOUT)

def call(host, op):
    with NodeClient(Address(host, 7420), token, 10.0) as c:
        return c.request(op)

def members(host):
    try:
        return sorted(call(host, "status")["members"])
    except KSpeedError:
        return None

def records(names):
    with open(hosts_file, "w") as f:
        f.write("".join(f"{h} {service}\n" for h in names))
    os.kill(int(dnsmasq_pid), signal.SIGHUP)  # dnsmasq reads its hosts files again

def until(what, ok, limit=60):
    t0 = time.time()
    while not ok():
        assert time.time() < t0 + limit, what
        assert all(p.poll() is None for p in procs.values()), "a node exited"
        time.sleep(0.1)
    return round(time.time() - t0, 2)

at = lambda hs: [f"{h}:7420" for h in hs]
out = {}
try:
    for i, host in enumerate(hosts[:2]):
        start(i, host)
    until("two nodes", lambda: all(members(h) == at(hosts[:2]) for h in hosts[:2]))
    settings = load_settings({}, env={**base, **dns})
    reader = ClusterReader(settings)
    out["reader_before"] = reader.pool.nodes
    # A third node's pod starts, then its address is added to the Service's records.
    start(2, hosts[2])
    until("third node up", lambda: members(hosts[2]) is not None)
    out["third_alone"] = members(hosts[2])
    records(hosts)
    out["join_s"] = until("third joined", lambda: all(members(h) == at(hosts) for h in hosts))
    until("reader follows", lambda: reader.pool.nodes == at(hosts))
    done = subprocess.run([*cli, "preload", src, "--name", "train", "-q", "--nodes", f"{hosts[0]}:7420"],
                          env=base, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with NodeClient(Address(hosts[0], 7420), token, 10.0) as c:
        out["placed"] = [sorted(d.members) for d in c.call(List()).datasets]
    # The second node goes: its record leaves the Service, the others stop placing on it.
    procs[hosts[1]].terminate()
    procs[hosts[1]].wait(20)
    del procs[hosts[1]]
    records([hosts[0], hosts[2]])
    left = [hosts[0], hosts[2]]
    out["leave_s"] = until("second left", lambda: all(members(h) == at(left) for h in left))
    until("reader follows", lambda: reader.pool.nodes == at(left))
    out["reader_after"] = reader.pool.nodes
    reader.close()
finally:
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        p.wait(20)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_node_added_to_the_service_joins_and_a_gone_one_leaves(tmp_path: Path) -> None:
    """dns_refresh 1 s: two nodes start with the Service naming them; a third starts (alone:
    not in the records yet), its record is added (dnsmasq SIGHUP), and within the interval
    every node places over the three, as a ClusterReader asks them; a preload then spans the
    three. The second node's record goes: the others drop it, the reader too."""
    for tool in ("ip", "dnsmasq"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (make test installs it)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    root = Path("/tmp") / f"ks-dnsf-{uuid.uuid4().hex[:8]}"  # short: the shm folders' names
    root.mkdir()
    (root / "empty.toml").write_text("")
    auth.write_token(root / "token", auth.new_admin_token())
    src = tmp_path / "train"
    make_sample(src, classes=2, per_class=4, file_size=20000, bases=2)
    hosts_file = root / "service.hosts"
    netns = NetNamespace(root, SERVICE, HOSTS[:2], hosts_file)
    try:
        wait_pid = root / "dnsmasq.pid"
        wait_for(lambda: wait_pid.exists() and bool(wait_pid.read_text().strip()), 10, "its pid")
        done = subprocess.run(
            netns.command(
                [
                    sys.executable,
                    "-c",
                    FOLLOW_SCRIPT,
                    str(root),
                    SERVICE,
                    str(src),
                    str(hosts_file),
                    wait_pid.read_text().strip(),
                    *HOSTS,
                ]
            ),  # fmt: skip
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        netns.close()
        for i in range(len(HOSTS)):
            shutil.rmtree(f"/dev/shm/{root.name}-{i}", ignore_errors=True)
            shutil.rmtree(f"/dev/shm/{root.name}-{i}.run", ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    at = [f"{h}:7420" for h in HOSTS]
    assert result["reader_before"] == at[:2]
    assert result["third_alone"] == [at[2]]  # not in the records yet: places over itself
    assert result["placed"] == [at]  # the preload after the join spans the three
    assert result["reader_after"] == [at[0], at[2]]
    print(f"joined in {result['join_s']} s, left in {result['leave_s']} s (dns_refresh 1 s)")
