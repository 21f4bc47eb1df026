"""The shared node-health table's file goes with its last user, in one process: a second
user holds it up; closing or dropping the last one removes it."""

from __future__ import annotations

import gc
from pathlib import Path

from kspeedfs.client.health import NodeHealth


def test_the_last_user_to_close_removes_the_file(tmp_path: Path) -> None:
    table = tmp_path / "health"
    first, second = NodeHealth(str(table)), NodeHealth(str(table))
    first.suspect_for("n:1", 30)
    first.close()
    assert table.exists()
    assert second.is_suspect("n:1")  # what the first wrote is still shared
    third = NodeHealth(str(table))
    assert third.is_suspect("n:1")  # the same file, not a new one
    second.close()
    assert table.exists()
    third.close()
    assert not table.exists()


def test_a_user_dropped_without_close_leaves_too(tmp_path: Path) -> None:
    table = tmp_path / "health"
    NodeHealth(str(table)).down_for("n:1", 30)
    gc.collect()
    assert not table.exists()
    again = NodeHealth(str(table))  # a new file, nothing in it
    assert not again.is_down("n:1")
    again.close()
    assert not table.exists()


def test_a_table_that_is_not_ours_is_never_removed(tmp_path: Path) -> None:
    open_to_all = tmp_path / "open"
    open_to_all.touch(mode=0o666)
    open_to_all.chmod(0o666)
    NodeHealth(str(open_to_all)).close()
    assert open_to_all.exists()
