"""A training loop whose "GPU step" is a sleep, timed by the loop itself (the ground truth the
stall telemetry is held to), run here or as a script (`python watchloop.py CONFIG_JSON`, which
prints the truth and this process's meter as JSON on its last line)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from torch.utils.data import DataLoader, Dataset

from pytorch_ext import KSpeedFolder


class SlowItems(Dataset[int]):
    """`n` samples that each take `delay` seconds of __getitem__ (a heavy transform)."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)  # under test: the sample's cost the loop waits for
        return i


class FileSizes(KSpeedFolder):
    """The sizes of a cached folder's files, read through the fast path."""

    def __getitem__(self, i: int) -> int:
        return len(self.read(self.files[i]))


class Sleep:
    """A transform that costs `delay` seconds of a worker's time."""

    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self, x: Any) -> Any:
        time.sleep(self.delay)  # under test: the transform's cost the loop waits for
        return x


def loader_of(config: dict[str, Any]) -> DataLoader:  # type: ignore[type-arg]
    kind = config["kind"]
    if kind == "slow":
        ds: Dataset[Any] = SlowItems(config["samples"], config["delay"])
    elif kind == "fast":
        ds = FileSizes(
            config["root"], nodes=config["nodes"], token=config["token"], local=config.get("local")
        )
    else:  # stock ImageFolder (over the mount)
        from torchvision import datasets, transforms

        ds = datasets.ImageFolder(
            config["root"],
            transform=transforms.Compose([transforms.ToTensor(), Sleep(config["delay"])]),
        )
    return DataLoader(
        ds,
        batch_size=config["batch"],
        num_workers=config["workers"],
        shuffle=False,
        collate_fn=list,
        persistent_workers=bool(config.get("persistent")) and config["workers"] > 0,
    )


def timed_loop(loader: Any, step: float, epochs: int = 1) -> tuple[float, float, int]:
    """Run `epochs` passes with a `step`-second sleep per batch; the loop's own blocked and
    busy seconds (as pytorch_ext.watch defines them) and the batches."""
    blocked = busy = 0.0
    batches = 0
    for _ in range(epochs):
        t = time.perf_counter()
        it = iter(loader)
        while True:
            try:
                next(it)
            except StopIteration:
                blocked += time.perf_counter() - t
                break
            now = time.perf_counter()
            blocked += now - t
            batches += 1
            time.sleep(step)
            t = time.perf_counter()
            busy += t - now
    return blocked, busy, batches


def main(config: dict[str, Any]) -> dict[str, Any]:
    loader: Any = loader_of(config)
    if config.get("explicit"):
        from pytorch_ext import watch

        loader = watch(loader)
    blocked, busy, batches = timed_loop(loader, config["step"], config.get("epochs", 1))
    from pytorch_ext import loop_watch

    meter = loop_watch.meter()
    if config.get("linger"):  # a report after the loop's end reaches the node before exit
        sent = meter.report.sent
        deadline = time.monotonic() + config["linger"] + 5
        while meter.report.sent < sent + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    return {
        "truth": blocked / (blocked + busy),
        "reported": meter.blocked / max(meter.blocked + meter.busy, 1e-9),
        "batches": batches,
        "meter_batches": meter.batches,
        "samples": meter.samples,
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
