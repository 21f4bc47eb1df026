"""kspeedfs-mountd: declared mounts come up, come back after kill -9, follow SIGHUP, end on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import KSPEEDFS, NodeProcess, node_in, run_cli, wait_for
from mountdutil import (
    MOUNTD,
    MountdProcess,
    NotifyListener,
    alive,
    declare,
    kspeedfs_mounts_under,
    unmount_all_under,
)

from kspeedfs.system.mountinfo import is_stale, kspeedfs_mounted
from kspeedfs.testing.readgap import HostReader
from mountd.declarations import Declaration, InvalidDeclaration, load_declarations

pytestmark = [pytest.mark.fuse, pytest.mark.slow]  # the mount daemon restarting mounts

FILES = {"sub/x.txt": b"hello from the cache\n", "y.bin": os.urandom(3000)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the module, with datasets alpha and beta loaded from FILES (in its source)."""
    base = tmp_path_factory.mktemp("mountd-node")
    src = base / "src"
    for rel, data in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    with node_in(base) as node:
        for name in ("alpha", "beta"):
            done = run_cli("preload", str(src), "--name", name, "-q", env=node.env())
            assert done.returncode == 0, done.stderr
        yield node


class Mountds:
    """Starts mountd on tmp_path/mounts.d; the fixture stops it and clears leftover mounts."""

    def __init__(self, cache: NodeProcess, tmp_path: Path):
        self.cache = cache
        self.tmp_path = tmp_path
        self.mounts_dir = tmp_path / "mounts.d"
        self.mounts_dir.mkdir()
        self.started: list[MountdProcess] = []

    def start(self, wait_ready: bool = True, env: dict[str, str] | None = None) -> MountdProcess:
        m = MountdProcess(
            self.mounts_dir,
            self.tmp_path / "state.json",
            env or self.cache.env(),
            self.tmp_path / "mountd.log",
        )
        self.started.append(m)
        return m.start(wait_ready)


@pytest.fixture
def mountds(cache: NodeProcess, tmp_path: Path) -> Iterator[Mountds]:
    m = Mountds(cache, tmp_path)
    yield m
    for proc in m.started:
        proc.stop()
    unmount_all_under(tmp_path)


def read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def test_two_mounts_come_up_and_one_is_restored_after_kill9(
    mountds: Mountds, tmp_path: Path
) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    a, b = tmp_path / "mnt" / "a", tmp_path / "mnt" / "b"
    declare(mounts_dir, "a", mountpoint=str(a), dataset="alpha")
    declare(mounts_dir, "b", mountpoint=str(b), options=["allow_other"])
    mountd = start()
    mountd.wait(
        lambda s: [m["state"] for m in s["mounts"]] == ["mounted", "mounted"], "both mounted"
    )
    assert (a / "sub" / "x.txt").read_bytes() == FILES["sub/x.txt"]
    assert (b / "beta" / "y.bin").read_bytes() == FILES["y.bin"]
    first_a, first_b = mountd.mount("a"), mountd.mount("b")
    assert first_a and first_b

    os.kill(first_a["pid"], signal.SIGKILL)
    mountd.wait_mount(
        "a",
        lambda m: m["state"] == "mounted" and m["pid"] not in (None, first_a["pid"]),
        "mounted again by a new process",
    )
    wait_for(lambda: read(a / "sub" / "x.txt") is not None, what="reads from the new mount")
    assert (a / "sub" / "x.txt").read_bytes() == FILES["sub/x.txt"]
    again_a, again_b = mountd.mount("a"), mountd.mount("b")
    assert again_a and again_b
    assert again_a["restarts"] >= 1
    assert again_a["error"] is None and "SIGKILL" in again_a["last_error"]
    assert again_b["pid"] == first_b["pid"] and again_b["restarts"] == 0
    assert not alive(first_a["pid"])


