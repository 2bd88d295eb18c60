/* Uprobe/uretprobe programs that time every probed library call.
 *
 * Entry saves the start time and the argument slots per (thread, function);
 * return (a uretprobe, or for functions that may throw a uprobe at the
 * caller's return site: see greyhound.h) computes the duration, reads out-parameters (for example the
 * ncclComm_t that ncclCommInitRank writes) and reserves one ring-buffer
 * record. A record the ring buffer cannot take is counted in `lost`, never
 * dropped silently. Load-time settings come in as -D flags:
 *   GH_RINGBUF_PAGES  ring buffer size in pages (power of two)
 *   GH_INFLIGHT_MAX   concurrent in-flight calls tracked
 *   GH_WAKEUP_EVERY   wake the consumer once per this many records per CPU
 *   GH_NFUNCS         functions in the catalog (slots 0..GH_NFUNCS-1)
 *   GH_RETPROBES      bit n set: function n is timed by a uretprobe
 *
 * Waking the consumer on every record costs an irq_work and a context
 * switch per call, more than the probe itself. Records are submitted
 * without a wake-up except every GH_WAKEUP_EVERY-th on a CPU; in between,
 * the consumer's poll timeout (100 ms) collects them. User space sets it
 * to a quarter of the ring's capacity at most, so a wake-up comes well
 * before the ring fills.
 */
#include <uapi/linux/ptrace.h>
#include "greyhound.h"

#ifndef GH_RINGBUF_PAGES
#define GH_RINGBUF_PAGES 256
#endif
#ifndef GH_INFLIGHT_MAX
#define GH_INFLIGHT_MAX 16384
#endif
#ifndef GH_WAKEUP_EVERY
#define GH_WAKEUP_EVERY 64
#endif
#ifndef GH_NFUNCS
#define GH_NFUNCS GH_MAX_FUNCS
#endif
#ifndef GH_RETPROBES
#define GH_RETPROBES (~0ULL)
#endif
#ifndef GH_MAX_SITES
#define GH_MAX_SITES 4096
#endif

BPF_RINGBUF_OUTPUT(events, GH_RINGBUF_PAGES);
BPF_ARRAY(fn_spec, struct gh_fn_spec, GH_MAX_FUNCS);
/* LRU: a thread killed inside a call must not leak its slot forever. */
BPF_TABLE("lru_hash", struct gh_inflight_key, struct gh_inflight, inflight,
	  GH_INFLIGHT_MAX);
BPF_TABLE("lru_hash", struct gh_frame_key, struct gh_frame, frames, GH_INFLIGHT_MAX);
/* Return sites seen, for user space to probe (it deletes a process's on detach). */
BPF_HASH(sites, struct gh_site_key, u8, GH_MAX_SITES);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_PERCPU_ARRAY(untimed, u64, 1);
BPF_PERCPU_ARRAY(submitted, u64, 1);
/* cudaLaunchKernel is too frequent to stream: count it per process here. */
BPF_HASH(launches, u32, u64, 4096);

static __always_inline int gh_enter(struct pt_regs *ctx, u32 fn)
{
	struct gh_fn_spec *spec = fn_spec.lookup(&fn);
	if (!spec)
		return 0;

	struct gh_inflight st = {};
	st.start_ns = bpf_ktime_get_ns();
	st.args[0] = PT_REGS_PARM1(ctx);
	st.args[1] = PT_REGS_PARM2(ctx);
	st.args[2] = PT_REGS_PARM3(ctx);
	st.args[3] = PT_REGS_PARM4(ctx);
	st.args[4] = PT_REGS_PARM5(ctx);
	st.args[5] = PT_REGS_PARM6(ctx);
	/* At entry the return address is at sp; stack arguments follow it. */
	if (spec->nargs > GH_REG_ARGS)
		bpf_probe_read_user(&st.args[GH_REG_ARGS],
				    (GH_MAX_ARGS - GH_REG_ARGS) * sizeof(u64),
				    (void *)(PT_REGS_SP(ctx) + sizeof(u64)));
	/* Fields of an options struct passed by pointer (gloo's element count
	 * and size): read now, while the struct is alive. */
	if (spec->nfields) {
		u32 fs = spec->field_slot;
		u64 base = fs < GH_REG_ARGS ? st.args[fs & 7] : 0;
		if (base) {
			bpf_probe_read_user(&st.args[GH_FIELD_SLOT0], sizeof(u64),
					    (void *)(base + spec->field_off[0]));
			if (spec->nfields > 1)
				bpf_probe_read_user(&st.args[GH_FIELD_SLOT0 + 1], sizeof(u64),
						    (void *)(base + spec->field_off[1]));
		}
	}

	u64 id = bpf_get_current_pid_tgid();
	if (spec->flags & GH_SPEC_RETURN_SITE) {
		u64 sp = PT_REGS_SP(ctx), ra = 0;
#if defined(__TARGET_ARCH_arm64)
		ra = ctx->regs[30]; /* link register; sp is unchanged by ret */
#else
		/* x86_64: the return address is at sp; ret pops it */
		bpf_probe_read_user(&ra, sizeof(ra), (void *)sp);
		sp += sizeof(u64);
#endif
		struct gh_frame_key fk = { .tid = (u32)id, .sp = sp };
		struct gh_frame fr = { .call = st, .fn = fn };
		frames.update(&fk, &fr);
		struct gh_site_key sk = { .pid = id >> 32, .fn = fn, .addr = ra };
		u8 *state = sites.lookup(&sk);
		if (!state || *state != GH_SITE_PROBED) {
			u32 zero = 0;
			u64 *n = untimed.lookup(&zero);
			if (n)
				(*n)++;
		}
		u8 fresh = GH_SITE_NEW;
		if (!state && sites.insert(&sk, &fresh) == 0) {
			/* Wake user space now: the sooner the site is probed,
			 * the fewer calls go untimed. */
			struct gh_call *mark = events.ringbuf_reserve(sizeof(struct gh_call));
			if (mark) {
				__builtin_memset(mark, 0, sizeof(*mark));
				mark->pid = id >> 32;
				mark->tid = (u32)id;
				mark->fn = fn;
				mark->flags = GH_F_NEW_SITE;
				events.ringbuf_submit(mark, BPF_RB_FORCE_WAKEUP);
			}
		}
		return 0;
	}
	struct gh_inflight_key key = { .tid = (u32)id, .fn = fn };
	inflight.update(&key, &st);
	return 0;
}

