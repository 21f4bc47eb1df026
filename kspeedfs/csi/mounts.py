"""The volumes' mounts, owned by mountd: the plugin declares them and waits, it never holds one.

A FUSE mount dies with the process that serves it, and a pod whose volume's process died gets
ENOTCONN until it is restarted (Fluid #5495, mountpoint-s3-csi-driver #576). So the plugin
serves none: each volume is a mountd declaration (a TOML file in mountd's folder, named after
the target path), mountd mounts it in a process of its own session and remounts it when it
fails, and the plugin waits on mountd's status file. Killing or upgrading the plugin (its
container) leaves mountd and every mount as they are; the plugin finds them again from its
records and mountd's status on start. In the DaemonSet mountd runs in a container of its own
in the same pod (shareProcessNamespace, so that the plugin can send it SIGHUP).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from kspeedfs.format.config import Settings
from kspeedfs.format.errors import KSpeedError, MountError
from kspeedfs.system.mountinfo import kspeedfs_mounted
from mountd.state import read_state

from .volumes import Volume, mount_name

log = logging.getLogger(__name__)

POLL_S = 0.05


class MountdUnavailable(KSpeedError):
    """mountd is not running, so no volume can be mounted or unmounted now."""


class MountdLink:
    """Declares volumes to mountd (its mounts folder) and reads their state (its status file)."""

    def __init__(self, mounts_dir: Path, state_file: Path, settings: Settings):
        self.mounts_dir = mounts_dir
        self.state_file = state_file
        self.settings = settings

    def declaration(self, volume: Volume) -> str:
        """The TOML mountd reads for a volume: the dataset at the target, for every uid."""
        # dns: entries as given: the mount looks them up again (format/discovery.py)
        nodes = ",".join(
            str(a) for a in getattr(self.settings.nodes, "entries", self.settings.nodes)
        )
        lines = [
            f"mountpoint = {_toml_str(volume.target)}",
            f"dataset = {_toml_str(volume.mounted)}",
            f"nodes = {_toml_str(nodes)}",
            f"token_file = {_toml_str(str(self.settings.token_file))}",
            # A pod's containers run as any uid; the mount is read-only and the node checks
            # each file's modes (access = "source") as for any other mount.
            'options = ["allow_other"]',
        ]
        return "\n".join(lines) + "\n"

    def declare(self, volume: Volume) -> None:
        path = self.mounts_dir / f"{mount_name(volume.target)}.toml"
        text = self.declaration(volume)
        try:
            if path.read_text() == text:
                self._reload()  # a plugin killed between the write and the signal
                return
        except FileNotFoundError:
            pass
        self.mounts_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")  # not *.toml: mountd never reads it half done
        tmp.write_text(text)
        os.replace(tmp, path)
        self._reload()

    def withdraw(self, target: str) -> None:
        try:
            (self.mounts_dir / f"{mount_name(target)}.toml").unlink()
        except FileNotFoundError:
            pass
        self._reload()

    def declared(self, target: str) -> bool:
        return (self.mounts_dir / f"{mount_name(target)}.toml").exists()

    def _reload(self) -> None:
        pid = int(self._state()["pid"])
        # A status file left by a mountd that was killed may name a pid since reused by
        # another process (the node!), which SIGHUP would end: signal only a mountd.
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                is_mountd = b"mountd" in f.read()
        except OSError:
            is_mountd = False
        if not is_mountd:
            raise MountdUnavailable(f"mountd is not running (process {pid} is not mountd)")
        try:
            os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            raise MountdUnavailable("mountd is not running (its process is gone)") from None

    def _state(self) -> dict[str, Any]:
        try:
            return read_state(self.state_file)
        except KSpeedError as e:
            raise MountdUnavailable(str(e)) from None

    def entry(self, target: str) -> dict[str, Any] | None:
        name = mount_name(target)
        for m in self._state().get("mounts", []):
            if m.get("name") == name:
                return m
        return None

    def wait_mounted(self, volume: Volume, timeout: float) -> None:
        """Until mountd reports the volume's mount up; MountError with mountd's reason after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        error = "mountd has not started it yet"
        while True:
            entry = self.entry(volume.target)
            if entry is not None:
                if entry["state"] == "mounted" and kspeedfs_mounted(volume.target):
                    return
                error = entry.get("error") or entry.get("last_error") or entry["state"]
            if time.monotonic() > deadline:
                raise MountError(
                    f"{volume.mounted} was not mounted at {volume.target} in {timeout:.0f}s: "
                    f"{error}"
                )
            time.sleep(POLL_S)

    def wait_unmounted(self, target: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.entry(target) is not None or kspeedfs_mounted(target):
            if time.monotonic() > deadline:
                raise MountError(f"{target} is still mounted {timeout:.0f}s after its unpublish")
            time.sleep(POLL_S)


def _toml_str(value: str) -> str:
    """A TOML basic string (json's escapes are TOML's for these characters)."""
    return json.dumps(value)
