"""`kspeedfs dashboard`: a Grafana dashboard (JSON) of the per-job families a node exports."""

from __future__ import annotations

from typing import Any

# (title, PromQL, unit): one panel each, per job.
PANELS = (
    (
        "Stall: share of the loop's time waiting for data (TF Profiler: >5% moderately, >20% highly data-bound)",
        "rate(kspeedfs_job_loop_blocked_seconds_total[1m]) / (rate(kspeedfs_job_loop_blocked_seconds_total[1m]) + rate(kspeedfs_job_loop_busy_seconds_total[1m]))",
        "percentunit",
    ),
    (
        "Accelerator utilisation (MLPerf Storage passes at 90%)",
        "rate(kspeedfs_job_loop_busy_seconds_total[1m]) / (rate(kspeedfs_job_loop_blocked_seconds_total[1m]) + rate(kspeedfs_job_loop_busy_seconds_total[1m]))",
        "percentunit",
    ),
    ("Samples per second", "sum by (job) (rate(kspeedfs_job_samples_total[1m]))", "ops"),
    (
        "Hit rate of the job's datasets",
        "sum by (job) (rate(kspeedfs_job_dataset_hits_total[1m])) / (sum by (job) (rate(kspeedfs_job_dataset_hits_total[1m])) + sum by (job) (rate(kspeedfs_job_dataset_misses_total[1m])))",
        "percentunit",
    ),
    (
        "Bytes read from the source",
        "sum by (job, dataset) (rate(kspeedfs_job_source_bytes_total[1m]))",
        "Bps",
    ),
    (
        "Memory the job's datasets hold",
        "sum by (job, dataset) (kspeedfs_job_resident_bytes)",
        "bytes",
    ),
)


def grafana(datasource: str = "Prometheus") -> dict[str, Any]:
    """The dashboard: one time-series panel per figure, two a row, a job variable."""
    panels = []
    for i, (title, expr, unit) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {
                        "refId": "A",
                        "expr": expr.replace("[1m])", '{job=~"$job"}[1m])').replace(
                            "(kspeedfs_job_resident_bytes)",
                            '(kspeedfs_job_resident_bytes{job=~"$job"})',
                        ),
                        "legendFormat": "{{job}} {{dataset}}",
                    }
                ],
            }
        )
    return {
        "title": "kspeedfs: is my job data-bound?",
        "uid": "kspeedfs-jobs",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["kspeedfs"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": datasource, "value": datasource},
                },
                {
                    "name": "job",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(kspeedfs_job_loop_busy_seconds_total, job)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": panels,
    }
