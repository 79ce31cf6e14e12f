/* Interface between the emulator runtime (runtime.cpp), the generated kernel wrappers and the Python harness. */
#ifndef TV_ABI_H
#define TV_ABI_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* The built-in values of one MSL thread. */
struct __tv_thread {
  unsigned tgid[3], tid[3], gid[3], tgsize[3], ngroups[3], gridsize[3];
  unsigned tindex, lane, sg, nsg;
};
typedef void (*__tv_entry_fn)(void* const* bufs, const struct __tv_thread* t);

/* One kernel (one host_name) of a compiled library. */
struct __tv_kernel {
  const char* name;
  const char* file;
  __tv_entry_fn entry;
  int nbufs;
  const char* const* buf_names;
  const unsigned char* buf_writable;
};

enum { TV_ORDER_FORWARD = 0, TV_ORDER_REVERSE = 1, TV_ORDER_RANDOM = 2 };
#define TV_MAX_BUFS 31

/* A launch: threadgroups per grid, threads per threadgroup, byte size of each buffer, options. */
struct tv_launch_desc {
  const struct __tv_kernel* kern;
  uint32_t grid[3];
  uint32_t tg[3];
  uint64_t buf_sizes[TV_MAX_BUFS];
  int32_t order;      /* TV_ORDER_* */
  uint32_t seed;      /* for TV_ORDER_RANDOM */
  int32_t threads;    /* OS threads running threadgroups */
  int32_t guard;      /* copy buffers into guarded pages, report out-of-bounds accesses */
};

/* Runs a launch; returns 0, or nonzero with a message in err. */
int tv_launch(const struct tv_launch_desc* d, void* const* bufs, char* err, int errlen);
/* Same, for callers that cannot take an error (tinygrad's CPU worker): errors are kept until tv_take_error. */
void tv_launch_deferred(const struct tv_launch_desc* d, void* const* bufs);
/* Copies the oldest kept error into err and returns how many were kept (0: none); clears them. */
int tv_take_error(char* err, int errlen);

#ifdef __cplusplus
}
#endif
#endif