def test_sighup_adds_removes_and_changes_mounts(mountds: Mountds, tmp_path: Path) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    a, b, c = (tmp_path / "mnt" / n for n in ("a", "b", "c"))
    declare(mounts_dir, "a", mountpoint=str(a), dataset="alpha")
    declare(mounts_dir, "b", mountpoint=str(b), dataset="alpha")
    mountd = start()
    before = mountd.wait(
        lambda s: [m["state"] for m in s["mounts"]] == ["mounted", "mounted"], "both mounted"
    )
    pid_a, pid_b = (m["pid"] for m in before["mounts"])

    (mounts_dir / "a.toml").unlink()
    declare(mounts_dir, "b", mountpoint=str(b), dataset="beta")
    declare(mounts_dir, "c", mountpoint=str(c), dataset="beta")
    mountd.send(signal.SIGHUP)
    after = mountd.wait(
        lambda s: (
            [(m["name"], m["state"]) for m in s["mounts"]] == [("b", "mounted"), ("c", "mounted")]
            and s["mounts"][0]["dataset"] == "beta"
        ),
        "a gone, b changed, c added",
    )
    assert not kspeedfs_mounted(a)
    assert after["mounts"][0]["pid"] != pid_b
    assert sorted(kspeedfs_mounts_under(tmp_path)) == [str(b), str(c)]
    with open("/proc/self/mountinfo") as f:
        assert sum(f" {b} " in line for line in f) == 1  # the old b is gone, not stacked
    assert (c / "y.bin").read_bytes() == FILES["y.bin"]
    wait_for(lambda: not alive(pid_a) and not alive(pid_b), what="the old mounts' processes to end")


def test_sigterm_leaves_no_mount_behind(mountds: Mountds, tmp_path: Path) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    for name in ("a", "b"):
        declare(mounts_dir, name, mountpoint=str(tmp_path / "mnt" / name), dataset="alpha")
    mountd = start()
    state = mountd.wait(
        lambda s: [m["state"] for m in s["mounts"]] == ["mounted", "mounted"], "both mounted"
    )
    pids = [m["pid"] for m in state["mounts"]]
    assert len(kspeedfs_mounts_under(tmp_path)) == 2

    mountd.send(signal.SIGTERM)
    assert mountd.proc is not None
    assert mountd.proc.wait(60) == 0, mountd.log()
    assert kspeedfs_mounts_under(tmp_path) == []
    assert not any(alive(pid) for pid in pids)
    assert not mountd.state_file.exists()


def test_bad_declarations_are_reported_and_do_not_stop_the_others(
    mountds: Mountds, tmp_path: Path, cache: NodeProcess
) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    good = tmp_path / "mnt" / "good"
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    declare(mounts_dir, "good", mountpoint=str(good), dataset="alpha")
    declare(mounts_dir, "nodata", mountpoint=str(tmp_path / "mnt" / "nodata"), dataset="nope")
    declare(mounts_dir, "relative", mountpoint="mnt/rel")
    declare(mounts_dir, "filemp", mountpoint=str(a_file))
    declare(mounts_dir, "typo", mountpoint=str(tmp_path / "mnt" / "typo"), datset="alpha")
    (mounts_dir / "broken.toml").write_text("mountpoint = \n")
    (mounts_dir / "ignored.conf").write_text("not a declaration")
    mountd = start()
    state = mountd.wait(
        lambda s: (
            {m["name"]: m["error"] is not None for m in s["mounts"]}
            == {
                "good": False,
                "nodata": True,
                "relative": True,
                "filemp": True,
                "typo": True,
                "broken": True,
            }
        ),
        "every declaration judged",
    )
    by_name = {m["name"]: m for m in state["mounts"]}
    assert by_name["good"]["state"] == "mounted"
    assert (good / "sub" / "x.txt").read_bytes() == FILES["sub/x.txt"]
    assert "no dataset named 'nope'" in by_name["nodata"]["error"]
    assert by_name["nodata"]["state"] in ("retrying", "mounting")
    assert "absolute path" in by_name["relative"]["error"]
    assert by_name["relative"]["state"] == "invalid"
    assert "not a folder" in by_name["filemp"]["error"]
    assert "unknown key 'datset'" in by_name["typo"]["error"]
    assert "bad TOML" in by_name["broken"]["error"]
    assert kspeedfs_mounts_under(tmp_path) == [str(good)]

    listing = run_cli("mounts", "--state-file", str(mountd.state_file), env=cache.env())
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert sorted(rows) == ["broken", "filemp", "good", "nodata", "relative", "typo"]
    assert " mounted " in rows["good"] and "invalid" in rows["broken"]
    status = subprocess.run(
        [*MOUNTD, "--state-file", str(mountd.state_file), "status", "--json"],
        capture_output=True,
        text=True,
    )
    assert status.returncode == 0, status.stderr
    listed = {m["name"]: m for m in json.loads(status.stdout)["mounts"]}
    assert sorted(listed) == sorted(rows)
    assert listed["good"]["state"] == "mounted" and listed["broken"]["state"] == "invalid"


