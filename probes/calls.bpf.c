/* The uprobe/uretprobe programs that time every probed library call.
 *
 * gh_enter (a uprobe at each probed function) finds the function from where
 * it hit (`probe_fn`, greyhound.h), saves the start time and the argument
 * slots under (thread, stack pointer after the return). gh_return (a
 * uretprobe, or for functions that may throw a uprobe at the caller's
 * return site: see greyhound.h) computes the duration, reads out-parameters
 * (for example the ncclComm_t that ncclCommInitRank writes) and reserves
 * one ring-buffer record. A record the ring buffer cannot take is counted
 * in `lost`, never dropped silently. Load-time settings come in as -D flags:
 *   GH_RINGBUF_PAGES  ring buffer size in pages (power of two)
 *   GH_INFLIGHT_MAX   concurrent in-flight calls tracked
 *   GH_WAKEUP_EVERY   wake the consumer once per this many records per CPU
 *   GH_MAX_PROBES     (process, function) pairs probed at once
 *
 * Waking the consumer on every record costs an irq_work and a context
 * switch per call, more than the probe itself. Records are submitted
 * without a wake-up except every GH_WAKEUP_EVERY-th on a CPU; in between,
 * the consumer collects them after its poll timeout (ring_buffer_consume:
 * epoll reports only wake-ups). User space sets it
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
#ifndef GH_MAX_PROBES
#define GH_MAX_PROBES 16384
#endif
#ifndef GH_MAX_SITES
#define GH_MAX_SITES 4096
#endif

BPF_RINGBUF_OUTPUT(events, GH_RINGBUF_PAGES);
BPF_ARRAY(fn_spec, struct gh_fn_spec, GH_MAX_FUNCS);
BPF_HASH(probe_fn, struct gh_probe_key, u32, GH_MAX_PROBES);
/* LRU: a thread killed inside a call must not leak its slot forever. */
BPF_TABLE("lru_hash", struct gh_frame_key, struct gh_frame, frames, GH_INFLIGHT_MAX);
/* Return sites seen, for user space to probe (it deletes a process's on detach). */
BPF_HASH(sites, struct gh_site_key, u8, GH_MAX_SITES);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_PERCPU_ARRAY(untimed, u64, 1);
BPF_PERCPU_ARRAY(submitted, u64, 1);
/* cudaLaunchKernel is too frequent to stream: count it per process here. */
BPF_HASH(launches, u32, u64, 4096);

int gh_enter(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	/* A uprobe's handler sees the instruction pointer at the probe. */
	struct gh_probe_key pk = { .pid = id >> 32, .addr = PT_REGS_IP(ctx) };
	u32 *fnp = probe_fn.lookup(&pk);
	if (!fnp)
		return 0;
	u32 fn = *fnp;
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

	u64 sp = PT_REGS_SP(ctx), ra = 0;
#if defined(__TARGET_ARCH_arm64)
	ra = ctx->regs[30]; /* link register; sp is unchanged by ret */
#else
	/* x86_64: the return address is at sp; ret pops it */
	if (spec->flags & GH_SPEC_RETURN_SITE)
		bpf_probe_read_user(&ra, sizeof(ra), (void *)sp);
	sp += sizeof(u64);
#endif
	struct gh_frame_key fk = { .tid = (u32)id, .sp = sp };
	struct gh_frame fr = { .call = st, .fn = fn };
	frames.update(&fk, &fr);
	if (spec->flags & GH_SPEC_RETURN_SITE) {
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
	}
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

/* A uretprobe, or a uprobe at a return site: the call whose frame returns
 * to this stack pointer on this thread, if any (a return site may be
 * reached otherwise too). */
int gh_return(struct pt_regs *ctx)
{
	struct gh_frame_key key = { .tid = (u32)bpf_get_current_pid_tgid(),
				    .sp = PT_REGS_SP(ctx) };
	struct gh_frame *fr = frames.lookup(&key);
	if (!fr)
		return 0; /* the call began before we attached */
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
