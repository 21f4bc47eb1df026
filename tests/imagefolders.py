"""Image class folders for the fast-path tests, with the awkward cases, and the fixed transform
they are compared through."""

from __future__ import annotations

from pathlib import Path

from torchvision import transforms

from kspeedfs.sample import make_sample

FIXED = transforms.Compose(
    [transforms.Resize(48), transforms.CenterCrop(40), transforms.ToTensor()]
)


def make_images(root: Path) -> Path:
    """Class folders with the awkward cases: nesting, a non-image, an upper-case extension,
    a non-ASCII name, an empty class folder."""
    src = root / "train"
    make_sample(src, classes=3, per_class=5, file_size=5000, bases=3)
    nested = src / "n00000001" / "sub" / "deeper"
    nested.mkdir(parents=True)
    data = (src / "n00000001" / "n00000001_00000.JPEG").read_bytes()
    (nested / "x.jpg").write_bytes(data)
    (src / "n00000001" / "sub-b.JPG").write_bytes(data)
    (src / "n00000002" / "notes.txt").write_bytes(b"not an image\n")
    (src / "n00000002" / "ünï.jpeg").write_bytes(data)
    (src / "n00000000" / "a").mkdir()
    (src / "n00000000" / "a" / "b.png").write_bytes(_png())
    return src


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()
