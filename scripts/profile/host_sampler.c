// A sampling profiler of a process's host CPU time, loaded with LD_PRELOAD. While sampling is on,
// every 500 us of the process's CPU time (ITIMER_PROF) the running thread records its stack (glibc's
// backtrace) and its thread id. SIGUSR2 turns sampling on and off (a driver sends it when the
// program reaches the part worth profiling: see host_profile.py); HOST_SAMPLER_ON=1 samples from
// the start. At exit it writes $HOST_SAMPLER_OUT: samples per thread, then one line per sampled
// address with its count as the interrupted function ("self") and on any stack ("total"), the
// library and offset it falls in, and its exported name where dladdr finds one. host_profile.py
// names the offsets with the libraries' symbol tables (nm) and sums them by function.
// Build: gcc -O2 -shared -fPIC -o libhost_sampler.so host_sampler.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#define DEPTH 64
#define MAX_SAMPLES 200000

static void *stacks[MAX_SAMPLES][DEPTH];
static unsigned char depths[MAX_SAMPLES];
static int tids[MAX_SAMPLES];
static volatile long taken;
static volatile int sampling;

static void on_prof(int sig) {
    (void)sig;
    if (!sampling) return;
    long i = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
    if (i >= MAX_SAMPLES) return;
    tids[i] = (int)syscall(SYS_gettid);
    depths[i] = (unsigned char)backtrace(stacks[i], DEPTH);
}

static void set_timer(int on) {
    struct itimerval t = {{0, on ? 500 : 0}, {0, on ? 500 : 0}};
    setitimer(ITIMER_PROF, &t, NULL);
}

static void on_toggle(int sig) {
    (void)sig;
    sampling = !sampling;
    set_timer(sampling);
}

// Open addressing over addresses: self and total counts.
#define SLOTS (1 << 20)
static void *keys[SLOTS];
static long selfc[SLOTS], totalc[SLOTS];
static long slot_of(void *a) {
    unsigned long h = ((unsigned long)a * 0x9E3779B97F4A7C15ul) >> 44;
    while (keys[h] && keys[h] != a) h = (h + 1) & (SLOTS - 1);
    keys[h] = a;
    return (long)h;
}

__attribute__((destructor)) static void report(void) {
    const char *path = getenv("HOST_SAMPLER_OUT");
    if (!path) return;
    sampling = 0;
    set_timer(0);
    long n = taken < MAX_SAMPLES ? taken : MAX_SAMPLES;
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "samples %ld every 500 us of CPU time\n", n);
    // Threads: a few, counted by a linear scan.
    int tid_list[256]; long tid_count[256]; int nt = 0;
    for (long i = 0; i < n; i++) {
        int k = 0;
        while (k < nt && tid_list[k] != tids[i]) k++;
        if (k == nt && nt < 256) { tid_list[nt] = tids[i]; tid_count[nt++] = 0; }
        if (k < 256) tid_count[k]++;
    }
    for (int k = 0; k < nt; k++) fprintf(f, "thread %d %ld\n", tid_list[k], tid_count[k]);
    for (long i = 0; i < n; i++) {
        // Frame 0 is the handler, 1 the signal trampoline: the interrupted function is frame 2.
        // Return addresses (frames above it) are moved back one byte into their call.
        long seen[DEPTH]; int nseen = 0;
        for (int d = 2; d < depths[i]; d++) {
            void *a = d == 2 ? stacks[i][d] : (char *)stacks[i][d] - 1;
            long s = slot_of(a);
            if (d == 2) selfc[s]++;
            int dup = 0;
            for (int k = 0; k < nseen; k++) dup |= seen[k] == s;
            if (!dup) { totalc[s]++; seen[nseen++] = s; }
        }
    }
    for (long s = 0; s < SLOTS; s++) {
        if (!keys[s]) continue;
        Dl_info info;
        int ok = dladdr(keys[s], &info);
        const char *lib = ok && info.dli_fname ? info.dli_fname : "?";
        unsigned long off = ok ? (unsigned long)((char *)keys[s] - (char *)info.dli_fbase) : (unsigned long)keys[s];
        fprintf(f, "addr %ld %ld %s 0x%lx %s\n", selfc[s], totalc[s], lib, off,
                ok && info.dli_sname ? info.dli_sname : "-");
    }
    fclose(f);
}

__attribute__((constructor)) static void start(void) {
    if (!getenv("HOST_SAMPLER_OUT")) return;
    void *warm[4];
    backtrace(warm, 4);  // loads the unwinder before any signal arrives
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_prof;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGPROF, &sa, NULL);
    sa.sa_handler = on_toggle;
    sigaction(SIGUSR2, &sa, NULL);
    const char *on = getenv("HOST_SAMPLER_ON");
    if (on && *on == '1') { sampling = 1; set_timer(1); }
}
