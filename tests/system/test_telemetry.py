"""Is the job data-bound? The stall pytorch_ext.watch reports against the loop's own timing,
with real DataLoader workers and a real node: the job in `kspeedfs jobs`, `top`, `report` and
the node's /metrics, and KSPEEDFS_WATCH=1 through the package's .pth hook."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import watchloop
from conftest import NodeProcess, free_port, node_in, preload, run_cli, wait_for
from imagefolders import make_images

from kspeedfs.client import read_times
from kspeedfs.format.contract.jobs import JobsAnswer, JobsReq
from kspeedfs.sample import make_sample
from kspeedfs.testing.mount import MountProcess

pytestmark = pytest.mark.slow  # DataLoader workers, a node, a mount

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def metrics_node(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("telemetry")
    port = free_port()
    with node_in(folder, extra=("--metrics-listen", f"127.0.0.1:{port}")) as node:
        source = folder / "data"
        make_sample(source / "train", classes=4, per_class=40, file_size=3000, bases=3)
        preload(node, source, "fastdata")
        yield node, port, source


def run_script(config: dict[str, Any], env: dict[str, str], hook: bool = False) -> dict[str, Any]:
    """watchloop as its own process (its own job); `hook`: with the .pth line of the package
    processed at start, as site-packages would."""
    if hook:
        pth_dir = env["PTH_DIR"]
        code = (
            f"import site; site.addsitedir({pth_dir!r}); import runpy, sys; "
            f"sys.argv = ['watchloop', {json.dumps(config)!r}]; "
            f"runpy.run_path({str(HERE / 'watchloop.py')!r}, run_name='__main__')"
        )
        argv = [sys.executable, "-c", code]
    else:
        argv = [sys.executable, str(HERE / "watchloop.py"), json.dumps(config)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def jobs_of(node: NodeProcess, job: str = "") -> JobsAnswer:
    with node.client() as client:
        return client.call(JobsReq(job=job))


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_preloaded_fast_path_with_long_steps(metrics_node, monkeypatch, capsys) -> None:
    """Stall near 0, reported within 2 points; the job and its dataset on the node within 2 s
    of the loop's end, in `jobs`, /metrics with its labels, and the exit table printed."""
    node, port, source = metrics_node
    env = {**node.env(), "KSPEEDFS_JOB": "fastpath-job"}
    config = {
        "kind": "fast",
        "root": str(source / "train"),
        "nodes": node.address,
        "token": str(node.token_file),
        "batch": 8,
        "workers": 2,
        "step": 0.05,
        "epochs": 3,
        "persistent": True,
        "explicit": True,
        "linger": 0,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(watchloop_meter(), "_meter", None)
    result = watchloop.main(config)
    assert result["truth"] < 0.2
    assert abs(result["reported"] - result["truth"]) <= 0.02, result
    assert "kspeedfs watch (job fastpath-job rank 0)" in capsys.readouterr().err
    samples = result["samples"]

    def on_the_node() -> bool:
        jobs = {e.job: e for e in jobs_of(node).jobs}
        e = jobs.get("fastpath-job")
        return e is not None and e.samples == samples

    wait_for(on_the_node, timeout=2.0, what="the loop's figures on the node")
    (entry,) = jobs_of(node, "fastpath-job").jobs
    assert [d.name for d in entry.datasets] == ["fastdata"]
    assert entry.datasets[0].resident_bytes > 0
    assert abs(entry.stall - result["reported"]) <= 0.02
    text = metrics(port)
    for family in (
        'kspeedfs_job_loop_blocked_seconds_total{job="fastpath-job",tenant=""}',
        'kspeedfs_job_loop_busy_seconds_total{job="fastpath-job",tenant=""}',
        'kspeedfs_job_source_bytes_total{dataset="fastdata",job="fastpath-job",tenant=""}',
    ):
        assert family in text, family
    shown = run_cli("jobs", "--json", env=node.env())
    assert shown.returncode == 0, shown.stderr
    (row,) = [j for j in json.loads(shown.stdout)["jobs"] if j["job"] == "fastpath-job"]
    assert row["verdict"] in ("not input-bound", "data-bound (moderately)")
    assert row["datasets"][0]["name"] == "fastdata"
    table = run_cli("top", "--iterations", "1", env=node.env())
    assert table.returncode == 0, table.stderr
    assert "fastpath-job" in table.stdout and "STALL (RUN)" in table.stdout


def watchloop_meter():
    from pytorch_ext import loop_watch

    return loop_watch


def test_slow_getitem_is_highly_data_bound(metrics_node, tmp_path) -> None:
    """A heavy __getitem__ on one worker: stall high, within 2 points; its picture drawn."""
    node, _port, _source = metrics_node
    env = {**node.env(), "KSPEEDFS_JOB": "slow-job"}
    config = {
        "kind": "slow",
        "samples": 600,
        "delay": 0.004,
        "batch": 4,
        "workers": 1,
        "step": 0.002,
        "explicit": True,
        "linger": 1.5,
    }
    result = run_script(config, env)
    assert result["truth"] > 0.2
    assert abs(result["reported"] - result["truth"]) <= 0.02, result
    assert "data-bound (highly)" in result["stderr"]
    wait_for(lambda: bool(jobs_of(node, "slow-job").jobs), timeout=5.0, what="slow-job")
    (entry,) = jobs_of(node, "slow-job").jobs
    cause = read_times.cause(entry.read_seconds, entry.fetch_seconds)
    assert cause["cpu"] >= 0.8, cause  # the worker's time is its __getitem__'s, no reads
    assert entry.ranks == 1  # the worker reported too, as a worker
    svg = tmp_path / "slow.svg"
    png = tmp_path / "slow.png"
    done = run_cli("report", "slow-job", "--svg", str(svg), "--png", str(png), env=node.env())
    assert done.returncode == 0, done.stderr
    assert "data-bound (highly)" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    root = ET.parse(svg).getroot()
    ids = {e.get("id") for e in root.iter()}
    assert {"axes", "x-axis", "y-axis", "series-compute", "series-waiting-cpu", "legend"} <= ids
    ns = "{http://www.w3.org/2000/svg}"
    waiting = root.find(f".//{ns}g[@id='series-waiting-cpu']")  # the worker's __getitem__
    assert waiting is not None and len(waiting.findall(f"{ns}rect")) >= 2
    labels = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "legend-label"]
    assert labels[0] == "computing (between batches)" and labels[-1] == "hit rate"
    assert "waiting: workers' CPU" in labels


