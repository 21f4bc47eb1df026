"""Client side of decoded variants: start one on every member of a dataset, wait for its fill."""

from __future__ import annotations

import time

from kspeedfs.format.contract.decoded import (
    DatasetVariants,
    Decode,
    DecodeStarted,
    DecodeStatus,
    VariantSummary,
)
from kspeedfs.format.errors import DataError, ProtocolError
from kspeedfs.net.connection import SCAN_TIMEOUT, NodeClient
from kspeedfs.system.progress import ProgressBar

POLL_S = 0.2


def start(client: NodeClient, name: str, size: int, uuid: str = "") -> DecodeStarted:
    """Ask every member to decode the images it holds (NoSpace, one line, before any decoding
    when a member's budget cannot take it). An existing variant is left as it is."""
    return client.call(Decode(name=name, size=size, uuid=uuid), answer_within=SCAN_TIMEOUT)


def status(client: NodeClient, name: str) -> dict[str, VariantSummary]:
    """{size: summary over the members} of a dataset's variants (see node.decoded.summarize)."""
    answer = client.call(DecodeStatus(name=name))
    if not isinstance(answer, DatasetVariants):  # (a member's own, asked with `local`)
        raise ProtocolError(f"decode_status of {name} answered one member's variants")
    return answer.variants


def wait(
    client: NodeClient, name: str, size: int, progress_label: str | None = None
) -> VariantSummary:
    """Poll until the variant is ready on every member (DataError when one failed); its
    summary over them."""
    bar = ProgressBar(progress_label) if progress_label else None
    try:
        while True:
            v = status(client, name).get(str(size))
            if v is None:
                raise DataError(f"dataset {name} has no decoded variant at {size}")
            if bar is not None:
                bar.update(v.files_done, v.files_total, v.files_done, v.files_total)
            if v.state == "failed":
                raise DataError(f"decoding {name} at {size} failed: {v.error}")
            if v.state == "ready":
                return v
            time.sleep(POLL_S)
    finally:
        if bar is not None:
            bar.close()


def describe(v: VariantSummary) -> str:
    """`256: 100% (1.2 GiB)` for `ls`."""
    from kspeedfs.format.units import format_size

    pct = 100.0 * v.files_done / v.files_total if v.files_total else 100.0
    state = "" if v.state in ("ready", "filling") else f" {v.state}"
    return f"{v.size}: {pct:.0f}% ({format_size(v.bytes)}){state}"
