/* memsem native layer: helpers shared by the C files (not part of the cffi interface).
 *
 * One copy of the clock and futex calls for memsem_native.c, memsem_wait.c, memsem_pipe.c and
 * memsem_hot.c. Shared futexes (no FUTEX_PRIVATE_FLAG) for words in segments many processes
 * map (control blocks, ready words); private ones for a process's own words (use words, pipes).
 */
#ifndef MEMSEM_INTERNAL_H
#define MEMSEM_INTERNAL_H
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* CLOCK_MONOTONIC in nanoseconds: one clock for all processes of a node. */
static inline uint64_t ms_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline struct timespec ms_timespec(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    return ts;
}

/* Wait at most ns while *addr == val (shared or private futex). 0 woken / value differed /
 * timed out; -errno otherwise. */
static inline int ms_futex_wait(uint32_t *addr, uint32_t val, uint64_t ns, int shared) {
    struct timespec ts = ms_timespec(ns);
    long rc = syscall(SYS_futex, addr, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, val, &ts, NULL, 0);
    if (rc == 0 || errno == EAGAIN || errno == ETIMEDOUT || errno == EINTR) return 0;
    return -errno;
}

/* Wake up to n waiters of *addr; returns the number woken or -errno. */
static inline int ms_futex_wake(uint32_t *addr, int n, int shared) {
    long rc = syscall(SYS_futex, addr, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
    return rc < 0 ? -errno : (int)rc;
}

/* The low 32 bits of a 64-bit word (what a futex waits on; little endian). */
static inline uint32_t *ms_low32(uint64_t *w) { return (uint32_t *)w; }

#endif
