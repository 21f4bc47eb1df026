"""How long a training loop waited for its data, and the verdict on the usual scales.

Stall is the share of the loop's time spent blocked in `next(loader)`: blocked / (blocked +
busy). The verdict follows TF Profiler's input-pipeline analysis (not input-bound below 5%,
moderately 5-20%, highly above 20%); accelerator utilisation (AU, the busy share) is held
against MLPerf Storage's pass mark of 90%. One place for this arithmetic: the loop's exit
table, the node's job table, `kspeedfs jobs` and the metrics all use it.
"""

from __future__ import annotations

MODERATE = 0.05  # TF Profiler: below this share waiting, not input-bound
HIGH = 0.20  # ...above this, highly input-bound
AU_PASS = 0.90  # MLPerf Storage: a run passes at this accelerator utilisation or more


def stall(blocked: float, busy: float) -> float:
    """The share of the loop's time spent waiting for data (0 when it has not run)."""
    total = blocked + busy
    return blocked / total if total > 0 else 0.0


def verdict(share: float) -> str:
    """TF Profiler's words for a stall share."""
    if share < MODERATE:
        return "not input-bound"
    if share <= HIGH:
        return "data-bound (moderately)"
    return "data-bound (highly)"


def au_verdict(share: float) -> str:
    """Accelerator utilisation (1 - stall) against MLPerf Storage's 90%."""
    au = 1.0 - share
    mark = "passes" if au >= AU_PASS else "below"
    return f"AU {au:.0%} ({mark} MLPerf Storage's {AU_PASS:.0%})"


def duration(seconds: float) -> str:
    """`1 h 03 m`, `4 m 05 s`, `12.3 s`: a span as a person reads it."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    if hours:
        return f"{hours} h {rest // 60:02d} m"
    return f"{rest // 60} m {rest % 60:02d} s"


def summary(blocked: float, busy: float) -> str:
    """One line: `data-bound (moderately): 17% of 1 h 03 m waiting`."""
    share = stall(blocked, busy)
    return f"{verdict(share)}: {share:.0%} of {duration(blocked + busy)} waiting"