def test_the_pth_hook_watches_stock_imagefolder_on_the_mount(metrics_node, tmp_path) -> None:
    """KSPEEDFS_WATCH=1 (the package's .pth line, no change to the script) against the
    explicit wrapper over stock ImageFolder on a mount: within 3 points; the job names the
    dataset behind the mount."""
    node, _port, _source = metrics_node
    images = make_images(tmp_path / "images")
    preload(node, images.parent, "imgs")
    mount = MountProcess(tmp_path / "mnt", node.env(), tmp_path).start()
    try:
        pth = tmp_path / "site"
        pth.mkdir()
        (pth / "kspeedfs_watch.pth").write_text((REPO / "kspeedfs_watch.pth").read_text())
        config = {
            "kind": "image",
            "root": str(tmp_path / "mnt" / "imgs" / "train"),
            "batch": 2,
            "workers": 1,
            "delay": 0.01,
            "step": 0.002,
            "epochs": 3,
            "linger": 1.5,
        }
        base = {**node.env(), "PTH_DIR": str(pth)}
        explicit = run_script({**config, "explicit": True}, {**base, "KSPEEDFS_JOB": "wrapped"})
        hooked = run_script(
            config, {**base, "KSPEEDFS_JOB": "hooked", "KSPEEDFS_WATCH": "1"}, hook=True
        )
        for r in (explicit, hooked):
            assert abs(r["reported"] - r["truth"]) <= 0.02, r
            assert r["meter_batches"] == r["batches"]
        assert abs(hooked["reported"] - explicit["reported"]) <= 0.03, (hooked, explicit)
        assert "kspeedfs watch (job hooked rank 0)" in hooked["stderr"]
        wait_for(lambda: bool(jobs_of(node, "hooked").jobs), timeout=5.0, what="hooked")
        (entry,) = jobs_of(node, "hooked").jobs
        assert [d.name for d in entry.datasets] == ["imgs"]
    finally:
        mount.stop()


def test_remote_reads_are_the_cause(metrics_node) -> None:
    """The fast path reading over the node's socket (local=False) with a cheap __getitem__:
    the workers' time is mostly remote reads, and the family says so by path."""
    node, port, source = metrics_node
    env = {**node.env(), "KSPEEDFS_JOB": "remote-job"}
    config = {
        "kind": "fast",
        "local": False,
        "root": str(source / "train"),
        "nodes": node.address,
        "token": str(node.token_file),
        "batch": 8,
        "workers": 2,
        "step": 0.001,
        "epochs": 2,
        "explicit": True,
        "linger": 1.5,
    }
    result = run_script(config, env)
    assert abs(result["reported"] - result["truth"]) <= 0.02, result
    wait_for(lambda: bool(jobs_of(node, "remote-job").jobs), timeout=5.0, what="remote-job")
    (entry,) = jobs_of(node, "remote-job").jobs
    cause = read_times.cause(entry.read_seconds, entry.fetch_seconds)
    assert cause["remote"] == max(cause.values()), cause
    assert (
        'kspeedfs_job_read_wait_seconds_total{job="remote-job",path="remote",tenant=""}'
        in metrics(port)
    )
