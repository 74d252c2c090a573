/* A GPU timeline of any CUDA program, kernels inside CUDA graphs included: CUPTI's activity API
 * records every kernel's start and end on the device, and at exit this library writes one line a
 * kernel ("start_ns end_ns name", tab-separated) to $CUPTI_TRACE_OUT. Loaded with LD_PRELOAD; finds
 * CUPTI at $CUPTI_LIB (else libcupti.so.13, .12, .so). Written against CUPTI's documented
 * activity API without its headers (no CUDA toolkit needed to build it): the kernel record's
 * start, end and name fields sit at offsets 16, 24 and 104 in every kernel record version
 * (CUpti_ActivityKernel5 to 13). Build: gcc -O2 -shared -fPIC -o libcupti_trace.so cupti_trace.c -ldl
 * Analyse: scripts/cupti/timeline.py TRACE. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*enable_fn)(int);
typedef int (*register_fn)(void (*)(uint8_t **, size_t *, size_t *),
                           void (*)(void *, uint32_t, uint8_t *, size_t, size_t));
typedef int (*next_fn)(uint8_t *, size_t, void **);
typedef int (*flush_fn)(uint32_t);

enum { KIND_KERNEL = 3, KIND_CONCURRENT_KERNEL = 10, BUFFER = 8 << 20 };

static next_fn next_record;
static flush_fn flush_all;
static FILE *out;

static void finish(void);

static void request(uint8_t **buffer, size_t *size, size_t *max_records) {
  /* Registered once CUDA is running, so that it runs before the CUDA libraries' own exit handlers. */
  static int registered;
  if (!registered) registered = !atexit(finish);
  *buffer = aligned_alloc(8, BUFFER);
  *size = *buffer ? BUFFER : 0;
  *max_records = 0;
}

static void complete(void *context, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  void *record = NULL;
  (void)context, (void)stream, (void)size;
  while (next_record(buffer, valid, &record) == 0) {
    uint32_t kind = *(uint32_t *)record;
    if (kind != KIND_KERNEL && kind != KIND_CONCURRENT_KERNEL) continue;
    uint64_t start = *(uint64_t *)((char *)record + 16), end = *(uint64_t *)((char *)record + 24);
    const char *name = *(const char **)((char *)record + 104);
    if (out) fprintf(out, "%llu\t%llu\t%s\n", (unsigned long long)start, (unsigned long long)end, name ? name : "?");
  }
  free(buffer);
}

static void finish(void) {
  if (flush_all) flush_all(1);
  if (out) fclose(out);
  out = NULL;
}

__attribute__((constructor)) static void start(void) {
  const char *path = getenv("CUPTI_TRACE_OUT");
  if (!path) return;
  const char *names[] = {getenv("CUPTI_LIB"), "libcupti.so.13", "libcupti.so.12", "libcupti.so"};
  void *lib = NULL;
  for (int i = 0; i < 4 && !lib; ++i) lib = names[i] ? dlopen(names[i], RTLD_NOW | RTLD_GLOBAL) : NULL;
  if (!lib) {
    fprintf(stderr, "cupti_trace: CUPTI not found (set CUPTI_LIB): %s\n", dlerror());
    return;
  }
  enable_fn enable = (enable_fn)dlsym(lib, "cuptiActivityEnable");
  register_fn reg = (register_fn)dlsym(lib, "cuptiActivityRegisterCallbacks");
  next_record = (next_fn)dlsym(lib, "cuptiActivityGetNextRecord");
  flush_all = (flush_fn)dlsym(lib, "cuptiActivityFlushAll");
  if (!enable || !reg || !next_record || !flush_all) {
    fprintf(stderr, "cupti_trace: CUPTI's activity API is incomplete\n");
    return;
  }
  out = fopen(path, "w");
  int r1 = reg(request, complete), r2 = enable(KIND_CONCURRENT_KERNEL);
  if (r1 || r2) fprintf(stderr, "cupti_trace: CUPTI refused (%d, %d)\n", r1, r2);
}
