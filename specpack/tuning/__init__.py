"""Profiles: workloads (workload.py), `specpack tune` (tune.py, report.py) and the profiles stored
in an artifact and their selection (profiles.py)."""
