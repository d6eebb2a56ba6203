/* A real skewed wall clock for one process, by LD_PRELOAD (bench/fault_injection.py, the clock-skew scenarios).

   libfaketime 0.9.10 (Debian's) does not run Python 3.11 here: with the monotonic clock left alone time.sleep()
   fails with EINVAL (its clock_nanosleep wrapper), and with it faked threading.Event.wait() never returns. This
   shim moves CLOCK_REALTIME (clock_gettime, gettimeofday, time) by RSFI_SKEW_S seconds and nothing else, so the
   process's wall clock is off as a badly synchronised node's is, and its sleeps and timeouts still work.

   RSFI_SKEW_NODE (optional): act only in a torchrun worker (LOCAL_RANK set) whose RANKSIGHT_NODE equals it. The
   training ranks of that node then share its skewed clock while torchrun itself keeps the true one: torch's elastic
   rendezvous compares its nodes' wall-clock heartbeats and drops a node more than ~15 s off (torch's own
   requirement of synchronised clocks, not a ranksight concern).

   Built by the benchmark: gcc -shared -fPIC -O2 -o clock_skew.so clock_skew.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

static long long skew_ns;
static int inited;
static int (*real_clock_gettime)(clockid_t, struct timespec *);
static int (*real_gettimeofday)(struct timeval *, void *);

static void init(void) {
    if (inited)
        return;
    real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    real_gettimeofday = dlsym(RTLD_NEXT, "gettimeofday");
    const char *s = getenv("RSFI_SKEW_S");
    const char *node = getenv("RSFI_SKEW_NODE");
    if (s && node) {
        const char *mine = getenv("RANKSIGHT_NODE");
        if (!mine || strcmp(mine, node) != 0 || !getenv("LOCAL_RANK"))
            s = NULL;
    }
    skew_ns = s ? (long long)(atof(s) * 1e9) : 0;
    inited = 1;
}

__attribute__((constructor)) static void at_load(void) { init(); }

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns;
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int clock_gettime(clockid_t c, struct timespec *ts) {
    init();
    int r = real_clock_gettime(c, ts);
    if (r == 0 && skew_ns && (c == CLOCK_REALTIME || c == CLOCK_REALTIME_COARSE))
        shift(ts);
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    init();
    int r = real_gettimeofday(tv, tz);
    if (r == 0 && tv && skew_ns) {
        struct timespec ts = {tv->tv_sec, tv->tv_usec * 1000};
        shift(&ts);
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t)
        *t = ts.tv_sec;
    return ts.tv_sec;
}
