"""Probe sources shipped with greyhound_bpf: BPF C (*.bpf.c, greyhound.h) and
the per-library catalogs (*.toml). Installed as ``greyhound_bpf.probes``."""
