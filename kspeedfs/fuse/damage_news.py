"""The mount's side of damage news: the kernel's cached pages of damaged files dropped.

Reads the kernel answers from its page cache never reach a serving process, so its own check
of the news (system/damage.py, at each read) cannot cover them: the mount process follows
each mounted instance's table too, every POLL_S, and on news tells the kernel to drop the
pages of every file with bytes in the segments found damaged (FUSE_NOTIFY_INVAL_INODE). The
next read of one comes to a worker, which has dropped its maps and checks of those segments.
"""

from __future__ import annotations

import functools
import logging
import stat

import numpy as np
import trio

from kspeedfs.format.manifest import Manifest
from kspeedfs.fuse.datasets import SLOT_SHIFT, DatasetList
from kspeedfs.fuse.kernel import FuseSession
from kspeedfs.system.damage import DamageNews

log = logging.getLogger(__name__)

POLL_S = 0.02  # how long news waits at most to reach the kernel's page cache


def files_in(manifest: Manifest, segments: list[int]) -> list[int]:
    """The files of `manifest` with bytes in any of `segments`."""
    if not segments:
        return []
    size = manifest.segment_size
    start = manifest.data.astype(np.int64)
    end = start + manifest.size.astype(np.int64)
    hit = np.zeros(len(start), dtype=bool)
    for seg in segments:
        hit |= (start < (seg + 1) * size) & (end > seg * size)
    hit &= (manifest.mode & 0o170000) == stat.S_IFREG
    return [int(i) for i in np.flatnonzero(hit)]


async def drop_damaged_pages(datasets: DatasetList, session: FuseSession) -> None:
    """Follow the damage news of every mounted instance (decoded variants and tar views have
    their own files: not followed); runs until cancelled."""
    followed: dict[int, DamageNews] = {}
    while True:
        # One pass in a function of its own: nothing of an instance stays referenced from here
        # while this sleeps (an unloaded one's maps must go with its last user).
        follow_once(datasets, session, followed)
        await trio.sleep(POLL_S)


def follow_once(
    datasets: DatasetList, session: FuseSession, followed: dict[int, DamageNews]
) -> None:
    """Look once at the news of every mounted instance; forget the ones no longer mounted."""
    for slot, mounted in list(datasets.by_slot.items()):
        local = mounted.data.local
        if local is None or mounted.view is not None:
            continue
        news = followed.get(slot)
        if news is None:
            followed[slot] = local.news.follow()
            continue
        if news.heard:
            damaged, _passed = news.take()
            entries = files_in(local.manifest, damaged)
            if entries:
                session.invalidate_pages_async([(slot << SLOT_SHIFT) | (i + 1) for i in entries])
                said = functools.partial(
                    log.info,
                    "%s: segments %s found damaged: the kernel's pages of %d files dropped",
                    mounted.name, ",".join(map(str, damaged)), len(entries),
                )  # fmt: skip
                session.after_invalidations(said)
    for slot in followed.keys() - datasets.by_slot.keys():
        del followed[slot]
