"""`kspeedfs jobs`, `top`, `report` and `dashboard`: whether each job waits on its data.

Each node keeps the jobs whose training loops report to it (kspeedfs.node.jobs); a job with
ranks on several nodes is one row, its figures summed over them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from kspeedfs.cli.settings import settings_from
from kspeedfs.cli.tables import print_table
from kspeedfs.client import read_times
from kspeedfs.format import stall
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.jobs import JobDataset, JobEntry, JobSecond, JobsReq
from kspeedfs.format.errors import AuthError, InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.units import format_size

W = TypeVar("W", JobDataset, JobSecond)

COLUMNS = (
    "JOB",
    "RANKS",
    "SAMPLES/S",
    "STALL (10 s)",
    "STALL (RUN)",
    "AU / 90%",
    "CAUSE (WORKERS)",
    "HIT %",
    "DATASETS",
    "RESIDENT",
)


def ask_jobs(settings: Settings, job: str = "", history: bool = False) -> list[JobEntry]:
    """Every node's jobs (or job `job`), a job on several nodes merged into one entry."""
    from kspeedfs.format.tls import client_context
    from kspeedfs.net.connection import NodeClient

    found: dict[str, list[JobEntry]] = {}
    errors: list[str] = []
    for address in settings.nodes:
        try:
            with NodeClient(
                address, settings.credential(), settings.timeout, client_context(settings)
            ) as client:
                answer = client.call(JobsReq(job=job, history=history))
        except NotFound:
            continue
        except KSpeedError as e:
            if len(settings.nodes) == 1 or isinstance(e, AuthError):
                raise
            errors.append(f"{address}: {e}")
            continue
        for entry in answer.jobs:
            found.setdefault(entry.job, []).append(entry)
    for error in errors:
        print(f"kspeedfs: no answer from {error}", file=sys.stderr)
    if job and not found:
        raise NotFound(f"no job {job!r} reports to any node")
    merged = [merge(entries) for entries in found.values()]
    return sorted(merged, key=lambda e: (-e.samples_per_s, e.job))


def merge(entries: Sequence[JobEntry]) -> JobEntry:
    """One job's entries of several nodes as one: sums, its stall recomputed from them."""
    if len(entries) == 1:
        return entries[0]
    blocked = sum(e.blocked for e in entries)
    busy = sum(e.busy for e in entries)
    ranks = sum(e.ranks for e in entries)
    datasets: dict[str, JobDataset] = {}
    for e in entries:
        for d in e.datasets:
            datasets[d.name] = _sum(datasets[d.name], d) if d.name in datasets else d
    seconds: dict[float, JobSecond] = {}
    for e in entries:  # each node counts seconds from when it first heard of the job
        for s in e.history:
            seconds[s.t] = _sum(seconds[s.t], s) if s.t in seconds else s
    return dataclasses.replace(
        entries[0],
        ranks=ranks,
        blocked=blocked,
        busy=busy,
        batches=sum(e.batches for e in entries),
        samples=sum(e.samples for e in entries),
        samples_per_s=sum(e.samples_per_s for e in entries),
        stall=stall.stall(blocked, busy),
        recent_stall=sum(e.recent_stall * e.ranks for e in entries) / max(ranks, 1),
        idle_s=min(e.idle_s for e in entries),
        datasets=sorted(datasets.values(), key=lambda d: d.name),
        fetch_seconds=sum(e.fetch_seconds for e in entries),
        read_seconds={
            p: sum(e.read_seconds.get(p, 0.0) for e in entries) for p in read_times.PATHS
        },
        history=[seconds[t] for t in sorted(seconds)],
    )


def _sum(a: W, b: W) -> W:
    """`a` with each number field the sum of `a`'s and `b`'s (its name and time kept)."""
    kept = ("name", "t")
    return dataclasses.replace(
        a,
        **{
            f.name: getattr(a, f.name) + getattr(b, f.name)
            for f in dataclasses.fields(a)
            if f.name not in kept
        },
    )


