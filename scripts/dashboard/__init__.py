"""The parts of scripts/dashboard_snapshot.py, one job each.

``common`` (names and the progress line), ``stack`` (Redis, workers, Prometheus as processes),
``load`` (the traffic), ``timeline`` (the run's events and the load around them), ``queries``
(the dashboard's PromQL with its template variables, through Prometheus' HTTP API), ``canvas``
(the matplotlib drawing) and ``report`` (every panel evaluated and drawn, with the caption).
"""
