/* Host time spent inside chosen cuBLASLt, cuDNN and CUDA driver calls, for any program that links
 * them dynamically (MLX's CUDA backend does; its CUDA runtime is static, so runtime calls are not seen): loaded with LD_PRELOAD, each wrapped call is timed with
 * CLOCK_MONOTONIC and counted; at exit one line a function ("calls total_ms name") goes to
 * $HOST_CALLS_OUT (else stderr). Tells how much of an operation's host cost is cuBLASLt's plan
 * search and launch, cuDNN or graph building. Written without CUDA's headers: handles are pointers,
 * statuses ints; calls of at most six integer arguments are forwarded as six (the x86-64 System V
 * ABI passes them in registers, so a shorter real signature ignores the rest).
 * Build: gcc -O2 -shared -fPIC -o libhost_calls.so host_calls.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef uint64_t u64;
enum { SLOTS = 32 };
static const char *names[SLOTS];
static u64 calls[SLOTS], nanos[SLOTS];
static int used;

static u64 now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (u64)t.tv_sec * 1000000000ull + (u64)t.tv_nsec;
}

static void report(void) {
  const char *path = getenv("HOST_CALLS_OUT");
  FILE *f = path ? fopen(path, "w") : stderr;
  if (!f) return;
  for (int i = 0; i < used; ++i)
    fprintf(f, "%llu\t%.3f\t%s\n", (unsigned long long)calls[i], nanos[i] / 1e6, names[i]);
  if (f != stderr) fclose(f);
}

static int slot(const char *name) {
  static int registered;
  if (!registered) registered = !atexit(report);
  names[used] = name;
  return used++;
}

/* A call of up to six integer arguments. */
#define WRAP6(name)                                                                   \
  u64 name(u64 a, u64 b, u64 c, u64 d, u64 e, u64 f) {                              \
    static u64 (*real)(u64, u64, u64, u64, u64, u64);                                \
    static int s = -1;                                                               \
    if (!real) real = (u64(*)(u64, u64, u64, u64, u64, u64))dlsym(RTLD_NEXT, #name); \
    if (s < 0) s = slot(#name);                                                      \
    u64 t = now(), r = real(a, b, c, d, e, f);                                       \
    nanos[s] += now() - t, calls[s]++;                                               \
    return r;                                                                        \
  }

WRAP6(cublasLtMatmulDescCreate)
WRAP6(cublasLtMatmulDescDestroy)
WRAP6(cublasLtMatmulDescSetAttribute)
WRAP6(cublasLtMatrixLayoutCreate)
WRAP6(cublasLtMatrixLayoutDestroy)
WRAP6(cublasLtMatrixLayoutSetAttribute)
WRAP6(cuGraphAddKernelNode_v2)
WRAP6(cuGraphCreate)
WRAP6(cuGraphGetNodes)
WRAP6(cuLaunchKernelEx)
WRAP6(cudnnBackendExecute)
WRAP6(cudnnBackendPopulateCudaGraph)
WRAP6(cudnnBackendUpdateCudaGraph)
WRAP6(cudnnBackendFinalize)

int cublasLtMatmulAlgoGetHeuristic(void *h, void *desc, void *a, void *b, void *c, void *d, void *pref,
                                   int requested, void *results, int *returned) {
  static int (*real)(void *, void *, void *, void *, void *, void *, void *, int, void *, int *);
  static int s = -1;
  if (!real) real = dlsym(RTLD_NEXT, "cublasLtMatmulAlgoGetHeuristic");
  if (s < 0) s = slot("cublasLtMatmulAlgoGetHeuristic");
  u64 t = now();
  int r = real(h, desc, a, b, c, d, pref, requested, results, returned);
  nanos[s] += now() - t, calls[s]++;
  return r;
}

int cublasLtMatmul(void *h, void *desc, const void *alpha, const void *a, void *ad, const void *b, void *bd,
                   const void *beta, const void *c, void *cd, void *d, void *dd, const void *algo, void *ws,
                   size_t wss, void *stream) {
  static int (*real)(void *, void *, const void *, const void *, void *, const void *, void *, const void *,
                     const void *, void *, void *, void *, const void *, void *, size_t, void *);
  static int s = -1;
  if (!real) real = dlsym(RTLD_NEXT, "cublasLtMatmul");
  if (s < 0) s = slot("cublasLtMatmul");
  u64 t = now();
  int r = real(h, desc, alpha, a, ad, b, bd, beta, c, cd, d, dd, algo, ws, wss, stream);
  nanos[s] += now() - t, calls[s]++;
  return r;
}
