"""The node daemon: a trio TCP server over the segment store (preload, list, read, unload)."""

from __future__ import annotations

import base64
import functools
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from . import auth, protocol
from .client import SCAN_TIMEOUT, NodeClient
from .config import Settings
from .errors import AlreadyExists, AuthError, InvalidArgument, KSpeedError, NotFound, ProtocolError
from .leases import LeaseTable
from .loader import Progress
from .names import validate_name
from .notify import notify, watchdog_interval
from .preload import Plan, Stager, coordinate, plan_preload, start_stages
from .protocol import MsgType
from .rdma.server import RdmaService
from .readthrough import ReadThroughCache
from .store import SegmentStore
from .units import format_size, parse_address

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
MANIFEST_PIECE = 4 * 1024 * 1024
FAILED_PRELOAD_KEPT_S = 600.0
# Small pieces are joined before sending: one copy is cheaper than one syscall each.
COALESCE_BELOW = 256 * 1024

ADMIN_OPS = frozenset(
    {
        "preload",
        "unload",
        "unload_local",
        "shutdown",
        "stage",
        "stage_status",
        "stage_result",
        "stage_manifest",
        "stage_put",
        "stage_done",
        "commit",
        "abort",
        "register_source",
        "refresh",
    }
)


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
    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = SegmentStore(settings.shm_dir, settings.memory_budget())
        self.loading: dict[str, Progress] = {}
        self.failed_at: dict[str, float] = {}
        self.started = time.time()
        self.token = ""
        self.port = settings.listen.port
        self.stats = {"connections": 0, "reads": 0, "read_bytes": 0, "refused": 0}
        self._nursery: trio.Nursery | None = None
        self.members = cluster_members(settings)
        self.stager = Stager(self.store, self.address)
        self.leases = LeaseTable(settings.lease_ttl)
        self._ops: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "ping": self.op_ping,
            "status": self.op_status,
            "list": self.op_list,
            "preload": self.op_preload,
            "progress": self.op_progress,
            "manifest": self.op_manifest,
            "lease_acquire": self.op_lease_acquire,
            "lease_renew": self.op_lease_renew,
            "lease_release": self.op_lease_release,
            "unload": self.op_unload,
            "unload_local": self.op_unload_local,
            "stage": self.stager.op_stage,
            "stage_status": self.stager.op_stage_status,
            "stage_result": self.stager.op_stage_result,
            "stage_manifest": self.stager.op_stage_manifest,
            "stage_put": self.stager.op_stage_put,
            "stage_done": self.stager.op_stage_done,
            "commit": self.stager.op_commit,
            "abort": self.stager.op_abort,
            "shutdown": self.op_shutdown,
        }
        self.rdma = RdmaService.start(settings)
        self.rdma.attach(self)
        self.cache = ReadThroughCache(self)  # read-through datasets: fill, evict, spill
        self._ops.update(self.cache.ops())

    @property
    def address(self) -> str:
        return f"{self.settings.listen.host}:{self.port}"

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        self.token = auth.ensure_token(self.settings.token_file)
        await trio.to_thread.run_sync(self.store.recover, self.settings.verify_on_start)
        await trio.to_thread.run_sync(self.cache.recover)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.stager.nursery = nursery
            nursery.start_soon(self.stager.expire_idle)
            nursery.start_soon(self._expire_leases)
            await nursery.start(self.cache.run)
            listen = self.settings.listen
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle, listen.port, host=listen.host)
            )
            self.port = listeners[0].socket.getsockname()[1]
            log.info(
                "serving on %s: %d datasets, %s of %s budget used, shm %s",
                self.address,
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
                self._cancel_loads()
                nursery.cancel_scope.cancel()

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1")
            await trio.sleep(interval)

    def _cancel_loads(self) -> None:
        for progress in self.loading.values():
            progress.cancel.set()

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.stats["connections"] += 1
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
        nonce = secrets.token_bytes(32)
        await conn.send_json(
            MsgType.HELLO,
            0,
            {"version": protocol.VERSION, "node": self.address, "nonce": nonce.hex()},
        )
        with trio.move_on_after(HANDSHAKE_TIMEOUT):
            frame = await conn.receive()
            if frame is None:
                return None
            if frame.type != MsgType.AUTH:
                self.stats["refused"] += 1
                await conn.send_error(frame.request_id, AuthError("authenticate first"))
                return None
            msg = frame.json()
            role = msg.get("role")
            if not auth.verify(self.token, nonce, str(role), msg.get("mac", "")):
                self.stats["refused"] += 1
                log.warning("refused a client with a wrong token (role %r)", str(role)[:16])
                await conn.send_error(
                    frame.request_id, AuthError("authentication refused: wrong cluster token")
                )
                return None
            await conn.send_json(MsgType.RESPONSE, frame.request_id, {"role": role})
            conn.decoder.max_payload = protocol.MAX_CONTROL_PAYLOAD
            return str(role)
        return None

    async def _serve(self, conn: Connection, role: str) -> None:
        while True:
            frame = await conn.receive()
            if frame is None:
                return
            try:
                if frame.type == MsgType.REQUEST:
                    msg = frame.json()
                    op = msg.get("op")
                    handler = self._ops.get(op) if isinstance(op, str) else None
                    if handler is None:
                        raise InvalidArgument(f"unknown operation {op!r}")
                    if op in ADMIN_OPS and role != "admin":
                        raise AuthError(f"{op} needs the admin role; this client has {role}")
                    result = await handler(msg)
                    await conn.send_json(MsgType.RESPONSE, frame.request_id, result)
                elif frame.type == MsgType.READ:
                    await self._read(conn, frame)
                else:
                    raise ProtocolError(f"unexpected message type {frame.type.name}")
            except ProtocolError as e:
                await conn.send_error(frame.request_id, e)
                raise
            except KSpeedError as e:
                await conn.send_error(frame.request_id, e)
            except (KeyError, TypeError, ValueError) as e:
                # A request missing a field or with one of the wrong type: refuse it, stay up.
                await conn.send_error(
                    frame.request_id, InvalidArgument(f"malformed request: {e!r}")
                )

    async def _read(self, conn: Connection, frame: protocol.Frame) -> None:
        name, ranges = protocol.decode_read(frame.payload)
        ds = self.store.open(name)
        views = [ds.view(seg, off, n) for seg, off, n in ranges]
        total = sum(len(v) for v in views)
        self.stats["reads"] += 1
        self.stats["read_bytes"] += total
        header = protocol.encode_header(MsgType.DATA, frame.request_id, total)
        if total < COALESCE_BELOW:
            await conn.stream.send_all(b"".join([header, *views]))
        else:
            await conn.stream.send_all(header)
            for v in views:
                await _send_direct(conn.stream, v)

    async def op_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"node": self.address, "version": protocol.VERSION}

    async def op_status(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {
            "node": self.address,
            "pid": os.getpid(),
            "shm_dir": str(self.settings.shm_dir),
            "budget": self.store.budget,
            "used": self.store.used(),
            "datasets": len(self.store.datasets),
            "loading": sorted(n for n, p in self.loading.items() if p.state == "loading"),
            "segments": sum(len(os.listdir(r.path / "seg")) for r in self.store.datasets.values()),
            "uptime": time.time() - self.started,
            "stats": dict(self.stats),
            "transport": self.rdma.label,
            "rdma": self.rdma.status(),
            "leases": self.leases.total(),
            "cache": self.cache.status(),
            "loaded": dict(self.stager.loaded),
            "members": self.members,
            "held": {
                r.name: {"held": r.held, "segments": r.segments}
                for r in self.store.datasets.values()
            },
        }

    async def op_list(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._expire_failed()
        out = [
            {**r.to_wire(), "leases": self.leases.count(r.name)}
            for r in self.store.datasets.values()
        ]
        for name, p in self.loading.items():
            out.append({"name": name, **p.to_wire()})
        return {"node": self.address, "datasets": sorted(out, key=lambda d: d["name"])}

    def _expire_failed(self) -> None:
        now = time.monotonic()
        for name, when in list(self.failed_at.items()):
            if now - when > FAILED_PRELOAD_KEPT_S:
                self.failed_at.pop(name)
                self.loading.pop(name, None)

    async def op_preload(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Coordinate a preload over the live members (this node included)."""
        name = validate_name(msg.get("name", ""))
        if name in self.store.datasets:
            raise AlreadyExists(f"dataset {name!r} is already loaded")
        current = self.loading.get(name)
        if current is not None and current.state != "failed":
            raise AlreadyExists(f"dataset {name!r} is already loading")
        progress = Progress(state="scanning", source=str(msg.get("source", "")))
        self.loading[name] = progress
        self.failed_at.pop(name, None)
        try:
            live = await self.live_members()
            plan = await plan_preload(msg, self.settings.segment_size, live)
            self.stager.planned[plan.uuid] = plan.tree
            try:
                pushed = await start_stages(plan, self.call)
            finally:
                self.stager.planned.pop(plan.uuid, None)
        except BaseException:
            self.loading.pop(name, None)
            raise
        progress.state = "loading"
        progress.files_total, progress.bytes_total = plan.tree.file_count, plan.tree.data_bytes
        assert self._nursery is not None
        self._nursery.start_soon(self._coordinate, plan, progress, pushed)
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

    async def _coordinate(self, plan: Plan, progress: Progress, pushed: set[str]) -> None:
        try:
            await coordinate(plan, self.call, progress, self.store.staging_dir, pushed)
            progress.state = "ready"
            self.loading.pop(plan.name, None)
            elapsed = time.monotonic() - progress.started
            log.info(
                "dataset %s ready: %s in %.1fs (%.0f MB/s)",
                plan.name,
                format_size(plan.tree.data_bytes),
                elapsed,
                plan.tree.data_bytes / 1e6 / max(elapsed, 1e-9),
            )
        except BaseException as e:
            progress.state = "failed"
            progress.error = str(e) if isinstance(e, KSpeedError) else f"{type(e).__name__}: {e}"
            if isinstance(e, BaseExceptionGroup):
                progress.error = "; ".join(str(x) for x in e.exceptions)
            self.failed_at[plan.name] = time.monotonic()
            log.error("preload of %s failed: %s", plan.name, progress.error)
            if not isinstance(e, Exception):
                raise

    async def call(self, member: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run an op on a member: directly when it is this node, else over TCP."""
        if member == self.address:
            return await self._ops[op](dict(args, op=op))
        return await trio.to_thread.run_sync(self._remote_call, member, op, args)

    def _remote_call(self, member: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        with NodeClient(
            parse_address(member), self.settings.token_file, self.settings.timeout
        ) as c:
            slow = op in ("stage", "preload")
            return c.request(op, answer_within=SCAN_TIMEOUT if slow else None, **args)

    async def live_members(self) -> list[str]:
        live = []
        for member in self.members:
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
        offset = int(msg.get("offset", 0))
        path = record.path / "manifest.ksm"
        total = path.stat().st_size
        # In pieces of MANIFEST_PIECE: a large manifest is far over one control frame.
        length = max(0, min(int(msg.get("length", MANIFEST_PIECE)), MANIFEST_PIECE, total - offset))

        def read_piece() -> bytes:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)

        data = await trio.to_thread.run_sync(read_piece)
        return {
            "name": name,
            "uuid": record.uuid,
            "offset": offset,
            "total": total,
            "data": base64.b64encode(data).decode(),
        }

    async def op_progress(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        progress = self.loading.get(name)
        if progress is not None:
            return progress.to_wire()
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
        return {
            "state": "ready",
            "source": record.source,
            "files_total": record.files,
            "bytes_total": record.bytes,
            "files_done": record.files,
            "bytes_done": record.bytes,
            "elapsed": 0.0,
            "error": "",
        }

    async def op_unload(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Unload everywhere: here and on every other member that holds part of it."""
        name = validate_name(msg.get("name", ""))
        progress = self.loading.get(name)
        if progress is not None and progress.state == "failed":
            self.loading.pop(name)
            return {"name": name, "state": "forgotten"}
        if progress is not None:
            progress.cancel.set()
            return {"name": name, "state": "cancelled"}
        record = self.store.datasets.get(name)
        if record is None:
            raise NotFound(f"no dataset named {name!r}")
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
        log.info("unloaded %s", name)
        return {"name": name, "state": "unloaded"}

    async def op_lease_acquire(self, msg: dict[str, Any]) -> dict[str, Any]:
        name = validate_name(msg.get("name", ""))
        if name not in self.store.datasets:
            raise NotFound(f"no dataset named {name!r}")
        lease = self.leases.acquire(name, str(msg.get("holder", "")))
        count = self.leases.count(name)
        log.info("lease on %s taken by %s (%d held)", name, lease.holder, count)
        return {**lease.to_wire(self.leases.clock()), "ttl": self.leases.ttl, "leases": count}

    async def op_lease_renew(self, msg: dict[str, Any]) -> dict[str, Any]:
        lease = self.leases.renew(str(msg.get("lease", "")))
        return lease.to_wire(self.leases.clock())

    async def op_lease_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        lease = self.leases.release(str(msg.get("lease", "")))
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
    reads (measured with bench/bench_cluster.py)."""
    if not isinstance(stream, trio.SocketStream):
        await stream.send_all(data)
        return
    sock = stream.socket
    while data:
        try:
            data = data[os.write(sock.fileno(), data) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
    await trio.lowlevel.checkpoint()


def run_node(settings: Settings) -> None:
    server = NodeServer(settings)
    trio.run(server.run)
