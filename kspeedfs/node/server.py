"""The node daemon: a trio TCP server over the segment store (preload, list, read, unload)."""

from __future__ import annotations

import base64
import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import trio

from kspeedfs.format import auth, protocol, users
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import Ping, Pong
from kspeedfs.format.errors import (
    AlreadyExists,
    AuthError,
    InternalError,
    InvalidArgument,
    KSpeedError,
    NotFound,
    ProtocolError,
    StaleDataset,
)
from kspeedfs.format.names import validate_name
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.tls import client_context, server_context
from kspeedfs.format.units import format_size
from kspeedfs.net import secure
from kspeedfs.node import sourceio
from kspeedfs.node.controlplane import ControlPlane, loading_record
from kspeedfs.node.decoded import DecodedVariants
from kspeedfs.node.fdserver import FdServer
from kspeedfs.node.leases import LeaseTable
from kspeedfs.node.loads import LoadTable, failure_reason
from kspeedfs.node.meta import AddedIndexes
from kspeedfs.node.metrics import serve_metrics
from kspeedfs.node.ops import (
    ADMIN,
    JOB,
    READ,
    OpRegistry,
    answering,
    caller_role,
    int_field,
    one_line,
    refusal,
    str_field,
)
from kspeedfs.node.peers import PeerPool
from kspeedfs.node.preload import (
    LOAD_ATTEMPTS,
    Plan,
    Stager,
    coordinate,
    plan_preload,
    source_modified,
    start_stages,
)
from kspeedfs.node.readthrough import ReadThroughCache
from kspeedfs.node.store import SegmentStore
from kspeedfs.rdma.server import RdmaService
from kspeedfs.sources.loader import Progress
from kspeedfs.system.memory import return_large_buffers
from kspeedfs.system.notify import notify, watchdog_interval

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
MANIFEST_PIECE = 4 * 1024 * 1024
# Small pieces are joined before sending: one copy is cheaper than one syscall each.
COALESCE_BELOW = 256 * 1024
TLS_PIECE = 256 * 1024
Range = tuple[int, int, int]  # segment, offset, length


def cluster_members(settings: Settings) -> list[str]:
    """The node list this node places data over; just itself when it is not in the list."""
    me = str(settings.listen)
    members = [str(a) for a in settings.nodes]
    return members if me in members else [me]


