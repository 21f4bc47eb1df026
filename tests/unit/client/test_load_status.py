"""The client reads a `progress` answer once, typed (LoadProgress.answer), and then only its
attributes: a published dataset's record, or its load's progress, as the node sends them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kspeedfs.client import admin
from kspeedfs.format.contract.preload import (
    UNVERSIONED,
    LoadProgress,
    LoadState,
    Progressing,
    Published,
)
from kspeedfs.format.errors import DataError, InvalidArgument
from kspeedfs.node.loads import progressing
from kspeedfs.node.records import DatasetRecord
from kspeedfs.sources.loader import Progress


def load_status(msg: dict[str, Any]) -> Progressing | Published:
    return LoadProgress(name="ds").answer(msg)


def sent(state: LoadState, error: str = "") -> dict[str, Any]:
    """A load's `progress` answer as the node sends it."""
    return progressing(Progress(state=state, source="/src", error=error)).to_wire()


def published(tmp_path: Path) -> dict[str, Any]:
    record = DatasetRecord("ds", "u" * 32, "/src", "offline", 1, 3, 30, 4096, 1.5, tmp_path)
    return Published(**record.to_wire(), version=5).to_wire()


def test_a_published_dataset_is_read_as_its_record(tmp_path: Path) -> None:
    answer = load_status(published(tmp_path))
    assert isinstance(answer, Published)
    assert (answer.uuid, answer.files_done, answer.files_total) == ("u" * 32, 3, 3)
    assert admin.preload_done(answer, "preload of ds")


def test_a_load_under_way_is_read_as_its_progress() -> None:
    answer = load_status(sent("loading"))
    assert isinstance(answer, Progressing) and answer.state == "loading"
    assert not admin.preload_done(answer, "preload of ds")


def test_a_failed_progress_answer_is_an_error_naming_the_load() -> None:
    answer = load_status(sent("failed", "disk on fire"))
    with pytest.raises(DataError, match="^preload of ds failed: disk on fire$"):
        admin.preload_done(answer, "preload of ds")


def test_an_older_nodes_progress_answer_is_read_with_the_defaults_the_client_used() -> None:
    """A node older than the long poll and the error classes sends no `version` nor
    `error_kind`: its answer is read as before, and the next poll is answered at once."""
    older = {k: v for k, v in sent("loading").items() if k not in ("version", "error_kind")}
    answer = load_status(older)
    assert isinstance(answer, Progressing)
    assert (answer.version, answer.error_kind) == (UNVERSIONED, "")
    assert not admin.preload_done(answer, "preload of ds")


def test_an_older_nodes_record_is_read_without_the_tiers_and_caps(tmp_path: Path) -> None:
    older = {
        k: v
        for k, v in published(tmp_path).items()
        if k not in ("disk", "disk_stored", "max_memory", "max_disk", "version")
    }
    answer = load_status(older)
    assert isinstance(answer, Published)
    assert (answer.disk, answer.disk_stored, answer.max_memory, answer.max_disk) == ([], 0, 0, 0)
    assert answer.version == UNVERSIONED


def test_a_malformed_progress_answer_is_refused_in_one_line() -> None:
    with pytest.raises(InvalidArgument, match="^Progressing: state must be one of"):
        load_status({**sent("loading"), "state": "lost"})
