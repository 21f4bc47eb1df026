"""WebDataset section of the data-stacks benchmark: one epoch of tar shards in order through
webdataset.WebDataset on the source folder, against a shuffled epoch (random access) through
pytorch_ext.KSpeedWebDataset, both with 2 DataLoader workers, samples/s side by side.

    PYTHONPATH=$PWD .venv/bin/python bench/datastacks_wds.py [--wds-shards 8] [--wds-samples 400]

bench/bench_datastacks.py calls `webdataset_section(args)` and prints its rows with the
others; run alone, this prints them itself. The shards (`make_shards`: a ~110 KB JPEG, its
class, a JSON record per sample) are made once under --cache and preloaded into a private
node. Each side runs --rounds times in a rotating order (best kept), memory warmed (touched
and freed) before it; the source's shards are in the page cache (read once before). Raw
samples (bytes, no decoding: decoding costs both sides the same) and, with --wds-decode,
decoded ones. Target (issue 22): the shuffled KSpeedWebDataset epoch at least as fast as
WebDataset's sequential one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import webdataset as wds  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from kspeedfs.format.units import format_size, parse_size  # noqa: E402
from kspeedfs.sample import make_shards  # noqa: E402
from kspeedfs.testing.bench import warm_memory  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import ClairvoyantSampler, KSpeedWebDataset  # noqa: E402

NAME = "wds-bench"
WEBDATASET = "source"  # the table's side for webdataset.WebDataset on the source folder
OURS = "fast path"  # and for KSpeedWebDataset


@dataclasses.dataclass
class Row:
    """One workload's rate on each side, higher is better (bench_datastacks.Row's fields)."""

    workload: str
    unit: str
    rates: dict[str, float | None]


def option(args: argparse.Namespace, name: str, default: Any) -> Any:
    """This section's options, with defaults when the calling benchmark does not define them."""
    return getattr(args, name, None) or default


def ensure_shards(dest: Path, shards: int, samples: int, size: int) -> list[Path]:
    stamp = dest.with_name(dest.name + ".json")
    want = {"shards": shards, "samples": samples, "size": size}
    try:
        if json.loads(stamp.read_text()) == want:
            return sorted(dest.glob("*.tar"))
    except (OSError, ValueError):
        pass
    for old in dest.glob("*.tar"):
        old.unlink()
    made = make_shards(dest, shards, samples // shards, size)
    stamp.write_text(json.dumps(want))
    return made


def sizes(batch: list[dict[str, Any]]) -> int:
    """The collate: what crosses back from a worker is the samples, counted here."""
    return len(batch)


def epoch_rate(loader: DataLoader[Any], expected: int) -> float:
    started = time.perf_counter()
    got = sum(loader)
    elapsed = time.perf_counter() - started
    if got != expected:
        raise SystemExit(f"an epoch gave {got} samples, not {expected}")
    return got / elapsed


def webdataset_section(args: argparse.Namespace) -> list[Row]:
    """Samples/s of an epoch: WebDataset in order on the source, KSpeedWebDataset shuffled."""
    shards_n = int(option(args, "wds_shards", 8))
    samples = int(option(args, "wds_samples", 3200))
    size = parse_size(str(option(args, "wds_size", "110KiB")))
    batch = int(option(args, "wds_batch", 32))
    rounds = int(option(args, "rounds", 3))
    warm = int(option(args, "warm", 512)) << 20
    cache = Path(option(args, "cache", "/var/tmp/kspeedfs-bench-datastacks"))
    decodes: list[str | None] = [None] + (["pil"] if option(args, "wds_decode", False) else [])
    root = cache / "wds" / "train"
    shards = ensure_shards(root, shards_n, samples, size)
    urls = [str(p) for p in shards]
    data_bytes = sum(p.stat().st_size for p in shards)
    for p in shards:
        p.read_bytes()  # in the page cache, as a source read a second time is
    print(f"WebDataset: {len(shards)} shards, {format_size(data_bytes)}, {root}")
    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-wds-"))
    rows: list[Row] = []
    with LocalCache(workdir, data_bytes * 2 + (256 << 20)) as node:
        node.preload(root.parent, NAME, show_progress=False)
        for decode in decodes:
            ours = KSpeedWebDataset(
                str(root), decode=decode, nodes=str(node.address), token=str(node.token_file)
            )
            n = len(ours)
            sampler = ClairvoyantSampler(ours, seed=int(option(args, "seed", 0)))

            def webdataset_epoch(decode: str | None = decode, n: int = n) -> float:
                ds = wds.WebDataset(urls, shardshuffle=False)
                if decode:
                    ds = ds.decode(decode)
                loader = DataLoader(
                    ds.batched(batch, collation_fn=sizes), batch_size=None, num_workers=2
                )
                return epoch_rate(loader, n)

            def kspeed_epoch(
                ours: KSpeedWebDataset = ours, sampler: ClairvoyantSampler = sampler, n: int = n
            ) -> float:
                sampler.set_epoch(sampler.epoch + 1)  # a new shuffle each round
                loader = DataLoader(
                    ours, batch_size=batch, sampler=sampler, num_workers=2, collate_fn=sizes
                )
                return epoch_rate(loader, n)

            sides: dict[str, Callable[[], float]] = {
                WEBDATASET: webdataset_epoch,
                OURS: kspeed_epoch,
            }
            best: dict[str, float] = {}
            names = list(sides)
            for r in range(rounds):
                for side in names[r % 2 :] + names[: r % 2]:
                    warm_memory(warm)
                    best[side] = max(best.get(side, 0.0), sides[side]())
            label = "bytes" if decode is None else f"decode={decode}"
            ratio = best[OURS] / best[WEBDATASET]
            state = "meets" if ratio >= 1.0 else "MISSES"
            print(
                f"  WebDataset epoch ({label}, {n} samples, 2 workers): in order on the source "
                f"{best[WEBDATASET]:.0f}/s, KSpeedWebDataset shuffled {best[OURS]:.0f}/s: "
                f"{ratio:.2f}x, target >= 1: {state}"
            )
            rows.append(
                Row(f"WebDataset epoch, {label}: in order vs shuffled", "samples/s", dict(best))
            )
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wds-shards", type=int, default=8, help="WebDataset shards (default 8)")
    p.add_argument("--wds-samples", type=int, default=3200, help="samples in all shards")
    p.add_argument("--wds-size", default="110KiB", help="approximate JPEG size of a sample")
    p.add_argument("--wds-batch", type=int, default=32, help="DataLoader batch size")
    p.add_argument("--wds-decode", action="store_true", help="also decoded (PIL) epochs")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    p.add_argument("--rounds", type=int, default=3, help="measurements per side (best kept)")
    p.add_argument("--warm", type=int, default=512, help="MiB touched and freed before a side")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench-datastacks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for row in webdataset_section(args):
        cells = "  ".join(f"{side} {rate:.0f}" for side, rate in row.rates.items() if rate)
        print(f"{row.workload:50s} {row.unit:>10s}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
