"""The read-through ops answered by a real node, without a mount: what does not fit the
dataset (a segment past its end, another instance, another source) is refused in one line
and changes nothing; reads a mount reports count only for the instance they name."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from conftest import NodeProcess, wait_for
from rt_util import cache_status, write_files

from kspeedfs.format.errors import AlreadyExists, InvalidArgument, NotFound


def ready(node: NodeProcess, name: str) -> bool:
    progress = node.request("progress", name=name)
    assert progress["state"] != "failed", progress
    return bool(progress["state"] == "ready")


@pytest.fixture
def src(node: NodeProcess, tmp_path: Path) -> Path:
    root = tmp_path / "src"
    write_files(root, 4, 300_000)
    answer = node.request("register_source", name="src", source=str(root))
    assert answer["state"] in ("scanning", "loading", "ready"), answer
    wait_for(functools.partial(ready, node, "src"), what="the listing")
    return root


def test_a_fill_that_does_not_fit_the_dataset_is_refused_in_one_line(
    node: NodeProcess, src: Path
) -> None:
    segments = cache_status(node, "src")["segments"]
    with pytest.raises(InvalidArgument, match=f"^segment {segments} out of range for src$"):
        node.request("fill", name="src", segment=segments)
    with pytest.raises(NotFound, match="refreshed or loaded again"):
        node.request("fill", name="src", segment=0, uuid="0" * 32)
    with pytest.raises(NotFound, match="no read-through dataset named 'nope'"):
        node.request("fill", name="nope", segment=0)
    status = cache_status(node, "src")
    assert (status["in_memory"], status["misses"], status["fills_source"]) == (0, 0, 0)
    assert node.request("fill", name="src", segment=0) == {"state": "cached", "error": ""}
    assert cache_status(node, "src")["in_memory"] == 1


def test_reads_reported_count_for_the_instance_they_name_only(node: NodeProcess, src: Path) -> None:
    assert node.request("touch", name="nope", segments=[0], hits=5) == {"known": False}
    assert node.request("touch", name="src", uuid="f" * 32, segments=[0], hits=5) == {
        "known": False
    }
    assert cache_status(node, "src")["hits"] == 0
    assert node.request("touch", name="src", segments=[0, 1], hits=3) == {"known": True}
    assert cache_status(node, "src")["hits"] == 3


def test_registering_again_finds_the_dataset_and_another_source_is_refused(
    node: NodeProcess, src: Path, tmp_path: Path
) -> None:
    again = node.request("register_source", name="src", source=str(src))
    assert again == {"name": "src", "state": "ready", "lifetime": "readthrough"}
    other = tmp_path / "other"
    write_files(other, 1, 1000)
    with pytest.raises(AlreadyExists, match="already holds"):
        node.request("register_source", name="src", source=str(other))
    with pytest.raises(InvalidArgument, match="absolute path or a URL"):
        node.request("register_source", name="rel", source="relative/folder")
    assert [d["name"] for d in node.request("list")["datasets"]] == ["src"]
    segments = cache_status(node, "src")["segments"]
    assert node.request("refresh", name="src") == {
        "name": "src",
        "state": "unchanged",
        "changed": 0,
        "kept": segments,
        "segments": segments,
    }
