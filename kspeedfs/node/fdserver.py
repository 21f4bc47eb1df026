"""The node's fd passing: hands segment descriptors to authenticated local readers.

The socket and its connections are fdsocket's (bound where only the node's uid can, a selector
thread and a small pool, bounded per uid); this decides what a reader gets, a few syscalls per
reader, once per process. Who gets a dataset's descriptors: a client that proves a token (any
role) and, with `access = "source"`, whose uid (with the groups the kernel reports for it) the
dataset's root folder lets in (r-x), by the modes and owners the manifest recorded at preload.
It then gets the segments that hold only files it could read at the source (read on the file,
search on the folders above it): a segment packs many files, so one that also holds a file the
uid could not read is not passed, and the reader's policy reads those files elsewhere (another
node over TCP, where the token decides, or the source itself, where the source's own
permissions do).
`access = "open"`: every segment to every token holder.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from kspeedfs.format import auth, users
from kspeedfs.format.errors import AuthError, KSpeedError, NotFound, StaleDataset
from kspeedfs.format.localdata import DAMAGE_FILE
from kspeedfs.net import fdpass
from kspeedfs.node import fdsocket
from kspeedfs.node.store import SegmentStore
from kspeedfs.system.local_dataset import LocalDataset

log = logging.getLogger(__name__)


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def peer_groups(sock: socket.socket, uid: int, gid: int) -> list[int]:
    """The peer's groups as the kernel saw them at connect (its supplementary groups and its
    gid); where the kernel cannot say, the groups the user database gives uid."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        return [gid, *struct.unpack(f"{len(raw) // 4}I", raw)]
    except OSError:
        try:
            return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
        except KeyError:
            return [gid]


def passable_segments(ds: LocalDataset, uid: int, groups: list[int]) -> list[int] | None:
    """The held segments uid may have (None: the dataset's root does not let it in)."""
    m = ds.manifest
    if not (m.permits(uid, groups, 4)[0] and m.permits(uid, groups, 1)[0]):
        return None
    blocked = m.segments_holding(~m.readable_files(uid, groups))
    return [seg for seg in sorted(ds.held) if not blocked[seg]]


class FdServer:
    def __init__(
        self,
        store: SegmentStore,
        path: Path,
        access: str,
        timeout: float,
        known: users.UsersFile,
    ):
        self.store = store
        self.users = known
        self.path = path
        self.access = access
        self.timeout = timeout
        self.token = ""
        self._served = {"attached": 0, "refused": 0}
        self._count = threading.Lock()  # the pool's threads count alike
        self._listener: fdsocket.LocalListener | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound
        self._made: list[Path] = []

    @property
    def stats(self) -> dict[str, int]:
        listener = self._listener.stats if self._listener is not None else {}
        return {**self._served, **listener}

    def start(self, token: str) -> None:
        """Bind the socket and serve it; InvalidArgument (one line) when its path is held by
        another uid or lies where others could bind it first."""
        self.token = token
        folder = Path(os.path.abspath(self.path.parent))
        # The folders the bind makes (SHM_DIR.run by default) go again at close when empty.
        self._made = [p for p in [folder, *folder.parents] if not os.path.lexists(p)]
        sock = fdsocket.bind(self.path)
        st = os.stat(self.path)
        self._bound = (st.st_dev, st.st_ino)
        self._listener = fdsocket.LocalListener(sock, self._serve, self.timeout, self.greeting)
        log.info("passing segment descriptors on %s (access %s)", self.path, self.access)

    def close(self) -> None:
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._bound:
                os.unlink(self.path)
        except OSError:
            pass
        for folder in self._made:  # deepest first; one that holds anything stays
            try:
                os.rmdir(folder)
            except OSError:
                break

    def greeting(self) -> dict[str, Any]:
        try:
            realm = self.users.realm()
        except KSpeedError as e:  # a damaged users file: token holders are still served
            log.warning("%s", e)
            realm = None
        return {"realm": realm} if realm else {}

    def _serve(self, peer: fdsocket.Peer, msg: dict[str, Any]) -> None:
        try:
            self._answer(peer, msg)
        except (OSError, KSpeedError) as e:
            with self._count:
                self._served["refused"] += 1
            log.info("local reader refused: %s", e)

    def _answer(self, peer: fdsocket.Peer, msg: dict[str, Any]) -> None:
        conn, uid = peer.sock, peer.uid
        try:
            role, proof = users.authenticate(
                self.token, self.users, auth.FD_SOCKET, peer.nonce, msg
            )
            ds, segs = self._dataset(
                str(msg.get("name", "")),
                str(msg.get("uuid", "")),
                uid,
                peer_groups(conn, uid, peer.gid),
            )
        except KSpeedError as e:
            fdpass.refuse(conn, e)
            raise
        fds = self._open_all(ds, segs)
        damage = _open_damage_table(ds)
        head = {"segments": len(fds) - 1, "mac": proof, "damage": damage >= 0}
        try:
            fdpass.send(conn, head, fds[:1] + ([damage] if damage >= 0 else []))
            for k in range(0, len(segs), fdpass.FDS_PER_MESSAGE):
                part = segs[k : k + fdpass.FDS_PER_MESSAGE]
                fdpass.send(conn, {"segs": part}, fds[1 + k : 1 + k + len(part)])
        finally:
            for fd in fds + ([damage] if damage >= 0 else []):
                os.close(fd)
        with self._count:
            self._served["attached"] += 1
        log.debug(
            "passed %s to uid %d (%s role): %d of %d held segments",
            ds.path.name, uid, role, len(segs), len(ds.held),
        )  # fmt: skip

    def _dataset(
        self, name: str, uuid: str, uid: int, groups: list[int]
    ) -> tuple[LocalDataset, list[int]]:
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r} on this node")
        if record.uuid != uuid:
            raise StaleDataset(f"dataset {name!r} is another instance than the one asked for")
        if record.lifetime == "readthrough":
            raise NotFound(f"{name!r} is read-through: its segments come and go, read over TCP")
        ds = self.store.open(name)
        if self.access != "source":
            return ds, sorted(ds.held)
        segs = passable_segments(ds, uid, groups)
        if segs is None:
            raise AuthError(f"uid {uid} may not read the source of {name!r} ({record.source})")
        return ds, segs

    def _open_all(self, ds: LocalDataset, segs: list[int]) -> list[int]:
        """The manifest's fd, then each of segs', in order."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fds = [os.open(ds.manifest.file, flags)]
        try:
            for seg in segs:
                fds.append(ds.open_segment(seg))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds


def _open_damage_table(ds: LocalDataset) -> int:
    """A read-only descriptor of the instance's damage news (system/damage.py; -1: none)."""
    try:
        return os.open(ds.path / DAMAGE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
