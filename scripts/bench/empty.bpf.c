/* The platform's limit for scripts/bench_probe_overhead: a uprobe and a
 * uretprobe whose programs do nothing. Greyhound's probes are compared to it. */
#include <uapi/linux/ptrace.h>

int bench_enter(struct pt_regs *ctx) { return 0; }
int bench_return(struct pt_regs *ctx) { return 0; }
