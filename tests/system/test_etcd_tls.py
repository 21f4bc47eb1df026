"""The etcd control plane over TLS, with a real etcd that requires client certificates and
certificates made by `kspeedfs tls`: a node with the TLS settings joins through https etcd,
`kspeedfs status` lists it, a preload and reads (FUSE and fast path) work; a client with no
certificate, one from another CA, one that does not trust etcd's CA and one dialling http://
each fail with one line naming etcd and change nothing; a node etcd refuses keeps serving and
logs one line."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import MountProcess, NodeProcess, new_cas, run_cli, wait_for
from etcdutil import EtcdCluster

from kspeedfs.format import auth
from kspeedfs.testing.etcd import EtcdProcess, EtcdTls
from kspeedfs.testing.process import is_users_setting

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")

NAME = "etcdtls"


@dataclass
class Pki:
    ca: Path  # the cluster's CA folder: ca.crt, and 127.0.0.1.crt/.key (etcd, nodes, clients)
    other: Path  # another CA's folder, the same files

    def env(self, folder: Path | None = None, ca: Path | None = None) -> dict[str, str]:
        """The TLS variables for the pair in `folder` (default: the cluster's) and CA `ca`."""
        folder = folder or self.ca
        return {
            "KSPEEDFS_TLS_CERT": str(folder / "127.0.0.1.crt"),
            "KSPEEDFS_TLS_KEY": str(folder / "127.0.0.1.key"),
            "KSPEEDFS_TLS_CA": str((ca or folder) / "ca.crt"),
        }


@dataclass
class TlsEtcd:
    cluster: EtcdCluster
    node: NodeProcess
    pki: Pki
    source: Path
    files: dict[str, bytes]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates made the way a user makes them; etcd uses the cluster's 127.0.0.1 pair."""
    tmp = tmp_path_factory.mktemp("pki")
    new_cas(tmp, "ca", "other")
    return Pki(tmp / "ca", tmp / "other")


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[TlsEtcd]:
    """One node with TLS on, joined through an etcd that requires client certificates, and a
    dataset it preloaded (asked by the CLI, which found the node in that etcd)."""
    tmp = tmp_path_factory.mktemp("etcdtls")
    token = tmp / "token"
    auth.write_token(token, auth.new_admin_token())
    tls = EtcdTls(pki.ca / "127.0.0.1.crt", pki.ca / "127.0.0.1.key", pki.ca / "ca.crt")
    etcd = EtcdProcess(tmp, tls).start()
    cluster = EtcdCluster(tmp, token, etcd, tls=pki.env())
    try:
        node = cluster.add()
        source = tmp / "src"
        files = {}
        for i in range(12):
            rel = f"d{i % 3}/f{i:02d}.bin"
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            files[rel] = os.urandom(3000 + 7919 * i)
            (source / rel).write_bytes(files[rel])
        cluster.preload(source, NAME)
        yield TlsEtcd(cluster, node, pki, source, files)
    finally:
        cluster.stop()
        etcd.stop()


def test_a_node_joins_through_https_etcd_and_status_lists_it(tls_etcd: TlsEtcd) -> None:
    cluster = tls_etcd.cluster
    assert cluster.etcd.endpoint.startswith("https://")
    assert cluster.members() == {tls_etcd.node.address: "up"}
    # REQUESTS_CA_BUNDLE names another CA: tls_ca alone decides whom etcd is checked against.
    env = {**cluster.client_env(), "REQUESTS_CA_BUNDLE": str(tls_etcd.pki.other / "ca.crt")}
    done = run_cli("status", env=env)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if tls_etcd.node.address in line)
    assert "up" in row.split(), done.stdout
    assert "Traceback" not in tls_etcd.node.log()


