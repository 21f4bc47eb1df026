"""The damage news table: what the node writes is what every follower takes, once each."""

from __future__ import annotations

import os
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kspeedfs.format.localdata import DAMAGE_FILE
from kspeedfs.system.damage import DamageNews, announce, create_table

SEGMENTS = 12


def folder_with_table(root: Path, segments: int = SEGMENTS) -> int:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    create_table(fd, segments)
    return fd


def test_a_follower_takes_what_was_announced_since_it_last_took(tmp_path: Path) -> None:
    fd = folder_with_table(tmp_path)
    try:
        news = DamageNews.open(fd, SEGMENTS)
    finally:
        os.close(fd)
    assert not news.heard and news.take() == ([], False)
    announce(tmp_path, [3, 7])
    other = news.follow()  # from now on: it has heard nothing
    assert news.heard and not other.heard
    assert news.take() == ([3, 7], False)
    assert not news.heard and news.take() == ([], False)  # once each
    announce(tmp_path, scrub_pass=True)
    announce(tmp_path, [11, 99, -1])  # (numbers past the table: ignored)
    assert news.take() == ([11], True)
    assert other.take() == ([11], True)


def test_a_table_of_the_wrong_size_or_none_is_silence(tmp_path: Path) -> None:
    fd = folder_with_table(tmp_path, SEGMENTS + 1)
    try:
        news = DamageNews.open(fd, SEGMENTS)
    finally:
        os.close(fd)
    announce(tmp_path, [1])
    assert not news.heard and news.take() == ([], False)
    assert announce(tmp_path / "gone", [1]) == 0  # no table: nobody to tell


def test_an_existing_table_is_kept_by_a_new_node(tmp_path: Path) -> None:
    fd = folder_with_table(tmp_path)
    try:
        news = DamageNews.open(fd, SEGMENTS)
        announce(tmp_path, [2])
        create_table(fd, SEGMENTS)  # a restart: readers keep their map of it
    finally:
        os.close(fd)
    assert news.take() == ([2], False)
    assert (tmp_path / DAMAGE_FILE).stat().st_size == 8 * (2 + SEGMENTS)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, SEGMENTS - 1), max_size=4), max_size=8), st.data())
def test_every_segment_announced_is_taken_by_every_follower(
    tmp_path_factory: pytest.TempPathFactory, rounds: list[list[int]], data: st.DataObject
) -> None:
    """Followers that take at random moments each take every segment announced."""
    root = tmp_path_factory.mktemp("news")
    fd = folder_with_table(root)
    try:
        followers = [DamageNews.open(fd, SEGMENTS) for _ in range(3)]
    finally:
        os.close(fd)
    taken: list[set[int]] = [set() for _ in followers]
    for segments in rounds:
        announce(root, segments)
        for k, news in enumerate(followers):
            if data.draw(st.booleans()):
                taken[k].update(news.take()[0])
    for k, news in enumerate(followers):
        taken[k].update(news.take()[0])
        assert taken[k] == {seg for segments in rounds for seg in segments}
