"""Diagnosis: which rank or link is slow, and computation or communication.

passive.py (from the engine's events) and rules.py (validation's verdicts
from measurements) are pure; host.py, validator.py and worker.py measure
for real, where each rank runs."""
