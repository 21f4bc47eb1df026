"""Discovery as in a Kubernetes cluster: a headless Service's DNS name answered by dnsmasq in a
network namespace of the test's own, three nodes on 127.0.0.1-3 that find each other through
it, and a job with kspeed_iplist=None that finds its host's node from the downward API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kspeedfs.format import auth
from kspeedfs.format.config import load_settings
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


NETNS_SCRIPT = r"""
import json, os, subprocess, sys, time
from kspeedfs.format.contract.node import List
from kspeedfs.format.units import Address
from kspeedfs.net.connection import NodeClient
from kspeedfs.format.errors import KSpeedError

root, service, src, JOB = sys.argv[1:5]
hosts = sys.argv[5:]
token = os.path.join(root, "token")
base = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
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
        listed[h] = [d.get("members") for d in reply["datasets"] if d["name"] == "train"]
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

    def __init__(self, root: Path, name: str, hosts: list[str]):
        self.name = f"ks-{uuid.uuid4().hex[:8]}"
        self.etc = Path("/etc/netns") / self.name
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.exec(["ip", "link", "set", "lo", "up"])
        self.etc.mkdir(parents=True)
        (self.etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1\n")
        records = [f"--address=/{name}/{h}" for h in hosts]
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
