"""`kspeedfs report JOB --svg`: a job's loop over time as an SVG, written by hand (no plotting
library): per interval a bar of its time split into computing (below) and waiting for data
(above), the wait split by what its workers spent their time on (CPU, kspeedfs reads by path)
where they were timed, and its datasets' hit rate as a line on the same 0-100% scale."""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

from kspeedfs.client import read_times
from kspeedfs.format import stall
from kspeedfs.format.contract.jobs import JobEntry, JobSecond

WIDTH, HEIGHT = 900, 450
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 40, 90  # margins: the axes' labels and the title
MAX_BARS = 120  # more seconds than this are summed into wider bars
COMPUTE, HIT = "#4c9a5a", "#1f5fbf"
# The wait's parts, bottom up: (series, label, colour); "" is a wait whose workers were not timed.
WAITS = (
    ("cpu", "waiting: workers' CPU", "#f0ad4e"),
    ("local", "waiting: local reads", "#9b7fd1"),
    ("remote", "waiting: remote reads", "#d9534f"),
    ("source", "waiting: source reads", "#7a1f1f"),
    ("", "waiting for data", "#999999"),
)


def buckets(seconds: Sequence[JobSecond], most: int = MAX_BARS) -> list[JobSecond]:
    """`seconds` summed into at most `most` equal spans of time (each named by its start)."""
    ran = [i for i, s in enumerate(seconds) if s.blocked + s.busy > 0]
    if not ran:
        return []
    seconds = seconds[ran[0] : ran[-1] + 1]  # not the seconds before the loop or after it
    start, end = seconds[0].t, seconds[-1].t + 1
    width = max(1, -(-int(end - start) // most))
    out: dict[int, JobSecond] = {}
    for s in seconds:
        k = int(s.t - start) // width
        was = out.get(k)
        out[k] = (
            JobSecond(t=start + k * width, **{f: getattr(s, f) for f in _FIELDS})
            if was is None
            else JobSecond(t=was.t, **{f: getattr(was, f) + getattr(s, f) for f in _FIELDS})
        )
    return [out[k] for k in sorted(out)]


_FIELDS = (
    "blocked",
    "busy",
    "samples",
    "hits",
    "misses",
    "fetch",
    "read_local",
    "read_remote",
    "read_source",
)


def wait_parts(b: JobSecond) -> dict[str, float]:
    """The bar's wait (a share of its time) split by its workers' time (read_times.cause);
    all of it under "" when no worker fetch was timed in it."""
    waiting = stall.stall(b.blocked, b.busy)
    reads = {"local": b.read_local, "remote": b.read_remote, "source": b.read_source}
    shares = read_times.cause(reads, b.fetch)
    if not shares:
        return {"": waiting}
    return {path: waiting * share for path, share in shares.items()}


def svg(entry: JobEntry) -> str:
    """The picture of `entry` (asked with its history)."""
    bars = buckets(entry.history)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    span = (bars[-1].t - bars[0].t + (bars[1].t - bars[0].t if len(bars) > 1 else 1)) if bars else 1
    start = bars[0].t if bars else 0
    bar_w = plot_w / max(len(bars), 1)

    def y(share: float) -> float:
        return TOP + plot_h * (1 - share)

    title = (
        f"{entry.job}: {stall.summary(entry.blocked, entry.busy)}; {stall.au_verdict(entry.stall)}"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text id="title" x="{LEFT}" y="24" font-size="15">{escape(title)}</text>',
    ]
    compute: list[str] = []
    waits: dict[str, list[str]] = {series: [] for series, _label, _colour in WAITS}
    points = []
    for i, b in enumerate(bars):
        x = LEFT + i * bar_w
        share = stall.stall(b.blocked, b.busy)
        if b.blocked + b.busy > 0:
            compute.append(_rect(x, y(1 - share), bar_w, plot_h * (1 - share), "computing", share))
            below = 1 - share
            parts = wait_parts(b)
            for series, label, _colour in WAITS:
                part = parts.get(series, 0.0)
                if part > 0:
                    waits[series].append(
                        _rect(x, y(below + part), bar_w, plot_h * part, label, part)
                    )
                    below += part
        if b.hits + b.misses:
            points.append(f"{x + bar_w / 2:.1f},{y(b.hits / (b.hits + b.misses)):.1f}")
    out.append(f'<g id="series-compute" fill="{COMPUTE}">{"".join(compute)}</g>')
    shown = [(series, label, colour) for series, label, colour in WAITS if waits[series]]
    for series, _label, colour in shown:
        name = f"series-waiting-{series}" if series else "series-waiting"
        out.append(f'<g id="{name}" fill="{colour}">{"".join(waits[series])}</g>')
    out.append(
        f'<polyline id="series-hit-rate" fill="none" stroke="{HIT}" stroke-width="2.5" '
        f'points="{" ".join(points)}"/>'
    )
    out.append(_axes(plot_w, plot_h, start, span))
    out.append(_legend(shown or [WAITS[-1]]))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rect(x: float, top: float, w: float, h: float, label: str, share: float) -> str:
    return (
        f'<rect x="{x:.1f}" y="{top:.1f}" width="{max(w - 1, 0.5):.1f}" height="{h:.1f}">'
        f"<title>{escape(label)} {share:.0%}</title></rect>"
    )


def _axes(plot_w: float, plot_h: float, start: float, span: float) -> str:
    bottom = TOP + plot_h
    parts = [
        '<g id="axes" stroke="black" fill="black">',
        f'<line id="x-axis" x1="{LEFT}" y1="{bottom}" x2="{LEFT + plot_w}" y2="{bottom}"/>',
        f'<line id="y-axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}"/>',
    ]
    for pct in range(0, 101, 25):
        yy = TOP + plot_h * (1 - pct / 100)
        parts.append(f'<line x1="{LEFT - 4}" y1="{yy:.1f}" x2="{LEFT}" y2="{yy:.1f}"/>')
        parts.append(
            f'<text stroke="none" x="{LEFT - 8}" y="{yy + 4:.1f}" text-anchor="end">{pct}%</text>'
        )
    for i in range(6):
        xx = LEFT + plot_w * i / 5
        parts.append(f'<line x1="{xx:.1f}" y1="{bottom}" x2="{xx:.1f}" y2="{bottom + 4}"/>')
        parts.append(
            f'<text stroke="none" x="{xx:.1f}" y="{bottom + 18}" text-anchor="middle">'
            f"{stall.duration(start + span * i / 5)}</text>"
        )
    parts.append(
        f'<text stroke="none" x="{LEFT + plot_w / 2}" y="{bottom + 36}" text-anchor="middle">'
        "time since the node first heard of the job</text>"
    )
    parts.append(
        f'<text stroke="none" transform="translate(16 {TOP + plot_h / 2}) rotate(-90)" '
        'text-anchor="middle">share of the loop\'s time</text>'
    )
    parts.append("</g>")
    return "".join(parts)


def _legend(waits: Sequence[tuple[str, str, str]]) -> str:
    """One row under the axes: computing, the wait's parts drawn, the hit rate."""
    items = [(COMPUTE, "rect", "computing (between batches)")]
    items += [(colour, "rect", label) for _series, label, colour in waits]
    items.append((HIT, "line", "hit rate"))
    x, y = LEFT, HEIGHT - 12
    parts = ['<g id="legend">']
    for colour, kind, label in items:
        if kind == "rect":
            parts.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>')
        else:
            parts.append(
                f'<line x1="{x}" y1="{y - 4}" x2="{x + 14}" y2="{y - 4}" stroke="{colour}" '
                'stroke-width="2.5"/>'
            )
        parts.append(f'<text class="legend-label" x="{x + 17}" y="{y}">{escape(label)}</text>')
        x += 17 + 7 * len(label) + 18  # about 7 pixels a character at 12 px
    parts.append("</g>")
    return "".join(parts)
