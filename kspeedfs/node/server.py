"""The node daemon's listener: the handshake, the dispatch of ops and the read path over a Node
(node.root), whose parts answer the ops."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from typing import Any

import trio

from kspeedfs.format import auth, protocol, users
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import Ping, Pong, Shutdown, Stopping
from kspeedfs.format.errors import (
    AuthError,
    InvalidArgument,
    KSpeedError,
    ProtocolError,
    StaleDataset,
)
from kspeedfs.format.protocol import MsgType
from kspeedfs.format.tls import server_context
from kspeedfs.format.units import format_size
from kspeedfs.net import secure
from kspeedfs.net.connection import tune
from kspeedfs.node import sourceio
from kspeedfs.node.framing import Connection, peer_of, response
from kspeedfs.node.ops import ADMIN, READ, answering, caller_role, refusal
from kspeedfs.node.root import Node, RdmaFactory
from kspeedfs.system.memory import return_large_buffers
from kspeedfs.system.notify import notify, watchdog_interval

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
# Small pieces are joined before sending: one copy is cheaper than one syscall each.
COALESCE_BELOW = 256 * 1024
TLS_PIECE = 256 * 1024
Range = tuple[int, int, int]  # segment, offset, length


class NodeServer:
    """The listener over a Node: the handshake, the dispatch of its ops, the read path."""

    def __init__(self, settings: Settings, rdma: RdmaFactory | None = None):
        self.node = Node(settings, rdma)
        self.settings = settings
        node = self.node
        self.ops, self.store, self.rdma, self.cache = node.ops, node.store, node.rdma, node.cache
        self.token, self.users, self.fds, self.stats = node.token, node.users, node.fds, node.stats
        self.tls = server_context(settings)  # None: plain TCP
        self._stop = trio.Event()  # a shutdown asked for by an admin
        self.ops.add(Ping, self.op_ping, READ)
        self.ops.add(Shutdown, self.op_shutdown, ADMIN)

    @property
    def address(self) -> str:
        return self.node.address

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.node.run)
            listen = self.settings.listen
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle, listen.port, host=listen.host)
            )
            for listener in listeners:
                with contextlib.suppress(OSError):
                    tune(listener.socket)  # accepted connections inherit the options
            self.node.port = listeners[0].socket.getsockname()[1]
            await nursery.start(self.node.join)  # the control plane, once the port is known
            store = self.store
            log.info(
                "serving on %s%s: %d datasets, %s of %s budget used, shm %s",
                self.address,
                " (mutual TLS)" if self.tls else "",
                len(store.datasets),
                format_size(store.budgets.used()),
                format_size(store.budgets.memory),
                self.settings.shm_dir,
            )
            nursery.start_soon(self._stop_when_asked, nursery.cancel_scope)
            interval = watchdog_interval()
            if interval:
                nursery.start_soon(self._watchdog, interval)
            notify("READY=1", f"STATUS=serving {len(store.datasets)} datasets on {self.address}")
            task_status.started(self.node.port)

    async def _stop_when_asked(self, scope: trio.CancelScope) -> None:
        """Stop on SIGTERM or SIGINT, or shortly after a shutdown op's answer went out."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def on_signal() -> None:
                    async for signum in signals:
                        log.info("received %s, shutting down", signal.Signals(signum).name)
                        sourceio.bound_the_stop()
                        self.node.cancel_loads()
                        nursery.cancel_scope.cancel()

                async def on_shutdown() -> None:
                    await self._stop.wait()
                    await trio.sleep(0.05)  # the answer first
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on_signal)
                nursery.start_soon(on_shutdown)
        notify("STOPPING=1")
        scope.cancel()

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1")
            await trio.sleep(interval)

    async def _handle(self, tcp: trio.SocketStream) -> None:
        self.stats["connections"] += 1
        with contextlib.suppress(OSError):
            tune(tcp.socket)
        stream: trio.abc.Stream = tcp
        if self.tls is not None:
            peer = peer_of(tcp)
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
                    await conn.stream.send_all(response(frame.request_id, result))
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

    async def op_shutdown(self, request: Shutdown) -> Stopping:
        self.node.cancel_loads()
        self._stop.set()
        return Stopping(node=self.address)


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


def run_node(settings: Settings) -> None:
    return_large_buffers()  # a dropped client's big frame must not stay resident
    server = NodeServer(settings)
    try:
        trio.run(server.run)
    except BaseExceptionGroup as group:
        # A refusal at start (a planted shm folder, a port in use) comes out of the owners'
        # nurseries as a group: the user gets its one line and exit code, not a traceback.
        leaf = refusal(group)
        if leaf is None:
            raise
        raise leaf from None
