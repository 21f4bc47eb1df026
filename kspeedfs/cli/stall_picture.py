"""`kspeedfs report JOB --svg`: a job's loop over time as an SVG, written by hand (no plotting
library): per interval a bar of its time split into computing (below) and waiting for data
(above), and its datasets' hit rate as a line on the same 0-100% scale."""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

from kspeedfs.format import stall
from kspeedfs.format.contract.jobs import JobEntry, JobSecond

WIDTH, HEIGHT = 900, 450
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 40, 90  # margins: the axes' labels and the title
MAX_BARS = 120  # more seconds than this are summed into wider bars
COMPUTE, WAITING, HIT = "#4c9a5a", "#d9534f", "#1f5fbf"


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


_FIELDS = ("blocked", "busy", "samples", "hits", "misses")


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
    compute, waiting, points = [], [], []
    for i, b in enumerate(bars):
        x = LEFT + i * bar_w
        share = stall.stall(b.blocked, b.busy)
        if b.blocked + b.busy > 0:
            compute.append(_rect(x, y(1 - share), bar_w, plot_h * (1 - share), b, "compute"))
            waiting.append(_rect(x, y(1), bar_w, plot_h * share, b, "waiting"))
        if b.hits + b.misses:
            points.append(f"{x + bar_w / 2:.1f},{y(b.hits / (b.hits + b.misses)):.1f}")
    out.append(f'<g id="series-compute" fill="{COMPUTE}">{"".join(compute)}</g>')
    out.append(f'<g id="series-waiting" fill="{WAITING}">{"".join(waiting)}</g>')
    out.append(
        f'<polyline id="series-hit-rate" fill="none" stroke="{HIT}" stroke-width="2.5" '
        f'points="{" ".join(points)}"/>'
    )
    out.append(_axes(plot_w, plot_h, start, span))
    out.append(_legend())
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rect(x: float, top: float, w: float, h: float, b: JobSecond, what: str) -> str:
    share = stall.stall(b.blocked, b.busy)
    shown = share if what == "waiting" else 1 - share
    return (
        f'<rect x="{x:.1f}" y="{top:.1f}" width="{max(w - 1, 0.5):.1f}" height="{h:.1f}">'
        f"<title>{b.t:.0f} s: {what} {shown:.0%}</title></rect>"
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


def _legend() -> str:
    x, y = LEFT, HEIGHT - 12
    items = [
        (COMPUTE, "rect", "computing (between batches)"),
        (WAITING, "rect", "waiting for data"),
        (HIT, "line", "hit rate"),
    ]
    parts = ['<g id="legend">']
    for i, (color, kind, label) in enumerate(items):
        xx = x + (0, 215, 355)[i]
        if kind == "rect":
            parts.append(f'<rect x="{xx}" y="{y - 10}" width="12" height="12" fill="{color}"/>')
        else:
            parts.append(
                f'<line x1="{xx}" y1="{y - 4}" x2="{xx + 14}" y2="{y - 4}" stroke="{color}" '
                'stroke-width="2.5"/>'
            )
        parts.append(f'<text class="legend-label" x="{xx + 17}" y="{y}">{label}</text>')
    parts.append("</g>")
    return "".join(parts)
