"""Which job a process belongs to: `KSPEEDFS_JOB`, else the scheduler's job id, else its cgroup.

The same identity for the process that reports its own training loop (this process's
environment) and for the mount, which knows a reader only by its pid (/proc/PID/environ when it
may read it, then /proc/PID/cgroup). A job name is at most MAX_JOB printable characters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

MAX_JOB = 64
# The variables that name a job, first found wins: ours, then Slurm's, then torchrun's.
JOB_VARIABLES = ("KSPEEDFS_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# The variables that name a process's rank in its job (torchrun's, then Slurm's).
RANK_VARIABLES = ("RANK", "SLURM_PROCID")
UNKNOWN = "unknown"


def clean(name: str) -> str:
    """`name` as a job name: printable, no spaces, at most MAX_JOB characters ("" if none)."""
    kept = "".join(c if c.isprintable() and not c.isspace() else "_" for c in name.strip())
    return kept[:MAX_JOB]


def from_environ(environ: Mapping[str, str]) -> str:
    """The job named by the environment's variables, or ""."""
    for variable in JOB_VARIABLES:
        name = clean(environ.get(variable, ""))
        if name:
            return name
    return ""


def from_cgroup(text: str) -> str:
    """The job a /proc/PID/cgroup text stands for: the pod (a `pod...` folder) when there is
    one, else the innermost folder of the unified hierarchy (or of a v1 controller's, memory
    first, when the unified one is the root); "" when the process sits at the root."""
    unified, controllers = "", {}
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if number == "0" and not names:
            unified = path
        else:
            for controller in names.split(","):
                controllers[controller] = path
    candidates = [unified] + [
        controllers.get(c, "") for c in ("memory", "pids", "cpu", "name=systemd")
    ]
    path = next((p for p in candidates if p.strip("/")), "")
    parts = [p for p in path.split("/") if p]
    if not parts:
        return ""
    pods = [p for p in parts if p.startswith("pod") or "-pod" in p]
    return clean(pods[-1] if pods else parts[-1])


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def of_process(pid: int) -> str:
    """The job of process `pid` (its environment when readable, else its cgroup); UNKNOWN
    when neither names one."""
    raw = _read(f"/proc/{pid}/environ")
    environ = dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )
    return (
        from_environ(environ)
        or from_cgroup(_read(f"/proc/{pid}/cgroup").decode(errors="replace"))
        or UNKNOWN
    )


def this_job() -> str:
    """The job of this process."""
    return (
        from_environ(os.environ)
        or from_cgroup(_read("/proc/self/cgroup").decode(errors="replace"))
        or UNKNOWN
    )


def this_rank() -> int:
    """This process's rank in its job (0 when no launcher says)."""
    for variable in RANK_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0