def test_stale_leftover_at_a_mountpoint_is_cleared(
    mountds: Mountds, tmp_path: Path, cache: NodeProcess
) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    mp = tmp_path / "mnt" / "a"
    mp.mkdir(parents=True)
    # A mount killed before anyone looked at it: not even its root's attributes are cached.
    crashed = subprocess.Popen(
        [*KSPEEDFS, "mount", str(mp), "--foreground", "--dataset", "alpha"],
        env=cache.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: kspeedfs_mounted(mp), what="the mount that will crash")
    finally:
        crashed.kill()
        crashed.wait()
    assert is_stale(mp)

    declare(mounts_dir, "a", mountpoint=str(mp), dataset="alpha")
    mountd = start()
    mountd.wait_mount("a", lambda m: m["state"] == "mounted", "mounted over the stale leftover")
    assert (mp / "sub" / "x.txt").read_bytes() == FILES["sub/x.txt"]
    assert kspeedfs_mounts_under(tmp_path) == [str(mp)]


def test_declared_source_is_preloaded_before_mounting(
    mountds: Mountds, tmp_path: Path, cache: NodeProcess
) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    name = f"gamma-{uuid.uuid4().hex[:6]}"
    mp = tmp_path / "mnt" / "g"
    source = cache.log_path.parent / "src"
    declare(mounts_dir, "g", mountpoint=str(mp), dataset=name, source=str(source))
    mountd = start()
    mountd.wait_mount("g", lambda m: m["state"] == "mounted", "preloaded and mounted")
    assert (mp / "y.bin").read_bytes() == FILES["y.bin"]
    listed = {d["name"]: d for d in cache.request("list")["datasets"]}
    assert listed[name]["lifetime"] == "offline"
    cache.request("unload", name=name)


