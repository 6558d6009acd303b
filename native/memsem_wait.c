/* memsem async word waiter: block on many shared 32/64-bit words at once.
 * See the "async word waiter" block at the end of memsem_native.h for the contract. */
#define _GNU_SOURCE
#include "memsem_native.h"
#include "memsem_internal.h"

#include <errno.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449 /* one number on every architecture (the unified syscall table) */
#endif

/* The kernel's struct futex_waitv (uapi linux/futex.h, 5.16), declared here so that building
 * does not depend on the installed kernel headers. */
struct memsem_kwaitv {
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
};
#define MEMSEM_FUTEX2_SIZE_U32 0x02

int memsem_wait_probe(void) {
    /* nr_futexes == 0 is refused with EINVAL by a kernel that has the call, before any work. */
    long rc = syscall(SYS_futex_waitv, NULL, 0, 0, NULL, 0);
    if (rc < 0 && errno == EINVAL) return 1;
    return rc < 0 ? -errno : -EINVAL;
}

static uint64_t load_word(const struct memsem_wait_word *w) {
    if (w->size == 4)
        return __atomic_load_n((const uint32_t *)(uintptr_t)w->addr, __ATOMIC_ACQUIRE);
    return __atomic_load_n((const uint64_t *)(uintptr_t)w->addr, __ATOMIC_ACQUIRE);
}

static int scan(struct memsem_wait_word *words, int n) {
    int changed = 0;
    for (int i = 0; i < n; i++) {
        uint64_t v = load_word(&words[i]);
        words[i].seen = v;
        words[i].changed = v != words[i].expected;
        changed += (int)words[i].changed;
    }
    return changed;
}

/* The 32-bit halves of a word's expected value, in memory order (endian neutral). */
static void halves(const struct memsem_wait_word *w, uint32_t out[2]) {
    if (w->size == 4) {
        out[0] = (uint32_t)w->expected;
        out[1] = 0;
    } else {
        memcpy(out, &w->expected, 8);
    }
}

static int wait_waitv(struct memsem_wait_word *words, int n, uint64_t deadline_ns) {
    struct memsem_kwaitv kv[MEMSEM_WAITV_MAX];
    int m = 0;
    for (int i = 0; i < n; i++) {
        uint32_t h[2];
        halves(&words[i], h);
        int parts = words[i].size == 8 ? 2 : 1;
        for (int p = 0; p < parts; p++) {
            if (m == MEMSEM_WAITV_MAX) return -E2BIG;
            kv[m].val = h[p];
            kv[m].uaddr = words[i].addr + 4u * (unsigned)p;
            kv[m].flags = MEMSEM_FUTEX2_SIZE_U32; /* shared: no FUTEX2_PRIVATE */
            kv[m].reserved = 0;
            m++;
        }
    }
    struct timespec ts = {(time_t)(deadline_ns / 1000000000ull), (long)(deadline_ns % 1000000000ull)};
    long rc = syscall(SYS_futex_waitv, kv, m, 0, &ts, CLOCK_MONOTONIC);
    if (rc >= 0) return 0;
    if (errno == EAGAIN || errno == EINTR || errno == ETIMEDOUT) return 0;
    return -errno;
}

static int wait_slice(struct memsem_wait_word *w, uint64_t now, uint64_t deadline_ns) {
    uint64_t left = deadline_ns - now;
    uint64_t slice = (uint64_t)MEMSEM_WAIT_SLICE_US * 1000ull;
    if (left < slice) slice = left;
    uint32_t h[2];
    halves(w, h);
    return ms_futex_wait((uint32_t *)(uintptr_t)w->addr, h[0], slice, 1);
}

int memsem_wait_any(struct memsem_wait_word *words, int n, uint64_t deadline_ns, int mode) {
    if (n < 1 || (mode != MEMSEM_WAIT_WAITV && mode != MEMSEM_WAIT_SLICES)) return -EINVAL;
    for (int i = 0; i < n; i++) {
        uint32_t sz = words[i].size;
        if ((sz != 4 && sz != 8) || words[i].addr == 0 || words[i].addr % sz) return -EINVAL;
    }
    int rr = 0;
    for (;;) {
        int changed = scan(words, n);
        if (changed) return changed;
        uint64_t now = memsem_monotonic_ns();
        if (now >= deadline_ns) return -ETIMEDOUT;
        int rc;
        if (mode == MEMSEM_WAIT_WAITV) {
            rc = wait_waitv(words, n, deadline_ns);
        } else {
            rc = wait_slice(&words[rr], now, deadline_ns);
            rr = (rr + 1) % n;
        }
        if (rc < 0) {
            scan(words, n);
            return rc;
        }
        /* woken, a value moved before we slept, a slice or the deadline passed: scan again */
    }
}

void memsem_wait_bump(uint32_t *word) {
    __atomic_fetch_add(word, 1u, __ATOMIC_SEQ_CST);
    ms_futex_wake(word, 0x7fffffff, 1);
}
