"""The one preload-and-wait (kspeedfs.client.admin) against a real node."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import NodeProcess

from kspeedfs.client import admin
from kspeedfs.format.errors import AlreadyExists, InvalidArgument
from kspeedfs.node.loads import state_version


def test_ensure_loaded_loads_once_then_joins_without_the_source(
    node: NodeProcess, tree: Path, tmp_path: Path
) -> None:
    settings = node.settings()
    first = admin.ensure_loaded(settings, str(tree), "ds")
    assert first.state == "ready" and first.files_done == first.files_total > 0
    (before,) = node.request("list")["datasets"]
    # Loaded already: the source is not looked at (a mountd or job whose source is gone).
    again = admin.ensure_loaded(settings, str(tmp_path / "gone"), "ds")
    assert again.state == "ready"
    (after,) = node.request("list")["datasets"]
    assert after["uuid"] == before["uuid"]
    # The CLI's preload refuses instead.
    with pytest.raises(AlreadyExists):
        admin.preload(settings, str(tree), "ds", show_progress=False)


def test_progress_is_long_polled_and_never_held_past_its_cap(node: NodeProcess, tree: Path) -> None:
    settings = node.settings()
    admin.ensure_loaded(settings, str(tree), "ds")
    ready = node.request("progress", name="ds")
    assert ready["state"] == "ready" and ready["version"] == state_version("ready")
    # A version of another state is answered at once, with the state as it is.
    assert node.request("progress", name="ds", wait_for_change_after=1)["state"] == "ready"
    # The version as it is, and a wait far over any client's timeout: answered (by the cap,
    # within the client's timeout) with nothing changed, on the same connection.
    with node.client() as c:
        held = c.request("progress", name="ds", wait_for_change_after=ready["version"], wait_s=1e9)
        assert held["version"] == ready["version"] and held["uuid"] == ready["uuid"]
        assert c.request("ping")["node"] == node.address
    with pytest.raises(InvalidArgument, match="op progress: wait_s must be at least 0"):
        node.request("progress", name="ds", wait_s=-1)
