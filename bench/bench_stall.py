"""Does pytorch_ext.watch tell the truth, and what does it cost? Its stall against the loop's
own timing of next(loader), and the microseconds a next() pays for being watched.

    .venv/bin/python bench/bench_stall.py [--svg FILE] [--calls 1000000]

One node (a subprocess of this tree) with /metrics; each run is tests/watchloop.py in a process
of its own (a job of its own): a DataLoader with real workers whose "GPU step" is a sleep.
Printed per run: the loop's own stall (truth), the stall the watch reported, their difference
in points, the stall `kspeedfs jobs` shows for it, the hit rate, and the cause split: the
workers' fetch time in CPU (__getitem__ but reads) and in kspeedfs reads by path. Then the cost:
a watched iterable (pytorch_ext.watch) and the KSPEEDFS_WATCH hook's patched __next__ against
the same unwatched, in µs per next() (the issue's bound: 2 µs). `--svg` draws the picture of
a run that turns from computing to waiting (kspeedfs report JOB --svg).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kspeedfs.client import read_times  # noqa: E402
from kspeedfs.format import auth  # noqa: E402
from kspeedfs.format.contract.jobs import JobsReq  # noqa: E402
from kspeedfs.sample import make_sample  # noqa: E402
from kspeedfs.testing.node import NodeProcess, remove_tree  # noqa: E402
from kspeedfs.testing.process import free_port  # noqa: E402

LOOP = ROOT / "tests" / "watchloop.py"


def run(config: dict, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, str(LOOP), json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def scenarios(node: NodeProcess, source: Path) -> list[tuple[str, dict]]:
    fast = {
        "kind": "fast",
        "root": str(source / "train"),
        "nodes": node.address,
        "token": str(node.token_file),
        "batch": 8,
        "workers": 2,
        "persistent": True,
    }
    return [
        ("preloaded, long steps", {**fast, "step": 0.05, "epochs": 3}),
        ("preloaded, short steps", {**fast, "step": 0.001, "epochs": 3}),
        ("over the socket, short steps", {**fast, "local": False, "step": 0.001, "epochs": 3}),
        (
            "slow __getitem__, 1 worker",
            {
                "kind": "slow",
                "samples": 800,
                "delay": 0.004,
                "batch": 4,
                "workers": 1,
                "step": 0.002,
            },
        ),
        (
            "heavy transform, 2 workers",
            {
                "kind": "slow",
                "samples": 800,
                "delay": 0.004,
                "batch": 4,
                "workers": 2,
                "step": 0.006,
            },
        ),
    ]


def accuracy(node: NodeProcess, source: Path) -> None:
    print(
        f"{'run':<30} {'truth':>7} {'reported':>9} {'diff':>6} {'jobs shows':>28} {'hit %':>6}"
        "  workers' time: cpu / local / remote / source"
    )
    for i, (title, config) in enumerate(scenarios(node, source)):
        job = f"bench-{i}"
        env = {**node.env(), "KSPEEDFS_JOB": job}
        r = run({**config, "explicit": True, "linger": 1.2}, env)
        with node.client() as client:
            (entry,) = client.call(JobsReq(job=job)).jobs
        shown = f"{entry.stall:.1%} {entry.datasets and 'on ' + entry.datasets[0].name or ''}"
        hit = "-" if entry.hit_rate is None else f"{entry.hit_rate:.0%}"
        cause = read_times.cause(entry.read_seconds, entry.fetch_seconds)
        split = " / ".join(f"{cause.get(p, 0):.0%}" for p in ("cpu", *read_times.PATHS))
        print(
            f"{title:<30} {r['truth']:>7.1%} {r['reported']:>9.1%} "
            f"{100 * (r['reported'] - r['truth']):>+6.2f} {shown:>28} {hit:>6}  {split}"
        )


def cost(calls: int) -> None:
    from pytorch_ext import loop_watch, watch_hook

    os.environ["KSPEEDFS_WATCH_REPORT"] = "0"
    items = list(range(calls))

    def per_next(iterable) -> float:
        t = time.perf_counter()
        for _ in iterable:
            pass
        return (time.perf_counter() - t) / calls * 1e6

    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (the tables each pass prints)
    plain = min(per_next(iter(items)) for _ in range(3))
    watched = min(per_next(loop_watch.watch(items)) for _ in range(3))

    # The hook's patch on stand-ins of torch's two classes (the same code patches torch's).
    class Iter:
        _index_sampler = types.SimpleNamespace(batch_size=8)

        def __init__(self) -> None:
            self.it = iter(items)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.it)

    class Loader:
        def __iter__(self):
            return Iter()

    module = types.SimpleNamespace(DataLoader=Loader, _BaseDataLoaderIter=Iter)
    bare = min(per_next(Loader()) for _ in range(3))
    watch_hook.patch(module)  # type: ignore[arg-type]
    hooked = min(per_next(Loader()) for _ in range(3))
    sys.stderr = sys.__stderr__
    print(f"\ncost per next() over {calls:,} calls (best of 3):")
    print(
        f"  pytorch_ext.watch(iterable)   {watched - plain:6.3f} µs  ({plain:.3f} -> {watched:.3f})"
    )
    print(f"  KSPEEDFS_WATCH=1 (hook)       {hooked - bare:6.3f} µs  ({bare:.3f} -> {hooked:.3f})")
    print("  (at 1,000 batches/s that is", f"{(hooked - bare) / 1000:.3%} of the loop's time)")


def picture(node: NodeProcess, source: Path, svg: Path) -> None:
    """A run that computes (long steps), then waits on remote reads (the fast path over the
    node's socket), then on a heavy transform, drawn."""
    env = {**node.env(), "KSPEEDFS_JOB": "bench-picture"}
    config = {"batch": 4, "workers": 1}
    script = (
        f"import json, sys, time; sys.path.insert(0, {str(LOOP.parent)!r}); import watchloop; "
        "from pytorch_ext import watch; "
        "[watchloop.timed_loop(watch(watchloop.loader_of(c)), c['step'], c.get('epochs', 1)) "
        "for c in json.loads(sys.argv[1])]; "
        "time.sleep(1.5)"
    )
    remote = {
        "kind": "fast",
        "local": False,
        "root": str(source / "train"),
        "nodes": node.address,
        "token": str(node.token_file),
    }
    phases = [
        {**config, "kind": "slow", "samples": 160, "delay": 0.002, "step": 0.03},
        {**config, **remote, "step": 0.001, "epochs": 8},
        {**config, "kind": "slow", "samples": 400, "delay": 0.006, "step": 0.004},
        {**config, "kind": "slow", "samples": 240, "delay": 0.003, "step": 0.012},
    ]
    subprocess.run([sys.executable, "-c", script, json.dumps(phases)], env=env, check=True)
    subprocess.run(
        [sys.executable, "-m", "kspeedfs.cli", "report", "bench-picture", "--svg", str(svg)],
        env=env,
        check=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--svg", type=Path, help="draw a changing run's picture here")
    parser.add_argument("--calls", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        token = folder / "token"
        auth.write_token(token, auth.new_admin_token())
        shm = Path("/dev/shm") / f"kspeedfs-bench-stall-{os.getpid()}"
        port = free_port()
        node = NodeProcess(shm, token, folder, extra=("--metrics-listen", f"127.0.0.1:{port}"))
        node.start()
        try:
            source = folder / "data"
            make_sample(source / "train", classes=4, per_class=40, file_size=3000, bases=3)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kspeedfs.cli",
                    "preload",
                    str(source),
                    "--name",
                    "fastdata",
                    "-q",
                ],
                env=node.env(),
                check=True,
            )
            accuracy(node, source)
            print("\n$ kspeedfs jobs")
            jobs = [sys.executable, "-m", "kspeedfs.cli", "jobs"]
            subprocess.run(jobs, env=node.env(), check=True)
            if args.svg:
                picture(node, source, args.svg)
                print(f"\nwrote {args.svg}")
        finally:
            node.stop()
            remove_tree(shm)
    cost(args.calls)


if __name__ == "__main__":
    main()
