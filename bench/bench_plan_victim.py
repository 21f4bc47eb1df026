"""What choosing a victim costs the `plan` policy with several ranks' plans, side by side: its
victim() (every segment's uses ahead counted once a miss, one bincount a plan) against the
per-segment sum over the plans (PlannedUses.uses_ahead for each resident segment).

    .venv/bin/python bench/bench_plan_victim.py [--segments 8192] [--resident 4096]

A dataset of `segments` segments, `resident` of them in memory, and 1, 8 and 64 readers, each
with a plan of draws with replacement over two epochs of its share; milliseconds a choice (on
the node's event loop, once for every miss the budget is short for) and their ratio. No
memory to warm: it runs in the policy alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.node.readthrough.policy import Key, PlannedUses  # noqa: E402

CHOICES = 50


def build(readers: int, segments: int, resident: int, seed: int) -> PlannedUses:
    rng = np.random.default_rng(seed)
    policy = PlannedUses()
    for seg in range(resident):
        policy.admitted(("a", seg))
    uses = max(2, 2 * segments // readers)  # two epochs of a rank's share
    for r in range(readers):
        plan = rng.integers(0, segments, uses)
        policy.planned("a", plan, margin=1, reader=f"{r}/{readers}")
    return policy


def per_segment_choice(policy: PlannedUses, incoming: Key) -> Key | None:
    """The same choice as victim(), each resident segment's uses summed plan by plan."""
    fewest = max(0, policy.uses_ahead(incoming) - 1) - 1
    victim = None
    for key in list(policy._order):
        n = policy.uses_ahead(key)
        if n < fewest:
            fewest, victim = n, key
    return victim


def ms_a_choice(policy: PlannedUses, resident: int, vectorized: bool) -> float:
    start = time.perf_counter()
    for i in range(CHOICES):
        incoming = ("a", resident + i)
        if vectorized:
            victim = policy.victim(incoming, others=[])
            if victim is not None:
                policy.admitted(victim)  # put it back: every choice over the same residents
        else:
            per_segment_choice(policy, incoming)
    return (time.perf_counter() - start) / CHOICES * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=8192)
    parser.add_argument("--resident", type=int, default=4096)
    args = parser.parse_args()
    print(f"{args.segments} segments, {args.resident} resident, {CHOICES} choices each")
    print(f"{'readers':>8} {'victim() ms':>12} {'per-segment ms':>15} {'ratio':>6}")
    for readers in (1, 8, 64):
        fast = ms_a_choice(build(readers, args.segments, args.resident, 0), args.resident, True)
        slow = ms_a_choice(build(readers, args.segments, args.resident, 0), args.resident, False)
        print(f"{readers:>8} {fast:>12.2f} {slow:>15.2f} {slow / fast:>6.1f}")


if __name__ == "__main__":
    main()
