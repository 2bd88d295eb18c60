"""Many machines, one job (issue #14): one agent per node publishes its
ranks' iterations to its own Redis stream, one controller runs JobAnalysis
over them all. Built so far: who is who (`identity`), the streams and the
messages -> analysis inputs (`bus`), and the analysis's `Iterations` input.
Not yet: the `attach --cluster` agent and the `controller` command, commands
and plans back to the agents, heartbeats' loss, TLS, the multi-node tests."""
