// Emulator runtime: runs MSL threadgroups as fibers on the CPU.
//
// Each MSL thread of a threadgroup is a fiber with its own stack; all fibers of a threadgroup run on one OS
// thread. A fiber runs until it reaches a threadgroup barrier, a SIMD-group operation or its end; when no fiber
// can run, the scheduler releases the SIMD-groups whose active lanes all wait at the same SIMD operation, else
// the threadgroup if all its threads wait at the same barrier, else reports a divergence. Threadgroup memory is
// filled with 0xFF (NaN in float and half) at the start of every threadgroup. With `guard`, each device buffer
// is copied to the end of its own mapping, followed by an inaccessible page, so a read or write past the end
// faults; a SIGSEGV/SIGBUS handler turns the fault into an error naming the kernel and the buffer.
#include "tv_abi.h"

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace {

constexpr size_t kStackSize = 256 << 10;     // per MSL thread
constexpr size_t kTgLimit = 32 << 10;         // Apple GPUs: 32 KB threadgroup memory
constexpr size_t kArenaSize = 64 << 10;
constexpr int kMaxThreads = 1024;
constexpr int kSlotBytes = 32;
constexpr size_t kScratchBytes = 512;      // per SIMD-group, for collective simdgroup_matrix results
const size_t kPage = (size_t)sysconf(_SC_PAGESIZE);

enum State { RUN, WAIT_TG, WAIT_SIMD, DONE };

struct Exec;

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest address; the first page is a guard page
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  State state = DONE;
  unsigned line = 0;
  const char* op = nullptr;
  unsigned gen = 0;       // SIMD operations done
  unsigned active = 0;    // active-lane mask handed back by the scheduler
  __tv_thread t;
  Exec* ex = nullptr;
};

struct Launch {
  const tv_launch_desc* d;
  void* const* bufs;        // what the kernel sees (guarded copies if guard)
  char* const* maps;        // guarded mappings (base), or null
  const size_t* map_sizes;
  std::atomic<long> next{0};
  std::atomic<bool> abort{false};
  std::mutex mu;
  std::string error;
  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> l(mu);
    if (error.empty()) error = msg;
    abort = true;
  }
};

struct Exec {
  std::vector<Fiber> fibers;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  unsigned char* arena = nullptr;
  size_t arena_top = 0;
  std::vector<long> tg_off;
  std::vector<unsigned char> slots;  // [simdgroup][parity][lane][kSlotBytes]
  std::vector<unsigned char> scratch;  // [simdgroup][kScratchBytes]
  std::vector<unsigned> led;          // [simdgroup]: the last SIMD meeting (fiber gen after it) a lane has led
  long group = 0;                     // linear index of the threadgroup running
  Launch* L = nullptr;
  Fiber* cur = nullptr;
  std::string error;                  // set by a fiber, picked up by the scheduler
  unsigned tg[3] = {0, 0, 0};
  sigjmp_buf jb;

  Exec() {
    arena = (unsigned char*)mmap(nullptr, kArenaSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena == MAP_FAILED) abort();
  }
  ~Exec() {
    for (Fiber& f : fibers) if (f.stack) munmap(f.stack, kStackSize + kPage);
    munmap(arena, kArenaSize);
  }
  void ensure_fibers(int n) {
    size_t old = fibers.size();
    if ((size_t)n <= old) return;
    fibers.resize(n);
    for (size_t i = old; i < (size_t)n; i++) {
      void* m = mmap(nullptr, kStackSize + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) abort();
      mprotect(m, kPage, PROT_NONE);
      fibers[i].stack = (char*)m;
    }
  }
};

thread_local Exec* t_exec = nullptr;       // the executor running on this OS thread, while a launch runs
thread_local Exec* t_cached = nullptr;     // kept between launches (fiber stacks are reused)

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap; va_start(ap, f); vsnprintf(buf, sizeof buf, f, ap); va_end(ap);
  return buf;
}

// ---------------------------------------------------------------- context switching
extern "C" void tv_fiber_main(Fiber* f);

