/* A pool of worker threads for tinyvllm's C kernels on tinygrad's CPU device (tinyvllm/kernels/threads.py).

   tinygrad runs each kernel on one thread. Our kernels split their work (rows of a linear, heads of attention) into
   `nparts` parts and hand them to tv_pool_run, which runs part 0 on the calling thread and the others on the
   workers, and returns when all are done. A decode step runs a few hundred such regions, each tens of microseconds
   long, so waking workers must cost about a microsecond: between regions they spin on a generation counter, and
   only after TV_SPIN_NS without work (an idle engine, Python between steps) do they sleep on a condition variable.
   The kernels reach tv_pool_run through an address stored in a buffer, so their compiled code does not depend on
   this library's load address (tinygrad caches compiled kernels on disk by source). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define TV_SPIN_NS 200000L   /* 0.2 ms: longer than the gaps inside a step, shorter than an idle poll */

typedef void (*tv_task)(void *ctx, int part, int nparts);

typedef struct tv_pool {
  atomic_int n;                 /* threads, the caller included (1 once destroyed) */
  pthread_t *threads;
  struct tv_worker *workers;
  tv_task fn;
  void *ctx;
  atomic_long generation;       /* one more per region: workers run it when they see it change */
  atomic_int remaining;         /* workers still running the current region */
  atomic_int sleepers;
  atomic_int stop;
  long epoch;                   /* fork_epoch when created */
  long long regions, wait_ns;   /* regions run, and time the caller spent waiting for workers after its own part
                                   (the pool's synchronization cost; tv_pool_stats) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
} tv_pool;

typedef struct tv_worker { tv_pool *pool; int part; } tv_worker;

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void *worker_main(void *arg) {
  tv_worker *w = arg;
  tv_pool *p = w->pool;
  long seen = 0;
  for (;;) {
    long start = now_ns();
    int spins = 0;
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) {
      /* a few pauses, then yield: with more runnable threads than cores (tinygrad's own threads, Python), a pure
         spin would hold a core the thread we wait for needs */
      if (++spins < 64) cpu_relax(); else sched_yield();
      if (spins % 64 == 0 && now_ns() - start > TV_SPIN_NS) {
        /* sleep; seq_cst on both sides: tv_pool_run bumps generation then reads sleepers, we bump sleepers then
           read generation, so at least one of us sees the other and no wake-up is lost */
        pthread_mutex_lock(&p->mu);
        atomic_fetch_add(&p->sleepers, 1);
        while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv, &p->mu);
        atomic_fetch_sub(&p->sleepers, 1);
        pthread_mutex_unlock(&p->mu);
      }
    }
    long g = atomic_load(&p->generation);
    if (g == seen) return NULL;   /* stopped; a region already published still runs, so its caller is not left waiting */
    seen = g;
    p->fn(p->ctx, w->part, p->n);
    atomic_fetch_sub(&p->remaining, 1);
  }
}

/* Bumped in a forked child: its copy of a pool has no workers (fork copies only the calling thread). */
static atomic_long fork_epoch;
static void on_fork_child(void) { atomic_fetch_add(&fork_epoch, 1); }
static pthread_once_t fork_hook = PTHREAD_ONCE_INIT;
static void install_fork_hook(void) { pthread_atfork(NULL, NULL, on_fork_child); }

/* Run fn(ctx, part, n) for every part in 0..n-1, part 0 on the calling thread; returns when all have finished.
   One caller at a time (tinygrad's CPU queue thread). In a forked child every part runs here, in order: the same
   results, since a row's arithmetic does not depend on which part computes it. */
void tv_pool_run(tv_pool *p, tv_task fn, void *ctx) {
  const int n = atomic_load(&p->n);
  if (n == 1) { fn(ctx, 0, 1); return; }
  if (atomic_load(&fork_epoch) != p->epoch) { for (int i = 0; i < n; i++) fn(ctx, i, n); return; }
  p->fn = fn;
  p->ctx = ctx;
  atomic_store(&p->remaining, n - 1);
  atomic_fetch_add(&p->generation, 1);
  if (atomic_load(&p->sleepers) > 0) {
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
  fn(ctx, 0, n);
  long waited = now_ns();
  for (int spins = 0; atomic_load(&p->remaining) > 0; spins++) {
    if (spins < 64) cpu_relax(); else sched_yield();   /* a worker may be waiting for a core: let it have ours */
  }
  p->wait_ns += now_ns() - waited;   /* one caller at a time: plain fields suffice */
  p->regions++;
}

tv_pool *tv_pool_create(int n) {
  pthread_once(&fork_hook, install_fork_hook);
  tv_pool *p = calloc(1, sizeof(tv_pool));
  if (!p) return NULL;
  p->n = n < 1 ? 1 : n;
  p->epoch = atomic_load(&fork_epoch);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->threads = calloc(p->n, sizeof(pthread_t));
  tv_worker *ws = p->workers = calloc(p->n, sizeof(tv_worker));
  if (!p->threads || !ws) { free(p->threads); free(ws); p->threads = NULL; p->workers = NULL; p->n = 1; return p; }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 8 << 20);   /* the quantized GEMMs keep up to ~1 MB of x rows and codes on the stack */
  for (int i = 1; i < p->n; i++) {
    ws[i].pool = p;
    ws[i].part = i;
    if (pthread_create(&p->threads[i], &attr, worker_main, &ws[i]) != 0) {
      p->n = i;   /* fewer threads: the parts shrink (workers read n only after a region is published) */
      break;
    }
  }
  pthread_attr_destroy(&attr);
  return p;
}

int tv_pool_size(tv_pool *p) { return p->n; }

/* out[0]: regions run with workers, out[1]: nanoseconds the caller waited for them (read between kernels) */
void tv_pool_stats(tv_pool *p, long long *out) { out[0] = p->regions; out[1] = p->wait_ns; }

void tv_pool_destroy(tv_pool *p) {
  if (!p || atomic_load(&fork_epoch) != p->epoch) return;   /* a forked child's copy: no workers to stop */
  pthread_mutex_lock(&p->mu);
  atomic_store(&p->stop, 1);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
  /* The struct itself stays (a few hundred bytes per engine): a kernel still queued in tinygrad when the pool is
     collected finds n == 1 and runs its parts on its own thread, never freed memory. */
  atomic_store(&p->n, 1);
  free(p->threads);
  free(p->workers);
  p->threads = NULL;
  p->workers = NULL;
}