def test_mountd_notifies_ready_status_and_watchdog(
    mountds: Mountds, tmp_path: Path, cache: NodeProcess
) -> None:
    mounts_dir, start = mountds.mounts_dir, mountds.start
    declare(mounts_dir, "a", mountpoint=str(tmp_path / "mnt" / "a"), dataset="alpha")
    sock_dir = Path(tempfile.mkdtemp(prefix="kspeedfs-notify-"))
    listener = NotifyListener(sock_dir / "notify")
    try:
        env = {**cache.env(), "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "200000"}
        env.pop("WATCHDOG_PID", None)
        mountd = start(wait_ready=False, env=env)
        listener.receive_until(lambda msgs: any(f.get("READY") == "1" for _, f in msgs), "READY=1")
        # READY comes once the declared mounts had their first try: this one is up already.
        assert mountd.mount("a")["state"] == "mounted"  # type: ignore[index]
        listener.receive_until(
            lambda msgs: sum(f.get("WATCHDOG") == "1" for _, f in msgs) >= 2, "WATCHDOG=1 pings"
        )
        ready = next(f for _, f in listener.messages if f.get("READY") == "1")
        assert ready.get("STATUS") == "1 mounted"
        assert mountd.proc is not None
        # Only the main process may talk to systemd (NotifyAccess=main), not the mount children.
        assert listener.senders() == {mountd.proc.pid}
        mountd.send(signal.SIGTERM)
        listener.receive_until(lambda msgs: any("STOPPING" in f for _, f in msgs), "STOPPING=1")
        assert mountd.proc.wait(60) == 0
    finally:
        listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_exec_becomes_the_mount_for_the_template_unit(tmp_path: Path, cache: NodeProcess) -> None:
    """kspeedfs-mount@NAME.service: the main PID must be the mount and send READY=1 itself."""
    mounts_dir = tmp_path / "mounts.d"
    mp = tmp_path / "mnt" / "a"
    declare(mounts_dir, "a", mountpoint=str(mp), dataset="beta")
    sock_dir = Path(tempfile.mkdtemp(prefix="kspeedfs-notify-"))
    listener = NotifyListener(sock_dir / "notify")
    proc = subprocess.Popen(
        [*MOUNTD, "--mounts-dir", str(mounts_dir), "exec", "a"],
        env={**cache.env(), "NOTIFY_SOCKET": str(listener.path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        listener.receive_until(lambda msgs: any("READY" in f for _, f in msgs), "READY=1")
        assert listener.senders() == {proc.pid}
        assert (mp / "y.bin").read_bytes() == FILES["y.bin"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not kspeedfs_mounted(mp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        unmount_all_under(tmp_path)


def test_status_without_mountd_is_a_clear_error(tmp_path: Path) -> None:
    done = run_cli("mounts", "--state-file", str(tmp_path / "none.json"), env=dict(os.environ))
    assert done.returncode == 4
    assert done.stderr.strip().splitlines() == [
        f"kspeedfs: mountd is not running (no status file {tmp_path / 'none.json'})"
    ]


def test_declarations_are_checked(tmp_path: Path) -> None:
    d = tmp_path / "mounts.d"
    declare(d, "one", mountpoint="/mnt/one", dataset="all", options="allow_other, allow_root")
    declare(d, "two", mountpoint="/mnt/two", dataset="ds", nodes=["h1:7420", "h2"])
    declare(d, "zdup", mountpoint="/mnt/two/")
    declare(d, "opt", mountpoint="/mnt/opt", options=["rw"])
    declare(d, "src", mountpoint="/mnt/src", source="/data")
    declare(d, "name", mountpoint="/mnt/name", dataset="Bad Name")
    declare(d, "bad name", mountpoint="/mnt/x")
    decls = {x.name: x for x in load_declarations(d)}

    one, two = decls["one"], decls["two"]
    assert isinstance(one, Declaration) and isinstance(two, Declaration)
    assert one.dataset is None and one.options == ("allow_other", "allow_root")
    assert two.nodes == "h1:7420,h2:7420"
    assert two.mount_argv()[-4:] == ["--dataset", "ds", "--nodes", "h1:7420,h2:7420"]
    errors = {n: x.error for n, x in decls.items() if isinstance(x, InvalidDeclaration)}
    # Files are read in name order: "two" claims /mnt/two first.
    assert "also declared by two" in errors.pop("zdup")
    assert "unsupported mount option 'rw'" in errors.pop("opt")
    assert "source needs a dataset" in errors.pop("src")
    assert "bad dataset name" in errors.pop("name")
    assert "bad declaration name" in errors.pop("bad name")
    assert errors == {}
    assert load_declarations(tmp_path / "missing") == []


def test_check_command_reports_bad_declarations(tmp_path: Path) -> None:
    d = tmp_path / "mounts.d"
    declare(d, "ok", mountpoint="/mnt/ok")
    declare(d, "bad", mountpoint="rel")
    done = subprocess.run(
        [*MOUNTD, "--mounts-dir", str(d), "check"], capture_output=True, text=True
    )
    assert done.returncode == 5
    assert done.stdout.splitlines() == [
        f"bad  {d / 'bad.toml'}: mountpoint must be an absolute path: 'rel'",
        f"ok   {d / 'ok.toml'}: all datasets at /mnt/ok",
    ]


SERVES = "the new mount process serves"  # mountd's line once a takeover is done


def reads_on(reader: HostReader, what: str) -> None:
    good = reader.reads.good
    wait_for(lambda: reader.reads.good >= good + 20, what=what)


def no_read_failed(reader: HostReader, what: str, mountpoint: Path, device: int) -> None:
    """Stop the reader: none of its reads failed, and the mount is the one it was (the same
    connection, never mounted again)."""
    reads = reader.stop()
    print(reads.line(what))
    assert reads.failed == []
    assert os.stat(mountpoint).st_dev == device
    assert kspeedfs_mounts_under(mountpoint.parents[1]) == [str(mountpoint.resolve())]


def test_a_killed_mount_process_is_taken_over_without_a_failed_read(
    mountds: Mountds, tmp_path: Path
) -> None:
    """The mount process SIGKILLed twice (as an OOM kill would) while a reader reads every file
    through the kernel in a loop: mountd's dups of its FUSE fds keep the connection, the next
    process takes it over, and no read fails or reads wrong bytes; the mount is never made
    again (same device, one mount at the mountpoint)."""
    a = tmp_path / "mnt" / "a"
    declare(mountds.mounts_dir, "a", mountpoint=str(a), dataset="alpha")
    mountd = mountds.start()
    mountd.wait_mount("a", lambda m: m["state"] == "mounted", "mounted")
    device = os.stat(a).st_dev
    reader = HostReader({a / rel: data for rel, data in FILES.items()}).start()
    wait_for(lambda: reader.reads.good >= 20, what="the reader reads")
    for served in (1, 2):
        before = mountd.mount("a")
        assert before
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda n=served: mountd.log().count(SERVES) == n, what="taken over")
        reads_on(reader, "reads after the takeover")
    no_read_failed(reader, "host reader, mount process killed twice", a, device)
    assert "took over the connection" in mountd.log()


def test_mountd_killed_and_restarted_adopts_its_mount_and_still_takes_it_over(
    mountds: Mountds, tmp_path: Path
) -> None:
    """mountd SIGKILLed while a reader reads: its mount process serves on (its own fds keep
    the connection) and calls the restarted mountd with them; the new mountd watches it, and
    when it is SIGKILLed in turn, takes its connection over. No read fails, the mount is
    never made again."""
    a = tmp_path / "mnt" / "a"
    declare(mountds.mounts_dir, "a", mountpoint=str(a), dataset="alpha")
    first = mountds.start()
    first.wait_mount("a", lambda m: m["state"] == "mounted", "mounted")
    pid = first.mount("a")["pid"]  # type: ignore[index]
    device = os.stat(a).st_dev
    reader = HostReader({a / rel: data for rel, data in FILES.items()}).start()
    wait_for(lambda: reader.reads.good >= 20, what="the reader reads")
    assert first.proc is not None
    first.proc.kill()
    first.proc.wait()
    second = mountds.start(wait_ready=False)
    assert second.proc is not None
    new_pid = second.proc.pid
    second.wait(
        lambda s: (
            s["pid"] == new_pid
            and [(m["state"], m["pid"]) for m in s["mounts"]] == [("mounted", pid)]
        ),
        "the live mount process adopted",
    )
    reads_on(reader, "reads after mountd's restart")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: second.log().count(SERVES) == 1, what="taken over")
    reads_on(reader, "reads after the takeover")
    what = "host reader, mountd killed and restarted, then the mount process"
    no_read_failed(reader, what, a, device)
    assert "watching mount process" in second.log()
