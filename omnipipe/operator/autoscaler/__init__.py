"""Per-stage autoscaling: Prometheus queries (queries.py, source.py) and a pure policy."""