#if defined(__x86_64__)
extern "C" void tv_ctx_switch(void** save_sp, void* new_sp);
extern "C" void tv_ctx_start();
asm(R"(
  .text
  .p2align 4
  .hidden tv_ctx_switch
  .globl tv_ctx_switch
  .type tv_ctx_switch,@function
tv_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tv_ctx_switch, .-tv_ctx_switch
  .hidden tv_ctx_start
  .globl tv_ctx_start
  .type tv_ctx_start,@function
tv_ctx_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size tv_ctx_start, .-tv_ctx_start
)");

void fiber_init(Fiber& f) {
  uintptr_t top = ((uintptr_t)f.stack + kPage + kStackSize) & ~(uintptr_t)15;
  void** sp = (void**)(top - 72);
  sp[0] = nullptr;                      // r15
  sp[1] = nullptr;                      // r14
  sp[2] = (void*)&tv_fiber_main;        // r13
  sp[3] = (void*)&f;                    // r12
  sp[4] = nullptr;                      // rbx
  sp[5] = nullptr;                      // rbp
  sp[6] = (void*)&tv_ctx_start;         // return address
  f.sp = sp;
}
inline void to_fiber(Exec* ex, Fiber& f) { tv_ctx_switch(&ex->sched_sp, f.sp); }
inline void to_scheduler(Fiber& f) { tv_ctx_switch(&f.sp, f.ex->sched_sp); }
#else
void fiber_entry_uc(unsigned hi, unsigned lo) { tv_fiber_main((Fiber*)(((uintptr_t)hi << 32) | lo)); }
void fiber_init(Fiber& f) {
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack + kPage;
  f.uc.uc_stack.ss_size = kStackSize;
  f.uc.uc_link = nullptr;
  uintptr_t p = (uintptr_t)&f;
  makecontext(&f.uc, (void (*)())fiber_entry_uc, 2, (unsigned)(p >> 32), (unsigned)p);
}
inline void to_fiber(Exec* ex, Fiber& f) { swapcontext(&ex->sched_uc, &f.uc); }
inline void to_scheduler(Fiber& f) { swapcontext(&f.uc, &f.ex->sched_uc); }
#endif

// ---------------------------------------------------------------- fault handling
struct sigaction g_old_segv, g_old_bus, g_old_ill;
std::once_flag g_handlers_once;

void on_fault(int sig, siginfo_t* info, void* uctx) {
  Exec* ex = t_exec;
  if (ex && ex->L) {
    const tv_launch_desc* d = ex->L->d;
    uintptr_t a = (uintptr_t)info->si_addr;
    std::string where;
    for (int i = 0; i < d->kern->nbufs && where.empty(); i++) {
      if (!ex->L->maps || !ex->L->maps[i]) continue;
      uintptr_t base = (uintptr_t)ex->L->maps[i], end = base + ex->L->map_sizes[i];
      uintptr_t data = (uintptr_t)ex->L->bufs[i], dend = data + d->buf_sizes[i];
      if (a >= base && a < end)
        where = a >= dend ? fmt("%lu bytes past the end of buffer %d `%s` (%lu bytes)", (unsigned long)(a - dend), i,
                                d->kern->buf_names[i], (unsigned long)d->buf_sizes[i])
                          : fmt("%lu bytes before the start of buffer %d `%s` (%lu bytes)", (unsigned long)(data - a), i,
                                d->kern->buf_names[i], (unsigned long)d->buf_sizes[i]);
    }
    if (where.empty())
      for (Fiber& f : ex->fibers)
        if (a >= (uintptr_t)f.stack && a < (uintptr_t)f.stack + kPage) where = "the stack guard page (stack overflow)";
    if (sig == SIGILL) ex->error = "misaligned access: a value read or written at an address its type's alignment does not "
                                   "divide (e.g. a float4 through a pointer into a float array not declared 16-byte aligned)";
    else {
      if (where.empty())
        where = info->si_addr ? fmt("address %p (not a kernel buffer: a wild pointer?)", info->si_addr)
                              : std::string("an unknown address: a misaligned vector access (Metal needs float4 and half8 "
                                            "16-byte aligned, e.g. a threadgroup float array read as float4 must be declared "
                                            "aligned) or a wild pointer");
      ex->error = fmt("%s at %s", sig == SIGBUS ? "bus error" : "invalid memory access", where.c_str());
    }
    if (ex->cur) ex->error += fmt(" by thread %u", ex->cur->t.tindex);
    siglongjmp(ex->jb, 1);
  }
  struct sigaction* old = sig == SIGBUS ? &g_old_bus : sig == SIGILL ? &g_old_ill : &g_old_segv;
  if (old->sa_flags & SA_SIGINFO) { if (old->sa_sigaction) { old->sa_sigaction(sig, info, uctx); return; } }
  else if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) { old->sa_handler(sig); return; }
  signal(sig, SIG_DFL);  // not ours: let the fault happen again with the default action
}

