"""mount.kspeedfs: the helper mount(8) runs for fstab entries of type kspeedfs or fuse.kspeedfs."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kspeedfs.client.admin import connect_within
from kspeedfs.format.config import load_settings
from kspeedfs.format.errors import InvalidArgument, KSpeedError
from kspeedfs.format.names import validate_mount_name
from kspeedfs.fuse.mount import ALLOWED_OPTIONS, check_mountpoint, fuse_options, run_mount
from kspeedfs.system.logs import setup_logging
from kspeedfs.system.mountinfo import clear_stale

# mount(8)'s exit codes, which it passes on from its helpers.
EXIT_USAGE = 1
EXIT_FAILURE = 32

ALL_DATASETS = "all"
TYPES = ("kspeedfs", "fuse.kspeedfs")
# Options meant for mount(8), systemd or the kernel's generic flags: a read-only FUSE
# filesystem has nothing to do with them.
# fmt: off
GENERIC_OPTIONS = frozenset({
    "defaults", "rw", "ro", "auto", "noauto", "user", "nouser", "users", "owner", "group",
    "_netdev", "nofail", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "atime", "noatime",
    "relatime", "norelatime", "strictatime", "nostrictatime", "diratime", "nodiratime",
    "lazytime", "nolazytime", "sync", "async", "dirsync", "silent", "loud", "iversion",
    "noiversion", "mand", "nomand",
})
# fmt: on
GENERIC_PREFIXES = ("x-", "comment=")
# kspeedfs settings given as options: nodes=H:P;H:P (or quoted with commas), config=, ...
VALUE_OPTIONS = {"nodes", "config", "token_file", "timeout", "log_file"}

log = logging.getLogger(__name__)


def split_options(text: str) -> list[str]:
    """Split at commas outside double quotes, as libmount does: nodes="a:1,b:2",ro."""
    out: list[str] = []
    current: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
            continue
        if ch == "," and not quoted:
            out.append("".join(current))
            current = []
            continue
        current.append(ch)
    out.append("".join(current))
    if quoted:
        raise InvalidArgument(f"unbalanced quote in mount options {text!r}")
    return [o.strip() for o in out if o.strip()]


def translate_options(options: list[str], sloppy: bool = False) -> tuple[list[str], dict[str, str]]:
    """-o options -> (FUSE options, kspeedfs settings); generic ones dropped."""
    fuse: list[str] = []
    values: dict[str, str] = {}
    for opt in options:
        key, eq, value = opt.partition("=")
        key = key.replace("-", "_")
        if opt in GENERIC_OPTIONS or opt.startswith(GENERIC_PREFIXES):
            continue
        if key in VALUE_OPTIONS:
            value = value.strip().strip('"')
            if not eq or not value:
                raise InvalidArgument(f"mount option {key} needs a value ({key}=...)")
            values[key] = value.replace(";", ",") if key == "nodes" else value
        elif opt in ALLOWED_OPTIONS:
            fuse.append(opt)
        elif sloppy:
            log.warning("ignoring unsupported mount option %r (-s)", opt)
        else:
            known = sorted(ALLOWED_OPTIONS) + [f"{k}=" for k in sorted(VALUE_OPTIONS)]
            raise InvalidArgument(f"unsupported mount option {opt!r} (known: {', '.join(known)})")
    return fuse, values


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mount.kspeedfs",
        description="Mount kspeedfs the way mount(8) runs its helpers: "
        "mount.kspeedfs DATASET|all DIR [-o OPTIONS] [-s] [-f] [-n] [-v].",
        epilog="Options: allow_other, allow_root, auto_unmount; nodes=H:P;H:P, config=FILE, "
        "token_file=FILE, timeout=SECONDS, log_file=FILE. Generic ones (defaults, _netdev, "
        "nofail, rw, ro, noauto, user, x-systemd.*, comment=...) are ignored. Exit codes are "
        "mount(8)'s: 0 mounted, 1 bad usage or option, 32 mount failed.",
    )
    p.add_argument(
        "source",
        help="the dataset (NAME@N: its decoded variant) to mount at DIR, or 'all' for one folder each",
    )
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[], help="comma-separated")
    p.add_argument("-s", dest="sloppy", action="store_true", help="ignore unknown options")
    p.add_argument("-f", dest="fake", action="store_true", help="check everything, mount nothing")
    p.add_argument("-n", dest="no_mtab", action="store_true", help="ignored: there is no mtab")
    p.add_argument("-v", dest="verbose", action="store_true", help="debug logging")
    p.add_argument("-t", dest="type", help="the filesystem type mount(8) was given")
    p.add_argument("-N", dest="namespace", help="not supported")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return _mount(args)
    except InvalidArgument as e:
        print(f"mount.kspeedfs: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KSpeedError as e:
        print(f"mount.kspeedfs: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("mount.kspeedfs: interrupted", file=sys.stderr)
        return EXIT_FAILURE


def _mount(args: argparse.Namespace) -> int:
    if args.type and args.type not in TYPES:
        raise InvalidArgument(f"not a kspeedfs type: {args.type!r} (use {' or '.join(TYPES)})")
    if args.namespace:
        raise InvalidArgument("mounting in another namespace (-N) is not supported")
    options = [o for text in args.options for o in split_options(text)]
    fuse, values = translate_options(options, args.sloppy)
    dataset = None if args.source == ALL_DATASETS else validate_mount_name(args.source)
    settings = load_settings(
        {
            "nodes": values.get("nodes"),
            "token_file": values.get("token_file"),
            "timeout": values.get("timeout"),
        },
        config_file=values.get("config"),
        cli_origin="mount options",
        cli_names={key: f"{key}=" for key in VALUE_OPTIONS},
    )
    if args.fake:
        check_mountpoint(args.mountpoint)
        fuse_options(fuse)
        return 0
    # After a crash, `mount DIR` should just work; a live mount there is refused, not replaced.
    if clear_stale(args.mountpoint):
        log.info("cleared the stale kspeedfs mount at %s", args.mountpoint)
    # mount(8) may run while the node is still starting (`mount -a` at boot, an fstab line
    # without x-systemd.after=): give it the timeout to answer.
    connect_within(settings, settings.timeout).close()
    # Returns once the datasets answer at the mountpoint, served by a background process;
    # fails before mounting anything when the node, the token or the dataset is not right.
    run_mount(
        args.mountpoint,
        settings,
        dataset=dataset,
        options=fuse,
        foreground=False,
        log_file=values.get("log_file"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
