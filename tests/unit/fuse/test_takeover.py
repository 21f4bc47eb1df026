"""The keeper's protocol (takeover.py) over a real socket pair, and slots kept across it."""

from __future__ import annotations

import os

from kspeedfs.fuse import takeover
from kspeedfs.fuse.datasets import DatasetList
from kspeedfs.net import fdpass


def record(slots: dict[tuple[str, str], int], next_slot: int) -> dict[str, object]:
    return {
        "device": "0:99",
        "workers": 2,
        "can_take_over": True,
        "max_write": 131072,
        "slots": takeover.slot_list(slots),
        "next_slot": next_slot,
    }


def test_the_keeper_keeps_the_fds_and_slots_and_hands_them_over() -> None:
    ours, theirs = takeover.keeper_pair()
    link = takeover.KeeperLink(theirs)
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        takeover.offer(ours, None)
        assert link.handoff() is None  # nothing to take over: mount anew
        link.keep(record({("a", "u1"): 1}, 2), fds)
        ours.setblocking(False)
        msg, got = fdpass.receive(ours, takeover.MAX_FDS)
        kept = takeover.apply(None, msg, got)
        assert kept is not None and kept.workers == 2 and len(kept.fds) == 3
        link.slots_changed({("a", "u1"): 1, ("b", "u2"): 2}, 3)
        msg, got = fdpass.receive(ours, takeover.MAX_FDS)
        assert takeover.apply(kept, msg, got) is kept
        assert kept.slots() == {("a", "u1"): 1, ("b", "u2"): 2}
        assert kept.record["next_slot"] == 3
        # The next mount process is handed dups of the same files, and the record.
        ours.setblocking(True)
        takeover.offer(ours, kept)
        again = link.handoff()
        assert again is not None and again.slots() == kept.slots()
        assert [os.fstat(fd).st_ino for fd in again.fds] == [os.fstat(fd).st_ino for fd in fds]
        again.close()
        kept.close()
    finally:
        for fd in fds:
            os.close(fd)
        ours.close()
        link.close()


def test_a_message_without_fds_changes_nothing_kept() -> None:
    assert takeover.apply(None, {"kept": record({}, 1)}, []) is None
    assert takeover.apply(None, {"slots": [], "next_slot": 4}, []) is None


def test_a_taken_over_mount_numbers_its_instances_as_before() -> None:
    datasets = DatasetList([], None, None)  # type: ignore[arg-type]
    datasets.reuse_slots({("a", "u1"): 7, ("b", "u2"): 3}, 9)
    assert datasets._new_slot("b", "u2") == 3
    assert datasets._new_slot("a", "u1") == 7
    assert datasets._new_slot("a", "u9") == 9  # a new instance: above every slot given out
    assert datasets._new_slot("c", "u3") == 10
    assert datasets.next_slot == 11
