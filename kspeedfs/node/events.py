"""The comings and goings of the node's datasets, and the damage its own reads find.

The store and its followers (the added meta indexes, the decoded variants, the RDMA
registration, the scrubber) need each other: the store tells them, and they use the store. So
the composition root (root.py) builds this object first and gives it, at construction, both to
the store, which tells it, and to each follower, which subscribes when it is built. No list on
the store is filled by others after it was built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class DatasetFollower(Protocol):
    """One that follows the node's published datasets."""

    def published(self, name: str) -> None:
        """Dataset `name` is visible: published, or found at start (told for each one)."""

    def unloading(self, name: str) -> None:
        """Dataset `name` goes: told before its files are unlinked."""


class DatasetEvents:
    """Told by the store; tells the followers, in the order they subscribed."""

    def __init__(self) -> None:
        self._followers: list[DatasetFollower] = []
        self._damage: list[Callable[[str, list[int]], None]] = []

    def follow(self, follower: DatasetFollower) -> None:
        self._followers.append(follower)

    def follow_damage(self, callback: Callable[[str, list[int]], None]) -> None:
        """`callback(name, segments)` is told, from any thread, the segments of `name` the
        node's own reads (serving a peer, decoding) found damaged."""
        self._damage.append(callback)

    # The telling side: the store's.

    def published(self, name: str) -> None:
        for follower in self._followers:
            follower.published(name)

    def unloading(self, name: str) -> None:
        for follower in self._followers:
            follower.unloading(name)

    def damage_found(self, name: str, segments: list[int]) -> None:
        for callback in self._damage:
            callback(name, segments)