def test_a_preload_and_reads_through_https_etcd(
    tls_etcd: TlsEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_ext import KSpeedFolder

    cluster = tls_etcd.cluster
    record = cluster.entry(NAME)
    assert record.state == "ready" and record.members == (tls_etcd.node.address,)
    # The mount and the fast path know only etcd: they find the node there, over TLS.
    mount = MountProcess(tmp_path / "mnt", cluster.client_env(), tmp_path)
    for key in [k for k in os.environ if is_users_setting(k)]:
        monkeypatch.delenv(key)
    for key, value in cluster.client_env().items():
        if key.startswith("KSPEEDFS_"):
            monkeypatch.setenv(key, value)
    try:
        mount.start()
        fast = KSpeedFolder(str(tls_etcd.source), local=False)
        for rel, data in tls_etcd.files.items():
            assert (tmp_path / "mnt" / NAME / rel).read_bytes() == data
            assert bytes(fast.read(rel)) == data
    finally:
        mount.stop()


# Each case: the client's pair and CA (folders of Pki; None: no TLS settings), the scheme it
# dials, and what its one line must say (etcd refuses a client with an alert or by hanging up
# in the handshake, whichever comes first).
ETCD_REFUSES = "etcd closed the connection|ALERT"
REFUSED = {
    "no client certificate": (None, "https", ETCD_REFUSES),
    "a certificate from another CA": (("other", "ca"), "https", ETCD_REFUSES),
    "another CA altogether": (("other", "other"), "https", "VERIFY_FAILED"),  # it refuses etcd
    "plain http": (("ca", "ca"), "http", "use https://"),
}


def _refused_env(tls_etcd: TlsEtcd, case: str) -> dict[str, str]:
    files, scheme, _expect = REFUSED[case]
    pki = tls_etcd.pki
    env = {k: v for k, v in tls_etcd.cluster.client_env().items() if "_TLS_" not in k}
    if files is None:  # it trusts etcd through the system's CAs, here the cluster's CA
        env["SSL_CERT_FILE"] = str(pki.ca / "ca.crt")
    else:
        pair, ca = files
        env.update(pki.env(getattr(pki, pair), getattr(pki, ca)))
    env["KSPEEDFS_ETCD"] = tls_etcd.cluster.etcd.endpoint.replace("https", scheme, 1)
    return env


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_client_etcd_refuses_or_cannot_verify_gets_one_line(
    tls_etcd: TlsEtcd, case: str, tmp_path: Path
) -> None:
    cluster = tls_etcd.cluster
    env = _refused_env(tls_etcd, case)
    before = {name: rec for name, (rec, _rev) in cluster.state().datasets().items()}
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    (other / "x" / "a.bin").write_bytes(b"a" * 5000)
    for args in (
        ("status",),
        ("preload", str(other), "--name", "intruder", "-q"),
        ("unload", NAME),
    ):
        done = run_cli(*args, env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 9, (args, done.stdout, done.stderr)  # authentication refused
        assert len(lines) == 1 and "etcd" in lines[0], (args, done.stderr)
        assert re.search(REFUSED[case][2], lines[0]), (args, lines[0])
        assert "Traceback" not in done.stderr
    after = {name: rec for name, (rec, _rev) in cluster.state().datasets().items()}
    assert after == before and NAME in after
    assert cluster.members() == {tls_etcd.node.address: "up"}


def test_a_node_etcd_refuses_serves_and_logs_one_line(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    cluster = tls_etcd.cluster
    members = cluster.members()
    # Another cluster's certificates: it serves with them, and refuses etcd's certificate.
    env = {**cluster.base_env(), **tls_etcd.pki.env(tls_etcd.pki.other)}
    shm = cluster.root / "refused"
    node = NodeProcess(shm, cluster.token_file, tmp_path, segment_size="64KiB", base_env=env)
    try:
        node.start()  # it serves...
        wait_for(lambda: "TLS with etcd" in node.log(), 20, "the node's warning")
        time.sleep(2 * 2)  # under test: two member TTLs of refused joins (one line logged)
        assert node.request("ping")["node"] == node.address  # ...after the refusals too
        said = [line for line in node.log().splitlines() if "kspeedfs.node.control" in line]
        assert len(said) == 1 and "Traceback" not in node.log(), node.log()
        assert "TLS with etcd" in said[0] and "VERIFY_FAILED" in said[0], said[0]
        assert cluster.members() == members  # ...but is no member
    finally:
        node.stop()
