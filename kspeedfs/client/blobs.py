"""A blob a node answers in pieces (a manifest, a meta-file index), fetched whole into a file
this process maps: the one copy of that loop for every reader of such blobs."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

from kspeedfs.client.nodepool import NodePool
from kspeedfs.format.contract import Request
from kspeedfs.format.contract.pieces import BlobPiece, fetch_all

Mapped = TypeVar("Mapped")


def fetch_blob(
    pool: NodePool,
    request_at: Callable[[int], Request[Any]],
    prefix: str,
    suffix: str,
    open_map: Callable[[str], Mapped],
) -> Mapped:
    """`request_at(offset)` asks for the piece at `offset` (its answer carries `.piece`): the
    first piece from the first node that answers, the rest from that same node (another may
    hold another instance). The pieces go to a temporary file that `open_map` maps; the file
    is unlinked at once (the map keeps it alive; nothing to clean up later)."""
    node, reply = pool.live_call(request_at(0))

    def ask(offset: int) -> BlobPiece:
        nonlocal reply
        if offset:
            reply = pool.call(node, request_at(offset))
        piece: BlobPiece = reply.piece
        return piece

    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            fetch_all(ask, f.write)
        return open_map(path)
    finally:
        os.unlink(path)
