"""Request counters shared by the processes serving one mount: a row per serving thread.

One memfd, mapped by the supervisor and every worker; each row belongs to one serving thread
(a worker process has one), which alone writes it, so increments need no lock. (With
fuse_uring a worker's ring threads count in its row too: an increment may rarely be lost when
two of them meet, which statistics can bear.) Any process reads every row:
`user.kspeedfs.stats` is answered by whichever worker gets the request.
"""

from __future__ import annotations

import mmap
import os

from kspeedfs.client import latency

SLOTS = 64  # opcodes below this count in their own slot; the rest in slot 0 ("other")
ROW_SLOTS = 80  # and past them, the latency histogram of remote reads
# Slots no opcode uses, for where cluster reads were served from (ClusterReader.stats).
SOURCE_SLOTS = {
    "local": 60,
    "remote": 61,
    "source": 62,
    "local_bytes": 57,  # and the bytes each path served (the mount's metrics)
    "remote_bytes": 58,
    "source_bytes": 59,
    "hedged": 56,  # reads sent to a second owner after the first was late (duplicates)
    "hedge_won": 55,  # of which the second answered first
    "past_deadline": 54,  # node requests given up at the read's deadline
    **{key: SLOTS + i for i, key in enumerate(latency.keys(latency.REMOTE_READ))},
}
assert max(SOURCE_SLOTS.values()) < ROW_SLOTS
RING_SLOT = 63  # requests that came through io_uring rings (fuse_uring), also counted by opcode
NOT_REQUESTS = frozenset(SOURCE_SLOTS.values()) | {RING_SLOT}
ROW_BYTES = ROW_SLOTS * 8


class SharedCounters:
    """`rows` rows of ROW_SLOTS unsigned 64-bit counters in shared memory."""

    def __init__(self, fd: int, rows: int):
        self.fd = fd
        self.rows = rows
        self._map = mmap.mmap(fd, rows * ROW_BYTES)
        self._view = memoryview(self._map).cast("Q")

    @classmethod
    def create(cls, rows: int) -> SharedCounters:
        fd = os.memfd_create("kspeedfs-fuse-counters", os.MFD_CLOEXEC)
        os.ftruncate(fd, rows * ROW_BYTES)
        return cls(fd, rows)

    def row(self, i: int) -> memoryview:
        """The counters of row i, indexed by opcode (what its serving thread increments)."""
        return self._view[i * ROW_SLOTS : (i + 1) * ROW_SLOTS]

    def totals(self, names: dict[int, str]) -> dict[str, int]:
        """Requests by kind over every row (`names`: opcode -> kind; others count as other)."""
        out: dict[str, int] = {}
        for r in range(self.rows):
            row = self.row(r)
            for slot in range(SLOTS):
                n = row[slot]
                if n and slot not in NOT_REQUESTS:
                    name = names.get(slot, "other")
                    out[name] = out.get(name, 0) + n
        return out

    def by_row(self) -> list[int]:
        """Requests answered by each row's thread."""
        return [
            sum(n for slot, n in enumerate(self.row(r)) if slot not in NOT_REQUESTS)
            for r in range(self.rows)
        ]

    def ring_requests(self) -> int:
        """Requests that came through io_uring rings, over every row."""
        return sum(self.row(r)[RING_SLOT] for r in range(self.rows))

    def sources(self) -> dict[str, int]:
        """Where cluster reads were served from, over every row."""
        return {
            kind: sum(self.row(r)[slot] for r in range(self.rows))
            for kind, slot in SOURCE_SLOTS.items()
        }

    def close(self) -> None:
        self._view.release()
        self._map.close()
        os.close(self.fd)
