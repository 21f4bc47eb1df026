"""Checksum candidates for bytes at rest, in bytes/s on this machine (one thread).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_checksums.py

xxh3_64 (the manifest's, xxhash), xxh64, blake2b (8 bytes) and crc32c where a package for it
is importable (google-crc32c or crc32c: not dependencies; install one to compare). Each over one
64 MiB buffer and over 64 KiB pieces of it (a typical file), best of 5.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable

import xxhash


def candidates() -> dict[str, Callable[[bytes], object]]:
    found: dict[str, Callable[[bytes], object]] = {
        "xxh3_64 (manifest)": xxhash.xxh3_64_intdigest,
        "xxh64": xxhash.xxh64_intdigest,
        "blake2b-64": lambda d: hashlib.blake2b(d, digest_size=8).digest(),
    }
    try:
        import google_crc32c  # type: ignore[import-not-found]

        found["crc32c (google-crc32c)"] = google_crc32c.value
    except ImportError:
        pass
    try:
        import crc32c  # type: ignore[import-not-found]

        found["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        pass
    return found


def rate(f: Callable[[bytes], object], pieces: list[bytes], reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        for piece in pieces:
            f(piece)
        best = min(best, time.perf_counter() - started)
    return sum(map(len, pieces)) / best / 1e9


def main() -> None:
    buf = os.urandom(64 << 20)
    small = [buf[i : i + 65536] for i in range(0, len(buf), 65536)]
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for name, f in candidates().items():
        print(
            f"  {name:24s} 64 MiB: {rate(f, [buf]):6.2f} GB/s   64 KiB: {rate(f, small):6.2f} GB/s"
        )


if __name__ == "__main__":
    main()
