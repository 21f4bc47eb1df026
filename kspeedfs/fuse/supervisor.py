"""The serving processes of one mount: each started on its clone of the fd, told of every
dataset change, restarted (on the same clone) when it dies, stopped with the mount.

The supervisor (the mount process) keeps each worker's fd open too, so that when a worker is
killed the requests it had read stay queued on that fd instead of failing; the kernel is then
asked to send them again (FUSE_NOTIFY_RESEND, kernel 6.9+), and another worker answers them.
Interrupts a worker cannot place (the request is another worker's) are passed to all others.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.readthrough import Touch
from kspeedfs.format.errors import KSpeedError, MountError
from kspeedfs.fuse.counters import SharedCounters
from kspeedfs.fuse.datasets import Change, DatasetList, MountedDataset
from kspeedfs.fuse.kernel import ROOT_INODE, FuseSession
from kspeedfs.fuse.worker import EXIT_DETACHED, MESSAGE_MAX
from kspeedfs.net.aconnection import AsyncNodeClient

log = logging.getLogger(__name__)

STOP_WAIT = 2.0  # seconds a worker has to end on SIGTERM before SIGKILL
QUICK_DEATH = 5.0  # a worker that dies sooner after its start is restarted after a pause


def default_workers() -> int:
    """The number of CPUs, at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


