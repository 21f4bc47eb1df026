"""kspeedfs-mountd: keeps the declared mounts mounted; SIGHUP re-reads them, SIGTERM unmounts."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import trio

from kspeedfs.format.errors import EXIT_CODES_DOC, InvalidArgument, KSpeedError
from kspeedfs.fuse.takeover import Kept
from kspeedfs.system.logs import setup_logging
from kspeedfs.system.mountinfo import clear_stale
from kspeedfs.system.notify import notify, watchdog_interval

from . import adopt
from .adopt import keeper_address
from .declarations import (
    DEFAULT_MOUNTS_DIR,
    Declaration,
    InvalidDeclaration,
    find_declaration,
    load_declarations,
)
from .state import DEFAULT_STATE_FILE, print_status, remove_state, write_state
from .supervisor import MountSupervisor, Timing, ensure_dataset, prepare_mountpoint

log = logging.getLogger("mountd")


class Mountd:
    """The supervisors of the declared mounts, the status file and the systemd notifications."""

    def __init__(
        self,
        mounts_dir: Path,
        state_file: Path,
        timing: Timing,
        ready_timeout: float = 60.0,
        verbose: bool = False,
    ):
        self.mounts_dir = mounts_dir
        self.state_file = state_file
        self.timing = timing
        self.ready_timeout = ready_timeout
        self.verbose = verbose
        self.supervisors: dict[str, MountSupervisor] = {}
        self.invalid: dict[str, InvalidDeclaration] = {}
        self.retiring: list[MountSupervisor] = []  # stopping; kept in the status until done
        self.ready = False
        self._status = ""
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    # Before any supervisor: the live mounts of an earlier mountd call here.
                    await nursery.start(self._listen)
                    self.reload()
                    nursery.start_soon(self._announce_ready)
                    interval = watchdog_interval()
                    if interval:
                        nursery.start_soon(self._watchdog, interval)
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            log.info("SIGHUP: re-reading %s", self.mounts_dir)
                            notify("RELOADING=1")
                            self.reload()
                            notify("READY=1", f"STATUS={self.status_line()}")
                            continue
                        log.info("%s: unmounting everything", signal.Signals(signum).name)
                        break
                    notify("STOPPING=1")
                    await self.stop_all()
                    nursery.cancel_scope.cancel()
            finally:
                remove_state(self.state_file)

    async def _listen(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        address = keeper_address(self.state_file)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adopt.listen, address, self._adopt)
            while not address.exists():
                await trio.sleep(0.01)
            task_status.started()

    def _adopt(self, mountpoint: str, sock: socket.socket, kept: Kept, pid: int) -> bool:
        for sup in self.supervisors.values():
            if _same_place(sup.decl.mountpoint, mountpoint):
                return sup.adopt(sock, kept, pid)
        return False

    def reload(self) -> None:
        """Start new declarations, stop removed ones, restart changed ones."""
        try:
            decls = load_declarations(self.mounts_dir)
        except KSpeedError as e:
            log.error("%s; keeping the current mounts", e)
            return
        self.invalid = {}
        wanted: dict[str, Declaration] = {}
        for decl in decls:
            if isinstance(decl, InvalidDeclaration):
                log.error("%s: bad declaration: %s", decl.file, decl.error)
                self.invalid[decl.name] = decl
            else:
                wanted[decl.name] = decl
        for name, sup in list(self.supervisors.items()):
            if wanted.get(name) != sup.decl:
                self._retire(name)
        for name, decl in wanted.items():
            if name not in self.supervisors:
                self._start(decl)
        self.changed()

    def _start(self, decl: Declaration) -> None:
        assert self._nursery is not None
        after = [s.done for s in self.retiring if s.decl.mountpoint == decl.mountpoint]
        address = str(keeper_address(self.state_file))
        sup = MountSupervisor(decl, self.timing, self.changed, self.verbose, after, address)
        self.supervisors[decl.name] = sup
        self._nursery.start_soon(sup.run)

    def _retire(self, name: str) -> None:
        assert self._nursery is not None
        sup = self.supervisors.pop(name)
        self.retiring.append(sup)
        sup.stop()
        self._nursery.start_soon(self._forget_when_done, sup)

    async def _forget_when_done(self, sup: MountSupervisor) -> None:
        await sup.done.wait()
        self.retiring.remove(sup)
        self.changed()

    async def stop_all(self) -> None:
        for name in list(self.supervisors):
            self._retire(name)
        for sup in list(self.retiring):
            await sup.done.wait()

    async def _announce_ready(self) -> None:
        # READY once every mount had its first try, so that units ordered after mountd find
        # their mounts; a slow one (a long preload) does not hold the start up for ever.
        with trio.move_on_after(self.ready_timeout):
            for sup in list(self.supervisors.values()):
                await sup.settled.wait()
        self.ready = True
        self.changed()
        notify("READY=1", f"STATUS={self.status_line()}")
        log.info("ready: %s", self.status_line())

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1")
            await trio.sleep(interval)

    def status_line(self) -> str:
        if not self.supervisors and not self.invalid:
            return f"no mounts declared in {self.mounts_dir}"
        counts: dict[str, int] = {}
        for sup in self.supervisors.values():
            counts[sup.state] = counts.get(sup.state, 0) + 1
        if self.invalid:
            counts["invalid"] = len(self.invalid)
        return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))

    def to_json(self) -> dict[str, Any]:
        mounts = [s.to_json() for s in self.supervisors.values()]
        mounts += [s.to_json() for s in self.retiring]
        mounts += [
            {
                "name": d.name,
                "file": str(d.file),
                "mountpoint": d.mountpoint,
                "dataset": None,
                "state": "invalid",
                "error": d.error,
                "last_error": None,
                "pid": None,
                "restarts": 0,
                "mounted_since": None,
                "next_retry": None,
            }
            for d in self.invalid.values()
        ]
        return {
            "pid": os.getpid(),
            "mounts_dir": str(self.mounts_dir),
            "ready": self.ready,
            "updated": time.time(),
            "mounts": sorted(mounts, key=lambda m: m["name"]),
        }

    def changed(self) -> None:
        """Called on every state change: rewrite the status file, tell systemd."""
        try:
            # A few hundred bytes on tmpfs (/run): not worth a thread.
            write_state(self.state_file, self.to_json())
        except OSError as e:
            log.error("cannot write the status file %s: %s", self.state_file, e)
        line = self.status_line()
        if line != self._status:
            self._status = line
            notify(f"STATUS={line}")


def _same_place(a: str, b: str) -> bool:
    """Whether two paths name one mountpoint; never looks at a mount itself (a kept mount
    waits for its next process)."""

    def place(p: str) -> str:
        p = os.path.abspath(p)
        return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))

    return place(a) == place(b)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kspeedfs-mountd",
        description="Keep the kspeedfs mounts declared in a folder of TOML files mounted.",
        epilog=EXIT_CODES_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--mounts-dir",
        type=Path,
        default=DEFAULT_MOUNTS_DIR,
        help=f"folder of NAME.toml mount declarations (default {DEFAULT_MOUNTS_DIR})",
    )
    parser.add_argument(
        "--state-file",
        type=Path,
        default=DEFAULT_STATE_FILE,
        help=f"status file for `kspeedfs mounts` (default {DEFAULT_STATE_FILE})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("run", help="run the daemon (the default)")
    _timing_options(p)
    p = sub.add_parser("status", help="list the declared mounts and their state")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("check", help="check the declarations, mount nothing")
    p = sub.add_parser("exec", help="become the mount of one declaration (kspeedfs-mount@.service)")
    p.add_argument("name")
    p = sub.add_parser("cleanup", help="clear a stale mount left at a declaration's mountpoint")
    p.add_argument("name")
    return parser


def _timing_options(p: argparse.ArgumentParser) -> None:
    d = Timing()
    p.add_argument("--retry-min", type=float, default=d.retry_min, help="first retry delay (s)")
    p.add_argument("--retry-max", type=float, default=d.retry_max, help="longest retry delay (s)")
    p.add_argument(
        "--check-interval", type=float, default=d.check_interval, help="health check period (s)"
    )
    p.add_argument("--ready-timeout", type=float, default=60.0, help="longest wait for READY=1 (s)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        if args.command in (None, "run"):
            return cmd_run(args)
        return COMMANDS[args.command](args)
    except KSpeedError as e:
        print(f"kspeedfs-mountd: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def cmd_run(args: argparse.Namespace) -> int:
    defaults = Timing()
    retry_min = getattr(args, "retry_min", defaults.retry_min)
    retry_max = getattr(args, "retry_max", defaults.retry_max)
    check_interval = getattr(args, "check_interval", defaults.check_interval)
    if not 0 < retry_min <= retry_max or check_interval <= 0:
        raise InvalidArgument("need 0 < --retry-min <= --retry-max and --check-interval > 0")
    timing = Timing(retry_min=retry_min, retry_max=retry_max, check_interval=check_interval)
    daemon = Mountd(
        args.mounts_dir,
        args.state_file,
        timing,
        ready_timeout=getattr(args, "ready_timeout", 60.0),
        verbose=args.verbose,
    )
    log.info("mountd %d: mounts declared in %s", os.getpid(), args.mounts_dir)
    trio.run(daemon.run)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    return print_status(args.state_file, args.json)


def cmd_check(args: argparse.Namespace) -> int:
    bad = 0
    decls = load_declarations(args.mounts_dir)
    for decl in decls:
        if isinstance(decl, InvalidDeclaration):
            bad += 1
            print(f"bad  {decl.file}: {decl.error}")
        else:
            print(f"ok   {decl.file}: {decl.dataset or 'all datasets'} at {decl.mountpoint}")
    if not decls:
        print(f"no mounts declared in {args.mounts_dir}")
    return InvalidArgument.exit_code if bad else 0


def cmd_exec(args: argparse.Namespace) -> int:
    """Replace this process by the mount, so that it is the unit's main process (Type=notify)."""
    decl = find_declaration(args.mounts_dir, args.name)
    settings = prepare_mountpoint(decl)
    if decl.source and decl.dataset:
        trio.run(ensure_dataset, settings, decl.dataset, decl.source)
    argv = decl.mount_argv(args.verbose)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def cmd_cleanup(args: argparse.Namespace) -> int:
    """After the unit's mount process ended: clear its mount if it died with it (stale); a
    live mount at that path is another process's."""
    decl = find_declaration(args.mounts_dir, args.name)
    clear_stale(decl.mountpoint)
    return 0


COMMANDS = {"status": cmd_status, "check": cmd_check, "exec": cmd_exec, "cleanup": cmd_cleanup}

if __name__ == "__main__":
    sys.exit(main())
