"""Generates an ImageNet-like sample dataset: class folders of distinct, decodable JPEGs."""

from __future__ import annotations

import io
import random
from pathlib import Path

_COM_MAX = 65533  # payload limit of one JPEG comment segment


def _base_jpeg(rng: random.Random, target: int) -> bytes:
    from PIL import Image

    side = 256
    data = b""
    for _ in range(4):  # a few rounds of resizing get within ~10% of the target size
        noise = bytes(rng.getrandbits(8) for _ in range((side // 4) ** 2 * 3))
        img = Image.frombytes("RGB", (side // 4, side // 4), noise).resize(
            (side, side), Image.Resampling.BILINEAR
        )
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        side = max(64, int(side * (target / len(data)) ** 0.5))
    return data


def _with_comment(jpeg: bytes, payload: bytes) -> bytes:
    """Insert comment segments after SOI: the image decodes the same, the bytes differ."""
    parts = [jpeg[:2]]
    for i in range(0, len(payload), _COM_MAX):
        chunk = payload[i : i + _COM_MAX]
        parts.append(b"\xff\xfe" + (len(chunk) + 2).to_bytes(2, "big") + chunk)
    parts.append(jpeg[2:])
    return b"".join(parts)


def make_sample(
    dest: Path, classes: int, per_class: int, file_size: int, seed: int = 0, bases: int = 16
) -> tuple[int, int]:
    """Write classes x per_class JPEGs of about file_size bytes; returns (files, bytes)."""
    rng = random.Random(seed)
    base_images = [_base_jpeg(rng, int(file_size * 0.85)) for _ in range(bases)]
    total = 0
    for c in range(classes):
        folder = dest / f"n{c:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = base_images[(c * per_class + i) % bases]
            extra = max(16, file_size - len(base) + rng.randint(-file_size // 10, file_size // 10))
            data = _with_comment(base, rng.randbytes(extra))
            (folder / f"n{c:08d}_{i:05d}.JPEG").write_bytes(data)
            total += len(data)
    return classes * per_class, total
