/* Tight-loop target for scripts/bench_probe_overhead and the overload test.
 *
 *   ghbench local N [THREADS]   call gh_bench_fn (in this binary) N times per thread
 *   ghbench nccl  N [THREADS]   call ncclGroupStart + ncclGroupEnd of the real
 *                               libnccl (path in $GH_NCCL_LIB) N times per thread
 *
 * Prints "calls ns_per_loop elapsed_ns". With GH_BENCH_WAIT set it prints
 * "ready" and waits for a line on stdin first, so a tracer can attach. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* noinline + the asm barrier keep the compiler from folding the calls. */
__attribute__((noinline, visibility("default"))) int gh_bench_fn(int x, int y)
{
	__asm__ volatile("" ::: "memory");
	return x + y;
}

static int (*group_start)(void);
static int (*group_end)(void);
static int use_nccl;

struct job { long n; long sum; };

static void *worker(void *arg)
{
	struct job *j = arg;
	if (use_nccl) {
		for (long i = 0; i < j->n; i++)
			j->sum += group_start() + group_end();
	} else {
		for (long i = 0; i < j->n; i++)
			j->sum += gh_bench_fn((int)i, 1);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc < 3)
		return 2;
	use_nccl = strcmp(argv[1], "nccl") == 0;
	long n = atol(argv[2]);
	int threads = argc > 3 ? atoi(argv[3]) : 1;
	if (threads < 1 || threads > 64)
		return 2;
	if (use_nccl) {
		const char *lib = getenv("GH_NCCL_LIB");
		void *h = dlopen(lib ? lib : "libnccl.so.2", RTLD_NOW);
		if (!h) {
			fprintf(stderr, "ghbench: %s\n", dlerror());
			return 1;
		}
		group_start = (int (*)(void))dlsym(h, "ncclGroupStart");
		group_end = (int (*)(void))dlsym(h, "ncclGroupEnd");
		if (!group_start || !group_end)
			return 1;
	}
	if (getenv("GH_BENCH_WAIT")) {
		char line[16];
		printf("ready\n");
		fflush(stdout);
		if (!fgets(line, sizeof(line), stdin))
			return 1;
	}
	pthread_t tid[64];
	struct job jobs[64];
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	for (int t = 0; t < threads; t++) {
		jobs[t].n = n;
		jobs[t].sum = 0;
		pthread_create(&tid[t], NULL, worker, &jobs[t]);
	}
	for (int t = 0; t < threads; t++)
		pthread_join(tid[t], NULL);
	clock_gettime(CLOCK_MONOTONIC, &b);
	double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
	printf("%ld %.1f %.0f\n", n * threads, ns / n, ns);
	fflush(stdout);
	return 0;
}
