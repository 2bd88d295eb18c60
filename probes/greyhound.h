/* Greyhound probe ABI, shared by calls.bpf.c and the ctypes mirror in
 * greyhound_bpf/records.py (tests/test_abi.py checks that they agree).
 * One gh_call record crosses to user space per probed call; everything else
 * (start times, per-function settings, loss and launch counters) stays in
 * kernel maps. */
#ifndef GREYHOUND_H
#define GREYHOUND_H

/* Argument slots per call: the six x86_64 integer registers, then stack
 * slots. ncclReduce has eight integer-class arguments, the most we probe. */
#define GH_MAX_ARGS 8
#define GH_REG_ARGS 6

/* Functions in the catalogs (fn_spec's size). */
#define GH_MAX_FUNCS 48

/* gh_fn_spec.flags */
#define GH_SPEC_RETURN_SITE 0x1 /* time the return at the caller's return site, not a uretprobe */

/* gh_call.flags */
#define GH_F_DEREF_FAILED 0x1 /* an out-parameter could not be read at return */
#define GH_F_NEW_SITE 0x2     /* not a call: a new return site to probe (fn, pid) */

struct gh_call {
	__u64 start_ns; /* bpf_ktime_get_ns() at entry (CLOCK_MONOTONIC) */
	__u64 dur_ns;   /* return minus entry */
	__u32 pid;      /* thread-group id (the process) */
	__u32 tid;      /* thread id */
	__u16 fn;       /* function id, assigned by user space from the catalogs */
	__u16 flags;    /* GH_F_* */
	__s32 ret;      /* low 32 bits of the return register */
	__u64 args[GH_MAX_ARGS]; /* raw argument slots, meaning given by the catalog */
};

/* Struct fields read at entry land in these slots (a function that uses
 * them has at most GH_REG_ARGS argument slots). */
#define GH_FIELD_SLOT0 6
#define GH_MAX_FIELDS 2

/* Per-function capture settings, written by user space into fn_spec[fn]. */
struct gh_fn_spec {
	__u8 nargs;      /* slots to capture; > GH_REG_ARGS reads the stack */
	__u8 deref_mask; /* bit i: slot i is a pointer to an out-value, read at return */
	__u8 field_slot; /* slot holding a pointer to an options struct */
	__u8 nfields;    /* u64 fields of that struct to read at entry (0..2) */
	__u16 field_off[GH_MAX_FIELDS]; /* their byte offsets */
	__u16 flags;     /* GH_SPEC_* */
};

/* One entry program serves every probed function: it finds the function
 * by where the probe hit, (process, runtime address of the entry), which
 * user space writes into `probe_fn` as it attaches. One program instead of
 * one per function keeps the compile on each attach (CPU that the job may
 * be short of) near the size of a single function's. */
struct gh_probe_key {
	__u32 pid;
	__u32 pad;
	__u64 addr;
};

/* A call in flight, from entry to return. */
struct gh_inflight {
	__u64 start_ns;
	__u64 args[GH_MAX_ARGS];
};

/* Entry saves a call under (thread, stack pointer after its return), where
 * the return finds it: nested calls on one thread (ncclGroupStart ...
 * ncclSend ... ncclGroupEnd) sit at different depths. A uretprobe fires
 * with that stack pointer, and so does a uprobe at the caller's return site.
 *
 * Functions that may throw (C++: gloo) are not given a uretprobe. A C++
 * exception unwinding through a uretprobe's frame finds the kernel's
 * trampoline where the return address was, has no unwind table for it and
 * calls std::terminate: the tracer would turn a peer's loss, which the job
 * can catch, into an abort. Such a call is timed at its return site
 * instead: entry reports the caller's return address in `sites`, and user
 * space puts a plain uprobe there. An exception skips the return site and
 * leaves a stale frame, which the next call at that depth overwrites (LRU
 * otherwise); only code that jumps to the instruction after the call, at
 * that depth, before calling again could meet it (and report one call too
 * long). */
struct gh_frame_key {
	__u32 tid;
	__u32 pad;
	__u64 sp; /* stack pointer at the return site */
};

struct gh_frame {
	struct gh_inflight call;
	__u32 fn;
	__u32 pad;
};

struct gh_site_key {
	__u32 pid;
	__u32 fn;
	__u64 addr; /* the caller's return address, in the process */
};

/* Values of `sites`: user space sets PROBED or UNPROBEABLE. Calls that
 * begin while their site is not PROBED are counted in `untimed` (the first
 * from each site is still timed if the probe lands before it returns). */
#define GH_SITE_NEW 0
#define GH_SITE_PROBED 1
#define GH_SITE_UNPROBEABLE 2

#endif /* GREYHOUND_H */
