"""How soon a spawned DataLoader worker of KSpeedFolder starts: this tree against the tree
before pytorch_ext's imports were made lazy, side by side in one run.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_worker_start.py [--rounds 5] [--base REV]

Two figures per tree, each the median of `rounds` runs, the trees alternating:
- "import" (and "import CPU", its CPU seconds): the wall time of `python -c "import pytorch_ext; pytorch_ext.KSpeedFolder"` (what a
  spawned worker pays to unpickle its dataset, the interpreter's own start included);
- "first batch": from `iter(loader)` to the first batch of a DataLoader with one spawned worker
  over a KSpeedFolder of a preloaded dataset (one node, started from this tree).
The base tree (default: the commit before pytorch_ext/__init__.py last changed) is checked out
with `git worktree add` into a temporary folder and removed after; each tree runs with
PYTHONPATH naming it alone, in it (`python -c` puts its working folder first on sys.path).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.format import auth  # noqa: E402
from kspeedfs.testing.node import NodeProcess, remove_tree  # noqa: E402
from kspeedfs.testing.process import KSPEEDFS  # noqa: E402

HERE = Path(__file__).resolve().parent.parent

IMPORT = "import pytorch_ext; pytorch_ext.KSpeedFolder"

# Run under each tree: prints the seconds from iter(loader) to a spawned worker's first batch.
FIRST_BATCH = """
import sys, time
import torch.utils.data
import pytorch_ext
source, name, nodes, token = sys.argv[1:5]
ds = pytorch_ext.KSpeedFolder(source, objname=name, nodes=nodes, token=token)
loader = torch.utils.data.DataLoader(
    ds, batch_size=4, num_workers=1, multiprocessing_context="spawn", collate_fn=len
)
started = time.perf_counter()
next(iter(loader))
print(time.perf_counter() - started)
"""


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(HERE), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def default_base() -> str:
    """The commit before the last change of pytorch_ext/__init__.py (its eager imports)."""
    return git("rev-parse", git("log", "-1", "--format=%H", "--", "pytorch_ext/__init__.py") + "~1")


def timed_import(tree: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of the import in a fresh interpreter: the CPU time is the
    steadier figure on a loaded machine."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORT], env=env, cwd=tree, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


def first_batch(tree: Path, args: list[str], env: dict[str, str]) -> float:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_BATCH, *args],
        env={**env, "PYTHONPATH": str(tree)},
        cwd=tree,  # `-c` puts the working folder first on sys.path
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"first batch under {tree} failed:\n{done.stderr}")
    return float(done.stdout.split()[-1])


def make_source(folder: Path, files: int) -> None:
    for i in range(files):
        sub = folder / f"c{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i}.bin").write_bytes(os.urandom(4096))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base", default="", help="the old tree's commit (default: see above)")
    p.add_argument("--files", type=int, default=200)
    args = p.parse_args()
    base_rev = args.base or default_base()
    with tempfile.TemporaryDirectory(prefix="kspeedfs-worker-start-") as tmp:
        workdir = Path(tmp)
        base = workdir / "base"
        git("worktree", "add", "--detach", str(base), base_rev)
        source = workdir / "src"
        make_source(source, args.files)
        token = workdir / "token"
        auth.write_token(token, auth.new_admin_token())
        shm = Path("/dev/shm") / f"kspeedfs-bench-{os.urandom(5).hex()}"
        node = NodeProcess(shm, token, workdir).start()
        try:
            env = node.env()
            subprocess.run(
                [*KSPEEDFS, "preload", str(source), "--name", "ws", "-q"], env=env, check=True
            )
            run_args = [str(source), "ws", node.address, str(token)]
            trees = {f"old ({base_rev[:10]})": base, "new (this tree)": HERE}
            imports: dict[str, list[float]] = {k: [] for k in trees}
            import_cpu: dict[str, list[float]] = {k: [] for k in trees}
            batches: dict[str, list[float]] = {k: [] for k in trees}
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    wall, cpu = timed_import(tree)
                    imports[label].append(wall)
                    import_cpu[label].append(cpu)
                    batches[label].append(first_batch(tree, run_args, env))
        finally:
            node.stop()
            remove_tree(shm)
            git("worktree", "remove", "--force", str(base))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"median of {args.rounds} runs, seconds:")
    print(f"{'tree':<24} {'import':>8} {'import CPU':>11} {'first batch':>12}")
    figures = {"import": imports, "import CPU": import_cpu, "first batch": batches}
    for label in trees:
        row = " ".join(
            f"{statistics.median(runs[label]):>{len(what) + 1}.2f}"
            for what, runs in figures.items()
        )
        print(f"{label:<24} {row}")
    old, new = list(trees)
    for what, runs in figures.items():
        o, n = statistics.median(runs[old]), statistics.median(runs[new])
        print(f"{what}: {o - n:.2f} s sooner, old/new {o / n:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