void install_handlers() {
  std::call_once(g_handlers_once, [] {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGILL, &sa, &g_old_ill);   // the alignment sanitizer's trap
  });
}

// The handler runs on an alternate stack: the faulting fiber's stack may be the problem.
struct AltStack {
  stack_t old{}, mine{};
  AltStack() {
    mine.ss_size = 64 << 10;
    mine.ss_sp = malloc(mine.ss_size);
    mine.ss_flags = 0;
    sigaltstack(&mine, &old);
  }
  ~AltStack() {
    if (old.ss_sp && !(old.ss_flags & SS_DISABLE)) sigaltstack(&old, nullptr);
    else { stack_t off{}; off.ss_flags = SS_DISABLE; sigaltstack(&off, nullptr); }
    free(mine.ss_sp);
  }
};

// ---------------------------------------------------------------- scheduling one threadgroup
uint32_t xorshift(uint32_t& s) { s ^= s << 13; s ^= s >> 17; s ^= s << 5; return s; }

const char* state_name(const Fiber& f) { return f.state == DONE ? "returned" : f.op ? f.op : "threadgroup_barrier"; }

// Returns false (with ex->error set) on a divergence or a kernel error.
bool run_threadgroup(Exec* ex, long g) {
  const tv_launch_desc* d = ex->L->d;
  unsigned gx = d->grid[0], gy = d->grid[1];
  ex->tg[0] = g % gx; ex->tg[1] = (g / gx) % gy; ex->tg[2] = g / ((long)gx * gy);
  ex->group = g;
  int n = d->tg[0] * d->tg[1] * d->tg[2];
  int nsg = (n + 31) / 32;
  memset(ex->arena, 0xff, kTgLimit);
  ex->arena_top = 0;
  std::fill(ex->tg_off.begin(), ex->tg_off.end(), -1);
  std::fill(ex->led.begin(), ex->led.end(), 0u);
  for (int i = 0; i < n; i++) {
    Fiber& f = ex->fibers[i];
    f.ex = ex; f.state = RUN; f.gen = 0; f.op = nullptr; f.line = 0; f.active = 0;
    __tv_thread& t = f.t;
    t.tid[0] = i % d->tg[0]; t.tid[1] = (i / d->tg[0]) % d->tg[1]; t.tid[2] = i / (d->tg[0] * d->tg[1]);
    for (int k = 0; k < 3; k++) {
      t.tgid[k] = ex->tg[k]; t.tgsize[k] = d->tg[k]; t.ngroups[k] = d->grid[k];
      t.gid[k] = ex->tg[k] * d->tg[k] + t.tid[k]; t.gridsize[k] = d->grid[k] * d->tg[k];
    }
    t.tindex = i; t.lane = i % 32; t.sg = i / 32; t.nsg = nsg;
    fiber_init(f);
  }
  std::vector<int> order(n);
  for (int i = 0; i < n; i++) order[i] = d->order == TV_ORDER_REVERSE ? n - 1 - i : i;
  uint32_t rng = (d->seed * 2654435761u) ^ (uint32_t)(g * 40503u + 1) ^ 0x9e3779b9u;
  if (!rng) rng = 1;
  auto where = [&](const Fiber& f) { return fmt("%s (line %u)", state_name(f), f.line); };
  for (;;) {
    if (d->order == TV_ORDER_RANDOM)
      for (int i = n - 1; i > 0; i--) std::swap(order[i], order[xorshift(rng) % (i + 1)]);
    for (int i : order) {
      Fiber& f = ex->fibers[i];
      if (f.state != RUN) continue;
      ex->cur = &f;
      to_fiber(ex, f);
      ex->cur = nullptr;
      if (!ex->error.empty()) return false;
    }
    bool released = false, any_tg = false;
    int done = 0;
    for (int s = 0; s < nsg; s++) {
      Fiber *first = nullptr, *tgw = nullptr;
      unsigned mask = 0;
      for (int l = 0; l < 32 && s * 32 + l < n; l++) {
        Fiber& f = ex->fibers[s * 32 + l];
        if (f.state == DONE) { done++; continue; }
        if (f.state == WAIT_TG) { tgw = &f; any_tg = true; continue; }
        if (!first) first = &f;
        else if (f.line != first->line || f.op != first->op || f.gen != first->gen) {
          ex->error = fmt("divergent SIMD-group operation in simdgroup %d: lane %u at %s, lane %u at %s", s, first->t.lane,
                          where(*first).c_str(), f.t.lane, where(f).c_str());
          return false;
        }
        mask |= 1u << l;
      }
      if (!first) continue;
      if (tgw) {
        ex->error = fmt("divergent SIMD-group operation in simdgroup %d: lane %u at %s while lane %u waits at %s", s,
                        first->t.lane, where(*first).c_str(), tgw->t.lane, where(*tgw).c_str());
        return false;
      }
      for (int l = 0; l < 32 && s * 32 + l < n; l++) {
        Fiber& f = ex->fibers[s * 32 + l];
        if (f.state == WAIT_SIMD) { f.active = mask; f.state = RUN; }
      }
      released = true;
    }
    if (released) continue;
    if (!any_tg) return true;  // every thread returned
    Fiber* first = nullptr;
    int waiting = 0;
    for (int i = 0; i < n; i++) {
      Fiber& f = ex->fibers[i];
      if (f.state != WAIT_TG) continue;
      waiting++;
      if (!first) first = &f;
      else if (f.line != first->line) {
        ex->error = fmt("threads wait at different threadgroup barriers: thread %u at line %u, thread %u at line %u "
                        "(barrier in divergent control flow)", first->t.tindex, first->line, f.t.tindex, f.line);
        return false;
      }
    }
    if (done) {
      int r = 0;
      while (ex->fibers[r].state != DONE) r++;
      ex->error = fmt("threadgroup_barrier at line %u reached by %d of %d threads; thread %d returned without reaching it "
                      "(barrier in divergent control flow)", first->line, waiting, n, r);
      return false;
    }
    for (int i = 0; i < n; i++) ex->fibers[i].state = RUN;
  }
}

