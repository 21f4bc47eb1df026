"""Client-side admin operations shared by the CLI, the demo and the fast path."""

from __future__ import annotations

import time
from typing import Any

from .client import SCAN_TIMEOUT, NodeClient
from .config import Settings
from .errors import DataError, KSpeedError, NodeUnreachable
from .names import validate_name
from .progress import ProgressBar
from .sources import normalize_source


def connect(settings: Settings) -> NodeClient:
    """A connection to the first node of the list that answers."""
    error: KSpeedError | None = None
    for address in settings.nodes:
        client = NodeClient(address, settings.token_file, settings.timeout)
        try:
            client.connect()
            return client
        except NodeUnreachable as e:
            error = e
    assert error is not None
    raise error


def preload(
    settings: Settings,
    source: str,
    name: str,
    wait: bool = True,
    show_progress: bool = True,
    lifetime: str = "offline",
    replicas: int = 1,
    endpoint: str = "",
) -> dict[str, Any]:
    """Ask the node to load `source` (a folder or an s3:// URL) as `name`; with `wait`, poll
    until ready or failed."""
    validate_name(name)
    src = normalize_source(source)
    with connect(settings) as client:
        started = client.request(
            "preload",
            answer_within=SCAN_TIMEOUT,
            name=name,
            source=src,
            lifetime=lifetime,
            replicas=replicas,
            endpoint=endpoint,
        )
        if not wait:
            return started
        bar = ProgressBar(f"preload {name}") if show_progress else None
        try:
            while True:
                p = client.request("progress", name=name)
                if bar:
                    bar.update(p["files_done"], p["files_total"], p["bytes_done"], p["bytes_total"])
                if p["state"] == "ready":
                    return p
                if p["state"] == "failed":
                    raise DataError(f"preload of {name} failed: {p['error']}")
                time.sleep(0.1)
        except KeyboardInterrupt:
            client.request("unload", name=name)
            raise KSpeedError(f"preload of {name} interrupted and cancelled") from None
        finally:
            if bar:
                bar.close()
