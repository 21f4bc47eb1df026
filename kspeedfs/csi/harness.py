"""kubelet's side, for tests and the bench: a CSI client on the plugin's socket, the plugin and
mountd as subprocesses, a "pod" (a process in a mount namespace of its own), and a real
container (podman) with a volume bound as the container runtime binds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import grpc

from kspeedfs.testing.process import KSPEEDFS, START_TIMEOUT, log_tail, stop_process, wait_until

from . import csi_pb2 as pb
from .server import SERVICES

MOUNTD = [sys.executable, "-m", "mountd.daemon"]


class CsiClient:
    """The calls kubelet makes, by name: `client.call("NodePublishVolume", volume_id=...)`."""

    def __init__(self, socket_path: Path, timeout: float = 150.0):
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.timeout = timeout
        self._methods: dict[str, tuple[Any, Any]] = {}
        for service, methods in SERVICES.items():
            for method, (request, response, _) in methods.items():
                stub = self.channel.unary_unary(
                    f"/{service}/{method}",
                    request_serializer=request.SerializeToString,
                    response_deserializer=response.FromString,
                )
                self._methods[method] = (request, stub)

    def call(self, method: str, **fields: Any) -> Any:
        request, stub = self._methods[method]
        return stub(request(**fields), timeout=self.timeout)

    def publish(
        self, volume_id: str, target: str, context: Mapping[str, str], readonly: bool = True
    ) -> Any:
        mode = pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY
        capability = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=pb.VolumeCapability.AccessMode(mode=mode),
        )
        return self.call(
            "NodePublishVolume",
            volume_id=volume_id,
            target_path=str(target),
            volume_capability=capability,
            readonly=readonly,
            volume_context=dict(context),
        )

    def unpublish(self, volume_id: str, target: str) -> Any:
        return self.call("NodeUnpublishVolume", volume_id=volume_id, target_path=str(target))

    def close(self) -> None:
        self.channel.close()


def inline_context(
    dataset: str, pod: str = "trainer", namespace: str = "default", **attrs: str
) -> dict[str, str]:
    """The volume context kubelet sends for an inline volume of a pod (podInfoOnMount)."""
    return {
        "dataset": dataset,
        **attrs,
        "csi.storage.k8s.io/pod.name": pod,
        "csi.storage.k8s.io/pod.namespace": namespace,
        "csi.storage.k8s.io/pod.uid": "5f0c3c1e-8a4e-4f5e-9d6a-0123456789ab",
        "csi.storage.k8s.io/serviceAccount.name": "default",
        "csi.storage.k8s.io/ephemeral": "true",
    }


class Daemon:
    """A subprocess that logs to a file, waited for by a predicate, stopped with SIGTERM."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log_path: Path):
        self.argv = argv
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.argv[3]} exited with {self.proc.returncode}: {log_tail(self.log_path)}"
            )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            stop_process(self.proc, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class MountdDaemon(Daemon):
    """kspeedfs-mountd with the plugin's folder and status file and short retry delays."""

    def __init__(self, mounts_dir: Path, state_file: Path, env: Mapping[str, str], log_dir: Path):
        argv = [*MOUNTD, "--mounts-dir", str(mounts_dir), "--state-file", str(state_file)]
        argv += ["run", "--retry-min", "0.2", "--retry-max", "1", "--check-interval", "0.5"]
        super().__init__(argv, env, log_dir / "mountd.log")
        self.state_file = state_file

    def start(self) -> Self:
        self.spawn()

        def ready() -> bool:
            self.check_alive()
            return self.state_file.exists()

        wait_until(ready, START_TIMEOUT, "mountd")
        return self


class PluginDaemon(Daemon):
    """`kspeedfs csi` on a unix socket in `run_dir`, with mountd's folder and status there."""

    def __init__(
        self,
        run_dir: Path,
        env: Mapping[str, str],
        node_id: str = "node-a",
        publish_timeout: float = 60.0,
        kubelet_dir: Path | None = None,
        policy: Path | None = None,
    ):
        """`kubelet_dir`: the folder the targets are in (default: `run_dir`'s parent)."""
        self.socket = run_dir / "csi.sock"
        argv = [
            *KSPEEDFS,
            "csi",
            "--endpoint",
            f"unix://{self.socket}",
            "--node-id",
            node_id,
            "--state-dir",
            str(run_dir / "state"),
            "--mounts-dir",
            str(run_dir / "mounts.d"),
            "--mountd-state",
            str(run_dir / "mountd.json"),
            "--publish-timeout",
            str(publish_timeout),
            "--kubelet-dir",
            str(kubelet_dir or run_dir.parent),
        ]
        if policy is not None:
            argv += ["--policy", str(policy)]
        super().__init__(argv, env, run_dir / "plugin.log")

    def start(self) -> Self:
        if self.socket.exists():
            self.socket.unlink()  # a killed plugin's: wait for the new one's
        self.spawn()

        def listening() -> bool:
            self.check_alive()
            return self.socket.exists()

        wait_until(listening, START_TIMEOUT, "the CSI plugin's socket")
        return self


def pod_command(argv: list[str]) -> list[str]:
    """`argv` as a pod runs it: in a mount namespace of its own, made after the volume was
    published (so the volume's mount is in it), receiving no mount events back (slave)."""
    return ["unshare", "--mount", "--propagation", "slave", *argv]


def run_pod(code: str, *args: str, env: Mapping[str, str] | None = None) -> str:
    """Python `code` run as a pod (pod_command); its stdout, or RuntimeError with its stderr."""
    done = subprocess.run(
        pod_command([sys.executable, "-c", code, *args]),
        capture_output=True,
        text=True,
        env=dict(os.environ if env is None else env),
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pod failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


BUSYBOX = "/usr/bin/busybox"  # Debian's busybox-static: a container root of one file


def busybox_root(folder: Path) -> Path:
    """A container's root file system: a static busybox as /bin/busybox and /bin/sh."""
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, folder / "bin" / "busybox")
    if not (folder / "bin" / "sh").is_symlink():
        os.symlink("busybox", folder / "bin" / "sh")
    return folder


def container_command(rootfs: Path, volumes: Mapping[Path, str], argv: list[str]) -> list[str]:
    """`argv` in a real OCI container (podman with runc; crun refuses hybrid cgroups), each
    volume's target bound at its path as the container runtime binds a pod's CSI volume: a
    bind of the target alone, read-only, `rslave` (mountPropagation HostToContainer)."""
    command = ["podman", "run", "--rm", "--runtime", "runc", "--cgroup-manager=cgroupfs"]
    command += ["--network", "none", "--ulimit", "nofile=20000:20000"]
    command += ["--ulimit", "nproc=4096:4096"]
    for target, path in volumes.items():
        command += ["-v", f"{target}:{path}:ro,rslave"]
    return [*command, "--rootfs", str(rootfs), *argv]