/* One record for a call that returned, or one count in `lost` if the ring
 * buffer is full. */
static __always_inline void gh_emit(struct pt_regs *ctx, u32 fn, struct gh_inflight *st)
{
	u64 id = bpf_get_current_pid_tgid();
	struct gh_fn_spec *spec = fn_spec.lookup(&fn);
	struct gh_call *rec = events.ringbuf_reserve(sizeof(struct gh_call));
	if (!rec) {
		u32 zero = 0;
		u64 *n = lost.lookup(&zero);
		if (n)
			(*n)++;
		return;
	}
	rec->start_ns = st->start_ns;
	rec->dur_ns = bpf_ktime_get_ns() - st->start_ns;
	rec->pid = id >> 32;
	rec->tid = (u32)id;
	rec->fn = fn;
	rec->flags = 0;
	rec->ret = (s32)PT_REGS_RC(ctx);
	u8 deref = spec ? spec->deref_mask : 0;
#pragma unroll
	for (int i = 0; i < GH_MAX_ARGS; i++) {
		rec->args[i] = st->args[i];
		if (deref & (1 << i)) {
			u64 v = 0;
			if (bpf_probe_read_user(&v, sizeof(v), (void *)st->args[i]) == 0)
				rec->args[i] = v;
			else
				rec->flags |= GH_F_DEREF_FAILED;
		}
	}
	u32 zero = 0;
	u64 *nsub = submitted.lookup(&zero);
	u64 flags = BPF_RB_NO_WAKEUP;
	if (nsub && ++(*nsub) % GH_WAKEUP_EVERY == 0)
		flags = BPF_RB_FORCE_WAKEUP;
	events.ringbuf_submit(rec, flags);
}

static __always_inline int gh_return(struct pt_regs *ctx, u32 fn)
{
	struct gh_inflight_key key = { .tid = (u32)bpf_get_current_pid_tgid(), .fn = fn };
	struct gh_inflight *st = inflight.lookup(&key);
	if (!st)
		return 0; /* entry happened before we attached */
	gh_emit(ctx, fn, st);
	inflight.delete(&key);
	return 0;
}

/* A uprobe at a return site: the call whose frame returns to this stack
 * pointer on this thread, if any (the site may be reached otherwise too). */
int gh_site(struct pt_regs *ctx)
{
	struct gh_frame_key key = { .tid = (u32)bpf_get_current_pid_tgid(),
				    .sp = PT_REGS_SP(ctx) };
	struct gh_frame *fr = frames.lookup(&key);
	if (!fr)
		return 0;
	gh_emit(ctx, fr->fn, &fr->call);
	frames.delete(&key);
	return 0;
}

int gh_count_launch(struct pt_regs *ctx)
{
	u32 pid = bpf_get_current_pid_tgid() >> 32;
	u64 one = 1;
	u64 *n = launches.lookup(&pid);
	if (n)
		__sync_fetch_and_add(n, 1);
	else
		launches.update(&pid, &one);
	return 0;
}

/* Every slot is a program, but only the catalog's functions (GH_NFUNCS)
 * and, of those, the ones timed by a uretprobe (bit n of GH_RETPROBES)
 * carry a body: the others fold to `return 0` before the inliner copies
 * gh_enter/gh_return into them, which cuts the compile (CPU the job may
 * be short of while we start) by about a quarter. */
#define GH_SLOT(n)                                                           \
	int gh_enter_##n(struct pt_regs *ctx)                                \
	{                                                                    \
		return (n) < GH_NFUNCS ? gh_enter(ctx, n) : 0;               \
	}                                                                    \
	int gh_return_##n(struct pt_regs *ctx)                               \
	{                                                                    \
		return ((GH_RETPROBES) >> (n)) & 1 ? gh_return(ctx, n) : 0;  \
	}

GH_SLOT(0)  GH_SLOT(1)  GH_SLOT(2)  GH_SLOT(3)  GH_SLOT(4)  GH_SLOT(5)
GH_SLOT(6)  GH_SLOT(7)  GH_SLOT(8)  GH_SLOT(9)  GH_SLOT(10) GH_SLOT(11)
GH_SLOT(12) GH_SLOT(13) GH_SLOT(14) GH_SLOT(15) GH_SLOT(16) GH_SLOT(17)
GH_SLOT(18) GH_SLOT(19) GH_SLOT(20) GH_SLOT(21) GH_SLOT(22) GH_SLOT(23)
GH_SLOT(24) GH_SLOT(25) GH_SLOT(26) GH_SLOT(27) GH_SLOT(28) GH_SLOT(29)
GH_SLOT(30) GH_SLOT(31) GH_SLOT(32) GH_SLOT(33) GH_SLOT(34) GH_SLOT(35)
GH_SLOT(36) GH_SLOT(37) GH_SLOT(38) GH_SLOT(39) GH_SLOT(40) GH_SLOT(41)
GH_SLOT(42) GH_SLOT(43) GH_SLOT(44) GH_SLOT(45) GH_SLOT(46) GH_SLOT(47)
