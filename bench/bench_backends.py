"""The ResNet-50 recipe's data backends side by side: loader images/s and training steps/s.

    .venv/bin/python bench/bench_backends.py [--files 1000] [--model tiny|resnet18|resnet50]
        [--device cpu|cuda] [--backends pytorch,kspeed,...] [--cache DIR]

The data pipelines of NVIDIA DeepLearningExamples' ConvNets (image_classification), over a
generated sample of ~110 KB JPEGs preloaded into a private one-node cache:
  pytorch         stock torchvision ImageFolder on the source folder, the recipe's transform
                  (RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize);
  kspeed          the same through KSpeed's API (pytorch_ext.kspeed.KSpeedImageFolder);
  kspeed-decoded  KSpeedImageFolder(decoded=256, decode="tensor") with transforms.train(224):
                  the node's decoded pixels, uint8 out, normalised per batch on the device;
  mount           stock ImageFolder over a FUSE mount of the cache;
  dali            DALI's fn.readers.file on the source, then the recipe's HybridTrainPipe
                  (decoders.image_random_crop, resize, crop_mirror_normalize);
  dali-kspeed     the same pipeline fed by fn.external_source(KSpeedCallable(...).batch,
                  batch=True, batch_info=True): one call per batch in the pipeline's own
                  process, the recommended way (docs/dali.md);
  dali-kspeed-sample  the same fed per sample, as the recipe does: fn.external_source(
                  KSpeedCallable(...), batch=False, parallel=True), DALI's Python workers;
  dali-mount      DALI's fn.readers.file on a FUSE mount of the cache.
Torch loaders: DataLoader(--workers); DALI: num_threads = --workers, and the per-sample
external source as many Python workers. Each round builds every backend in turn (memory warmed before each: a
buffer touched and freed), times one epoch from its first batch, then with --model times
--steps SGD steps of that model on --device fed by it (after one warm-up step); the best of
--rounds is kept. The table gives the ratios to `pytorch`, and the CPU time per image of the
whole process tree (loader workers, node, mount), which stays meaningful on a busy machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision import datasets, models  # noqa: E402

from kspeedfs.client import admin  # noqa: E402
from kspeedfs.client import decoded as decoded_client  # noqa: E402
from kspeedfs.demo import ensure_sample, train_transform  # noqa: E402
from kspeedfs.format import users  # noqa: E402
from kspeedfs.format.units import format_size  # noqa: E402
from kspeedfs.testing.bench import warm_memory  # noqa: E402
from kspeedfs.testing.cache import LocalCache  # noqa: E402
from pytorch_ext import KSpeedCallable, KSpeedImageFolder, kspeed  # noqa: E402
from pytorch_ext import transforms as kt  # noqa: E402

BACKENDS = (
    "pytorch",
    "kspeed",
    "kspeed-decoded",
    "mount",
    "dali",
    "dali-kspeed",
    "dali-kspeed-sample",
    "dali-mount",
)
INPUT_ONLY = ("dali", "dali-kspeed", "dali-kspeed-sample", "dali-mount", "dali-array")
CROP = 224
DECODED = 256
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]

# A batch as the training step takes it: (images, labels, images are uint8 to normalise).
Batch = tuple[torch.Tensor, torch.Tensor, bool]
Batches = Generator[Batch, None, None]
# A backend's figures: best images/s, least CPU ms per image, best steps/s (None: no model).
Row = tuple[float, float, float | None]


class ArraySource:
    """Not kspeedfs: DALI's per-sample source at its cheapest, slices of one array in memory of
    the sample's sizes (the ceiling of DALI's parallel external source itself)."""

    def __init__(self, sizes: list[int], batch: int):
        self.sizes = sizes
        self.batch = batch
        self.data = np.frombuffer(os.urandom(max(sizes)), dtype=np.uint8)

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, np.ndarray]:
        if sample_info.iteration >= len(self.sizes) // self.batch:
            raise StopIteration
        size = self.sizes[sample_info.idx_in_epoch]
        return self.data[:size], np.array([0], dtype=np.int32)


def kspeed_image_folder(source: Path, transform: Any, kw: dict[str, Any]) -> Dataset[Any]:
    """The `kspeed` backend's dataset, as the recipe builds it (pytorch_ext.kspeed, KSpeed's
    positional arguments, a user made for the bench)."""
    return kspeed.KSpeedImageFolder(
        str(source), None, 2, [kw["nodes"]], "bench", "bench", transform
    )


def torch_epochs(ds: Dataset[Any], args: argparse.Namespace, uint8: bool) -> Batches:
    loader = DataLoader(
        ds,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,  # the training steps go on after the epoch
        pin_memory=args.device == "cuda",
        drop_last=True,
    )
    while True:
        for images, labels in loader:
            yield images, labels, uint8


def dali_pipeline(
    args: argparse.Namespace,
    source: Path | None = None,
    per_sample: Any = None,
    batches: Any = None,
) -> Any:
    """The recipe's HybridTrainPipe fed by the file reader on `source`, or by an external
    source: `per_sample` (DALI's Python workers, one call per sample) or `batches` (one call
    per batch, with its BatchInfo, in this process)."""
    from nvidia.dali import fn, pipeline_def, types

    cuda = args.device == "cuda"

    @pipeline_def(
        batch_size=args.batch,
        num_threads=max(1, args.workers),
        device_id=0 if cuda else None,
        seed=12,
        py_num_workers=max(1, args.workers),
        py_start_method="spawn" if cuda else "fork",
    )
    def pipeline() -> Any:
        if source is not None:
            jpegs, labels = fn.readers.file(
                file_root=str(source), random_shuffle=True, pad_last_batch=True, name="reader"
            )
        elif batches is not None:
            jpegs, labels = fn.external_source(
                source=batches, num_outputs=2, batch=True, batch_info=True
            )
        else:
            jpegs, labels = fn.external_source(
                source=per_sample, num_outputs=2, batch=False, parallel=True
            )
        if args.input_only:
            return jpegs, labels
        images = fn.decoders.image_random_crop(
            jpegs,
            device="mixed" if cuda else "cpu",
            output_type=types.RGB,
            random_aspect_ratio=[0.75, 4.0 / 3.0],
            random_area=[0.08, 1.0],
            num_attempts=100,
        )
        images = fn.resize(
            images, resize_x=CROP, resize_y=CROP, interp_type=types.INTERP_LINEAR, antialias=False
        )
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=(CROP, CROP),
            mean=MEAN,
            std=STD,
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels.gpu() if cuda else labels

    p = pipeline()
    p.build()
    return p


def dali_epochs(p: Any, reader: bool) -> Batches:
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    it = DALIGenericIterator(
        [p],
        ["images", "labels"],
        reader_name="reader" if reader else None,
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )
    while True:
        for out in it:
            yield out[0]["images"], out[0]["labels"].view(-1).long(), False


def dali_input_epochs(p: Any) -> Batches:
    """Batches of a pipeline that ends at its reader (encoded files of any length, which the
    torch iterator cannot stack): the labels only."""
    while True:
        try:
            _jpegs, labels = p.run()
        except StopIteration:
            p.reset()
            continue
        yield torch.empty(0), torch.from_numpy(np.array(labels.as_tensor())).view(-1), False


def dali_maker(make: Callable[[], Any], reader: bool, input_only: bool) -> Callable[[], Batches]:
    """A backend's batches: its pipeline through the torch iterator, or (--input-only) the
    reader's output."""
    if input_only:
        return lambda: dali_input_epochs(make())
    return lambda: dali_epochs(make(), reader)