def _short_verdict(share: float) -> str:
    return {"not input-bound": "ok", "data-bound (moderately)": "moderate"}.get(
        stall.verdict(share), "high"
    )


def job_row(e: JobEntry) -> tuple[str, ...]:
    hit = e.hit_rate
    return (
        e.job,
        str(e.ranks),
        f"{e.samples_per_s:.1f}",
        f"{e.recent_stall:.1%} {_short_verdict(e.recent_stall)}" if e.samples_per_s else "idle",
        f"{e.stall:.1%} {_short_verdict(e.stall)}",
        f"{1 - e.stall:.0%} {'pass' if 1 - e.stall >= stall.AU_PASS else 'below'}",
        _dominant(e),
        "-" if hit is None else f"{hit:.1%}",
        ",".join(d.name for d in e.datasets) or "-",
        format_size(sum(d.resident_bytes for d in e.datasets)),
    )


def _dominant(e: JobEntry) -> str:
    """The largest share of the workers' fetch time: a read path or cpu ("-": none timed)."""
    shares = read_times.cause(e.read_seconds, e.fetch_seconds)
    if not shares:
        return "-"
    path = max(shares, key=lambda p: shares[p])
    return f"{path} {shares[path]:.0%}"


def job_json(e: JobEntry) -> dict[str, Any]:
    out = e.to_wire()
    out.update(
        verdict=stall.verdict(e.stall),
        accelerator_utilisation=1 - e.stall,
        hit_rate=e.hit_rate,
        cause=read_times.cause(e.read_seconds, e.fetch_seconds),
        datasets=[d.to_wire() for d in e.datasets],
    )
    out.pop("history", None)
    return out


def jobs_table(entries: Sequence[JobEntry]) -> list[tuple[str, ...]]:
    return [COLUMNS, *(job_row(e) for e in entries)]


def cmd_jobs(args: argparse.Namespace) -> int:
    entries = ask_jobs(settings_from(args))
    if args.json:
        print(json.dumps({"jobs": [job_json(e) for e in entries]}, indent=2))
        return 0
    if not entries:
        print("no job reports to the nodes (watch a loop: pytorch_ext.watch or KSPEEDFS_WATCH=1)")
        return 0
    print_table(jobs_table(entries))
    return 0


CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def cmd_top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise InvalidArgument(f"--interval must be more than 0, not {args.interval}")
    settings = settings_from(args)
    shown = 0
    while args.iterations == 0 or shown < args.iterations:
        entries = ask_jobs(settings)
        if sys.stdout.isatty():
            sys.stdout.write(CLEAR)
        stamp = time.strftime("%H:%M:%S")
        print(
            f"kspeedfs top  {stamp}  {len(entries)} jobs  (stall: TF Profiler's scale; AU: MLPerf Storage's 90%)"
        )
        print_table(jobs_table(entries))
        sys.stdout.flush()
        shown += 1
        if args.iterations == 0 or shown < args.iterations:
            time.sleep(args.interval)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kspeedfs.cli import stall_picture

    (entry,) = ask_jobs(settings_from(args), job=args.job, history=True)
    print(
        f"{entry.job}: {stall.summary(entry.blocked, entry.busy)}; {stall.au_verdict(entry.stall)}"
    )
    picture = stall_picture.svg(entry)
    if args.png and not shutil.which("rsvg-convert"):
        raise InvalidArgument("--png needs rsvg-convert (librsvg2-bin); --svg needs nothing")
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(picture)
        print(f"wrote {args.svg}")
    if args.png:
        subprocess.run(
            ["rsvg-convert", "--format", "png", "--output", args.png],
            input=picture.encode(),
            check=True,
        )
        print(f"wrote {args.png}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from kspeedfs.cli import dashboard

    print(json.dumps(dashboard.grafana(args.datasource), indent=2))
    return 0
