"""Many read-through datasets on one node's budget: do they settle at their shares, or evict
each other on every miss? This code's node against another revision's, side by side.

    .venv/bin/python bench/bench_tenants.py [--before REV] [--budget 128MiB]
        [--sizes 192,192] [--epochs 3] [--policy stable]

One node (a subprocess run from this tree, or from a git worktree of REV made in a temporary
folder), a budget, and read-through datasets of the given sizes in MiB (files of one segment
each: a miss admits one file), read at once through the fast path, interleaved file
by file (`strict`: one of each in turn; `random`: jobs at their own pace), each in its own
seeded shuffle every epoch. Printed per epoch and dataset: the share
of it read from the source (the node's counter), its evictions, and at the end its resident
bytes against its max-min share; the expected source share from the second epoch on is
1 - share/size (issue 39: two 192 MiB datasets on 128 MiB read 4.1-4.8x their size per epoch
when each miss could take from a dataset holding one segment more). Every byte is compared
with the source. The readers run this tree's client either way: only the node differs.
Then the queue: how long after an unload frees room a queued preload (`preload --queue`)
leaves the queue (target: within 1 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from kspeedfs.client import admin  # noqa: E402
from kspeedfs.client.admin import connect  # noqa: E402
from kspeedfs.format.contract.node import Unload  # noqa: E402
from kspeedfs.format.units import format_size, parse_size  # noqa: E402
from kspeedfs.node.readthrough.shares import Demand, fair_shares  # noqa: E402
from kspeedfs.testing.bench import warm_memory  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import KSpeedFolder  # noqa: E402

TREE = Path(__file__).resolve().parent.parent


def write_sources(
    root: Path, sizes: list[int], segment: int
) -> list[tuple[Path, dict[str, bytes]]]:
    rng = np.random.default_rng(0)
    out = []
    for k, size in enumerate(sizes):
        src = root / f"src{k}"
        files = {}
        for i in range(size):
            rel = f"c{i % 4}/f{i:05d}.bin"
            data = rng.integers(0, 256, segment, dtype=np.uint8).tobytes()
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
            files[rel] = data
        out.append((src, files))
    return out


def run_side(
    code: Path, work: Path, sources: list[tuple[Path, dict[str, bytes]]], args: argparse.Namespace
) -> tuple[list[list[tuple[float, int]]], list[int], int]:
    """Per epoch, per dataset (source share, evictions); resident bytes at the end; wrong bytes."""
    # The node subprocess runs that tree: `python -m` puts its working folder first.
    os.environ["PYTHONPATH"] = str(code)
    os.chdir(code)
    cache = LocalCache(
        work,
        parse_size(args.budget),
        segment_size=str(args.segment),
        extra=("--eviction", args.policy),
    )
    cache.start()
    try:
        sets = []
        for k, (src, files) in enumerate(sources):
            admin.register_source(cache.settings, str(src), name=f"d{k}")
            ds = KSpeedFolder(
                src, objname=f"d{k}", nodes=str(cache.address), token=cache.token_file
            )
            sets.append((f"d{k}", ds, files))

        def counters(name: str) -> dict[str, int]:
            found: dict[str, int] = cache.request("status")["cache"]["datasets"][name]
            return found

        rng = np.random.default_rng(11)
        wrong, epochs = 0, []
        for _ in range(args.epochs):
            before = [counters(name) for name, _, _ in sets]
            # strict: one file of each in turn; random: a random one of those with reads
            # left reads next (jobs at their own pace).
            orders = [list(rng.permutation(len(ds))) for _, ds, _ in sets]
            turn = 0
            while any(orders):
                left = [k for k, o in enumerate(orders) if o]
                turn += 1
                k = left[turn % len(left)] if args.interleave == "strict" else int(rng.choice(left))
                _, ds, files = sets[k]
                i = int(orders[k].pop())
                got = np.frombuffer(bytes(ds[i]), np.uint8)
                want = np.frombuffer(files[ds.files[i]], np.uint8)
                wrong += int(np.count_nonzero(got != want)) if len(got) == len(want) else len(want)
            row = []
            for (name, _, files), b in zip(sets, before, strict=True):
                now = counters(name)
                total = sum(map(len, files.values()))
                row.append(
                    (
                        (now["source_bytes"] - b["source_bytes"]) / total,
                        now["evictions"] - b["evictions"],
                    )
                )
            epochs.append(row)
        resident = [counters(name)["in_memory"] * args.segment for name, _, _ in sets]
        return epochs, resident, wrong
    finally:
        cache.node.stop()
        subprocess.run(["chattr", "-R", "-i", str(cache.shm_dir)], capture_output=True)
        subprocess.run(["rm", "-rf", str(cache.shm_dir)], capture_output=True)


def queue_latency(work: Path, budget: int, rounds: int) -> list[float]:
    """Seconds from an unload's answer to a queued preload (`preload --queue`) leaving the
    queue, `rounds` times: a dataset of 5/8 of the budget loaded, a second one queued behind
    it, the first unloaded."""
    cache = LocalCache(work, budget, segment_size="1MiB")
    cache.start()
    rng = np.random.default_rng(3)
    sources = []
    for name in ("a", "b"):
        folder = work / f"queue-{name}"
        for i in range(budget * 5 // 8 // (1 << 20)):
            (folder / f"f{i:04d}").parent.mkdir(parents=True, exist_ok=True)
            (folder / f"f{i:04d}").write_bytes(rng.bytes(1 << 20))
        sources.append(folder)
    out = []
    try:
        with connect(cache.settings) as client:
            held, queued = sources
            for r in range(rounds):
                first, second = f"held{r}", f"queued{r}"
                admin.preload(cache.settings, str(held), first, show_progress=False)
                admin.start_preload(client, second, str(queued), "offline", queue=True)
                assert admin.load_status(client, second).state == "queued"
                client.call(Unload(name=first))
                unloaded = time.perf_counter()
                while admin.load_status(client, second).state == "queued":
                    time.sleep(0.005)
                out.append(time.perf_counter() - unloaded)
                admin.wait_ready(client, second)
                client.call(Unload(name=second))
                held, queued = queued, held
    finally:
        cache.node.stop()
        subprocess.run(["chattr", "-R", "-i", str(cache.shm_dir)], capture_output=True)
        subprocess.run(["rm", "-rf", str(cache.shm_dir)], capture_output=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default="", help="a git revision whose node to run beside this one")
    p.add_argument("--budget", default="128MiB")
    p.add_argument("--sizes", default="96,160", help="dataset sizes in files of one segment")
    p.add_argument("--segment", type=parse_size, default=1 << 20, help="segment size")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--queue-rounds", type=int, default=5, help="queue latency rounds (0: none)")
    p.add_argument("--interleave", default="strict", choices=("strict", "random"))
    p.add_argument("--policy", default="stable", choices=("stable", "plan", "lru"))
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    shares = fair_shares(
        parse_size(args.budget), {f"d{k}": Demand(s * args.segment) for k, s in enumerate(sizes)}
    )
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        root = Path(tmp)
        sources = write_sources(root, sizes, args.segment)
        sides = [("this tree", TREE)]
        if args.before:
            old = root / "before"
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(TREE),
                    "worktree",
                    "add",
                    "-q",
                    "--detach",
                    str(old),
                    args.before,
                ],
                check=True,
            )
            sides.insert(0, (f"before ({args.before})", old))
        try:
            results = {}
            for label, code in sides:
                warm_memory(parse_size(args.budget) * 2)
                results[label] = run_side(code, root / label.split()[0], sources, args)
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(TREE), "worktree", "remove", "--force", str(old)])
    print(
        f"budget {args.budget}, policy {args.policy}, datasets (segments) {sizes}, "
        f"segments {format_size(args.segment)}; expected source share per epoch after the first: "
        + ", ".join(
            f"d{k} {1 - shares[f'd{k}'] / (s * args.segment):.2f}" for k, s in enumerate(sizes)
        )
    )
    print(
        f"{'side':<22} {'epoch':>5}  "
        + "  ".join(f"d{k} source/evictions" for k in range(len(sizes)))
    )
    for label, (epochs, _resident, _wrong) in results.items():
        for e, row in enumerate(epochs, 1):
            cells = "  ".join(f"{share:>9.2f} / {ev:>8}" for share, ev in row)
            print(f"{label:<22} {e:>5}  {cells}")
    for label, (_epochs, resident, wrong) in results.items():
        held = ", ".join(
            f"d{k} {format_size(r)} of {format_size(shares[f'd{k}'])}"
            for k, r in enumerate(resident)
        )
        print(f"{label:<22} resident: {held}; wrong bytes {wrong}")
    if args.queue_rounds:
        with tempfile.TemporaryDirectory(prefix="bench-queue-") as tmp:
            waits = queue_latency(Path(tmp), parse_size(args.budget), args.queue_rounds)
        print(
            f"queued preload started after the unload that freed room: median "
            f"{statistics.median(waits) * 1000:.0f} ms, max {max(waits) * 1000:.0f} ms "
            f"({len(waits)} rounds; target <= 1 s)"
        )
    if len(results) == 2:
        (_, (old, _, _)), (_, (new, _, _)) = results.items()
        later_old = sum(s for row in old[1:] for s, _ in row)
        later_new = sum(s for row in new[1:] for s, _ in row)
        if later_new:
            print(
                f"source bytes after the first epoch, before / this tree: {later_old / later_new:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
