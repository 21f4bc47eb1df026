"""A dataset mapped from descriptors the node passed over its local socket (no file access)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kspeedfs.format import auth
from kspeedfs.format.config import Settings
from kspeedfs.format.localdata import DamageReport, LocalDataset
from kspeedfs.format.manifest import Manifest
from kspeedfs.net import fdpass

log = logging.getLogger(__name__)


class PassedDataset(LocalDataset):
    """A LocalDataset whose manifest and segments are open descriptors, not paths: for a
    reader outside the segments' group. Static datasets only (read-through ones are refused)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        manifest_fd: int,
        segments: dict[int, int],
        *,
        on_damage: DamageReport | None = None,
    ):
        self.path = Path(path)
        self._dir_fd = self._seg_fd = -1
        try:
            self.manifest = Manifest(self.path / "manifest.ksm", fd=manifest_fd)
            memory_dev = os.fstat(manifest_fd).st_dev  # the manifest is in memory
            on_disk = {k for k, fd in segments.items() if os.fstat(fd).st_dev != memory_dev}
            self._init_copies(memory_dev if on_disk else None, on_disk, on_damage)
        finally:
            os.close(manifest_fd)  # the mapping keeps what it needs
        self._fds = segments
        self._maps = {}
        self._watched = {}
        self._plain = {}
        self._lock = threading.Lock()
        self.held = frozenset(segments)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def _open_segment(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            raise FileNotFoundError(f"segment {seg} was not passed")
        return os.dup(fd)

    def _stat_segment(self, seg: int) -> os.stat_result:
        fd = self._fds.get(seg)
        if fd is None:
            raise FileNotFoundError(f"segment {seg} was not passed")
        return os.fstat(fd)


def attach(
    settings: Settings, path: str, name: str, uuid: str, on_damage: DamageReport | None = None
) -> PassedDataset:
    """The local node's copy of an instance, through its socket (KSpeedError when refused;
    `on_damage`: told the segments this process finds damaged)."""
    token = auth.secret(settings.credential())
    manifest_fd, segments = fdpass.attach(
        settings.socket_path(), token, name, uuid, settings.timeout, settings.node_user
    )
    try:
        return PassedDataset(path, manifest_fd, segments, on_damage=on_damage)
    except BaseException:
        for fd in segments.values():
            os.close(fd)
        raise
