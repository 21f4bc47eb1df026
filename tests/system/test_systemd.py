"""systemd units: installed with real paths, accepted by systemd-analyze; the node's sd_notify."""

from __future__ import annotations

import configparser
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import NodeProcess, run_cli
from mountdutil import NotifyListener

from kspeedfs.cli.systemd_units import (
    EXAMPLES,
    MOUNT_HELPERS,
    SERVICES,
    default_exec_prefix,
    install,
    templates_dir,
)
from kspeedfs.format.errors import KSpeedError
from kspeedfs.node.safedir import DIR_MODE

# Each template checked, the template unit through an instance of it.
CHECKED_UNITS = (
    "kspeedfs-node.service",
    "kspeedfs-mountd.service",
    "kspeedfs-mount@imagenet.service",
    "mnt-imagenet.mount",
)
# Any of these gives a service its own mount namespace: its FUSE mounts would be invisible.
MOUNT_NAMESPACE_OPTIONS = (
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateMounts",
    "ReadWritePaths",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "TemporaryFileSystem",
    "BindPaths",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectProc",
    "DynamicUser",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("root")
    done = run_cli(
        "install-systemd", "--prefix", str(prefix), "--example-mount", env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    return prefix


def unit(prefix: Path, name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(prefix / "etc" / "systemd" / "system" / name)
    return parser


def test_install_writes_units_with_this_installation_paths(installed: Path) -> None:
    unit_dir = installed / "etc" / "systemd" / "system"
    assert sorted(p.name for p in unit_dir.iterdir()) == sorted(SERVICES + EXAMPLES)
    scripts = default_exec_prefix()
    for name in SERVICES:
        text = (unit_dir / name).read_text()
        assert "@EXEC_PREFIX@" not in text and str(scripts) in text
        for line in text.splitlines():
            if line.startswith(("ExecStart=", "ExecStopPost=")):
                exe = line.split("=", 1)[1].lstrip("-").split()[0]
                assert Path(exe).parent == scripts and os.access(exe, os.X_OK), line
    for helper in MOUNT_HELPERS:
        link = installed / "sbin" / helper
        assert link.is_symlink() and link.resolve() == (scripts / "mount.kspeedfs").resolve()
    assert (installed / "etc" / "kspeedfs" / "mounts.d").is_dir()


def test_install_checks_before_writing(tmp_path: Path) -> None:
    with pytest.raises(KSpeedError, match="not found in"):
        install(tmp_path / "root", exec_prefix=tmp_path / "empty")
    with pytest.raises(KSpeedError, match="cannot use"):
        install(tmp_path / "root", exec_prefix=Path("/opt/my venv/bin"))
    assert not (tmp_path / "root").exists()
    (tmp_path / "root" / "sbin").mkdir(parents=True)
    (tmp_path / "root" / "sbin" / "mount.kspeedfs").write_text("someone else's")
    with pytest.raises(KSpeedError, match="not a symlink"):
        install(tmp_path / "root")
    assert not (tmp_path / "root" / "etc").exists()


@pytest.mark.parametrize("name", CHECKED_UNITS)
def test_systemd_analyze_verify_accepts_the_unit(installed: Path, name: str) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    path = installed / "etc" / "systemd" / "system" / name
    done = subprocess.run(
        [tool, "verify", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Unknown keys and bad values are only warnings for verify: none may name our units.
    unit_stem = name.replace("@imagenet", "@")
    complaints = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if unit_stem in line or name in line or str(installed) in line
    ]
    assert complaints == []


def test_verify_would_catch_a_broken_unit(installed: Path, tmp_path: Path) -> None:
    """The check above can fail: a typo in a unit is reported."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    broken = tmp_path / "kspeedfs-node.service"
    text = (installed / "etc" / "systemd" / "system" / "kspeedfs-node.service").read_text()
    broken.write_text(text.replace("WatchdogSec=", "WatchdogSecs="))
    done = subprocess.run([tool, "verify", str(broken)], capture_output=True, text=True)
    assert "WatchdogSecs" in done.stdout + done.stderr


def test_fuse_units_share_their_mounts_and_reach_dev_fuse(installed: Path) -> None:
    for name in ("kspeedfs-mountd.service", "kspeedfs-mount@.service"):
        service = unit(installed, name)["Service"]
        present = [k for k in MOUNT_NAMESPACE_OPTIONS if k in service]
        assert present == [], f"{name}: {present} would hide the mounts from the host"
        assert service["DeviceAllow"] == "/dev/fuse rw"
        assert "CAP_SYS_ADMIN" in service["CapabilityBoundingSet"].split()
        assert service["Type"] == "notify"
    mountd = unit(installed, "kspeedfs-mountd.service")
    assert "kspeedfs-node.service" in mountd["Unit"]["After"].split()
    assert "kspeedfs-node.service" in mountd["Unit"]["Wants"].split()


def test_node_unit_fits_a_cache_in_dev_shm(installed: Path) -> None:
    service = unit(installed, "kspeedfs-node.service")["Service"]
    assert service["Type"] == "notify" and service["Restart"] == "on-failure"
    assert "WatchdogSec" in service
    assert "MemoryMax" not in service and "MemoryHigh" not in service
    assert service.get("PrivateDevices", "no") == "no"  # RDMA devices, /dev/shm
    assert service["RemoveIPC"] == "no"
    assert service["LimitMEMLOCK"] == "infinity"
    # RestrictSUIDSGID=yes would make the fchmod that sets it EPERM: the node would not start.
    if DIR_MODE & stat.S_ISGID:
        assert service.get("RestrictSUIDSGID", "no") == "no"


def test_templates_are_found_next_to_the_package() -> None:
    names = {p.name for p in templates_dir().iterdir()}
    assert set(SERVICES + EXAMPLES) <= names


def test_node_notifies_ready_when_serving_and_pings_the_watchdog(
    shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="kspeedfs-notify-"))
    listener = NotifyListener(sock_dir / "notify")
    node = NodeProcess(shm_dir, token_file, tmp_path)
    env = {**node.env(), "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspeedfs.cli",
            "node",
            "--listen",
            node.address,
            "--shm-dir",
            str(shm_dir),
            "--memory",
            "64MiB",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        listener.receive_until(lambda m: any(f.get("READY") == "1" for _, f in m), "READY=1")
        # READY means serving: the node answers right away, no retry needed.
        assert node.request("ping") is not None
        listener.receive_until(
            lambda m: sum(f.get("WATCHDOG") == "1" for _, f in m) >= 2, "WATCHDOG=1 pings"
        )
        assert listener.senders() == {proc.pid}
        proc.send_signal(signal.SIGTERM)
        listener.receive_until(lambda m: any("STOPPING" in f for _, f in m), "STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
