"""Many machines, one job (issue #14): one agent per node publishes its
ranks' iterations and verdicts to its own Redis stream, one controller runs
JobAnalysis over them all. Built so far: who is who (`identity`); the
analysis takes the agents' iterations (`analysis.Iterations`)."""
