"""The picture of a job's loop: its parts, and seconds summed into at most MAX_BARS bars."""

import xml.etree.ElementTree as ET

import pytest

from kspeedfs.cli import stall_picture
from kspeedfs.format.contract.jobs import JobEntry, JobSecond

NS = "{http://www.w3.org/2000/svg}"


def seconds(n: int) -> list[JobSecond]:
    out = [JobSecond(t=0)]  # the first report: nothing yet
    out += [
        JobSecond(
            t=t, blocked=0.2 + 0.6 * (t > n // 2), busy=0.8 - 0.6 * (t > n // 2), hits=3, misses=1
        )
        for t in range(1, n + 1)
    ]
    return out + [JobSecond(t=n + 1)]  # after the loop


def test_buckets_sum_and_trim():
    bars = stall_picture.buckets(seconds(600))
    assert len(bars) <= stall_picture.MAX_BARS
    assert bars[0].t == 1
    assert sum(b.hits for b in bars) == 3 * 600
    assert abs(sum(b.blocked + b.busy for b in bars) - 600) < 1e-6
    assert stall_picture.buckets([JobSecond(t=0)]) == []


def test_the_parts_are_there():
    entry = JobEntry(job="j", blocked=300, busy=300, stall=0.5, history=seconds(20))
    root = ET.fromstring(stall_picture.svg(entry))
    ids = {e.get("id") for e in root.iter()}
    assert {"title", "axes", "x-axis", "y-axis", "series-compute", "series-waiting"} <= ids
    assert {"series-hit-rate", "legend"} <= ids
    bars = root.find(f".//{NS}g[@id='series-waiting']")
    assert bars is not None and len(bars) == 20
    line = root.find(f".//{NS}polyline[@id='series-hit-rate']")
    assert line is not None and len(line.get("points", "").split()) == 20
    # the hit rate (75%) is drawn at three quarters of the plot's height
    plot_top, plot_h = (
        stall_picture.TOP,
        stall_picture.HEIGHT - stall_picture.TOP - stall_picture.BOTTOM,
    )
    y = float(line.get("points", "").split()[0].split(",")[1])
    assert abs(y - (plot_top + plot_h * 0.25)) < 1
    labels = [t.text for t in root.iter(f"{NS}text") if t.get("class") == "legend-label"]
    assert labels == ["computing (between batches)", "waiting for data", "hit rate"]
    assert "data-bound (highly): 50% of 10 m 00 s waiting" in (root.find(f"{NS}text").text or "")


def test_the_wait_is_split_by_the_workers_time():
    split = [
        JobSecond(t=t, blocked=0.6, busy=0.4, fetch=2.0, read_remote=1.5, read_local=0.1)
        for t in range(1, 11)
    ]
    parts = stall_picture.wait_parts(split[0])
    assert parts == pytest.approx({"cpu": 0.12, "local": 0.03, "remote": 0.45, "source": 0.0})
    entry = JobEntry(job="j", blocked=6, busy=4, stall=0.6, history=split)
    root = ET.fromstring(stall_picture.svg(entry))
    ids = {e.get("id") for e in root.iter()}
    assert {"series-waiting-cpu", "series-waiting-local", "series-waiting-remote"} <= ids
    assert "series-waiting" not in ids and "series-waiting-source" not in ids
    remote = root.find(f".//{NS}g[@id='series-waiting-remote']")
    assert remote is not None and len(remote) == 10
    plot_h = stall_picture.HEIGHT - stall_picture.TOP - stall_picture.BOTTOM
    assert float(remote[0].get("height", "0")) == pytest.approx(plot_h * 0.45, abs=0.1)
    labels = [t.text for t in root.iter(f"{NS}text") if t.get("class") == "legend-label"]
    assert labels == [
        "computing (between batches)",
        "waiting: workers' CPU",
        "waiting: local reads",
        "waiting: remote reads",
        "hit rate",
    ]
