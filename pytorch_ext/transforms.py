"""Ready-made train transforms for decoded samples: torchvision.transforms.v2 on uint8 tensors.

`train(224)` is RandomResizedCrop(224) + RandomHorizontalFlip on the uint8 CHW view that
`KSpeedImageFolder(..., decoded=256, decode="tensor")` hands out, and it returns uint8: the
float conversion and normalisation move to the GPU, per batch (`normalize`), as DALI and FFCV
do. What that changes against the stock pipeline (ToTensor + Normalize in the worker): samples
cross from the workers as uint8 (a quarter of the bytes), and the model gets its float input
from `normalize(batch)` instead of from the loader. `train(224, normalize=True)` keeps the
float output in the worker instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train(
    size: int = 224,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    normalize: bool = False,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> v2.Compose:
    """The usual ImageNet train augmentation on a uint8 CHW tensor (or a PIL image): uint8
    out, or float32 normalized with `normalize=True`."""
    steps: list[v2.Transform] = [
        v2.RandomResizedCrop(size, scale=scale, ratio=ratio, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.PILToTensor(),  # a PIL input becomes uint8 CHW; a tensor passes
    ]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    return v2.Compose(steps)


def normalize(
    batch: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A uint8 NCHW batch to float32 normalized, on `device` (the GPU: where it is cheap)."""
    x = batch.to(device, non_blocking=True) if device is not None else batch
    m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1) * 255.0
    s = torch.tensor(std, device=x.device).view(1, -1, 1, 1) * 255.0
    return (x.float() - m) / s
