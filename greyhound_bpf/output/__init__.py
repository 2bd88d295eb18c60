"""Outputs of the event stream: JSON lines, text lines, the live view, the
per-call summary and Prometheus metrics. Each reads the same events."""
