"""The built-in demo runs end to end on a tiny sample and leaves nothing running."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
from conftest import run_cli

from kspeedfs.testing.process import is_users_setting

pytestmark = pytest.mark.slow  # the whole demo


@pytest.mark.fuse
def test_demo_runs_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not is_users_setting(k)}
    args = ("demo", "--workdir", str(workdir), "--classes", "2", "--per-class", "6")
    done = run_cli(*args, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "decoded 12 images at 256" in out, out
    rows = re.findall(r"^  (\S.*\S)\s+12\s+\d+\s+(\d+\.\d\d)x$", out, re.M)
    assert [label for label, _ in rows] == [
        "stock ImageFolder, source folder",
        "stock ImageFolder, over the mount",
        "stock ImageFolder, the mount's sample@256 (decoded once)",
        "fast path, decoded=256 + transforms.train (uint8)",
    ], out
    assert rows[0][1] == "1.00"  # the ratios are to the first row
    node = re.search(r"node on 127\.0\.0\.1:(\d+), shm (\S+),", out)
    assert node, out
    port, shm = int(node.group(1)), Path(node.group(2))
    assert not shm.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with open("/proc/self/mounts") as f:
        assert str(workdir) not in f.read()
    assert (workdir / "token").exists()  # its own token, not the user's


def test_the_sample_is_generated_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kspeedfs.demo import ensure_sample

    train = ensure_sample(tmp_path / "s", classes=2, per_class=3, size="8KiB")
    files = sorted(train.rglob("*.JPEG"))
    assert len(files) == 6
    stamps = [f.stat().st_mtime_ns for f in files]
    assert ensure_sample(tmp_path / "s", classes=2, per_class=3, size="8KiB") == train
    assert "reusing the sample dataset" in capsys.readouterr().out
    assert [f.stat().st_mtime_ns for f in files] == stamps
    # Other parameters make a new sample in place of the old one.
    ensure_sample(tmp_path / "s", classes=3, per_class=1, size="8KiB")
    assert len(list(train.rglob("*.JPEG"))) == 3
