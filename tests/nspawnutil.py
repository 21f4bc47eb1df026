"""A booted Debian container (debootstrap + systemd-nspawn) whose systemd runs this checkout."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import wait_for

SUITE = "bookworm"
PACKAGES = "systemd,systemd-sysv,dbus,fuse3,python3"
# Outside the repository and kept between runs: debootstrap takes about a minute, a copy 1 s.
CACHE = Path("/var/cache/kspeedfs-test") / SUITE
DEFAULT_MIRROR = "http://deb.debian.org/debian"
REPO = Path(__file__).resolve().parent.parent
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BOOT_TIMEOUT = 120.0
# systemd-nspawn's exit status when the container's systemd rebooted it.
REBOOTED = 133


def missing() -> str:
    """Why no container can be booted here, or ''."""
    if os.geteuid() != 0:
        return "booting a container needs root"
    for tool in ("debootstrap", "systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install debootstrap systemd-container)"
    for device in ("/dev/fuse", "/dev/autofs"):  # FUSE mounts; x-systemd.automount
        if not os.path.exists(device):
            return f"{device} is missing"
    return ""


def debian_mirror() -> str:
    """The Debian mirror apt uses here (sources.list or deb822 .sources), else deb.debian.org."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file() or path.suffix not in ("", ".list", ".sources"):
            continue
        text = path.read_text(errors="replace")
        for uri in re.findall(r"^\s*(?:URIs:|deb)\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            if "debian" in uri and "security" not in uri:
                return uri
    return DEFAULT_MIRROR


def cached_root() -> Path:
    """The debootstrapped root, made once (one maker at a time: a lock beside it)."""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    done = CACHE / ".complete"
    with open(CACHE.parent / f".{SUITE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return CACHE
        partial = CACHE.with_name(f"{SUITE}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(CACHE, ignore_errors=True)
        made = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(partial)]
            + [debian_mirror()],
            capture_output=True,
            text=True,
            timeout=480,  # within the test timeout (600 s) that counts the fixture
        )
        if made.returncode != 0:
            raise RuntimeError(f"debootstrap failed: {made.stdout[-2000:]}{made.stderr[-2000:]}")
        os.rename(partial, CACHE)
        done.touch()
    return CACHE


def python_binds() -> list[str]:
    """Read-only binds that make this interpreter, its venv and this checkout run inside."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(REPO)}
    base = os.path.realpath(sys.base_prefix)
    # A Debian /usr python is the container's own python3 (same release): never bind /usr.
    if base != "/usr":
        paths.add(base)
    return [f"--bind-ro={p}" for p in sorted(paths)]


class Container:
    """One systemd-nspawn boot of a copy of the cached root, rebootable; `stop` always ends it.

    Commands run inside with nsenter. Its own network namespace (only lo), so its node's
    127.0.0.1:7420 is its own. The host reaches its mounts through /proc/LEADER/root.
    """

    def __init__(self, root: Path, log_path: Path):
        self.root = root
        self.log_path = log_path
        self.name = f"kspeedfs-test-{os.getpid()}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def prepare(self) -> None:
        """Copy the cached root and make its systemd run this checkout's code."""
        subprocess.run(["cp", "-a", str(cached_root()), str(self.root)], check=True)
        conf = self.root / "etc" / "systemd" / "system.conf.d"
        conf.mkdir(parents=True, exist_ok=True)
        # The venv's editable install may point at another checkout (a worktree): this one wins.
        (conf / "kspeedfs-test.conf").write_text(
            f"[Manager]\nDefaultEnvironment=PYTHONPATH={REPO}\n"
        )

    def boot(self) -> None:
        command = [
            "systemd-nspawn",
            "--directory",
            str(self.root),
            "--machine",
            self.name,
            "--boot",
            # No host systemd or machined is needed: no scope, no registration.
            "--register=no",
            "--keep-unit",
            "--private-network",
            "--console=pipe",
            "--capability=CAP_SYS_ADMIN",
            "--bind=/dev/fuse",
            "--bind=/dev/autofs",
            *python_binds(),
        ]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        wait_for(self._find_leader, BOOT_TIMEOUT, "the container's systemd to start")
        deadline = time.monotonic() + BOOT_TIMEOUT
        while True:  # its manager may not answer yet in its first moments
            state = self.run("systemctl", "is-system-running", "--wait", check=False)
            if state.stdout.strip() in ("running", "degraded") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert state.stdout.strip() == "running", self.failed_units()

    def _find_leader(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}: {self.log()}")
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
            for pid in children.split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    self.leader = int(pid)
                    return True
        except FileNotFoundError:
            pass
        return False

    def run(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside, with a clean environment; check: fail on a non-zero exit."""
        env = {"PATH": PATH, "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
        done = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"{args}: {done.returncode} {done.stdout}{done.stderr}"
        return done

    def host_path(self, path: str) -> Path:
        """The container's `path` as seen from here, through its mount namespace."""
        return Path(f"/proc/{self.leader}/root") / path.lstrip("/")

    def mounts(self) -> dict[str, str]:
        """Mountpoint -> filesystem type, inside."""
        lines = self.run("findmnt", "-rn", "-o", "TARGET,FSTYPE").stdout.splitlines()
        return dict(line.split(" ", 1) for line in lines if " " in line)

    def unit(self, name: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", name, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def failed_units(self) -> str:
        listed = self.run("systemctl", "--failed", "--no-legend", "--plain", check=False).stdout
        logs = self.run("journalctl", "-b", "--no-pager", "-n", "60", check=False).stdout
        return f"failed units: {listed}\n{logs}"

    def reboot(self) -> None:
        assert self.proc is not None
        self.run("systemctl", "reboot")
        status = self.proc.wait(BOOT_TIMEOUT)
        assert status == REBOOTED, f"systemd-nspawn exited {status}: {self.log()}"
        self.boot()

    def stop(self) -> None:
        """Power off (nspawn turns SIGTERM into an orderly shutdown), else kill its init:
        the kernel ends everything in its PID namespace with it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                if self.leader:
                    os.kill(self.leader, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait(30)
        # nspawn cannot remove this one where /run is not a tmpfs; it is empty by now.
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]
