"""Mount lifecycle: checks, daemonizing, the FUSE session and its trio side, signals, unmount.

A mount's life is one thing: `mount` reports success only once the datasets answer through
the kernel at the mountpoint, the process unmounts only a mount that is still its own, and
`umount` returns only once that process has ended (mountlock). The CLI, mountd (whose children
are `kspeedfs mount --foreground`) and mount.kspeedfs all run this module's serve_mount."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import trio

from kspeedfs.client.reader import ClusterReader, local_node_for
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.node import Ping
from kspeedfs.format.errors import ERROR_CLASSES, KSpeedError, MountError
from kspeedfs.format.names import validate_mount_name
from kspeedfs.format.tls import client_context
from kspeedfs.fuse import uring
from kspeedfs.fuse.counters import SharedCounters
from kspeedfs.fuse.damage_news import drop_damaged_pages
from kspeedfs.fuse.datasets import DatasetList
from kspeedfs.fuse.kernel import MAX_WRITE, FuseSession
from kspeedfs.fuse.metrics import serve_mount_metrics
from kspeedfs.fuse.supervisor import Workers, default_workers
from kspeedfs.fuse.takeover import LINGER, KeeperLink, Kept, slot_list
from kspeedfs.net.aconnection import AsyncNodeClient
from kspeedfs.system import mountlock
from kspeedfs.system.mountinfo import is_stale, kspeedfs_mounted, mount_at
from kspeedfs.system.notify import notify

log = logging.getLogger(__name__)

FUSE_OPTIONS = ("fsname=kspeedfs", "subtype=kspeedfs", "ro", "default_permissions")
ALLOWED_OPTIONS = frozenset({"allow_other", "allow_root", "auto_unmount"})
ERRORS_BY_EXIT_CODE = {cls.exit_code: cls for cls in ERROR_CLASSES.values() if cls.exit_code > 1}
READY_WAIT = 10.0  # seconds the first listing may take besides a node's timeout
UMOUNT_WAIT = 30.0  # seconds `umount` waits for the mount process to end (it stops in ~2-5 s)


def check_mountpoint(mountpoint: str | os.PathLike[str]) -> Path:
    path = Path(mountpoint)
    if kspeedfs_mounted(path) and is_stale(path):
        raise MountError(
            f"stale kspeedfs mount at {path} (its process died): `kspeedfs umount -z {path}`"
        )
    if not path.exists():
        raise MountError(f"mountpoint does not exist: {path}")
    if not path.is_dir():
        raise MountError(f"mountpoint is not a folder: {path}")
    # x-systemd.automount: systemd's autofs mount waits there for this mount to go on top.
    if os.path.ismount(path) and not _automount_point(path):
        raise MountError(f"mountpoint is busy (something is mounted there): {path}")
    return path.resolve()


def _automount_point(path: Path) -> bool:
    entry = mount_at(path)
    return entry is not None and entry.fstype == "autofs"


def fuse_options(extra: Iterable[str] = ()) -> set[str]:
    options = set(FUSE_OPTIONS)
    for opt in extra:
        if opt not in ALLOWED_OPTIONS:
            raise MountError(f"unsupported mount option {opt!r}")
        options.add(opt)
    return options


async def serve_mount(
    mountpoint: Path,
    settings: Settings,
    dataset: str | None,
    options: set[str],
    on_ready: Callable[[], None],
    on_mounted: Callable[[], None] = lambda: None,
    keeper: KeeperLink | None = None,
    kept: Kept | None = None,
) -> None:
    """Mount, then serve from settings.fuse_workers processes (0: one per CPU, at most 8)
    while this one keeps the dataset list in step with the node and supervises them.
    `on_mounted` runs once the kernel has the mount, before any worker starts. With `kept`
    (a connection mountd handed over: takeover.py) serve it instead of mounting; `keeper`
    (mountd) is given dups of the connection's fds and told the instances' slots."""
    local = local_node_for(settings)
    order = sorted(settings.nodes, key=lambda a: str(a) != local)
    tls = client_context(settings)
    clients = [AsyncNodeClient(a, settings.credential(), settings.timeout, tls) for a in order]
    reader = ClusterReader(settings, local)
    datasets = DatasetList(clients, reader, dataset)
    if kept is not None:  # before the first refresh: it numbers the instances
        datasets.reuse_slots(kept.slots(), int(kept.record.get("next_slot", 1)))
    # A mount with no node to ask is useless: check before mounting, fail with a clear error.
    await _first_answer(clients)
    await datasets.refresh(strict=True)
    if dataset:
        datasets.require(dataset)
    count = kept.workers if kept is not None else settings.fuse_workers or default_workers()
    # Under x-systemd.automount, a look at the mountpoint from here (out of PID 1's process
    # group once on_mounted has run) waits for autofs, which waits for this mount to be
    # reported done: the first access through autofs is the check there.
    check_here = not _automount_point(Path(mountpoint))
    # Held until this process exits, however it ends: `umount` waits for that. Not on a
    # connection taken over: the folder is covered, and opening the mount waits for us.
    if kept is None:
        mountlock.hold(mountpoint)
    if settings.fuse_uring and kept is None:  # the kernel offers io_uring in its INIT
        why = uring.enable_in_kernel(os.geteuid() == 0)
        if why is not None:
            log.warning("fuse_uring: serving through /dev/fuse: %s", why)
            settings = dataclasses.replace(settings, fuse_uring=False)
    if kept is not None:  # INIT was answered on this connection: no io_uring (takeover.py)
        settings = dataclasses.replace(settings, fuse_uring=False)
    counters = SharedCounters.create(count)  # a row for each serving process
    session = FuseSession(None, str(mountpoint), options, counters=counters)
    if kept is not None:
        session.fd, session.device = kept.fds[0], kept.record.get("device")
        session.resend_pending()  # what the dead process's workers had read
        log.info("took over the connection of %s at %s", session.device, mountpoint)
    else:
        try:
            session.mount()
        except OSError as e:
            counters.close()
            raise MountError(e.strerror or str(e)) from None
    on_mounted()
    if settings.fuse_read_ahead and kept is None:
        session.set_read_ahead(settings.fuse_read_ahead // 1024)

    def tell_slots() -> None:
        if keeper is not None:
            keeper.slots_changed(datasets.slots(), datasets.next_slot)

    pool = Workers(
        session, datasets, settings, dataset, count, clients, counters,
        fds=kept.fds[1:] if kept is not None else None, before_change=tell_slots,
        linger=LINGER if keeper is not None else 0.0,
    )  # fmt: skip

    def kept_now() -> tuple[dict[str, Any], list[int]]:
        """What mountd keeps of this mount: the record (takeover.py) and the fds."""
        record: dict[str, Any] = {
            "device": session.device,
            "workers": count,
            # io_uring rings end with their process; fusermount3 unmounts (auto_unmount)
            "can_take_over": not settings.fuse_uring and "auto_unmount" not in options,
            "max_write": MAX_WRITE,
            "slots": slot_list(datasets.slots()),
            "next_slot": datasets.next_slot,
        }
        return record, [session.fd, *pool.fds]

    if keeper is not None:
        keeper.keep(*kept_now())
    if settings.metrics_listen:  # metrics: Prometheus /metrics over the shared counters
        serve_mount_metrics(settings.metrics_listen, counters)
    error: MountError | None = None
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.run)
                if keeper is not None:
                    keeper.serving()
                nursery.start_soon(datasets.keep_refreshed, pool.on_change)
                nursery.start_soon(drop_damaged_pages, datasets, session)
                nursery.start_soon(_unmount_on_signal, signals, session, pool)
                if keeper is not None:
                    nursery.start_soon(keeper.stay_kept, str(mountpoint), kept_now)
                if check_here:
                    error = await _answering(session, datasets, settings.timeout + READY_WAIT)
                if error is None:
                    log.info(
                        "mounted %s at %s, served by %d processes",
                        dataset or "all datasets", mountpoint, count,
                    )  # fmt: skip
                    notify("READY=1", f"STATUS=mounted at {mountpoint}")
                    on_ready()
                    await pool.finished.wait()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await pool.stop()
        pool.close_fds()
        session.unmount()
        session.close()
        counters.close()
        reader.close()
        for client in clients:
            await client.aclose()
    if error is not None:
        raise error


async def _answering(
    session: FuseSession, datasets: DatasetList, timeout: float
) -> MountError | None:
    """None once the new mount answers at its mountpoint, else why it does not."""
    try:
        with trio.fail_after(timeout):
            await trio.to_thread.run_sync(
                check_answers, session.mountpoint, session.device, datasets.root_names,
                abandon_on_cancel=True,  # a stat stuck in our own mount ends with its unmount
            )  # fmt: skip
    except MountError as e:
        return e
    except trio.TooSlowError:
        return MountError(f"the mount at {session.mountpoint} did not answer in {timeout:.0f}s")
    return None


def check_answers(
    mountpoint: str | os.PathLike[str],
    device: str | None,
    expected: Callable[[], Collection[bytes]] = frozenset,
) -> None:
    """The one readiness rule, for the mount process and mountd alike: through the kernel, the
    mount at `mountpoint` is the one of `device` (None: any) and its root lists every name
    `expected()` gives before and after the listing (a dataset loaded or unloaded meanwhile
    is not awaited). Blocking: run it in a thread with a timeout."""
    before = set(expected())
    try:
        st = os.stat(mountpoint)
        listed = set(os.listdir(os.fsencode(mountpoint)))
    except OSError as e:
        raise MountError(f"the mount at {mountpoint} does not answer: {e.strerror}") from None
    if device is not None and f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" != device:
        raise MountError(f"another mount took {mountpoint} over while it was starting")
    missing = sorted((before & set(expected())) - listed)
    if missing:
        shown = ", ".join(os.fsdecode(name) for name in missing[:3])
        raise MountError(f"the mount at {mountpoint} does not list {shown}")


async def _first_answer(clients: list[AsyncNodeClient]) -> None:
    error: KSpeedError | None = None
    for client in clients:
        try:
            await client.call(Ping())
            return
        except KSpeedError as e:
            error = e
    assert error is not None
    raise error


async def _unmount_on_signal(
    signals: AsyncIterator[int], session: FuseSession, pool: Workers
) -> None:
    async for signum in signals:
        log.info("received %s, unmounting", signal.Signals(signum).name)
        await trio.to_thread.run_sync(session.unmount)
        pool.finished.set()  # files still open keep a detached mount's workers busy: stop anyway
        return


def run_mount(
    mountpoint: str,
    settings: Settings,
    dataset: str | None = None,
    options: Iterable[str] = (),
    foreground: bool = False,
    log_file: str | None = None,
) -> None:
    """Mount and serve; in the background unless `foreground`, returning once the mount is up."""
    if dataset is not None:
        validate_mount_name(dataset)
    opts = fuse_options(options)
    keeper = KeeperLink.from_env()  # mountd's: it may hand over a live connection
    kept = keeper.handoff() if keeper is not None else None
    # A kept mount waits for us: any look at it would wait too.
    path = Path(os.path.abspath(mountpoint)) if kept is not None else check_mountpoint(mountpoint)
    if foreground:
        trio.run(
            serve_mount, path, settings, dataset, opts, lambda: None, lambda: None, keeper, kept
        )
        return
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as r:
            answer = r.read().decode(errors="replace")
        if answer.startswith("ok"):
            return
        os.waitpid(pid, 0)
        code, _, message = answer.partition(" ")
        error = ERRORS_BY_EXIT_CODE.get(int(code) if code.isdigit() else 0, MountError)
        raise error(message.strip() or "the mount process died before the mount was ready")
    os.close(read_fd)
    _redirect_stdio(log_file)

    def ready() -> None:
        os.write(write_fd, b"ok\n")
        os.close(write_fd)

    status = 0
    try:
        # A session of its own only once mounted, as libfuse daemonizes after fuse_mount: an
        # automounter (systemd for x-systemd.automount) runs mount(8) in its own process
        # group, the one autofs lets through the mountpoint while the mount it awaits is made.
        trio.run(serve_mount, path, settings, dataset, opts, ready, os.setsid, keeper, kept)
    except KSpeedError as e:
        _report(write_fd, f"{e.exit_code} {e}")
        status = e.exit_code
    except BaseException as e:  # the parent must hear of any failure, then we exit
        log.exception("mount failed")
        _report(write_fd, f"{MountError.exit_code} mount failed: {e}")
        status = 1
    os._exit(status)


def _report(fd: int, message: str) -> None:
    try:
        os.write(fd, message.encode() + b"\n")
        os.close(fd)
    except OSError:
        pass  # already reported ready; the log has the error


def _redirect_stdio(log_file: str | None) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log_file else devnull
    os.dup2(out, 1)
    os.dup2(out, 2)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


def unmount(mountpoint: str, lazy: bool = False) -> None:
    """Unmount; unless `lazy`, return only once the mount's process has ended, so that a mount
    made right after never meets the old process's teardown."""
    path = Path(mountpoint)
    if not kspeedfs_mounted(path):  # mountinfo, not stat: a stale mount fails every stat
        raise MountError(f"not a kspeedfs mount: {path}")
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise MountError("fusermount3 not found: install the fuse3 package")
    args = [tool, "-u"] + (["-z"] if lazy else []) + [str(path)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise MountError(
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "unmount failed"
        )
    if not lazy:  # a lazily detached mount serves its open files on: its process may stay
        mountlock.wait_released(path, UMOUNT_WAIT)
