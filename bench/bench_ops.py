"""What the typed op contracts cost: the decode of a request alone, beside a whole op.

    .venv/bin/python bench/bench_ops.py [--rounds 5] [--n 20000]

For a few requests of different shapes (a fill, a touch of 64 segments, a preload, a 256 KiB
stage piece), the time `Request.from_wire` takes per request, the hand-written check it
replaced (the fields read and type-checked one by one, as `int_field`/`str_field` did), and a
whole `ping` and `progress` round trip to a real node over loopback TCP: the decode's share of
a round trip is the figure that matters (target < 2%; the READ path decodes no JSON request at
all: its frames are binary). Best of --rounds.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kspeedfs.format.contract import Request  # noqa: E402
from kspeedfs.format.contract.node import Ping  # noqa: E402
from kspeedfs.format.contract.pieces import BlobPiece  # noqa: E402
from kspeedfs.format.contract.preload import Preload, StagePut  # noqa: E402
from kspeedfs.format.contract.readthrough import FillSegment, Touch  # noqa: E402
from kspeedfs.format.errors import InvalidArgument  # noqa: E402
from kspeedfs.format.names import validate_name  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402

UUID = "0" * 32


def samples() -> list[tuple[str, type[Request], dict[str, Any]]]:
    def wire(request: Request) -> dict[str, Any]:
        return json.loads(json.dumps(request.to_wire()))  # as it comes off the wire

    return [
        ("fill", FillSegment, wire(FillSegment(name="imagenet", segment=7, uuid=UUID))),
        ("touch 64", Touch, wire(Touch(name="imagenet", segments=list(range(64)), uuid=UUID))),
        ("preload", Preload, wire(Preload(name="imagenet", source="/data/imagenet"))),
        (
            "stage_put 256K",
            StagePut,
            wire(
                StagePut(
                    name="imagenet",
                    uuid=UUID,
                    segment=3,
                    piece=BlobPiece.of(0, 1 << 20, bytes(256 << 10)),
                )
            ),
        ),
    ]


def hand_checked(msg: dict[str, Any]) -> None:
    """What a handler did before the contracts: each field read and checked by hand."""
    for key, value in msg.items():
        if key == "op":
            continue
        if key == "name":
            validate_name(value)
        elif key == "piece":  # the old handlers decoded a piece's base64 too
            base64.b64decode(value["data"])
        elif value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, str, list, dict))
        ):
            raise InvalidArgument(f"{key} has the wrong type")
        elif isinstance(value, int) and value < 0:
            raise InvalidArgument(f"{key} must be at least 0")


def per_call(fn: Callable[[], Any], n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=20000, help="decodes per round")
    args = p.parse_args()

    rows = []
    for label, kind, msg in samples():
        n = max(1, args.n // 100) if "stage_put" in label else args.n
        typed = per_call(lambda: kind.from_wire(msg), n, args.rounds)  # noqa: B023
        by_hand = per_call(lambda: hand_checked(msg), n, args.rounds)  # noqa: B023
        rows.append((label, typed, by_hand))

    with tempfile.TemporaryDirectory(prefix="kspeedfs-bench-ops-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        (src / "a.bin").write_bytes(bytes(1 << 20))
        with LocalCache(Path(tmp) / "cache", memory=64 << 20) as cache:
            cache.preload(src, "ops", show_progress=False)
            with cache.node.client() as c:
                ping = per_call(lambda: c.call(Ping()), 2000, args.rounds)
                progress = per_call(lambda: c.request("progress", name="ops"), 2000, args.rounds)

    print(f"{'request':<16}{'typed decode':>14}{'by hand':>10}{'typed/hand':>12}{'of an op':>10}")
    for label, typed, by_hand in rows:
        print(
            f"{label:<16}{typed * 1e6:>11.1f} us{by_hand * 1e6:>7.1f} us{typed / by_hand:>11.1f}x"
            f"{typed / progress:>10.1%}"
        )
    print(
        f"a whole op over loopback TCP: ping {ping * 1e6:.0f} us, "
        f"progress {progress * 1e6:.0f} us (the share above is of this one)"
    )


if __name__ == "__main__":
    main()
