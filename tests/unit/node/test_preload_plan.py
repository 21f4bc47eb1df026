"""One preload scans, checks, lays out and digests its source once: the Plan carries what it
computed to every step, and this node's own stage takes it from the plan.

A real NodeServer runs in trio in this process (so the work can be counted); each counted
function is wrapped with a pass-through counter wherever the package imported it.
"""

from __future__ import annotations

import collections
import functools
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import make_tree

from kspeedfs.format.config import Settings
from kspeedfs.format.contract.preload import LoadProgress, Preload
from kspeedfs.format.layout import Layout, plan_layout
from kspeedfs.format.units import Address
from kspeedfs.node.preload import tree_digest
from kspeedfs.node.server import NodeServer
from kspeedfs.sources.scan import check_source


def count_calls(monkeypatch: pytest.MonkeyPatch, counts: collections.Counter[str]) -> None:
    """Every kspeedfs module's name for a counted function now counts its calls."""

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for fn in (plan_layout, check_source, tree_digest):
        wrapped = counting(fn.__name__, fn)
        for module in [m for n, m in sys.modules.items() if n.startswith("kspeedfs")]:
            if getattr(module, fn.__name__, None) is fn:
                monkeypatch.setattr(module, fn.__name__, wrapped)
    of_tree = Layout.of_tree.__func__  # type: ignore[attr-defined]
    wrapped_of_tree = counting("Layout.of_tree", of_tree)
    monkeypatch.setattr(Layout, "of_tree", classmethod(wrapped_of_tree))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_single_node_preload_plans_once(
    monkeypatch: pytest.MonkeyPatch, shm_dir: Path, token_file: Path, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "src")
    address = Address("127.0.0.1", free_port())
    settings = Settings(
        listen=address,
        nodes=[address],
        shm_dir=shm_dir,
        memory="256MiB",
        token_file=token_file,
        transport="tcp",
        socket=tmp_path / "node.sock",
    )
    server = NodeServer(settings)
    counts: collections.Counter[str] = collections.Counter()
    count_calls(monkeypatch, counts)
    answers: list[dict[str, Any]] = []

    async def preload() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            await server.ops.call(Preload(name="once", source=str(src)))
            seen = -1
            while True:
                p = await server.ops.call(
                    LoadProgress(name="once", wait_for_change_after=seen, wait_s=2.0)
                )
                answers.append(p)
                seen = p.version
                if p.state in ("ready", "failed"):
                    break
            nursery.cancel_scope.cancel()

    started = time.monotonic()
    trio.run(preload)
    elapsed = time.monotonic() - started
    assert answers[-1].state == "ready", answers[-1]
    assert counts == {"plan_layout": 1, "Layout.of_tree": 1, "check_source": 1, "tree_digest": 1}
    # Long-polled: an answer when the state changes (loading, then ready), else one per wait.
    states = [
        s for i, s in enumerate(a.state for a in answers) if i == 0 or s != answers[i - 1].state
    ]
    assert states == ["loading", "ready"]
    assert len(answers) <= 2 + int(elapsed / 2.0)
