"""The client reads a node's `list` once, typed (DatasetListing), and then only attributes: the
ready datasets, their tiers over the members, `ls`'s rows and the mount's variant folders, as
they were when the entries were read as dicts; an older node's entries still read."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kspeedfs.cli.tables import ls_table
from kspeedfs.client.tier_bytes import ClusterTiers, cluster_tiers
from kspeedfs.format.config import Settings
from kspeedfs.format.contract.decoded import VariantProgress, VariantState, VariantSummary
from kspeedfs.format.contract.node import DatasetEntry, DatasetListing, LoadingEntry
from kspeedfs.fuse import variants
from kspeedfs.node.records import DatasetRecord
from kspeedfs.sources.loader import Progress

NODE = "127.0.0.1:7420"
GIB = 1 << 30


def entry(name: str, **changes: Any) -> DatasetEntry:
    record = DatasetRecord(name, name * 4, f"/src/{name}", "offline", 1, 3, GIB, GIB, 1.5, Path())
    listed = DatasetEntry(**{**record.to_wire(), "members": [NODE]}, leases=0, decoded={})
    return dataclasses.replace(listed, **changes)


def loading(name: str, **changes: Any) -> LoadingEntry:
    progress = Progress(files_total=4, bytes_total=4 * GIB, bytes_done=GIB, source=f"/src/{name}")
    return dataclasses.replace(LoadingEntry(name=name, **progress.to_wire()), **changes)


def variant(size: int, state: VariantState) -> VariantProgress:
    return VariantProgress(
        size=size, state=state, files_total=2, files_done=0, undecodable=0, bytes=0, elapsed=0.0
    )


def test_an_older_nodes_listing_reads_with_the_defaults_the_client_used() -> None:
    """Entries of a node older than the disk tier, the caps, the variants and the error classes
    (no disk, disk_stored, max_memory, max_disk, decoded; no error_kind) read as before."""
    newer = {"disk", "disk_stored", "max_memory", "max_disk", "decoded", "error_kind"}
    older = {
        "node": NODE,
        "datasets": [
            {k: v for k, v in d.to_wire().items() if k not in newer}
            for d in (entry("a"), loading("b"))
        ],
    }
    listing = DatasetListing.from_wire(older)
    (a,) = listing.ready().values()
    assert (a.name, a.decoded, a.disk, a.disk_stored, a.max_memory) == ("a", {}, [], 0, 0)
    assert isinstance(listing.datasets[1], LoadingEntry) and listing.datasets[1].error_kind == ""


def test_the_ready_datasets_are_the_published_ones_by_name() -> None:
    listing = DatasetListing(
        node=NODE, datasets=[entry("a"), loading("b"), loading("c", state="failed")]
    )
    wire = DatasetListing.from_wire(listing.to_wire())
    assert wire == listing and list(wire.ready()) == ["a"]


def test_a_dataset_on_the_node_asked_is_summed_from_its_listing_alone() -> None:
    """One member, the node asked: no other node is asked (the settings are not used)."""
    listing = DatasetListing(
        node=NODE, datasets=[entry("a", stored=5, disk_stored=7, members=[]), loading("b")]
    )
    tiers = cluster_tiers(Settings(), listing)
    assert tiers == {"a": ClusterTiers(5, 7, {NODE: {"memory_bytes": 5, "disk_bytes": 7}}, [])}


def test_ls_rows_read_each_kind_of_entry() -> None:
    listing = DatasetListing(
        node=NODE,
        datasets=[
            entry("a", decoded={"64": variant(64, "ready")}),
            loading("b"),
            loading("c", state="failed", error="disk on fire"),
        ],
    )
    tiers = {"a": ClusterTiers(2 * GIB, 0, {}, ["10.0.0.2:7420"])}
    summary = VariantSummary(size=64, state="ready", files_total=2, files_done=2, bytes=GIB)
    rows = ls_table(listing, tiers, {"a": {"64": summary}})
    assert rows == [
        ("NAME", "FILES", "BYTES", "STATE", "LIFETIME", "MEMORY", "DISK", "SOURCE", "DECODED"),
        (
            "a",
            "3",
            "1.0 GiB",
            "ready",
            "offline",
            "2.0 GiB?",
            "0 B?",
            "/src/a",
            "64: 100% (1.0 GiB)",
        ),
        ("b", "4", "4.0 GiB", "loading 25%", "-", "0 B", "0 B", "/src/b", "-"),
        ("c", "4", "4.0 GiB", "failed: disk on fire", "-", "0 B", "0 B", "/src/c", "-"),
    ]


def test_a_mount_offers_the_variants_whose_index_is_written() -> None:
    ready = {
        "a": entry("a", decoded={"64": variant(64, "ready"), "32": variant(32, "probing")}),
        "b": entry("b", decoded={"128": variant(128, "filling"), "16": variant(16, "failed")}),
    }
    assert variants.offered(ready) == {"a@64": ("a", 64), "b@128": ("b", 128)}