void run_groups(Exec* ex, Launch* L) {
  long total = (long)L->d->grid[0] * L->d->grid[1] * L->d->grid[2];
  ex->L = L;
  ex->error.clear();
  t_exec = ex;
  AltStack alt;
  if (sigsetjmp(ex->jb, 1) == 0) {
    for (;;) {
      if (L->abort) break;
      long g = L->next.fetch_add(1);
      if (g >= total) break;
      if (!run_threadgroup(ex, g)) break;
    }
  }
  if (!ex->error.empty())
    L->fail(fmt("kernel %s (%s): %s, threadgroup (%u,%u,%u)", L->d->kern->name, L->d->kern->file, ex->error.c_str(),
                ex->tg[0], ex->tg[1], ex->tg[2]));
  t_exec = nullptr;
  ex->L = nullptr;
}

std::mutex g_err_mu;
std::vector<std::string> g_errors;

}  // namespace

// ---------------------------------------------------------------- called from kernel code (via metal_stdlib)
extern "C" {

// IEEE half <-> float, round to nearest even: what clang calls for __fp16 conversions without F16C (the emulator
// compiles for SSE only; see harness._flags). Exported, so kernel libraries resolve them here.
float __gnu_h2f_ieee(unsigned short h) {
  unsigned sign = (unsigned)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (!man) bits = sign;
  else { unsigned e = 113; while (!(man & 0x400)) { man <<= 1; e--; } bits = sign | (e << 23) | ((man & 0x3FF) << 13); }
  float f; memcpy(&f, &bits, 4); return f;
}
unsigned short __gnu_f2h_ieee(float f) {
  unsigned x; memcpy(&x, &f, 4);
  unsigned sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xFF, man = x & 0x7FFFFF;
  if (exp == 0xFF) return (unsigned short)(sign | 0x7C00 | (man ? 0x200 | (man >> 13) : 0));   // inf, NaN (quiet)
  int e = (int)exp - 127 + 15;
  if (e >= 0x1F) return (unsigned short)(sign | 0x7C00);                                      // overflow: inf
  if (e <= 0) {                                                                                // subnormal or zero
    if (e < -10) return (unsigned short)sign;
    man |= 0x800000;
    unsigned shift = (unsigned)(14 - e), half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (unsigned short)(sign | half);
  }
  unsigned half = sign | ((unsigned)e << 10) | (man >> 13), rem = man & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;                                 // may carry into the exponent
  return (unsigned short)half;
}
unsigned short __truncsfhf2(float f) { return __gnu_f2h_ieee(f); }
float __extendhfsf2(unsigned short h) { return __gnu_h2f_ieee(h); }

void tv_fiber_main(Fiber* f) {
  for (;;) {
    f->ex->L->d->kern->entry(f->ex->L->bufs, &f->t);
    f->state = DONE;
    to_scheduler(*f);
  }
}

void __tv_barrier(int, unsigned line) {
  Fiber* f = t_exec->cur;
  f->state = WAIT_TG; f->line = line; f->op = nullptr;
  to_scheduler(*f);
}

const unsigned char* __tv_simd_exchange(const void* value, int bytes, unsigned line, const char* op, unsigned* active,
                                        unsigned* lane) {
  Fiber* f = t_exec->cur;
  Exec* ex = f->ex;
  unsigned char* slot = &ex->slots[(((size_t)f->t.sg * 2 + (f->gen & 1)) * 32 + f->t.lane) * kSlotBytes];
  if (bytes) memcpy(slot, value, bytes);
  f->state = WAIT_SIMD; f->line = line; f->op = op;
  to_scheduler(*f);
  const unsigned char* base = &ex->slots[((size_t)f->t.sg * 2 + (f->gen & 1)) * 32 * kSlotBytes];
  f->gen++;
  f->op = nullptr;
  if (active) *active = f->active;
  if (lane) *lane = f->t.lane;
  return base;
}

void* __tv_tg_alloc(int id, unsigned long size, unsigned long align) {
  Fiber* f = t_exec->cur;
  Exec* ex = f->ex;
  if ((size_t)id >= ex->tg_off.size()) ex->tg_off.resize(id + 1, -1);
  if (ex->tg_off[id] < 0) {
    // Arrays asking for less than 16-byte alignment are placed off a 16-byte boundary on purpose, so that a vector
    // access the declaration does not guarantee traps (the kernels' alignment checks) instead of working by luck:
    // in even threadgroups at 8 bytes past it (8-byte aligned, as a GPU would likely place it: a float2 read of a
    // `float x[N]` at an odd index, or a float4 at x + 4i, is misaligned), in odd threadgroups at exactly the declared
    // alignment past it (a float2 or half4 read of an array declared with 4-byte alignment is misaligned).
    size_t off = (ex->arena_top + 15) & ~(size_t)15;
    if (align < 16) off += (ex->group & 1) ? align : 8;
    if (off + size > kTgLimit) {
      ex->error = fmt("threadgroup memory exceeds %zu bytes (declaration %d needs %lu more at offset %zu)", kTgLimit, id, size, off);
      f->state = DONE;
      to_scheduler(*f);
    }
    ex->tg_off[id] = off;
    ex->arena_top = off + size;
  }
  return ex->arena + ex->tg_off[id];
}

unsigned __tv_lane(void) { return t_exec->cur->t.lane; }

// Called by a lane right after it leaves a SIMD meeting (no switch in between): *first is 1 for the first lane of
// the SIMD-group to resume, while the others are still suspended at the meeting. Returns the SIMD-group's scratch.
void* __tv_simd_lead(int* first) {
  Fiber* f = t_exec->cur;
  Exec* ex = f->ex;
  unsigned& led = ex->led[f->t.sg];
  *first = led != f->gen;
  led = f->gen;
  return &ex->scratch[(size_t)f->t.sg * kScratchBytes];
}

void __tv_fail(const char* msg, unsigned line) {
  Fiber* f = t_exec->cur;
  f->ex->error = fmt("%s (line %u)", msg, line);
  f->state = DONE;
  to_scheduler(*f);
}

int tv_launch(const tv_launch_desc* d, void* const* bufs, char* err, int errlen) {
  install_handlers();
  int nthreads = d->tg[0] * d->tg[1] * d->tg[2];
  long groups = (long)d->grid[0] * d->grid[1] * d->grid[2];
  auto bad = [&](const std::string& m) {
    snprintf(err, errlen, "kernel %s (%s): %s", d->kern->name, d->kern->file, m.c_str());
    return 1;
  };
  if (nthreads < 1 || nthreads > kMaxThreads) return bad(fmt("%d threads per threadgroup (Metal allows 1..%d)", nthreads, kMaxThreads));
  if (groups == 0) return 0;
  int nb = d->kern->nbufs;
  if (nb > TV_MAX_BUFS) return bad("too many buffers");

  // guarded copies: data ends 16-byte aligned right before an inaccessible page; slack is filled with 0xFF
  std::vector<void*> kbufs(bufs, bufs + nb);
  std::vector<char*> maps(nb, nullptr);
  std::vector<size_t> map_sizes(nb, 0);
  if (d->guard) {
    for (int i = 0; i < nb; i++) {
      size_t sz = d->buf_sizes[i], padded = (sz + 15) & ~(size_t)15;
      size_t pages = (padded + kPage - 1) / kPage;
      size_t total = (pages + 2) * kPage;
      char* m = (char*)mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) return bad("mmap failed");
      mprotect(m, kPage, PROT_NONE);
      mprotect(m + (pages + 1) * kPage, kPage, PROT_NONE);
      char* data = m + (pages + 1) * kPage - padded;
      memset(m + kPage, 0xff, pages * kPage);
      if (sz && bufs[i]) memcpy(data, bufs[i], sz);
      maps[i] = m; map_sizes[i] = total; kbufs[i] = data;
    }
  }
  Launch L;
  L.d = d; L.bufs = kbufs.data(); L.maps = d->guard ? maps.data() : nullptr; L.map_sizes = map_sizes.data();

  auto prepare = [&](Exec* ex) {
    ex->ensure_fibers(nthreads);
    ex->slots.assign((size_t)((nthreads + 31) / 32) * 2 * 32 * kSlotBytes, 0xff);
    ex->scratch.assign((size_t)((nthreads + 31) / 32) * kScratchBytes, 0xff);
    ex->led.assign((nthreads + 31) / 32, 0u);
  };
  if (!t_cached) t_cached = new Exec();
  prepare(t_cached);
  int workers = (int)std::min<long>(std::max(1, d->threads), groups);
  std::vector<std::thread> pool;
  std::vector<Exec*> extra;
  for (int w = 1; w < workers; w++) {
    Exec* ex = new Exec();
    prepare(ex);
    extra.push_back(ex);
    pool.emplace_back([ex, &L] { run_groups(ex, &L); });
  }
  run_groups(t_cached, &L);
  for (auto& t : pool) t.join();
  for (Exec* ex : extra) delete ex;

  if (d->guard) {
    for (int i = 0; i < nb; i++) {
      if (L.error.empty() && d->kern->buf_writable[i] && d->buf_sizes[i] && bufs[i]) memcpy(bufs[i], kbufs[i], d->buf_sizes[i]);
      munmap(maps[i], map_sizes[i]);
    }
  }
  if (!L.error.empty()) { snprintf(err, errlen, "%s", L.error.c_str()); return 1; }
  return 0;
}

void tv_launch_deferred(const tv_launch_desc* d, void* const* bufs) {
  char err[2048];
  if (tv_launch(d, bufs, err, sizeof err)) {
    fprintf(stderr, "tinyvllm emulator: %s\n", err);
    std::lock_guard<std::mutex> l(g_err_mu);
    g_errors.push_back(err);
  }
}

int tv_take_error(char* err, int errlen) {
  std::lock_guard<std::mutex> l(g_err_mu);
  int n = (int)g_errors.size();
  if (n) snprintf(err, errlen, "%s", g_errors[0].c_str());
  g_errors.clear();
  return n;
}

}  // extern "C"
