"""Grafana dashboards, Prometheus alert rules, and their provisioning."""
