"""A local etcd server for tests, the demo and benches: its own loopback ports and data folder."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import requests

from kspeedfs.format.errors import NodeUnreachable, NotFound
from kspeedfs.testing.process import START_TIMEOUT, free_ports, wait_until


@dataclass(frozen=True)
class EtcdTls:
    """etcd's certificate and key (for 127.0.0.1, with clientAuth too: its health check shows
    them), and the CA whose client certificates it accepts (`kspeedfs tls` makes all three)."""

    cert: Path
    key: Path
    ca: Path


class EtcdProcess:
    """One `etcd` subprocess on 127.0.0.1 (Debian's etcd-server package), data in a temp folder
    that `stop` removes. `pause`/`resume` stop and start the same member on the same ports.
    With `tls` its client URL is https:// and it requires a client certificate from `tls.ca`
    (the peer URL stays plain: it is a one-member cluster)."""

    def __init__(self, log_dir: Path, tls: EtcdTls | None = None):
        self.client_port, self.peer_port = free_ports(2)
        self.tls = tls
        self.data_dir = Path(tempfile.mkdtemp(prefix="kspeedfs-etcd-"))
        self.log_path = log_dir / f"etcd-{self.client_port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def command(self) -> list[str]:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.tls is not None:
            tls = [
                "--cert-file", str(self.tls.cert),
                "--key-file", str(self.tls.key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        return [
            etcd,
            *tls,
            "--name",
            "kspeedfs-test",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"kspeedfs-test={peer}",
            "--log-level",
            "warn",
        ]

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        if not Path(self.command()[0]).exists():
            raise NotFound("etcd is not installed (apt-get install etcd-server)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(self._healthy, timeout, f"etcd on {self.endpoint}")
        except TimeoutError:
            raise NodeUnreachable(f"etcd on {self.endpoint} did not start") from None
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise NodeUnreachable(f"etcd exited with {self.proc.returncode}: see {self.log_path}")
        verify: str | bool = True
        cert = None
        if self.tls is not None:  # an explicit CA file (REQUESTS_CA_BUNDLE replaces only True)
            verify, cert = str(self.tls.ca), (str(self.tls.cert), str(self.tls.key))
        try:
            return requests.get(self.endpoint + "/health", timeout=1, verify=verify, cert=cert).ok
        except requests.RequestException:
            return False

    def pause(self) -> None:
        """Stop the server, keeping its data: `resume` brings the same member back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def resume(self) -> Self:
        return self.start()

    def stop(self) -> None:
        self.pause()
        shutil.rmtree(self.data_dir, ignore_errors=True)