class Workers:
    """`count` worker processes serving `session`, fed from `datasets` (each refresh's change
    comes to `on_change`), each counting its requests in its row of `counters` (the
    session's)."""

    def __init__(
        self,
        session: FuseSession,
        datasets: DatasetList,
        settings: Settings,
        dataset: str | None,
        count: int,
        clients: list[AsyncNodeClient],
        counters: SharedCounters,
        fds: list[int] | None = None,
        before_change: Callable[[], None] = lambda: None,
        linger: float = 0.0,
    ):
        self.session = session
        # A clone of the session's fd per worker, kept across its restarts (and by mountd:
        # takeover.py), so that the requests a dead worker had read wait to be resent.
        self.fds = fds if fds is not None else [session.clone_fd() for _ in range(count)]
        self.datasets = datasets
        self.settings = settings
        self.dataset = dataset
        self.count = count
        self.clients = clients
        self.counters = counters
        self.before_change = before_change  # new slots: told to mountd before any worker
        # Seconds a worker serves on once this process is gone (mountd ends it once a new
        # mount process took the connection over: takeover.py); 0 without mountd.
        self.linger = linger
        self.finished = trio.Event()  # the mount is gone (a worker saw ENODEV)
        self.stopping = False
        self._links: dict[int, trio.MemorySendChannel[tuple[Any, ...]]] = {}
        self._procs: dict[int, trio.Process] = {}
        self._invalidations = 0
        self._changes = 0  # dataset changes sent to the workers
        self._applied: dict[int, int] = {}  # worker -> the last change it applied
        # (change, names under the root to forget, invalidation number) waiting for workers
        self._to_forget: list[tuple[int, list[bytes], int]] = []
        self._refresh_queued = False
        self._nursery: trio.Nursery | None = None
        self._token = trio.lowlevel.current_trio_token()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker, report started once all serve, then keep them running."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            async with trio.open_nursery() as starting:  # in parallel: each takes a while
                for i in range(self.count):
                    starting.start_soon(nursery.start, self._keep_running, i)
            task_status.started()

    # ---- dataset changes, to every worker

    def on_change(self, change: Change) -> None:
        """Tell every worker; once all of them serve the change, make the kernel forget the
        dropped instances' names. Adds go first: a worker's add of a new instance replaces the
        old one of that name in one step, so a dataset loaded again never goes missing in
        between (a lookup meanwhile found no such name; at a single dataset's root, EIO). The
        kernel forgets only after every worker has switched: a lookup answered in between
        with the old instance would stay cached (a day), its reads failing with ESTALE."""
        self._changes += 1
        if change.added:
            self.before_change()
        if change.forget:
            self._invalidations += 1
            self._to_forget.append((self._changes, change.forget, self._invalidations))
        for mounted in change.added:
            self._broadcast(_added(mounted))
        for mounted in change.dropped:
            self._broadcast(("drop", mounted.slot, self._invalidations))
        self._broadcast(("refreshed", change.node_answers, change.mounted_at_ns, self._changes))
        self._forget_applied()

    def _forget_applied(self) -> None:
        """The invalidations of the changes every worker has applied."""
        while self._to_forget and all(
            self._applied.get(index, 0) >= self._to_forget[0][0] for index in self._links
        ):
            _change, names, seq = self._to_forget.pop(0)
            for name in names:
                self.session.invalidate_entry_async(ROOT_INODE, name)
            self.session.after_invalidations(
                functools.partial(self._from_thread, ("invalidated", seq))
            )

    def _from_thread(self, message: tuple[Any, ...]) -> None:
        try:
            self._token.run_sync_soon(self._broadcast, message)
        except trio.RunFinishedError:
            pass

    def _broadcast(self, message: tuple[Any, ...], but: int = -1) -> None:
        for index, channel in list(self._links.items()):
            if index != but:
                try:
                    channel.send_nowait(message)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # that worker is ending

    def _snapshot(self, index: int) -> list[tuple[Any, ...]]:
        """What a new worker is told first: every dataset, then "refreshed"."""
        d = self.datasets
        hello = ("hello", self.settings, self.dataset, index, self.count, self.linger)
        adds = [_added(m) for m in d.by_slot.values()]
        return [hello, *adds, ("refreshed", d.node_answers, d.mounted_at_ns, self._changes)]

    # ---- one worker slot

    async def _keep_running(
        self, index: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        fd = self.fds[index]
        while not self.stopping:
            began = time.monotonic()
            ready, code = await self._run_once(index, fd, None if started else task_status)
            started = started or ready
            if self.stopping or code == EXIT_DETACHED:
                if not started:
                    # Unmounted while this worker was starting: nothing is left to serve, so
                    # the start ends here quietly rather than as "failed to start".
                    task_status.started()
                if not self.stopping:
                    log.info("worker %d: the mount is gone", index)
                    self.finished.set()
                return
            if not started:
                raise MountError(f"the serving process failed to start ({_describe(code)})")
            log.warning("worker %d %s: restarting it", index, _describe(code))
            if self.settings.fuse_uring:
                log.warning(
                    "worker %d served through io_uring: a request it held gets no answer "
                    "until the mount ends (docs/mounts.md)", index,
                )  # fmt: skip
            # Its fd is still open here: the requests it had read wait there, to be resent.
            self.session.resend_pending()
            if time.monotonic() - began < QUICK_DEATH:
                await trio.sleep(1.0)

    async def _run_once(
        self, index: int, fd: int, task_status: trio.TaskStatus[None] | None
    ) -> tuple[bool, int]:
        """One worker process, from start to exit: (whether it became ready, its exit code)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        args = [
            sys.executable, "-m", "kspeedfs.fuse.worker", "--fuse-fd", str(fd),
            "--control-fd", str(theirs.fileno()), "--counters-fd", str(self.counters.fd),
        ]  # fmt: skip
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            args.append("--verbose")
        try:
            proc = await trio.lowlevel.open_process(
                args,
                pass_fds=(fd, theirs.fileno(), self.counters.fd, *self.session.inherited_fds()),
            )
        finally:
            theirs.close()
        self._procs[index] = proc
        send, receive = trio.open_memory_channel[tuple[Any, ...]](math.inf)
        for message in self._snapshot(index):
            send.send_nowait(message)
        self._links[index] = send
        sock = trio.socket.from_stdlib_socket(ours)
        ready = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_loop, sock, receive)
                nursery.start_soon(self._receive_loop, sock, index, ready)
                nursery.start_soon(self._wait_exit, proc, nursery.cancel_scope)
                await ready.wait()
                if task_status is not None:
                    task_status.started()
        finally:
            del self._links[index]
            self._applied.pop(index, None)
            self._forget_applied()  # no longer waiting for this one
            self._procs.pop(index, None)
            send.close()
            sock.close()
            if proc.returncode is None:  # the mount is stopping (or a worker went silent)
                proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()  # reaped here: no zombie is left to an init that may not
        assert proc.returncode is not None
        return ready.is_set(), proc.returncode

    async def _wait_exit(self, proc: trio.Process, scope: trio.CancelScope) -> None:
        await proc.wait()
        scope.cancel()

    async def _send_loop(
        self, sock: trio.socket.SocketType, receive: trio.MemoryReceiveChannel[tuple[Any, ...]]
    ) -> None:
        try:
            async for message in receive:
                await sock.send(pickle.dumps(message))
        except OSError:
            pass  # the worker is gone; _wait_exit ends the rest

    async def _receive_loop(
        self, sock: trio.socket.SocketType, index: int, ready: trio.Event
    ) -> None:
        assert self._nursery is not None
        while True:
            try:
                data = await sock.recv(MESSAGE_MAX)
            except OSError:
                return
            if not data:
                return
            message = pickle.loads(data)
            kind = message[0]
            if kind == "ready":
                ready.set()
            elif kind == "refresh":
                if not self._refresh_queued:
                    self._refresh_queued = True
                    self._nursery.start_soon(self._refresh)
            elif kind == "applied":
                self._applied[index] = message[1]
                self._forget_applied()
            elif kind == "interrupt":
                self._broadcast(message, but=index)
            elif kind == "touch":
                self._nursery.start_soon(self._report_touch, *message[1:])

    async def _refresh(self) -> None:
        self._refresh_queued = False
        await self.datasets.refresh_unless_running(self.on_change)

    async def _report_touch(self, name: str, uuid: str, segments: list[int], hits: int) -> None:
        """Tell the node which read-through segments were read (its LRU cannot see mmap hits)."""
        try:
            await self.clients[0].call(Touch(name=name, uuid=uuid, segments=segments, hits=hits))
        except KSpeedError as e:
            log.debug("could not report reads of %s: %s", name, e)

    # ---- stopping

    async def stop(self) -> None:
        """SIGTERM every worker, SIGKILL those still there after STOP_WAIT."""
        self.stopping = True
        procs = list(self._procs.values())
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_WAIT):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()

    def close_fds(self) -> None:
        """Once every worker has ended: let go of their clones."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _added(m: MountedDataset) -> tuple[Any, ...]:
    """The message that tells a worker to open an instance (KSpeedFS.add's arguments)."""
    return ("add", m.slot, m.name, m.uuid, m.info, m.view)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"