class Connection:
    """Framing over one trio stream."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self.decoder = protocol.FrameDecoder(protocol.MAX_HANDSHAKE_PAYLOAD)

    async def receive(self) -> protocol.Frame | None:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            data = await self.stream.receive_some(256 * 1024)
            if not data:
                if self.decoder.pending:
                    raise ProtocolError("connection closed inside a frame")
                return None
            self.decoder.feed(data)

    async def send_json(self, msg_type: MsgType, request_id: int, obj: dict[str, Any]) -> None:
        await self.stream.send_all(protocol.encode_json(msg_type, request_id, obj))

    async def send_error(self, request_id: int, exc: KSpeedError) -> None:
        await self.send_json(
            MsgType.ERROR, request_id, {"kind": type(exc).__name__, "message": str(exc)}
        )


class NodeServer:
    def __init__(self, settings: Settings, rdma: RdmaService | None = None):
        self.settings = settings
        # First: a token file that is refused (open to others, not UTF-8) starts nothing.
        self.token = auth.ensure_token(settings.token_file)
        self.store = SegmentStore(settings.shm_dir, settings.memory_budget(), settings.group)
        self.loads = LoadTable()
        self.started = time.time()
        self.port = settings.listen.port
        self.stats = {"connections": 0, "reads": 0, "read_bytes": 0, "refused": 0}
        self._nursery: trio.Nursery | None = None
        self.members = cluster_members(settings)
        self.stager = Stager(self.store, self.address)
        self.leases = LeaseTable(settings.lease_ttl)
        self.tls = server_context(settings)  # None: plain TCP
        self.peers = PeerPool(settings.token_file, settings.timeout, tls=client_context(settings))
        self.rdma = rdma if rdma is not None else RdmaService.start(settings)
        self.rdma.follow(self.store)
        # read-through datasets: fill, evict, spill
        self.cache = ReadThroughCache(self.store, settings, self.address, self.loads)
        self.ops = OpRegistry()
        self._register_ops()
        self.stager.register_ops(self.ops)
        # decoded pixel variants
        self.decoded = DecodedVariants(self.store, self.address, settings.decode_workers)
        self.decoded.register_ops(self.ops, self.call)
        # meta indexes added to published datasets (`meta add`, a job's first use)
        self.meta_indexes = AddedIndexes(self.store, self.address)
        self.meta_indexes.register_ops(self.ops, self.call)
        self.rdma.register_ops(self.ops)
        self.cache.register_ops(self.ops)
        self.users = users.UsersFile(settings.users_path())
        self.fds = FdServer(
            self.store, settings.socket_path(), settings.access, settings.timeout, self.users
        )
        # Control plane (etcd): membership, catalog, healing; None with a static node list.
        self.control: ControlPlane | None = None
        if settings.etcd:
            self.control = ControlPlane(
                settings, self.store, self.call, self.op_unload_local, self.stager, self.cache
            )
            self.cache.use_cluster(self.control)  # read-through datasets span the members
            self.ops.add("rebalance", self.op_rebalance, ADMIN)
            self.ops.add("adopt", self.control.op_adopt, ADMIN)

    def _register_ops(self) -> None:
        # Leases are the job role's: a lease can unload a dataset when it ends. A lease's id
        # is a secret handed to the job that took it, so a job renews or ends only its own.
        for name, handler, role in (
            (Ping, self.op_ping, READ),
            ("status", self.op_status, READ),
            ("list", self.op_list, READ),
            ("progress", self.op_progress, READ),
            ("manifest", self.op_manifest, READ),
            ("lease_acquire", self.op_lease_acquire, JOB),
            ("lease_renew", self.op_lease_renew, JOB),
            ("lease_release", self.op_lease_release, JOB),
            ("preload", self.op_preload, JOB),  # a job's: under source_roots, leased
            ("unload", self.op_unload, ADMIN),
            ("unload_local", self.op_unload_local, ADMIN),
            ("shutdown", self.op_shutdown, ADMIN),
        ):
            self.ops.add(name, handler, role)

    @property
    def address(self) -> str:
        return f"{self.settings.listen.host}:{self.port}"

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self.store.recover, self.settings.verify_on_start)
        await trio.to_thread.run_sync(self.cache.recover)
        self.fds.start(self.token)
        try:
            await self._serve_until_stopped(task_status)
        finally:
            self.fds.close()
            await self.peers.aclose()

    async def _serve_until_stopped(self, task_status: trio.TaskStatus[int]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.stager.run)
            nursery.start_soon(self._expire_leases)
            await nursery.start(self.cache.run)
            listen = self.settings.listen
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle, listen.port, host=listen.host)
            )
            self.port = listeners[0].socket.getsockname()[1]
            if self.control is not None:  # control plane: join once the port is known
                await nursery.start(self.control.run, self.address)
            if self.settings.metrics_listen:  # metrics: Prometheus /metrics, its own thread
                histograms = [self.cache.fill_seconds]
                if self.control is not None:
                    histograms.append(self.control.copy_seconds)
                serve_metrics(self.settings.metrics_listen, self._metrics_snapshot, histograms)
            log.info(
                "serving on %s%s: %d datasets, %s of %s budget used, shm %s",
                self.address,
                " (mutual TLS)" if self.tls else "",
                len(self.store.datasets),
                format_size(self.store.used()),
                format_size(self.store.budget),
                self.settings.shm_dir,
            )
            nursery.start_soon(self._watch_signals, nursery)
            interval = watchdog_interval()
            if interval:
                nursery.start_soon(self._watchdog, interval)
            notify(
                "READY=1", f"STATUS=serving {len(self.store.datasets)} datasets on {self.address}"
            )
            task_status.started(self.port)

    async def _watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("received %s, shutting down", signal.Signals(signum).name)
                notify("STOPPING=1")
                sourceio.bound_the_stop()
                self._cancel_loads()
                nursery.cancel_scope.cancel()

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1")
            await trio.sleep(interval)

    def _cancel_loads(self) -> None:
        self.loads.cancel_all()

    async def _handle(self, tcp: trio.SocketStream) -> None:
        self.stats["connections"] += 1
        stream: trio.abc.Stream = tcp
        if self.tls is not None:
            peer = _peer(tcp)
            try:
                stream = await secure.accept(tcp, self.tls, self.address, HANDSHAKE_TIMEOUT)
            except AuthError as e:
                self.stats["refused"] += 1
                log.warning("refused a connection from %s: %s", peer, e)
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await tcp.aclose()
                return
        conn = Connection(stream)
        rdma_peers = self.rdma.bind_connection()  # its queue pairs live as long as it does
        try:
            role = await self._handshake(conn)
            if role is None:
                return
            await self._serve(conn, role)
        except ProtocolError as e:
            log.warning("closing connection: %s", e)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except Exception:
            log.exception("unexpected error on a connection; closing it")
        finally:
            rdma_peers.close()
            with trio.move_on_after(1) as scope:
                scope.shield = True
                await stream.aclose()

    async def _handshake(self, conn: Connection) -> str | None:
        nonce = auth.new_nonce()
        channel = secure.channel(conn.stream)
        hello = {"version": protocol.VERSION, "node": self.address, "nonce": nonce.hex()}
        await conn.send_json(MsgType.HELLO, 0, {**hello, **self.fds.greeting()})
        with trio.move_on_after(HANDSHAKE_TIMEOUT):
            frame = await conn.receive()
            if frame is None:
                return None
            if frame.type != MsgType.AUTH:
                self.stats["refused"] += 1
                await conn.send_error(frame.request_id, AuthError("authenticate first"))
                return None
            try:
                msg = frame.json()
            except (ValueError, ProtocolError):
                msg = None
            try:
                role, proof = users.authenticate(
                    self.token, self.users, channel, nonce, msg if isinstance(msg, dict) else {}
                )
            except AuthError as e:
                self.stats["refused"] += 1
                who = msg.get("user", msg.get("role")) if isinstance(msg, dict) else None
                log.warning("refused a client (%s; it named %r)", e, str(who)[:64])
                await conn.send_error(frame.request_id, e)
                return None
            await conn.send_json(MsgType.RESPONSE, frame.request_id, {"role": role, "mac": proof})
            conn.decoder.max_payload = protocol.MAX_CONTROL_PAYLOAD
            return role
        return None

    async def _serve(self, conn: Connection, role: str) -> None:
        caller_role.set(role)  # this connection's task (and what it starts) runs as role
        while True:
            frame = await conn.receive()
            if frame is None:
                return
            # Every frame gets an answer. Only a frame that cannot be read (ProtocolError
            # here) ends the connection; a handler's failure of any kind, a ProtocolError of
            # its own calls to other members included, is an error reply (ops.answering).
            try:
                if frame.type == MsgType.REQUEST:
                    request: Any = frame.json()
                elif frame.type == MsgType.READ:
                    request = protocol.decode_read(frame.payload)
                else:
                    raise ProtocolError(f"unexpected message type {frame.type.name}")
            except ProtocolError as e:
                await conn.send_error(frame.request_id, e)
                raise
            try:
                if frame.type == MsgType.REQUEST:
                    result = await self.ops.dispatch(request, role)
                    await conn.stream.send_all(_response(frame.request_id, result))
                else:
                    await self._read(conn, frame.request_id, *request)
            except KSpeedError as e:
                if isinstance(e, (AuthError, InvalidArgument)):
                    self.stats["refused"] += 1
                await conn.send_error(frame.request_id, e)

    async def _read(
        self, conn: Connection, request_id: int, name: str, instance: str, ranges: list[Range]
    ) -> None:
        with answering(f"a read of {name}"):  # the sending below is the connection's
            ds = self.store.open(name)
            if ds.uuid != instance:
                raise StaleDataset(
                    f"dataset {name} on {self.address} is another instance than the one asked"
                    " for (unloaded and loaded again): not serving its bytes"
                )
            views = [ds.view(seg, off, n) for seg, off, n in ranges]
            if name in self.cache.datasets:  # read-through: a remote hit keeps it in the LRU
                self.cache.note_reads(name, [seg for seg, _off, _n in ranges])
        total = sum(len(v) for v in views)
        self.stats["reads"] += 1
        self.stats["read_bytes"] += total
        header = protocol.encode_header(MsgType.DATA, request_id, total)
        if total < COALESCE_BELOW:
            await conn.stream.send_all(b"".join([header, *views]))
        else:
            await conn.stream.send_all(header)
            for v in views:
                await _send_direct(conn.stream, v)

    async def op_ping(self, request: Ping) -> Pong:
        return Pong(self.address, protocol.VERSION)

    async def op_status(self, msg: dict[str, Any]) -> dict[str, Any]:
        folders = [r.path / "seg" for r in self.store.datasets.values()]
        segments = await trio.to_thread.run_sync(_count_files, folders)
        return {
            "node": self.address,
            "pid": os.getpid(),
            "shm_dir": str(self.settings.shm_dir),
            "budget": self.store.budget,
            "used": self.store.used(),
            "datasets": len(self.store.datasets),
            "loading": sorted(n for n, p in self.loads.items() if p.state == "loading"),
            "segments": segments,
            "uptime": time.time() - self.started,
            "stats": dict(self.stats),
            "local_socket": {"path": str(self.fds.path), **self.fds.stats},
            "transport": self.rdma.label,
            "rdma": self.rdma.status(),
            "leases": self.leases.total(),
            "cache": self.cache.status(),
            "loaded": dict(self.stager.loaded),
            "decoded": {r: self.decoded.local_status(r) for r in self.store.datasets},
            "members": self.control.members() if self.control is not None else self.members,
            "control": self.control.status() if self.control is not None else None,
            "peers": self.peers.statistics(),
            "held": {
                r.name: {"held": r.held, "segments": r.segments}
                for r in self.store.datasets.values()
            },
        }

    async def op_list(self, msg: dict[str, Any]) -> dict[str, Any]:
        out = [
            {
                **r.to_wire(),
                "leases": self.leases.count(r.name),
                "decoded": self.decoded.local_status(r.name),
                **self._placement(r.name, r.uuid),
            }
            for r in self.store.datasets.values()
        ]
        out.extend(self.loads.to_wire())
        return {"node": self.address, "datasets": sorted(out, key=lambda d: d["name"])}

    def _placement(self, name: str, uuid: str) -> dict[str, Any]:
        """Where an instance's segments are placed now, when the catalog says: the members of
        its last rebalance and the lost ones (a heal or a rebalance changes them after the
        load)."""
        entry = self.control.catalog.get(name) if self.control is not None else None
        if not entry or entry.get("uuid") != uuid:
            return {}
        return {"placed": entry.get("members", []), "lost": entry.get("lost", [])}

    async def op_preload(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Coordinate a preload over the live members (this node included)."""
        name = validate_name(msg.get("name", ""))
        if caller_role.get() != ADMIN:
            msg = self._job_preload(msg)
        if name in self.store.datasets:
            raise AlreadyExists(f"dataset {name!r} is already loaded")
        progress = self.loads.start(name, str(msg.get("source", "")))
        try:
            plan, pushed = await self._start_preload(msg)
        except BaseException:
            self.loads.finish(name)
            raise
        progress.state = "loading"
        progress.files_total, progress.bytes_total = plan.tree.file_count, plan.tree.data_bytes
        assert self._nursery is not None
        self._nursery.start_soon(self._coordinate, plan, progress, pushed, msg)
        log.info(
            "preloading %s from %s over %d nodes: %d files, %s",
            name,
            plan.source,
            len(plan.members),
            plan.tree.file_count,
            format_size(plan.tree.data_bytes),
        )
        return {
            "name": name,
            "files_total": plan.tree.file_count,
            "bytes_total": plan.tree.data_bytes,
            "nodes": plan.members,
        }

    async def _start_preload(self, msg: dict[str, Any]) -> tuple[Plan, set[str]]:
        """Scan and plan a preload, claim its name, start every member's stage."""
        claimed = ""  # control plane: the instance this preload claimed the name for
        try:
            live = await self.live_members()
            plan = await plan_preload(msg, self.settings.segment_size, live)
            if self.control is not None:  # control plane: one of two racing preloads wins
                await self.control.claim(loading_record(plan, self.address))
                claimed = plan.uuid
            with self.stager.scanned(plan.uuid, plan.tree):
                pushed = await start_stages(plan, self.call)
        except BaseException:
            if claimed:
                with trio.CancelScope(shield=True):
                    await self._forget_claim(plan.name, claimed)
            raise
        return plan, pushed

    def _job_preload(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A job's preload: its source must lie under one of `source_roots` (after resolving
        links, so a link out of a root does not count) and it lives only while leased."""
        source = str_field(msg, "source")
        if msg.get("lifetime", "leased") != "leased":
            raise AuthError("a job token preloads only with a lease (lifetime leased)")
        roots = [os.path.realpath(r) for r in self.settings.source_roots]
        if not roots:
            raise AuthError("this node allows no job preloads: `source_roots` is not set")
        real = os.path.realpath(source) if os.path.isabs(source) else ""
        if not real or not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
            raise AuthError(f"a job token may preload only under {', '.join(roots)}, not {source}")
        return {**msg, "source": real, "lifetime": "leased"}

    async def _coordinate(
        self, plan: Plan, progress: Progress, pushed: set[str], msg: dict[str, Any]
    ) -> None:
        decoded = msg.get("decoded")
        try:
            for attempt in range(1, LOAD_ATTEMPTS + 1):
                try:
                    await coordinate(plan, self.call, progress, self.store.staging_dir, pushed)
                    break
                except Exception as e:
                    if attempt == LOAD_ATTEMPTS or not source_modified(e):
                        raise
                    log.warning(
                        "preload of %s, attempt %d of %d: %s; loading it again",
                        plan.name,
                        attempt,
                        LOAD_ATTEMPTS,
                        failure_reason(e),
                    )
                if self.control is not None:
                    await self._forget_claim(plan.name, plan.uuid)
                plan, pushed = await self._start_preload(msg)
                progress.files_total = plan.tree.file_count
                progress.bytes_total = plan.tree.data_bytes
            if self.control is not None:  # control plane: visible to everyone, unleased
                await self.control.publish(plan.name, plan.uuid, {})
            progress.state = "ready"
            self.loads.finish(plan.name)
            elapsed = time.monotonic() - progress.started
            log.info(
                "dataset %s ready: %s in %.1fs (%.0f MB/s)",
                plan.name,
                format_size(plan.tree.data_bytes),
                elapsed,
                plan.tree.data_bytes / 1e6 / max(elapsed, 1e-9),
            )
            if decoded is not None:  # preload --decoded N: every member decodes its part
                await self.decoded.after_preload(plan.name, plan.uuid, decoded)
        except BaseException as e:
            unplanned = isinstance(e, Exception) and refusal(e) is None  # a bug: its traceback
            reason = self.loads.fail(plan.name, e)
            log.error("preload of %s failed: %s", plan.name, reason, exc_info=unplanned)
            if self.control is not None:
                with trio.CancelScope(shield=True):
                    await self._forget_claim(plan.name, plan.uuid)
            if not isinstance(e, Exception):
                raise

    async def call(self, member: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run an op on a member: directly when it is this node, else over a kept connection."""
        if member == self.address:  # answered as a remote member would answer it
            return await self.ops.call(op, dict(args, op=op))
        return await self.peers.call(member, op, args)

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Metrics: the figures a scrape reads (from the exporter's thread)."""
        return {
            "stats": dict(self.stats),
            "used": self.store.used(),
            "budget": self.store.budget,
            "leases": self.leases.total(),
            "datasets": {
                r.name: (r.stored, len(r.held)) for r in list(self.store.datasets.values())
            },
            "control": self.control.status() if self.control is not None else None,
            "cache": self.cache.status(),  # read-through: hits, fills, evictions by policy
            "dataset_leases": {n: self.leases.count(n) for n in list(self.store.datasets)},
        }

    async def _forget_claim(self, name: str, uuid: str) -> None:
        """Control plane: drop a failed preload's catalog record (its lease would, later)."""
        assert self.control is not None
        try:
            await self.control.forget(name, uuid)
        except KSpeedError as e:
            log.warning("could not remove %s from the catalog: %s", name, e)

    async def op_rebalance(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Control plane: place datasets over the members live now (one, or all)."""
        assert self.control is not None
        name = validate_name(msg["name"]) if msg.get("name") else None
        done = await self.control.rebalance(name)
        if name and not done:
            raise NotFound(f"no ready dataset named {name!r} in the catalog")
        return {"datasets": done, "members": self.control.members()}

    async def live_members(self) -> list[str]:
        live = []
        members = await self.control.members_now() if self.control is not None else self.members
        for member in members:
            try:
                await self.call(member, "ping", {})
                live.append(member)
            except KSpeedError as e:
                log.warning("node %s is down, placing data on the others: %s", member, e)
        return live

    async def op_manifest(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The manifest's bytes, for a client on a machine that holds no part of the dataset."""
        name = validate_name(msg.get("name", ""))
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        offset = int_field(msg, "offset", 0)
        path = record.path / "manifest.ksm"
        # In pieces of MANIFEST_PIECE: a large manifest is far over one control frame.
        asked = int_field(msg, "length", MANIFEST_PIECE)

        def read_piece() -> tuple[int, bytes]:
            with open(path, "rb") as f:
                total = os.fstat(f.fileno()).st_size
                f.seek(offset)
                return total, f.read(max(0, min(asked, MANIFEST_PIECE, total - offset)))

        try:
            total, data = await trio.to_thread.run_sync(read_piece)
        except FileNotFoundError:  # unloaded since it was looked up
            raise NotFound(f"dataset {name!r} was unloaded while its manifest was read") from None
        return {
            "name": name,
            "uuid": record.uuid,
            "offset": offset,
            "total": total,
            "data": base64.b64encode(data).decode(),
        }

    async def op_progress(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        progress = self.loads.get(name)
        if progress is not None:
            return progress.to_wire()
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        return record.to_wire()

    async def op_unload(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Unload everywhere: here and on every other member that holds part of it."""
        name = validate_name(msg.get("name", ""))
        progress = self.loads.get(name)
        if progress is not None and progress.state == "failed":
            self.loads.finish(name)
            return {"name": name, "state": "forgotten"}
        if progress is not None:
            progress.cancel.set()
            return {"name": name, "state": "cancelled"}
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        if self.control is not None:  # control plane: gone for everyone, even nodes now down
            await self.control.forget(name, record.uuid)
        for member in record.members:
            if member != self.address:
                try:
                    await self.call(member, "unload_local", {"name": name, "uuid": record.uuid})
                except KSpeedError as e:
                    log.warning("could not unload %s on %s: %s", name, member, e)
        await self.op_unload_local({"name": name, "uuid": record.uuid})
        return {"name": name, "state": "unloaded", "bytes": record.stored}

    async def op_unload_local(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        record = self.store.datasets.get(name)
        if record is None or (msg.get("uuid") and record.uuid != msg["uuid"]):
            return {"name": name, "state": "absent"}
        await trio.to_thread.run_sync(self.store.unload, name)
        self.leases.forget(name)  # they kept that instance; a reload must not count them
        log.info("unloaded %s", name)
        return {"name": name, "state": "unloaded"}

    async def op_lease_acquire(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        if msg.get("uuid") and msg["uuid"] != record.uuid:
            raise StaleDataset(f"dataset {name!r} was loaded again: the instance asked for is gone")
        lease = self.leases.acquire(name, record.uuid, str_field(msg, "holder"))
        count = self.leases.count(name)
        log.info("lease on %s taken by %s (%d held)", name, lease.holder, count)
        return {**lease.to_wire(self.leases.clock()), "ttl": self.leases.ttl, "leases": count}

    async def op_lease_renew(self, msg: dict[str, Any]) -> dict[str, Any]:
        lease = self.leases.renew(str_field(msg, "lease"))
        record = self.store.datasets.get(lease.name)
        if record is None or record.uuid != lease.instance:
            self.leases.release(lease.id)
            raise NotFound(f"the instance of {lease.name!r} this lease kept is gone")
        return lease.to_wire(self.leases.clock())

    async def op_lease_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        lease = self.leases.release(str_field(msg, "lease"))
        left = self.leases.count(lease.name)
        log.info("lease on %s released by %s (%d left)", lease.name, lease.holder, left)
        unloaded = False
        if not left:
            unloaded = await self._unload_unleased(lease.name, "its last lease was released")
        return {"name": lease.name, "leases": left, "unloaded": unloaded}

    def _lease_home(self, name: str) -> bool:
        # One node keeps a dataset's leases (the first it was placed over), so that only
        # that node decides to unload it.
        record = self.store.datasets.get(name)
        return record is None or not record.members or record.members[0] == self.address

    async def _expire_leases(self) -> None:
        """End leases that were not renewed (a crashed job) and leased datasets no one holds."""
        while True:
            await trio.sleep(min(1.0, self.leases.ttl / 4))
            try:
                reasons: dict[str, str] = {}
                for lease in self.leases.expire():
                    log.warning("lease on %s held by %s expired", lease.name, lease.holder)
                    reasons[lease.name] = "its last lease expired"
                leased = [
                    r.name
                    for r in self.store.datasets.values()
                    if r.lifetime == "leased" and self._lease_home(r.name)
                ]
                for name in self.leases.idle(leased):
                    reasons.setdefault(name, f"no lease on it for {self.leases.ttl:g}s")
                for name, why in sorted(reasons.items()):
                    await self._unload_unleased(name, why)
            except Exception:
                log.exception("lease expiry failed; trying again")

    async def _unload_unleased(self, name: str, why: str) -> bool:
        """Unload a leased dataset no lease holds any more; an offline one is never touched."""
        record = self.store.datasets.get(name)
        if record is None or record.lifetime != "leased" or not self.leases.begin_close(name):
            return False
        try:
            log.info("unloading %s: %s", name, why)
            await self.op_unload({"name": name})
        except KSpeedError as e:
            log.warning("could not unload %s: %s", name, e)
            return False
        finally:
            self.leases.forget(name)
        return True

    async def op_shutdown(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self._nursery is not None
        self._cancel_loads()
        self._nursery.start_soon(self._stop_after_reply, self._nursery)
        return {"node": self.address, "state": "stopping"}

    async def _stop_after_reply(self, nursery: trio.Nursery) -> None:
        await trio.sleep(0.05)
        notify("STOPPING=1")
        nursery.cancel_scope.cancel()


async def _send_direct(stream: trio.abc.Stream, data: memoryview) -> None:
    """Write the mapped bytes straight to the socket, waiting only while it is full. trio's
    send_all takes two scheduler passes per partial send: most of a node's user CPU on bulk
    reads (measured with bench/bench_cluster.py). Over TLS, in pieces: OpenSSL encrypts a piece
    that stays in cache at ~2.5x the rate of one 8 MiB write into its buffer."""
    if not isinstance(stream, trio.SocketStream):
        for start in range(0, len(data), TLS_PIECE):
            await stream.send_all(data[start : start + TLS_PIECE])
        return
    sock = stream.socket
    while data:
        try:
            data = data[os.write(sock.fileno(), data) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
    await trio.lowlevel.checkpoint()


def _response(request_id: int, result: dict[str, Any]) -> bytes:
    """The frame of an op's result; one the client could not take (not JSON, over a control
    frame) is an InternalError, answered in its place."""
    try:
        frame = protocol.encode_json(MsgType.RESPONSE, request_id, result)
    except (TypeError, ValueError) as e:  # the handler's fault, not the request's
        log.exception("an answer that is not JSON")
        raise InternalError(one_line(f"internal error: an answer that is not JSON: {e}")) from None
    if len(frame) - protocol.HEADER_SIZE > protocol.MAX_CONTROL_PAYLOAD:
        log.error("an answer of %d bytes is over a control frame", len(frame))
        raise InternalError(f"internal error: an answer of {len(frame)} bytes is over a frame")
    return frame


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "a peer gone already"
    return f"{host}:{port}"


def _count_files(folders: list[Path]) -> int:
    count = 0
    for folder in folders:
        try:
            count += len(os.listdir(folder))
        except FileNotFoundError:
            pass  # unloaded meanwhile
    return count


def run_node(settings: Settings) -> None:
    return_large_buffers()  # a dropped client's big frame must not stay resident
    server = NodeServer(settings)
    trio.run(server.run)
