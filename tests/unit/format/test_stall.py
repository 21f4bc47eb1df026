"""The stall share, its verdict on TF Profiler's scale and AU against MLPerf Storage's 90%."""

from kspeedfs.format import stall


def test_share_and_verdicts():
    assert stall.stall(0, 0) == 0.0
    assert stall.stall(1, 3) == 0.25
    assert stall.verdict(0.049) == "not input-bound"
    assert stall.verdict(0.05) == "data-bound (moderately)"
    assert stall.verdict(0.20) == "data-bound (moderately)"
    assert stall.verdict(0.21) == "data-bound (highly)"
    assert stall.au_verdict(0.05).startswith("AU 95% (passes")
    assert stall.au_verdict(0.17).startswith("AU 83% (below")


def test_summary_reads_as_the_issue_says():
    assert (
        stall.summary(0.17 * 3780, 0.83 * 3780)
        == "data-bound (moderately): 17% of 1 h 03 m waiting"
    )
    assert stall.duration(245) == "4 m 05 s"
    assert stall.duration(12.34) == "12.3 s"
