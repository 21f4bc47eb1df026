"""`kspeedfs install-systemd`: the unit files of systemd/ with the paths of this installation."""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

from kspeedfs.format.errors import AlreadyExists, InvalidArgument, KSpeedError, NotFound

SERVICES = ("kspeedfs-node.service", "kspeedfs-mountd.service", "kspeedfs-mount@.service")
EXAMPLES = ("mnt-imagenet.mount",)
SCRIPTS = ("kspeedfs", "kspeedfs-mountd", "mount.kspeedfs")
# mount(8) looks for /sbin/mount.TYPE: `kspeedfs` and, for type fuse.kspeedfs, the full name.
MOUNT_HELPERS = ("mount.kspeedfs", "mount.fuse.kspeedfs")
PLACEHOLDER = "@EXEC_PREFIX@"
# systemd would split or expand these in ExecStart=; such paths are refused, not quoted.
_UNSAFE_PATH = re.compile(r"[\s%\"'\\$;]")


def templates_dir() -> Path:
    path = Path(__file__).resolve().parents[2] / "systemd"  # the source tree's systemd/
    if not (path / SERVICES[0]).is_file():
        raise NotFound(
            f"unit templates not found in {path}: install kspeedfs from its source tree "
            "(pip install -e .)"
        )
    return path


def default_exec_prefix() -> Path:
    """Where this interpreter's console scripts are: the venv's bin/ for a venv."""
    # abspath, not resolve: a venv's bin/python is a symlink to the system interpreter.
    return Path(os.path.abspath(sysconfig.get_path("scripts")))


def render(template: str, exec_prefix: Path) -> str:
    text = template.replace(PLACEHOLDER, str(exec_prefix))
    left = re.search(r"@[A-Z_]+@", text)
    if left:
        raise InvalidArgument(f"unit template has an unknown placeholder {left[0]}")
    return text


def check_exec_prefix(exec_prefix: Path) -> None:
    if not exec_prefix.is_absolute() or _UNSAFE_PATH.search(str(exec_prefix)):
        raise InvalidArgument(
            f"cannot use {exec_prefix} in unit files: need an absolute path without spaces, "
            "quotes, '%', '$', ';' or '\\'"
        )
    missing = [s for s in SCRIPTS if not os.access(exec_prefix / s, os.X_OK)]
    if missing:
        raise NotFound(
            f"{', '.join(missing)} not found in {exec_prefix}: is kspeedfs installed there?"
        )


def install(
    prefix: Path = Path("/"),
    exec_prefix: Path | None = None,
    example_mount: bool = False,
    templates: Path | None = None,
) -> list[Path]:
    """Write the units to PREFIX/etc/systemd/system and link the mount helpers into PREFIX/sbin.

    Everything is checked before anything is written; returns the paths written.
    """
    exec_prefix = exec_prefix or default_exec_prefix()
    check_exec_prefix(exec_prefix)
    source = templates or templates_dir()
    names = SERVICES + (EXAMPLES if example_mount else ())
    units = {name: render((source / name).read_text(), exec_prefix) for name in names}
    unit_dir = prefix / "etc" / "systemd" / "system"
    sbin = prefix / "sbin"
    for helper in MOUNT_HELPERS:
        link = sbin / helper
        if link.exists() and not link.is_symlink():
            raise AlreadyExists(f"{link} exists and is not a symlink: remove it first")

    try:
        return _write(units, unit_dir, sbin, exec_prefix)
    except OSError as e:
        raise KSpeedError(
            f"cannot write {e.filename or unit_dir}: {e.strerror} (run it as root?)"
        ) from None


def _write(units: dict[str, str], unit_dir: Path, sbin: Path, exec_prefix: Path) -> list[Path]:
    written: list[Path] = []
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name, text in units.items():
        dest = unit_dir / name
        tmp = dest.with_name(f".{name}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, dest)
        written.append(dest)
    sbin.mkdir(parents=True, exist_ok=True)
    for helper in MOUNT_HELPERS:
        link = sbin / helper
        if link.is_symlink():
            link.unlink()
        link.symlink_to(exec_prefix / "mount.kspeedfs")
        written.append(link)
    mounts_dir = unit_dir.parent.parent / "kspeedfs" / "mounts.d"
    mounts_dir.mkdir(parents=True, exist_ok=True)
    written.append(mounts_dir)
    return written
