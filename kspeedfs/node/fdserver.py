"""The node's local Unix socket: hands segment descriptors to authenticated local readers.

Runs in its own threads (a blocking accept loop, one short-lived thread per reader with a
timeout), beside the trio server: the work is a few syscalls per reader, once per process.
Who gets a dataset's descriptors: a client that proves a token (any role) and, with
`access = "source"`, whose uid the source's root folder lets in (r-x for it, its groups, or
others), so that the fast path never widens what the source allows at its root.
"""

from __future__ import annotations

import logging
import os
import pwd
import secrets
import socket
import stat
import threading
from pathlib import Path

from kspeedfs.format.errors import AuthError, KSpeedError, NotFound, StaleDataset
from kspeedfs.format.localdata import LocalDataset
from kspeedfs.net import fdpass
from kspeedfs.node.store import SegmentStore
from kspeedfs.sources.source import is_url

log = logging.getLogger(__name__)

TIMEOUT = 10.0


def may_read_root(source: str, uid: int, gid: int) -> bool:
    """Whether uid (with its groups) may list and enter the source's root folder."""
    if uid == 0 or is_url(source):
        return True
    try:
        st = os.stat(source)
    except OSError:
        return False
    try:
        groups = set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except KeyError:
        groups = {gid}
    if st.st_uid == uid:
        need = stat.S_IRUSR | stat.S_IXUSR
    elif st.st_gid in groups:
        need = stat.S_IRGRP | stat.S_IXGRP
    else:
        need = stat.S_IROTH | stat.S_IXOTH
    return st.st_mode & need == need


class FdServer:
    def __init__(self, store: SegmentStore, path: Path, access: str):
        self.store = store
        self.path = path
        self.access = access
        self.token = ""
        self.stats = {"attached": 0, "refused": 0}
        self._sock: socket.socket | None = None

    def start(self, token: str) -> None:
        """Bind the socket (replacing a stale one of ours) and serve in a daemon thread; a path
        held by someone else is logged and fd passing stays off."""
        self.token = token
        try:
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(os.fspath(self.path))
            os.chmod(self.path, 0o666)  # anyone may ask; only a token gets an answer
            sock.listen(64)
        except OSError as e:
            sock.close()
            log.error("no local fd passing: cannot listen on %s: %s", self.path, e)
            return
        self._sock = sock
        threading.Thread(target=self._accept, name="fdserver", daemon=True).start()
        log.info("passing segment descriptors on %s (access %s)", self.path, self.access)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _accept(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        try:
            with conn:
                self._answer(conn)
        except (OSError, KSpeedError) as e:
            self.stats["refused"] += 1
            log.info("local reader refused: %s", e)
        except Exception:
            log.exception("unexpected error on the local socket")

    def _answer(self, conn: socket.socket) -> None:
        _pid, uid, gid = fdpass.peer_credentials(conn)
        nonce = secrets.token_bytes(32)
        fdpass.send(conn, {"nonce": nonce.hex()})
        msg, _ = fdpass.receive(conn)
        try:
            role = fdpass.check_auth(self.token, nonce, msg)
            ds = self._dataset(str(msg.get("name", "")), str(msg.get("uuid", "")), uid, gid)
        except KSpeedError as e:
            fdpass.refuse(conn, e)
            raise
        fds = self._open_all(ds)
        try:
            fdpass.send(conn, {"segments": len(fds) - 1}, fds[:1])
            segs = sorted(ds.held)
            for k in range(0, len(segs), fdpass.FDS_PER_MESSAGE):
                part = segs[k : k + fdpass.FDS_PER_MESSAGE]
                fdpass.send(conn, {"segs": part}, fds[1 + k : 1 + k + len(part)])
        finally:
            for fd in fds:
                os.close(fd)
        self.stats["attached"] += 1
        log.debug("passed %s to uid %d (%s role)", ds.path.name, uid, role)

    def _dataset(self, name: str, uuid: str, uid: int, gid: int) -> LocalDataset:
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r} on this node")
        if record.uuid != uuid:
            raise StaleDataset(f"dataset {name!r} is another instance than the one asked for")
        if record.lifetime == "readthrough":
            raise NotFound(f"{name!r} is read-through: its segments come and go, read over TCP")
        if self.access == "source" and not may_read_root(record.source, uid, gid):
            raise AuthError(f"uid {uid} may not read the source of {name!r} ({record.source})")
        return self.store.open(name)

    def _open_all(self, ds: LocalDataset) -> list[int]:
        """The manifest's fd, then each held segment's, in order."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fds = [os.open(ds.manifest.file, flags)]
        try:
            for seg in sorted(ds.held):
                fds.append(ds._open_segment(seg))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds
