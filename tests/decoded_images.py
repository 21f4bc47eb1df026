"""A small image folder with the awkward cases for the decoded-variant tests."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def _noise(w: int, h: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(mode) if mode != "L" else 1
    arr = rng.integers(0, 256, size=(h, w, bands), dtype=np.uint8)
    # smooth gradients too, so resizing has something to interpolate
    arr[..., 0] = (np.arange(w)[None, :] * 255 // max(w - 1, 1)).astype(np.uint8)
    return Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)


def make_images(root: Path) -> dict[str, str]:
    """Class folders of JPEG, PNG, odd sizes, grayscale and CMYK JPEGs, one corrupt file and a
    non-image file. Returns {relative path: kind}."""
    kinds: dict[str, str] = {}

    def save(rel: str, img: Image.Image, fmt: str, kind: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        kinds[rel] = kind

    save("cat/a.jpg", _noise(97, 61, "RGB", 1), "JPEG", "jpeg")
    save("cat/b.JPEG", _noise(64, 64, "RGB", 2), "JPEG", "jpeg-exact-size")
    save("cat/c.png", _noise(33, 130, "RGBA", 3), "PNG", "png-rgba")
    save("cat/d.jpg", _noise(201, 150, "L", 4), "JPEG", "grayscale")
    save("dog/e.jpg", _noise(75, 49, "CMYK", 5), "JPEG", "cmyk")
    save("dog/f.png", _noise(17, 23, "RGB", 6), "PNG", "png-small")
    save("dog/g.jpeg", _noise(640, 480, "RGB", 7), "JPEG", "jpeg-large")
    buf = io.BytesIO()
    _noise(80, 60, "RGB", 8).save(buf, "JPEG")
    (root / "dog" / "h_corrupt.jpg").write_bytes(buf.getvalue()[:300])  # header, no scan
    kinds["dog/h_corrupt.jpg"] = "corrupt"
    (root / "dog" / "notes.txt").write_text("not an image\n")
    kinds["dog/notes.txt"] = "text"
    return kinds
