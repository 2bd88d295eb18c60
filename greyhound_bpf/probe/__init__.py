"""The probe side: catalogs of what to probe, discovery of a job's ranks,
the BPF tracer and its records, and `check` of the machine. Nothing here
interprets the calls; that is the engine's job."""
