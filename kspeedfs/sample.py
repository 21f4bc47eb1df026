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


def make_shards(
    dest: Path,
    shards: int,
    per_shard: int,
    file_size: int,
    seed: int = 0,
    bases: int = 8,
) -> list[Path]:
    """WebDataset shards `dest/shard-NNNNNN.tar`, `per_shard` samples each: a JPEG of about
    `file_size` bytes (.jpg), its class (.cls), a JSON record (.json) and, in every third, a
    member whose extension has a dot (.seg.bin). Keys have dots in their folder (WebDataset
    keys end at the first dot of the last path part), and in every shard a member of the
    second sample comes before the first sample's last one (keys that come back: WebDataset
    makes more samples of them). Returns the shards."""
    import json
    import tarfile

    rng = random.Random(seed)
    base = [_base_jpeg(rng, file_size) for _ in range(bases)]
    dest.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    n = 0
    for s in range(shards):
        members: list[tuple[str, bytes]] = []
        for k in range(per_shard):
            key = f"part.v{s % 2}/sample{n:07d}"
            jpeg = _with_comment(base[n % bases], f"{seed}:{n}".encode())
            fields = [
                ("jpg", jpeg),
                ("cls", str(n % 10).encode()),
                ("json", json.dumps({"n": n, "shard": s}).encode()),
            ]
            if n % 3 == 0:
                fields.append(("seg.bin", rng.randbytes(rng.randrange(1, 2000))))
            members += [(f"{key}.{ext}", data) for ext, data in fields]
            if k == 1:  # this sample's last member goes before the previous one's last
                members.insert(len(members) - len(fields) - 1, members.pop())
            n += 1
        path = dest / f"shard-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
                tar.addfile(info, io.BytesIO(data))
        out.append(path)
    return out
