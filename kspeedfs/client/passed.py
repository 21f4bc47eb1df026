"""A dataset mapped from descriptors the node passed over its local socket (no file access)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kspeedfs.format import auth
from kspeedfs.format.config import Settings
from kspeedfs.format.localdata import DamageReport
from kspeedfs.format.manifest import Manifest
from kspeedfs.net import fdpass
from kspeedfs.system.damage import DamageNews
from kspeedfs.system.local_dataset import LocalDataset

log = logging.getLogger(__name__)


class PassedDataset(LocalDataset):
    """A LocalDataset whose manifest and segments are open descriptors, not paths: for a
    reader outside the segments' group. Static datasets only (read-through ones are refused)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        manifest_fd: int,
        segments: dict[int, int],
        damage_fd: int = -1,
        *,
        on_damage: DamageReport | None = None,
    ):
        self.path = Path(path)
        self._dir_fd = self._seg_fd = self._disk_fd = -1
        try:
            self.manifest = Manifest(self.path / "manifest.ksm", fd=manifest_fd)
            memory_dev = os.fstat(manifest_fd).st_dev  # the manifest is in memory
            on_disk = {k for k, fd in segments.items() if os.fstat(fd).st_dev != memory_dev}
            news = DamageNews(self.manifest.segments, damage_fd)
        finally:
            os.close(manifest_fd)  # the mapping keeps what it needs
            if damage_fd >= 0:
                os.close(damage_fd)
        self._fds = segments
        dev = memory_dev if on_disk else None
        self._start(frozenset(segments), on_disk, dev, on_damage, news)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def open_segment(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            raise FileNotFoundError(f"segment {seg} was not passed")
        return os.dup(fd)

    def stat_segment(self, seg: int) -> os.stat_result:
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
    got = fdpass.attach(
        settings.socket_path(), token, name, uuid, settings.timeout, settings.node_user
    )
    try:
        return PassedDataset(
            path, got.manifest_fd, got.segments, got.damage_fd, on_damage=on_damage
        )
    except BaseException:
        for fd in got.segments.values():
            os.close(fd)
        raise
