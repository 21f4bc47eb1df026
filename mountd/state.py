"""mountd's status file: written by the daemon on every change, read by `kspeedfs mounts`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import KSpeedError, NotFound

# RuntimeDirectory=kspeedfs-mountd in the unit: systemd creates it and removes it at stop.
DEFAULT_STATE_FILE = Path("/run/kspeedfs-mountd/state.json")


class MountdNotRunning(KSpeedError):
    exit_code = NotFound.exit_code


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomic replace: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def remove_state(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def read_state(path: Path) -> dict[str, Any]:
    """The state of a running mountd; a clear error when it is not running."""
    try:
        with open(path) as f:
            state: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise MountdNotRunning(f"mountd is not running (no status file {path})") from None
    except (OSError, ValueError) as e:
        raise KSpeedError(f"cannot read the mountd status file {path}: {e}") from None
    pid = state.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        raise MountdNotRunning(f"mountd is not running (process {pid} of {path} is gone)")
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True


def format_state(state: dict[str, Any]) -> str:
    mounts = state.get("mounts", [])
    if not mounts:
        return f"no mounts declared in {state.get('mounts_dir')}"
    now = time.time()
    rows = [("NAME", "MOUNTPOINT", "DATASET", "STATE", "PID", "RESTARTS", "ERROR")]
    for m in mounts:
        status = m["state"]
        if status == "retrying" and m.get("next_retry"):
            status = f"retrying in {max(0.0, m['next_retry'] - now):.0f}s"
        rows.append(
            (
                m["name"],
                m.get("mountpoint") or "-",
                m.get("dataset") or "-",
                status,
                str(m["pid"]) if m.get("pid") else "-",
                str(m.get("restarts", 0)),
                m.get("error") or (f"last: {m['last_error']}" if m.get("last_error") else ""),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def print_status(path: Path, as_json: bool = False) -> int:
    state = read_state(path)
    print(json.dumps(state, indent=2) if as_json else format_state(state))
    return 0
