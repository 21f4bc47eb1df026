"""Placement: which members hold each segment of a dataset, computed the same everywhere.

Rendezvous (highest-random-weight) hashing gives every (segment, member) pair a weight. Plain
rendezvous hashing gives each segment its top-weighted members, but a member then holds about
Poisson(k) segments for k per member: 1.9x the mean at 1,000 members with 17 segments each.
So the owners are a stable matching with bounded loads: pairs are taken by weight, best first,
and a member that holds its cap, max(ceil(mean), floor(1.05 x mean)), takes no more. No
member holds more than 1.05x the mean (where the mean allows it; when the greedy pass leaves
a segment short, a member passes one of its segments on to make room), and a segment goes to its
top-weighted members whenever they have room, which is nearly always on small clusters: there
the result is plain rendezvous hashing. A join or a rebalance moves the segments the new
member gains plus the ones that follow the room it frees (about 2x the ideal 1/N at 1,000
members with 17 segments each, 1.0x on small clusters; `bench/bench_cluster.py` prints both).

Lost members (etcd: down past `heal_after`, until a rebalance) are not a new placement: each
of their slots goes to the best-weighted live member that does not hold the segment yet, so a
heal copies exactly the lost member's segments and nothing else moves.

Pure functions of (dataset, segments, members, replicas, lost): no metadata server; clients
and nodes agree as long as they agree on those.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

# How far above the mean a member may be filled (bench/bench_cluster.py section 7).
LOAD_SLACK = 0.05
# Pairs taken per segment in the first pass: its replicas plus this many next-best members.
# A segment whose top members are all full is placed in a second pass over every member.
SPARE_CHOICES = 16
# Segments whose weights are computed at once (bounds the temporary S x N matrix).
WEIGHT_ROWS = 4096


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads the bits of (segment hash ^ member hash)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _segment_hashes(dataset: str, segments: Iterable[int]) -> np.ndarray:
    return np.array(
        [xxhash.xxh3_64_intdigest(f"{dataset}\0{s}".encode()) for s in segments], dtype=np.uint64
    )


def _member_hashes(members: Sequence[str]) -> np.ndarray:
    return np.array([xxhash.xxh3_64_intdigest(m.encode()) for m in members], dtype=np.uint64)


def _weights(seg_hashes: np.ndarray, member_hashes: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _mix(seg_hashes[:, None] ^ member_hashes[None, :])


def member_cap(segments: int, members: int, replicas: int) -> int:
    """The most segments one member is given."""
    mean = segments * replicas / members
    return max(math.ceil(mean), math.floor(mean * (1 + LOAD_SLACK)))


@functools.lru_cache(maxsize=64)
def _table(dataset: str, segments: int, members: tuple[str, ...], replicas: int) -> np.ndarray:
    """The owners of every segment (indices into `members`, best first), shape (S, R)."""
    n = len(members)
    owners = np.full((segments, replicas), -1, dtype=np.int32)
    if segments == 0 or n == 0:
        return owners[:, :0] if n == 0 else owners
    cap = member_cap(segments, n, replicas)
    member_h = _member_hashes(members)
    choices = min(n, replicas + SPARE_CHOICES)
    # First pass: each segment's best `choices` members, all pairs by weight, best first.
    pair_seg, pair_member, pair_weight = [], [], []
    for start in range(0, segments, WEIGHT_ROWS):
        rows = range(start, min(segments, start + WEIGHT_ROWS))
        w = _weights(_segment_hashes(dataset, rows), member_h)
        top = np.argpartition(w, n - choices, axis=1)[:, n - choices :] if choices < n else None
        if top is None:
            top = np.broadcast_to(np.arange(n), w.shape)
        pair_seg.append(np.repeat(np.arange(rows.start, rows.stop), top.shape[1]))
        pair_member.append(top.ravel())
        pair_weight.append(np.take_along_axis(w, top, axis=1).ravel())
    load = [0] * n
    held: list[list[int]] = [[] for _ in range(segments)]
    _take(
        np.concatenate(pair_seg),
        np.concatenate(pair_member),
        np.concatenate(pair_weight),
        owners,
        load,
        held,
        cap,
        replicas,
    )
    short = np.array([s for s in range(segments) if len(held[s]) < replicas], dtype=np.int64)
    if short.size:  # their best members were full: every member, by weight
        w = _weights(_segment_hashes(dataset, short.tolist()), member_h).ravel()
        seg = np.repeat(short, n)
        member = np.tile(np.arange(n), short.size)
        _take(seg, member, w, owners, load, held, cap, replicas)
        for s in short.tolist():
            while len(held[s]) < replicas:
                _make_room(dataset, s, member_h, owners, load, held, cap)
    owners.flags.writeable = False
    return owners


def _make_room(
    dataset: str,
    s: int,
    member_h: np.ndarray,
    owners: np.ndarray,
    load: list[int],
    held: list[list[int]],
    cap: int,
) -> None:
    """Give segment s one more owner when every member with room holds it already (greedy
    taking can end so when the caps leave little slack: 9 segments x 2 replicas on 3 members
    of cap 6). A full member f that lacks s passes one of its segments t to a member r with
    room that lacks t, then takes s: f stays at its cap and r gains one, so no cap is passed.
    Such a t always exists: r has room, so it cannot hold all `cap` segments of f besides s."""
    order = np.argsort(_weights(_segment_hashes(dataset, [s]), member_h)[0], kind="stable")
    best_first = [int(m) for m in order[::-1]]
    f = next(m for m in best_first if m not in held[s])  # full, as every member lacking s is
    for r in best_first:
        if load[r] >= cap:
            continue
        passable = [
            t for t in np.flatnonzero((owners == f).any(axis=1)).tolist() if r not in held[t]
        ]
        if not passable:
            continue
        r_weights = _weights(_segment_hashes(dataset, passable), member_h[[r]])[:, 0]
        t = passable[int(np.argmax(r_weights))]  # the one r is best placed for
        i = held[t].index(f)
        held[t][i] = owners[t, i] = r
        load[r] += 1
        owners[s, len(held[s])] = f
        held[s].append(f)
        return
    raise AssertionError(f"no member can pass a segment on for segment {s}")  # see above


def _take(
    seg: np.ndarray,
    member: np.ndarray,
    weight: np.ndarray,
    owners: np.ndarray,
    load: list[int],
    held: list[list[int]],
    cap: int,
    replicas: int,
) -> None:
    """Greedy over (segment, member) pairs by weight, best first: a pair is taken when the
    segment lacks owners and the member has room and does not hold the segment yet."""
    order = np.argsort(weight, kind="stable")[::-1]
    needed = sum(replicas - len(h) for h in held)
    for s, m in zip(seg[order].tolist(), member[order].tolist(), strict=True):
        h = held[s]
        if len(h) < replicas and load[m] < cap and m not in h:
            owners[s, len(h)] = m
            h.append(m)
            load[m] += 1
            needed -= 1
            if not needed:
                return


class Placement:
    """Where the segments of one dataset instance are: `owners(seg)` and `ranked(seg, n)`."""

    def __init__(
        self,
        dataset: str,
        segments: int,
        members: Sequence[str],
        replicas: int = 1,
        lost: Iterable[str] = (),
    ):
        self.dataset = dataset
        self.segments = segments
        self.members = tuple(sorted(set(members)))
        self.replicas = max(1, min(replicas, len(self.members)))
        self.lost = frozenset(lost) & set(self.members)
        self._member_h = _member_hashes(self.members)
        self._table = _table(dataset, segments, self.members, self.replicas)
        self._substituted: dict[int, list[str]] = {}

    def owners(self, seg: int) -> list[str]:
        """The members that hold a segment, best first (the order reads try them in); a lost
        member's place goes to the best-weighted live member not holding it already."""
        if not 0 <= seg < self.segments:
            raise IndexError(f"segment {seg} of {self.dataset} is out of range")
        placed = [self.members[i] for i in self._table[seg].tolist()]
        if not self.lost.intersection(placed):
            return placed
        found = self._substituted.get(seg)
        if found is None:
            kept = [m for m in placed if m not in self.lost]
            spare = [m for m in self._by_weight(seg) if m not in self.lost and m not in kept]
            found = self._substituted[seg] = kept + spare[: len(placed) - len(kept)]
        return found

    def ranked(self, seg: int, count: int) -> list[str]:
        """`count` members to look for a segment on: its owners, then the other live members by
        weight (where a lost owner's copy is made, and a reader's last resorts)."""
        owners = self.owners(seg)
        rest = [m for m in self._by_weight(seg) if m not in owners and m not in self.lost]
        return (owners + rest)[: max(count, len(owners))]

    def assignment(self) -> dict[str, list[int]]:
        """member -> the segments it holds (every live member appears, possibly with none)."""
        out: dict[str, list[int]] = {m: [] for m in self.members if m not in self.lost}
        for seg in range(self.segments):
            for m in self.owners(seg):
                out[m].append(seg)
        return out

    def _by_weight(self, seg: int) -> list[str]:
        w = _weights(_segment_hashes(self.dataset, [seg]), self._member_h)[0]
        return [self.members[i] for i in np.argsort(w, kind="stable")[::-1]]
