"""One declared mount kept alive: a `kspeedfs mount --foreground` child, watched and restarted."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import trio

from kspeedfs.client import admin
from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.errors import KSpeedError, MountError, ProtocolError
from kspeedfs.format.names import split_variant
from kspeedfs.fuse import takeover
from kspeedfs.fuse.mount import check_answers
from kspeedfs.net import fdpass
from kspeedfs.system.mountinfo import clear_stale, kspeedfs_mounted, require_free_mountpoint

from .adopt import ADOPT_WAIT, AdoptedProcess
from .declarations import Declaration

log = logging.getLogger(__name__)

Watched = trio.Process | AdoptedProcess  # a mount process: our child, or adopted
QUICK_DEATH = 5.0  # a mount process that dies sooner after mounting is replaced after a backoff
LINGER_END_WAIT = 2.0  # seconds the old workers have to be gone before the kernel resends

# The child is not the service's main process: systemd would drop its notifications anyway,
# and a test socket must only see mountd's own.
CHILD_ENV_DROP = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


@dataclasses.dataclass(frozen=True)
class Timing:
    """How fast mountd reacts; the defaults suit a service, tests shorten them."""

    retry_min: float = 1.0
    retry_max: float = 60.0
    stable_after: float = 60.0  # a mount up this long restarts the backoff from retry_min
    check_interval: float = 2.0
    mount_timeout: float = 120.0
    hang_timeout: float = 60.0  # statfs asks the node too, which may take its timeout
    stop_timeout: float = 10.0


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}


def prepare_mountpoint(decl: Declaration) -> Settings:
    """Blocking checks before a mount: settings, the mountpoint folder, leftovers of a crash."""
    settings = load_settings(decl.settings_cli(), config_file=decl.config)
    # First, from mountinfo: any access to a stale leftover would fail with ENOTCONN. A live
    # mount there is refused (and retried): it is some other process's to end.
    require_free_mountpoint(decl.mountpoint)
    try:
        os.makedirs(decl.mountpoint, exist_ok=True)
    except FileExistsError:
        raise MountError(f"mountpoint is not a folder: {decl.mountpoint}") from None
    except OSError as e:
        raise MountError(f"cannot create mountpoint {decl.mountpoint}: {e.strerror}") from None
    return settings


async def ensure_dataset(settings: Settings, name: str, source: str) -> None:
    """Preload `name` from `source` unless the node has it; wait until it is ready. For a
    decoded variant (`NAME@N`) the dataset NAME is preloaded: the mount starts the variant."""
    name = split_variant(name)[0]
    # The one blocking preload-and-wait, in a thread; a stop (cancel) does not wait for it.
    await trio.to_thread.run_sync(
        functools.partial(admin.ensure_loaded, settings, source, name, lifetime="offline"),
        abandon_on_cancel=True,
    )


class MountSupervisor:
    """Mounts one declaration and remounts it, with exponential backoff, whenever it fails."""

    def __init__(
        self,
        decl: Declaration,
        timing: Timing,
        on_change: Callable[[], None],
        verbose: bool = False,
        after: list[trio.Event] | None = None,
        keeper_address: str = "",
    ):
        self.decl = decl
        self.keeper_address = keeper_address  # where this mountd listens (adopt.py)
        self.timing = timing
        self.verbose = verbose
        self.state = "starting"
        self.error: str | None = None  # why it is not mounted now
        self.last_error: str | None = None  # why it last failed, kept once mounted again
        self.pid: int | None = None
        self.restarts = 0
        self.mounted_since: float | None = None
        self.next_retry: float | None = None
        self.settled = trio.Event()  # the first attempt ended: mounted or failed
        self.done = trio.Event()
        self._on_change = on_change
        self._after = after or []
        self._cancel = trio.CancelScope()
        self._last_error_line: str | None = None
        # Dups of the live mount's FUSE fds: its next process takes the connection over.
        self.kept: takeover.Kept | None = None
        # A live mount process of an earlier mountd that called (adopt.py): its socket, pid.
        self._adopted: tuple[socket.socket, int] | None = None
        self._adoption = trio.Event()
        # Process groups of dead mount processes whose workers still serve (takeover.LINGER).
        self._lingering: list[int] = []
        self._served = trio.Event()  # the mount process said that all its workers serve

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.decl.name,
            "file": str(self.decl.file),
            "mountpoint": self.decl.mountpoint,
            "dataset": self.decl.dataset or "all",
            "state": self.state,
            "error": self.error,
            "last_error": self.last_error,
            "pid": self.pid,
            "restarts": self.restarts,
            "mounted_since": self.mounted_since,
            "next_retry": self.next_retry,
        }

    def stop(self) -> None:
        """Unmount and end; `done` is set once the mount and its process are gone."""
        if self.state not in ("stopping", "stopped"):
            log.info("%s: stopping", self.decl.name)
            self._set("stopping")
        self._cancel.cancel()

    def _set(self, state: str, error: str | None = None, next_retry: float | None = None) -> None:
        self.state, self.error, self.next_retry = state, error, next_retry
        self._on_change()

    async def run(self) -> None:
        try:
            with self._cancel:
                for event in self._after:  # a replaced mount of the same mountpoint goes first
                    await event.wait()
                if kspeedfs_mounted(self.decl.mountpoint):  # an earlier mountd's, maybe live
                    with trio.move_on_after(ADOPT_WAIT):
                        await self._adoption.wait()
                await self._keep_mounted()
        finally:
            with trio.CancelScope(shield=True):
                await self._end_lingering()
            self._let_go()  # stopping: our dups must not keep a dead mount's connection
            with trio.CancelScope(shield=True):
                await self._unmount_leftover()
            self.settled.set()
            self.state, self.pid, self.next_retry = "stopped", None, None
            log.info("%s: stopped, nothing mounted at %s", self.decl.name, self.decl.mountpoint)
            self.done.set()
            self._on_change()

    async def _keep_mounted(self) -> None:
        delay = self.timing.retry_min
        while True:
            try:
                reason = await self._attempt()
            except Exception as e:  # a bug here must not take the other mounts down
                log.exception("%s: mount attempt failed", self.decl.name)
                reason = f"internal error: {e!r}"
            self.settled.set()
            up_for = 0.0 if self.mounted_since is None else time.time() - self.mounted_since
            if self.mounted_since is not None:
                if up_for >= self.timing.stable_after:
                    delay = self.timing.retry_min
                self.mounted_since = None
            if up_for >= QUICK_DEATH and self.kept is not None:
                # Readers wait on the kept connection meanwhile: no backoff, no remount. (One
                # that dies sooner is taken over too, after the backoff: it may die again.)
                log.warning(
                    "%s: %s; a new process takes its connection over", self.decl.name, reason
                )
                self.last_error = reason
                self.restarts += 1
                continue
            log.warning("%s: %s; mounting again in %.1fs", self.decl.name, reason, delay)
            self.last_error = reason
            self._set("retrying", reason, next_retry=time.time() + delay)
            with trio.move_on_after(delay):  # a live mount calling ends the wait
                await self._adoption.wait()
            self._adoption = trio.Event()
            delay = min(delay * 2, self.timing.retry_max)
            self.restarts += 1

    async def _attempt(self) -> str:
        """Mount once and watch it; returns why it is not (or no longer) mounted."""
        if self._adopted is not None:
            ours, pid = self._adopted
            self._adopted = None
            try:
                adopted = AdoptedProcess(pid)
            except OSError:
                ours.close()
                return f"the mount process {pid} that called is gone"
            log.info("%s: watching mount process %d of an earlier mountd", self.decl.name, pid)
            self._set("taking over", self.error)
            return await self._serve(adopted, ours)
        decl = self.decl
        if self.kept is not None and not self.kept.usable():
            self._let_go()  # unmounted, aborted, or a mount that cannot be taken over
        if self.kept is None:
            self._set("mounting", self.error)
            try:
                settings = await trio.to_thread.run_sync(prepare_mountpoint, decl)
                if decl.source and decl.dataset:
                    self._set("loading", self.error)
                    await ensure_dataset(settings, decl.dataset, decl.source)
            except KSpeedError as e:
                return str(e)
            except OSError as e:
                return f"{e.strerror or e}"
        else:
            self._set("taking over", self.error)
        self._last_error_line = None
        ours, theirs = takeover.keeper_pair()
        try:
            takeover.offer(ours, self.kept)  # waits in the socket for the child
            proc = await trio.lowlevel.open_process(
                decl.mount_argv(self.verbose),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={
                    **child_env(),
                    takeover.KEEPER_ENV: str(theirs.fileno()),
                    takeover.KEEPER_SOCKET_ENV: self.keeper_address,
                },
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a terminal's Ctrl-C reaches mountd only; it stops it
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return await self._serve(proc, ours)

    def adopt(self, sock: socket.socket, kept: takeover.Kept, pid: int) -> bool:
        """A live mount process of an earlier mountd called with its connection: watch it
        (next attempt) rather than mount; False while this supervisor runs a child."""
        if self.pid is not None or self._adopted is not None:
            return False
        if self.kept is not None:
            self.kept.close()
        self.kept, self._adopted = kept, (sock, pid)
        self._adoption.set()
        return True

    async def _serve(self, proc: Watched, ours: socket.socket) -> str:
        """Watch a mount process (ours or adopted) while keeping its fds; why it ended."""
        self.pid = proc.pid
        self._served = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                output_done = trio.Event()
                if proc.stdout is not None:
                    nursery.start_soon(self._read_output, proc.stdout, output_done)
                else:
                    output_done.set()
                nursery.start_soon(self._keep_fds, ours)
                nursery.start_soon(self._end_lingering_once_served)
                reason = await self._watch(proc)
                if proc.poll() is not None:
                    # Its last line on stderr says why it failed: read it before reporting.
                    with trio.move_on_after(2.0):
                        await output_done.wait()
                    reason = self._exit_reason(proc)
                nursery.cancel_scope.cancel()
            return reason
        finally:
            with trio.CancelScope(shield=True):
                if proc.poll() is None:
                    await self._stop_process(proc)
                else:  # it died: its workers serve on until the next process serves
                    await proc.wait()
                    self._lingering.append(proc.pid)
                self._take_fds(ours)  # what it said last, before it died
                ours.close()
                if self.kept is None or not self.kept.usable():
                    await self._end_lingering()
                    self._let_go()
                    # A look at a kept mount would wait for a process that is not there.
                    await self._unmount_leftover()
                if proc.stdout is not None:
                    await proc.stdout.aclose()
            self.pid = None

    async def _keep_fds(self, sock: socket.socket) -> None:
        """Keep what the mount process sends: dups of its FUSE fds, its instances' slots."""
        sock.setblocking(False)
        while self._take_fds(sock):
            await trio.lowlevel.wait_readable(sock)

    def _take_fds(self, sock: socket.socket) -> bool:
        """Every message waiting on `sock`; False once the mount process's end is closed."""
        sock.setblocking(False)
        while True:
            try:
                msg, fds = fdpass.receive(sock, takeover.MAX_FDS)
            except BlockingIOError:
                return True
            except (OSError, ProtocolError):
                return False  # closed (or garbled: the next process mounts anew)
            if msg.get("serving"):
                self._served.set()
            self.kept = takeover.apply(self.kept, msg, fds)

    async def _end_lingering_once_served(self) -> None:
        """The workers of the process before answer (the mount looks ready) until every
        worker of the new one serves: only then end them."""
        await self._served.wait()
        await self._end_lingering()

    async def _end_lingering(self) -> None:
        """End the workers of dead mount processes, then have the kernel resend the requests
        they had read (our dups of their fds kept those parked)."""
        if not self._lingering:
            return
        # By pid, the serving processes only: a group id is free again once its leader died.
        pids = [pid for pgid in self._lingering for pid in _workers_in(pgid)]
        self._lingering = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with trio.move_on_after(LINGER_END_WAIT):
            while any(_running(pid) for pid in pids):
                await trio.sleep(0.02)
        if self.kept is not None:
            takeover.resend(self.kept.fds[0])
        log.info(
            "%s: the new mount process serves; the old one's workers are ended", self.decl.name
        )

    def _let_go(self) -> None:
        if self.kept is not None:
            self.kept.close()
            self.kept = None

    async def _watch(self, proc: Watched) -> str:
        mountpoint = self.decl.mountpoint
        deadline = trio.current_time() + self.timing.mount_timeout
        # Reading mountinfo is cheap and does not touch the new mount.
        while not kspeedfs_mounted(mountpoint):
            if proc.poll() is not None:
                return "exited"
            if trio.current_time() > deadline:
                return f"not mounted {self.timing.mount_timeout:.0f}s after start"
            await trio.sleep(0.05)
        problem = await self._check_health(proc) or await self._check_answers(proc)
        if problem:
            return problem
        self.mounted_since = time.time()
        log.info("%s: mounted %s at %s", self.decl.name, self.decl.dataset or "all", mountpoint)
        self._set("mounted")
        self.settled.set()
        while True:
            with trio.move_on_after(self.timing.check_interval):
                await proc.wait()
            problem = await self._check_health(proc)
            if problem:
                return problem

    async def _check_health(self, proc: Watched) -> str | None:
        if proc.poll() is not None:
            return "exited"
        if not kspeedfs_mounted(self.decl.mountpoint):
            return "the mount disappeared (unmounted from outside)"
        try:
            # statfs always goes to the FUSE process (stat may be answered from the kernel's
            # cache); a thread keeps a hung mount from blocking mountd.
            with trio.fail_after(self.timing.hang_timeout):
                await trio.to_thread.run_sync(
                    os.statvfs, self.decl.mountpoint, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            return f"the mount did not answer for {self.timing.hang_timeout:.0f}s"
        except OSError as e:
            if proc.poll() is not None:
                return "exited"
            if e.errno == errno.ENOTCONN:
                return "the mount is stale (Transport endpoint is not connected)"
            return f"the mount fails: {e.strerror}"
        return None

    async def _check_answers(self, proc: Watched) -> str | None:
        """Mounted means what the mount process itself waits for: its root lists."""
        try:
            with trio.fail_after(self.timing.mount_timeout):
                await trio.to_thread.run_sync(
                    check_answers, self.decl.mountpoint, None, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            return f"the mount did not answer for {self.timing.mount_timeout:.0f}s"
        except MountError as e:
            return "exited" if proc.poll() is not None else str(e)
        return None

    def _exit_reason(self, proc: Watched) -> str:
        code = proc.returncode
        assert code is not None
        if isinstance(proc, AdoptedProcess):
            return "mount process (of an earlier mountd) ended"
        if code < 0:
            return f"mount process killed by {signal.Signals(-code).name}"
        if self._last_error_line:
            return self._last_error_line
        if code == 0:
            return "mount process exited"
        return f"mount process exited with code {code}"

    async def _read_output(self, stream: trio.abc.ReceiveStream, done: trio.Event) -> None:
        pending = b""
        try:
            async for chunk in stream:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._child_line(line)
            if pending:
                self._child_line(pending)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        finally:
            done.set()

    def _child_line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        if not line:
            return
        log.info("[%s] %s", self.decl.name, line)
        if line.startswith("kspeedfs: "):  # the CLI's one-line error
            self._last_error_line = line.removeprefix("kspeedfs: ")

    async def _stop_process(self, proc: Watched) -> None:
        if proc.poll() is None:
            # The mount unmounts itself on SIGTERM; SIGKILL only when it does not end in time.
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(self.timing.stop_timeout):
                await proc.wait()
            if proc.poll() is None:
                log.warning(
                    "%s: mount process %d ignored SIGTERM, killing it", self.decl.name, proc.pid
                )
        # What is left of its session (it has one of its own): the serving processes of a mount
        # process that was killed. Then its mount is stale, and ours to clear.
        _kill_group(proc.pid)
        await proc.wait()

    async def _unmount_leftover(self) -> None:
        """What a mount process that died leaves (a stale mount); never a live one: that is
        either gone with our process or belongs to another."""
        try:
            await trio.to_thread.run_sync(clear_stale, self.decl.mountpoint)
        except MountError as e:
            log.error("%s: cannot unmount %s: %s", self.decl.name, self.decl.mountpoint, e)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # none left


def _workers_in(pgid: int) -> list[int]:
    """The serving processes (kspeedfs.fuse.worker) of process group `pgid`."""
    pids = []
    for entry in os.scandir("/proc"):
        stat = _stat_fields(f"/proc/{entry.name}/stat") if entry.name.isdigit() else None
        if stat is None or int(stat[2]) != pgid:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if b"kspeedfs.fuse.worker" in f.read():
                    pids.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return pids


def _running(pid: int) -> bool:
    """Whether a thread of `pid` still runs. Not the process's state: a killed process's
    leader is a zombie while its other threads still end (and may still read a request); a
    zombie whose threads are all gone has let go of its fds."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        fields = _stat_fields(f"/proc/{pid}/task/{task}/stat")
        if fields is not None and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a /proc stat file after the command (state first); None once gone."""
    try:
        with open(path, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