def cpu_seconds() -> float:
    """CPU time so far of this process and all its descendants (loader workers, DALI's Python
    workers, the node, the mount): what an image costs, whatever else runs on the machine."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def loader_rate(batches: Batches, per_epoch: int, batch: int) -> tuple[float, float]:
    """(images/s, CPU ms per image) over one epoch of `per_epoch` batches, timed from the first
    batch (the workers' start and the pipeline's build are left out alike)."""
    next(batches)
    started, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(per_epoch - 1):
        next(batches)
    images = (per_epoch - 1) * batch
    return images / (time.perf_counter() - started), 1000 * (cpu_seconds() - cpu) / images


class TinyNet(nn.Module):
    """A small CNN for a machine where ResNet-50 would measure only the model."""

    def __init__(self, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=4),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(name: str, classes: int) -> nn.Module:
    if name == "tiny":
        return TinyNet(classes)
    return getattr(models, name)(weights=None, num_classes=classes)


def train_rate(batches: Batches, args: argparse.Namespace, classes: int) -> float:
    """SGD steps/s of the model fed by `batches` (after one warm-up step)."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = make_model(args.model, classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        images, labels, uint8 = next(batches)
        x = kt.normalize(images, device=device) if uint8 else images.to(device, non_blocking=True)
        loss = loss_fn(model(x), labels.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return args.steps / (time.perf_counter() - started)


def read_all(root: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += len(f.read())
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=1000, help="images (default 1000)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--size", default="110KiB", help="approximate file size")
    p.add_argument("--cache", default="/var/tmp/kspeedfs-bench-backends", help="the data set")
    p.add_argument("--workers", type=int, default=2, help="loader workers / DALI threads")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="epochs per backend (best kept)")
    p.add_argument("--model", choices=("none", "tiny", "resnet18", "resnet50"), default="tiny")
    p.add_argument("--steps", type=int, default=20, help="training steps measured per backend")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--backends", help="comma-separated subset (default: all, or with --input-only its own)"
    )
    p.add_argument("--warm", type=int, default=512, help="MiB touched and freed before each")
    p.add_argument(
        "--input-only",
        action="store_true",
        help="only the DALI rows, ending at the reader (no decoding, no model): the part that\n"
        "stays on the CPU when a GPU decodes; with dali-array, the external source fed\n"
        "from one array in memory (DALI's own ceiling, no kspeedfs)",
    )
    args = p.parse_args()
    if args.input_only:
        args.model = "none"
        args.backends = args.backends or ",".join(INPUT_ONLY)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    chosen = [b.strip() for b in (args.backends or ",".join(BACKENDS)).split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BACKENDS) - (set(INPUT_ONLY) if args.input_only else set()))
    if unknown:
        p.error(f"unknown backends: {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device on this machine; nothing measured")
        return 0
    if any(b.startswith("dali") for b in chosen):
        try:
            import nvidia.dali  # noqa: F401
        except ImportError:
            print("DALI is not installed (pip install '.[dali]'); leaving out the dali rows")
            chosen = [b for b in chosen if not b.startswith("dali")]

    per_class = max(1, args.files // args.classes)
    source = ensure_sample(
        Path(args.cache) / f"set-{args.classes}x{per_class}-{args.size}",
        args.classes,
        per_class,
        args.size,
    )
    data_bytes = read_all(source)  # the page cache warm: the source at its best
    n = args.classes * per_class
    per_epoch = n // args.batch
    print(
        f"data set: {n} images, {format_size(data_bytes)} in {source}; {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; batch {args.batch}, {args.workers} workers, "
        f"{per_epoch} batches per epoch, best of {args.rounds}; model {args.model} on "
        f"{args.device}"
    )

    workdir = Path(tempfile.mkdtemp(prefix="kspeedfs-bench-backends-"))
    budget = 4 * data_bytes + 3 * n * DECODED * DECODED * 2 + (256 << 20)
    with LocalCache(workdir, budget) as cache:
        cache.preload(source.parent, "bench", show_progress=False)
        kw: dict[str, Any] = {"nodes": str(cache.address), "token": str(cache.token_file)}
        users.add_user(cache.token_file.with_name("users"), "bench", "read", "bench")
        if "kspeed-decoded" in chosen:
            with admin.connect(cache.settings) as client:
                decoded_client.start(client, "bench", DECODED)
                decoded_client.wait(client, "bench", DECODED)
        if "mount" in chosen or "dali-mount" in chosen:
            cache.mount(workdir / "mnt")
        makers: dict[str, Callable[[], Batches]] = {
            "pytorch": lambda: torch_epochs(
                datasets.ImageFolder(str(source), train_transform()), args, False
            ),
            "kspeed": lambda: torch_epochs(
                kspeed_image_folder(source, train_transform(), kw), args, False
            ),
            "kspeed-decoded": lambda: torch_epochs(
                KSpeedImageFolder(
                    str(source), kt.train(CROP), decoded=DECODED, decode="tensor", **kw
                ),
                args,
                True,
            ),
            "mount": lambda: torch_epochs(
                datasets.ImageFolder(
                    str(workdir / "mnt" / "bench" / source.name), train_transform()
                ),
                args,
                False,
            ),
        }

        def ks_callable() -> KSpeedCallable:
            return KSpeedCallable(str(source), args.batch, **kw)

        # Each DALI backend's pipeline; the torch iterator over it, or its reader's output.
        pipelines: dict[str, Callable[[], Any]] = {
            "dali": lambda: dali_pipeline(args, source=source),
            "dali-kspeed": lambda: dali_pipeline(args, batches=ks_callable().batch),
            "dali-kspeed-sample": lambda: dali_pipeline(args, per_sample=ks_callable()),
            "dali-mount": lambda: dali_pipeline(
                args, source=workdir / "mnt" / "bench" / source.name
            ),
        }
        if args.input_only:
            sizes = [p.stat().st_size for p in sorted(source.rglob("*.JPEG"))]
            pipelines["dali-array"] = lambda: dali_pipeline(
                args, per_sample=ArraySource(sizes, args.batch)
            )
        for name, make in pipelines.items():
            reader = name in ("dali", "dali-mount")
            makers[name] = dali_maker(make, reader=reader, input_only=args.input_only)
        rows: dict[str, Row] = {}
        rates: dict[str, list[float]] = {name: [] for name in chosen}  # each round's, in order
        for r in range(args.rounds):
            # A different order each round: load from elsewhere on the machine hits all sides.
            for name in chosen[r % len(chosen) :] + chosen[: r % len(chosen)]:
                warm_memory(args.warm << 20)
                batches = makers[name]()
                rate, cpu_ms = loader_rate(batches, per_epoch, args.batch)
                steps = None if args.model == "none" else train_rate(batches, args, args.classes)
                batches.close()  # its workers and pipeline end before the next backend runs
                shown = "" if steps is None else f", {steps:.2f} steps/s"
                print(
                    f"  round {r + 1}, {name}: {rate:.0f} images/s, {cpu_ms:.2f} CPU ms/image"
                    f"{shown}",
                    flush=True,
                )
                rates[name].append(rate)
                old = rows.get(name)
                if old is not None:
                    rate, cpu_ms = max(rate, old[0]), min(cpu_ms, old[1])
                    steps = None if steps is None or old[2] is None else max(steps, old[2])
                rows[name] = (rate, cpu_ms, steps)
    print_table(rows, rates, args)
    return 0


def print_table(
    rows: dict[str, Row], rates: dict[str, list[float]], args: argparse.Namespace
) -> None:
    base = rows.get("pytorch")
    model = "" if args.model == "none" else f"{args.model} steps/s"
    print(
        f"\nbest of {args.rounds} rounds; ratios to pytorch (CPU: pytorch's CPU per image over "
        "the backend's, so higher is better everywhere)"
    )
    print(
        f"  {'backend':16s} {'images/s':>9s} {'ratio':>6s}  {'CPU ms/image':>12s} {'ratio':>6s}",
        end="",
    )
    print(f"  {model:>18s} {'ratio':>6s}" if model else "")
    for name, (rate, cpu_ms, steps) in rows.items():
        line = f"  {name:16s} {rate:9.0f} {_ratio(rate, base and base[0]):>6s}"
        line += f"  {cpu_ms:12.2f} {_ratio(base and base[1], cpu_ms):>6s}"
        if steps is not None:
            line += f"  {steps:18.2f} {_ratio(steps, base and base[2]):>6s}"
        print(line)
    for name in ("dali-kspeed", "dali-kspeed-sample"):
        if "dali" not in rows or name not in rows:
            continue
        r = rows[name][0] / rows["dali"][0]
        c = rows["dali"][1] / rows[name][1]
        # The two side by side within each round: on a busy machine a steadier figure than
        # the best of each, which may come from different moments.
        paired = float(np.median([a / b for a, b in zip(rates[name], rates["dali"], strict=True)]))
        verdict = f" (target >= 1.0x: {'meets' if r >= 1.0 else 'MISSES'})"
        print(
            f"  {name} / dali: {r:.2f}x images/s{verdict if name == 'dali-kspeed' else ''}, "
            f"median of the rounds' ratios {paired:.2f}x; {c:.2f}x in CPU per image"
        )


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}x" if a and b else "     -"


if __name__ == "__main__":
    sys.exit(main())
