"""The /dev/fuse protocol loop on its own: a small filesystem mounted for real, in this process."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kspeedfs.fuse.kernel import ROOT_INODE, Attr, FuseError, FuseSession, ReadResult, StatFs

DIR_INO, FILE_INO, BOOM_INO, SLOW_INO, BAD_INO = 2, 3, 4, 5, 6
FIRST_CHILD = 1000
CHILDREN = 3000
DATA = os.urandom(300 * 1024 + 17)  # several reads, the last one short
TOP = {b"dir": DIR_INO, b"file": FILE_INO, b"boom": BOOM_INO, b"slow": SLOW_INO, b"bad": BAD_INO}


def child_name(i: int) -> bytes:
    return b"%04d-" % i + b"n" * 120 + "é".encode()  # long names: a listing spans many replies


class ToyFS:
    """Fixed tree: /dir (many files), /file (DATA), /boom, /slow and /bad for failing reads."""

    def __init__(self) -> None:
        self.slow_started = threading.Event()

    def _attr(self, ino: int) -> Attr:
        if ino in (ROOT_INODE, DIR_INO):
            return Attr(ino, stat.S_IFDIR | 0o555, nlink=2, timeout=60)
        size = len(DATA) if ino in (FILE_INO, SLOW_INO) or ino >= FIRST_CHILD else 10
        return Attr(ino, stat.S_IFREG | 0o444, size=size, timeout=60)

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent == ROOT_INODE and name in TOP:
            return self._attr(TOP[name])
        if parent == DIR_INO and name[:4].isdigit() and child_name(int(name[:4])) == name:
            return self._attr(FIRST_CHILD + int(name[:4]))
        raise FuseError(errno.ENOENT)

    def getattr(self, ino: int) -> Attr:
        return self._attr(ino)

    def readlink(self, ino: int) -> bytes:
        raise FuseError(errno.EINVAL)

    def opendir(self, ino: int) -> bool:
        if ino not in (ROOT_INODE, DIR_INO):
            raise FuseError(errno.ENOTDIR)
        return ino == DIR_INO

    def entries(self, ino: int, start: int) -> Iterator[tuple[bytes, Attr]]:
        if ino == ROOT_INODE:
            names = sorted(TOP)
            for name in names[start:]:
                yield name, self._attr(TOP[name])
            return
        for i in range(start, CHILDREN):
            yield child_name(i), self._attr(FIRST_CHILD + i)

    def read(self, ino: int, offset: int, size: int) -> ReadResult:
        if ino == BOOM_INO:
            raise RuntimeError("a bug in a handler")
        if ino == BAD_INO:
            raise FuseError(errno.EIO)
        if ino == SLOW_INO:

            def blocking() -> bytes:
                self.slow_started.set()
                time.sleep(0.05)  # under test: a handler that takes a while
                return DATA[offset : offset + size]

            return blocking
        return memoryview(DATA)[offset : offset + size]

    def statfs(self) -> StatFs:
        return StatFs(blocks=1234, files=CHILDREN + 6)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == b"user.toy":
            return b"value-%d" % ino
        raise FuseError(errno.ENODATA)

    def listxattr(self, ino: int) -> list[bytes]:
        return [b"user.toy", b"user.other"]


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[tuple[Path, FuseSession]]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    session = FuseSession(ToyFS(), str(mnt), ["ro", "default_permissions", "fsname=toy"])
    session.mount()
    session.start()
    try:
        yield mnt, session
    finally:
        session.unmount()
        session.close()
    assert not os.path.ismount(mnt)


def test_listing_spans_many_replies_and_matches(toy: tuple[Path, FuseSession]) -> None:
    mnt, session = toy
    assert sorted(os.listdir(mnt)) == sorted(n.decode() for n in TOP)
    names = os.listdir(os.fsencode(mnt / "dir"))
    assert sorted(names) == [child_name(i) for i in range(CHILDREN)]
    assert session.counts()["readdirplus"] > 10  # the listing really took many replies
    st = os.stat(os.path.join(os.fsencode(mnt / "dir"), child_name(7)))
    assert st.st_size == len(DATA) and stat.S_ISREG(st.st_mode)
    assert st.st_ino == FIRST_CHILD + 7


def test_reads_equal_and_a_second_pass_sends_no_request(toy: tuple[Path, FuseSession]) -> None:
    mnt, session = toy
    paths = [os.path.join(os.fsencode(mnt / "dir"), child_name(i)) for i in range(50)]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read() == DATA
    first = session.counts()
    assert first["open"] <= 1  # the one ENOSYS that switches the kernel to no-open mode
    assert first["release"] == 0
    assert first["read"] >= len(paths)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)  # not open(): it asks isatty(), an ioctl request
        try:
            assert os.read(fd, len(DATA) + 1) == DATA
        finally:
            os.close(fd)
    second = session.counts()
    second.subtract(first)
    assert +second == {}, f"a cached pass still reached the daemon: {+second}"
    with open(paths[0], "rb") as f:
        assert not f.isatty()
    assert session.counts()["ioctl"] >= 1
    # Reads at offsets (past the kernel cache) are served from those offsets.
    with open(mnt / "file", "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(f.fileno(), 1000, 200_000) == DATA[200_000:201_000]
        assert os.pread(f.fileno(), 1000, len(DATA) - 10) == DATA[-10:]


def test_failing_handlers_give_eio_and_the_mount_stays_up(
    toy: tuple[Path, FuseSession], caplog: pytest.LogCaptureFixture
) -> None:
    mnt, _ = toy
    for name in ("boom", "bad"):
        with pytest.raises(OSError) as info:
            (mnt / name).read_bytes()
        assert info.value.errno == errno.EIO
    assert "a bug in a handler" in caplog.text
    assert (mnt / "file").read_bytes() == DATA


def test_blocking_reads_run_beside_other_requests(toy: tuple[Path, FuseSession]) -> None:
    mnt, session = toy
    results: list[bytes] = []
    readers = [threading.Thread(target=lambda: results.append((mnt / "slow").read_bytes()))]
    readers += [threading.Thread(target=lambda: results.append((mnt / "file").read_bytes()))]
    for t in readers:
        t.start()
    for t in readers:
        t.join(30)
    assert results == [DATA, DATA]
    assert isinstance(session.fs, ToyFS) and session.fs.slow_started.is_set()


def test_errors_xattrs_and_statfs(toy: tuple[Path, FuseSession]) -> None:
    mnt, _ = toy
    with pytest.raises(FileNotFoundError):
        (mnt / "missing").stat()
    with pytest.raises(OSError) as info:
        (mnt / "file").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    with pytest.raises(OSError) as info:
        (mnt / "newdir").mkdir()
    assert info.value.errno == errno.EROFS
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "file")
    assert os.getxattr(mnt / "file", "user.toy") == b"value-%d" % FILE_INO
    assert sorted(os.listxattr(mnt / "file")) == ["user.other", "user.toy"]
    with pytest.raises(OSError) as info:
        os.getxattr(mnt / "file", "user.none")
    assert info.value.errno == errno.ENODATA
    st = os.statvfs(mnt)
    assert st.f_blocks == 1234 and st.f_files == CHILDREN + 6


def test_unmount_ends_the_threads(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    session = FuseSession(ToyFS(), str(mnt), ["ro"])
    session.mount()
    session.start()
    assert os.path.ismount(mnt)
    session.unmount()
    assert session.done.wait(10)
    session.close()
    assert session.fd == -1
    assert not os.path.ismount(mnt)
    session.unmount()  # twice is harmless


def test_mount_on_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    session = FuseSession(ToyFS(), str(tmp_path / "nope"), ["ro"])
    with pytest.raises(OSError) as info:
        session.mount()
    assert "\n" not in str(info.value)
    assert "nope" in str(info.value) or "mount failed" in str(info.value)


def test_every_ioctl_is_answered_enotty_before_any_handler(
    toy: tuple[Path, FuseSession],
) -> None:
    """The kernel forwards each isatty() (TCGETS) of Python's open(); the loop answers it
    ENOTTY on its fast path, one request each, and serves on."""
    import fcntl
    import termios

    mnt, session = toy
    before = session.counts()["ioctl"]
    fd = os.open(mnt / "file", os.O_RDONLY)
    try:
        for _ in range(20):
            with pytest.raises(OSError) as e:
                fcntl.ioctl(fd, termios.TCGETS, bytes(64))
            assert e.value.errno == errno.ENOTTY
            assert not os.isatty(fd)
        assert os.read(fd, len(DATA) + 1) == DATA
    finally:
        os.close(fd)
    assert session.counts()["ioctl"] - before == 40
