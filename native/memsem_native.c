/* memsem native layer; see memsem_native.h for the contract of every function. */
#define _GNU_SOURCE
#include "memsem_native.h"
#include "memsem_internal.h"

#include <errno.h>
#include <linux/futex.h>
#include <string.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

int64_t memsem_lease_claim(uint64_t slots_addr, uint32_t n_slots, uint64_t mark, uint64_t pid, uint64_t start,
                           uint64_t version, uint64_t expiry, uint64_t lease_id, uint64_t state_addr,
                           uint64_t live) {
    for (uint32_t i = 0; i < n_slots; i++) {
        uint64_t *w = (uint64_t *)(uintptr_t)(slots_addr + 8u * MEMSEM_LEASE_WORDS * i);
        uint64_t free_id = 0;
        if (__atomic_load_n(&w[MEMSEM_LEASE_ID], __ATOMIC_ACQUIRE) != 0 ||
            !__atomic_compare_exchange_n(&w[MEMSEM_LEASE_ID], &free_id, mark, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        __atomic_store_n(&w[MEMSEM_LEASE_PID], pid, __ATOMIC_RELEASE);
        __atomic_store_n(&w[MEMSEM_LEASE_START], start, __ATOMIC_RELEASE);
        __atomic_store_n(&w[MEMSEM_LEASE_VERSION], version, __ATOMIC_RELEASE);
        __atomic_store_n(&w[MEMSEM_LEASE_EXPIRY], expiry, __ATOMIC_RELEASE);
        __atomic_store_n(&w[MEMSEM_LEASE_ID], lease_id, __ATOMIC_RELEASE);  /* the lease exists */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n((const uint64_t *)(uintptr_t)state_addr, __ATOMIC_ACQUIRE) != live) {
            uint64_t held = lease_id;
            if (__atomic_compare_exchange_n(&w[MEMSEM_LEASE_ID], &held, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                ms_futex_wake(ms_low32(&w[MEMSEM_LEASE_ID]), INT32_MAX, 1);  /* the owner retiring it */
            return -2;
        }
        return (int64_t)i;
    }
    return -1;
}

static void lease_free_and_wake(uint64_t *w, uint64_t lease_id) {
    uint64_t held = lease_id;
    if (__atomic_compare_exchange_n(&w[MEMSEM_LEASE_ID], &held, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ms_futex_wake(ms_low32(&w[MEMSEM_LEASE_ID]), INT32_MAX, 1);  /* a writer of the pinned slot */
}

int64_t memsem_pin_latest(uint64_t cb_base, uint64_t generation, uint64_t n_slots, uint64_t slots_addr,
                          uint32_t n_lease, uint64_t mark, uint64_t pid, uint64_t start, uint64_t expiry,
                          uint64_t lease_id, uint64_t live, uint64_t *version, uint64_t *seq) {
    uint64_t *cb = (uint64_t *)(uintptr_t)cb_base;
    *version = 0;
    *seq = 0;
    if (n_slots == 0 || __atomic_load_n(&cb[MEMSEM_CB_GENERATION], __ATOMIC_ACQUIRE) != generation)
        return -3;
    uint64_t v = __atomic_load_n(&cb[MEMSEM_CB_LATEST], __ATOMIC_ACQUIRE);
    *version = v;
    int64_t slot = memsem_lease_claim(slots_addr, n_lease, mark, pid, start, v, expiry, lease_id,
                                      cb_base + 8u * MEMSEM_CB_STATE, live);  /* ends with a seq_cst fence */
    if (slot < 0)
        return slot;
    uint64_t *w = (uint64_t *)(uintptr_t)(slots_addr + 8u * MEMSEM_LEASE_WORDS * (uint64_t)slot);
    if (__atomic_load_n(&cb[MEMSEM_CB_GENERATION], __ATOMIC_ACQUIRE) != generation) {
        lease_free_and_wake(w, lease_id);
        return -3;
    }
    uint64_t intent = __atomic_load_n(&cb[MEMSEM_CB_WRITER], __ATOMIC_ACQUIRE);
    uint64_t s = __atomic_load_n(&cb[MEMSEM_CB_SEQ0 + v % n_slots], __ATOMIC_ACQUIRE);
    *seq = s;
    int overwriting = intent > v && intent % n_slots == v % n_slots;
    if (!overwriting && s == v << 1)
        return slot;
    lease_free_and_wake(w, lease_id);
    return -4;
}

uint64_t memsem_load_acquire(const uint64_t *addr) {
    return __atomic_load_n(addr, __ATOMIC_ACQUIRE);
}

void memsem_store_release(uint64_t *addr, uint64_t value) {
    __atomic_store_n(addr, value, __ATOMIC_RELEASE);
}

uint64_t memsem_fetch_add(uint64_t *addr, uint64_t delta) {
    return __atomic_fetch_add(addr, delta, __ATOMIC_ACQ_REL);
}

uint64_t memsem_fetch_sub(uint64_t *addr, uint64_t delta) {
    return __atomic_fetch_sub(addr, delta, __ATOMIC_ACQ_REL);
}

int memsem_compare_exchange(uint64_t *addr, uint64_t *expected, uint64_t desired) {
    return __atomic_compare_exchange_n(addr, expected, desired, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE) ? 1 : 0;
}

void memsem_fence_seq_cst(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

int memsem_futex_wait(uint32_t *addr, uint32_t expected, double timeout_s) {
    struct timespec ts, *tsp = NULL;
    if (timeout_s >= 0) {
        ts.tv_sec = (time_t)timeout_s;
        ts.tv_nsec = (long)((timeout_s - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec += 1; ts.tv_nsec -= 1000000000L; }
        if (ts.tv_nsec < 0) ts.tv_nsec = 0;
        tsp = &ts;
    }
    /* Shared futex (no FUTEX_PRIVATE_FLAG): the word lives in a segment mapped by many processes. */
    long rc = syscall(SYS_futex, addr, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (rc == 0) return 0;
    if (errno == EAGAIN) return 0;
    return -errno;
}

int memsem_futex_wake(uint32_t *addr, int n) {
    return ms_futex_wake(addr, n, 1);
}

static int64_t vm_transfer(int pid, void *local, uint64_t remote, uint64_t nbytes, int write) {
    uint64_t done = 0;
    while (done < nbytes) {
        struct iovec l = {(char *)local + done, (size_t)(nbytes - done)};
        struct iovec r = {(void *)(uintptr_t)(remote + done), (size_t)(nbytes - done)};
        ssize_t n = write ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                          : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) return -EFAULT; /* no progress: the remote range is not fully mapped */
        done += (uint64_t)n;
    }
    return (int64_t)done;
}

int64_t memsem_vm_read(int pid, void *local, uint64_t remote, uint64_t nbytes) {
    return vm_transfer(pid, local, remote, nbytes, 0);
}

int64_t memsem_vm_write(int pid, const void *local, uint64_t remote, uint64_t nbytes) {
    return vm_transfer(pid, (void *)local, remote, nbytes, 1);
}

void memsem_memcpy(void *dst, const void *src, uint64_t nbytes) {
    memcpy(dst, src, (size_t)nbytes);
}

/* ---- use words -------------------------------------------------------------------------- */
#define USE_CLOSED (1ull << MEMSEM_USE_CLOSED_BIT)
#define USE_COUNT (USE_CLOSED - 1)

int memsem_use_enter(uint64_t *word) {
    /* CAS, never a transient increment of a closed word: a closed word's count only falls, so
     * exactly one caller sees it reach zero. */
    uint64_t v = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    for (;;) {
        if (v & USE_CLOSED) return 1;
        if (__atomic_compare_exchange_n(word, &v, v + 1, 1, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return 0;
    }
}

int memsem_use_leave(uint64_t *word) {
    uint64_t v = __atomic_fetch_sub(word, 1, __ATOMIC_SEQ_CST);
    if (v == (USE_CLOSED | 1)) {
        ms_futex_wake(ms_low32(word), INT32_MAX, 0);
        return 1;
    }
    return 0;
}

int memsem_use_close(uint64_t *word) {
    uint64_t v = __atomic_fetch_or(word, USE_CLOSED, __ATOMIC_SEQ_CST);
    if (v & USE_CLOSED) return 2;
    return (v & USE_COUNT) == 0 ? 1 : 0;
}

int memsem_use_wait_idle(uint64_t *word, double timeout_s) {
    uint64_t deadline = ms_now_ns() + (uint64_t)(timeout_s * 1e9);
    for (;;) {
        uint64_t v = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        if ((v & USE_COUNT) == 0) return 0;
        uint64_t now = ms_now_ns();
        if (now >= deadline) return -ETIMEDOUT;
        ms_futex_wait(ms_low32(word), (uint32_t)v, deadline - now, 0);
    }
}

/* ---- the hot path -------------------------------------------------------------------------- */
int memsem_lat_bucket(uint64_t ns) {
    if (ns < 4) return (int)ns;
    int lg = 63 - __builtin_clzll(ns);              /* floor(log2 ns) >= 2 */
    int b = 4 * (lg - 1) + (int)((ns >> (lg - 2)) & 3);
    return b < MEMSEM_LAT_BUCKETS ? b : MEMSEM_LAT_BUCKETS - 1;
}

uint64_t memsem_lat_bucket_floor(int bucket) {
    if (bucket < 4) return bucket < 0 ? 0 : (uint64_t)bucket;
    int lg = bucket / 4 + 1;
    uint64_t sub = (uint64_t)(bucket % 4);
    return (1ull << lg) | (sub << (lg - 2));
}

static inline int lease_ok(uint64_t slot, uint64_t id, uint64_t now) {
    const uint64_t *w = (const uint64_t *)(uintptr_t)slot;
    uint64_t exp = __atomic_load_n(&w[MEMSEM_LEASE_EXPIRY], __ATOMIC_ACQUIRE);
    return __atomic_load_n(&w[MEMSEM_LEASE_ID], __ATOMIC_ACQUIRE) == id && exp > now;
}

/* When the plan's owner was last checked for liveness (its word, written by the runtime). */
static inline uint64_t checked_at(const memsem_plan *p) {
    return __atomic_load_n((const uint64_t *)(uintptr_t)p->checked_addr, __ATOMIC_RELAXED);
}

static inline uint64_t finish(memsem_plan *p, uint64_t status) {
    if (memsem_use_leave(&p->use)) status |= MEMSEM_RC_LAST_OUT;
    return status;
}

/* Leave the participant's in-flight count. A copy that found the generation moved wakes the
 * owner's retire, which sleeps on the count until it reads 0 (shared futex: the control block
 * is mapped by every participant). */
static inline void inflight_leave(uint64_t *inflight, int moved) {
    if (!inflight) return;
    __atomic_fetch_sub(inflight, 1, __ATOMIC_RELEASE);
    if (moved) ms_futex_wake(ms_low32(inflight), INT32_MAX, 1);
}

/* The seqlock bracket, the one implementation every route uses: open (checks, counted in the
 * participant's in-flight word), the copy (native here, or an engine's between the calls), close
 * (re-checks, telemetry). On failure open undoes what it did and returns the status. */
static uint64_t bracket_open(memsem_bracket *b, memsem_plan *p, int put, uint64_t offset,
                            uint64_t nbytes, uint64_t want_version, uint64_t lease_slot,
                            uint64_t lease_id) {
    b->is_open = 0;
    if (memsem_use_enter(&p->use)) return MEMSEM_RC_CLOSED;
    uint64_t t0 = ms_now_ns();
    if (offset > p->nbytes || nbytes > p->nbytes - offset) return finish(p, MEMSEM_RC_RANGE);
    if (want_version > MEMSEM_VERSION_MAX) return finish(p, MEMSEM_RC_VERSION_RANGE);
    if (put && (!(p->flags & MEMSEM_PLAN_WRITABLE) || (p->flags & MEMSEM_PLAN_NO_PUT)))
        return finish(p, MEMSEM_RC_READONLY);
    if (lease_slot && !lease_ok(lease_slot, lease_id, t0)) return finish(p, MEMSEM_RC_LEASE_BEFORE);
    /* A write must not land in the memory of an owner that may be dead: when its liveness is
     * due for a check, check first (a read is checked after the copy instead). */
    if (put && p->check_every_ns && t0 - checked_at(p) >= p->check_every_ns)
        return finish(p, MEMSEM_RC_CHECK_FIRST);
    uint64_t *inflight = (uint64_t *)(uintptr_t)p->inflight_addr;
    const uint64_t *gen = (const uint64_t *)(uintptr_t)p->gen_addr;
    const uint64_t *seqs = (const uint64_t *)(uintptr_t)p->seq_addr;
    uint64_t status;
    int moved = 0;
    /* Dekker with the owner's retire: count ourselves in, then read the generation (both
     * sequentially consistent); the owner bumps the generation, then reads the counters. */
    if (inflight) __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
    uint64_t g = __atomic_load_n(gen, __ATOMIC_SEQ_CST);
    if (g != p->generation) {
        status = MEMSEM_RC_GEN_BEFORE | (g << MEMSEM_RC_VERSION_SHIFT);
        moved = 1;
        goto fail;
    }
    uint64_t version, slot = 0;
    if (want_version) version = want_version;
    else if (p->nslots > 1)
        version = __atomic_load_n((const uint64_t *)(uintptr_t)p->latest_addr, __ATOMIC_ACQUIRE);
    else version = __atomic_load_n(&seqs[0], __ATOMIC_ACQUIRE) >> 1;
    if (p->nslots > 1) slot = version % p->nslots;
    uint64_t seq = __atomic_load_n(&seqs[slot], __ATOMIC_ACQUIRE);
    /* version <= MEMSEM_VERSION_MAX, so version << 1 never wraps: a slot that was never written
     * (sequence 0) never passes for a version asked for. */
    if (seq != (version << 1)) {
        /* The slot holds a newer version (or one is being written into it): the version asked
         * for is gone; else that version is being written or not committed yet. A read of the
         * latest version just retries. */
        status = ((seq >> 1) > version && want_version) ? MEMSEM_RC_VERSION_GONE : MEMSEM_RC_BUSY;
        status |= ((seq >> 1) << MEMSEM_RC_VERSION_SHIFT);
        goto fail;
    }
    b->plan = p;
    b->put = put;
    b->nbytes = nbytes;
    b->lease_slot = lease_slot;
    b->lease_id = lease_id;
    b->version = version;
    b->seq = seq;
    b->slot = slot;
    b->start_ns = t0;
    b->address = p->base + slot * p->slot_stride + offset;
    b->is_open = 1;
    return MEMSEM_OK;
fail:
    inflight_leave(inflight, moved);
    return finish(p, status);
}

static uint64_t bracket_close(memsem_bracket *b, uint64_t status) {
    memsem_plan *p = b->plan;
    uint64_t *inflight = (uint64_t *)(uintptr_t)p->inflight_addr;
    const uint64_t *seqs = (const uint64_t *)(uintptr_t)p->seq_addr;
    b->is_open = 0;
    /* seqlock: nothing of the copy may be ordered after these checks. Also after a failed
     * copy: a moved generation explains most failures (the memory went away). */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t g = __atomic_load_n((const uint64_t *)(uintptr_t)p->gen_addr, __ATOMIC_ACQUIRE);
    int moved = g != p->generation;
    if (moved)
        status = MEMSEM_RC_GEN_AFTER | (g << MEMSEM_RC_VERSION_SHIFT);
    else if (status == MEMSEM_OK && __atomic_load_n(&seqs[b->slot], __ATOMIC_ACQUIRE) != b->seq)
        status = MEMSEM_RC_TORN;
    inflight_leave(inflight, moved);
    if (status != MEMSEM_OK) return finish(p, status);
    uint64_t t1 = ms_now_ns();
    if (b->lease_slot && !lease_ok(b->lease_slot, b->lease_id, t1)) return finish(p, MEMSEM_RC_LEASE_DURING);
    int k = b->put ? 1 : 0;
    __atomic_fetch_add(&p->ops[k], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&p->bytes[k], b->nbytes, __ATOMIC_RELAXED);
    __atomic_fetch_add(&p->lat[k][memsem_lat_bucket(t1 - b->start_ns)], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&p->lat_sum[k], t1 - b->start_ns, __ATOMIC_RELAXED);
    status = b->version << MEMSEM_RC_VERSION_SHIFT;
    if ((p->check_every_ns && t1 - checked_at(p) >= p->check_every_ns) ||
        (p->check_bytes && b->nbytes >= p->check_bytes))
        status |= MEMSEM_RC_CHECK_PEER;
    return finish(p, status);
}

uint64_t memsem_plan_copy(memsem_plan *p, int put, uint64_t offset, uint64_t local,
                         uint64_t nbytes, uint64_t want_version, uint64_t lease_slot,
                         uint64_t lease_id) {
    memsem_bracket b;
    /* A plan of an engine route has no mapping to copy through (base 0): refuse, never touch it. */
    if (!p->base) return MEMSEM_RC_ERRNO | ((uint64_t)EFAULT << MEMSEM_RC_VERSION_SHIFT);
    uint64_t rc = bracket_open(&b, p, put, offset, nbytes, want_version, lease_slot, lease_id);
    if (rc != MEMSEM_OK) return rc;
    uint64_t status = MEMSEM_OK;
    switch (p->method) {
    case MEMSEM_COPY_MEMCPY:
        if (put) memcpy((void *)(uintptr_t)b.address, (const void *)(uintptr_t)local, (size_t)nbytes);
        else memcpy((void *)(uintptr_t)local, (const void *)(uintptr_t)b.address, (size_t)nbytes);
        break;
    case MEMSEM_COPY_VM: {
        int64_t n = vm_transfer(p->pid, (void *)(uintptr_t)local, b.address, nbytes, put);
        if (n < 0) status = MEMSEM_RC_ERRNO | ((uint64_t)(-n) << MEMSEM_RC_VERSION_SHIFT);
        break;
    }
    default:
        status = MEMSEM_RC_ERRNO | ((uint64_t)EINVAL << MEMSEM_RC_VERSION_SHIFT);
    }
    return bracket_close(&b, status);
}

uint64_t memsem_bracket_open(memsem_bracket *b, memsem_plan *p, int put, uint64_t offset,
                            uint64_t nbytes, uint64_t want_version, uint64_t lease_slot,
                            uint64_t lease_id) {
    return bracket_open(b, p, put, offset, nbytes, want_version, lease_slot, lease_id);
}

uint64_t memsem_bracket_close(memsem_bracket *b, int failed) {
    if (!b->is_open) return MEMSEM_RC_ERRNO | ((uint64_t)EBADF << MEMSEM_RC_VERSION_SHIFT);
    return bracket_close(b, failed ? MEMSEM_RC_ERRNO | ((uint64_t)EIO << MEMSEM_RC_VERSION_SHIFT) : MEMSEM_OK);
}

/* ---- scans ------------------------------------------------------------------------------ */
int memsem_scan_inflight(uint64_t slots, uint32_t n, uint64_t *out, uint32_t max) {
    const uint64_t *w = (const uint64_t *)(uintptr_t)slots;
    uint32_t found = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (uint32_t i = 0; i < n && found < max; i++) {
        const uint64_t *s = &w[MEMSEM_INFLIGHT_WORDS * i];
        uint64_t ident = __atomic_load_n(&s[MEMSEM_INFLIGHT_IDENT], __ATOMIC_ACQUIRE);
        if (!ident) continue;
        uint64_t count = __atomic_load_n(&s[MEMSEM_INFLIGHT_COUNT], __ATOMIC_ACQUIRE);
        if (!count) continue;
        out[2 * found] = ident;
        out[2 * found + 1] = count;
        found++;
    }
    return (int)found;
}

int memsem_scan_leases(uint64_t slots, uint32_t n, uint64_t now_ns, uint64_t *out, uint32_t max) {
    const uint64_t *w = (const uint64_t *)(uintptr_t)slots;
    uint32_t found = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (uint32_t i = 0; i < n && found < max; i++) {
        const uint64_t *s = &w[MEMSEM_LEASE_WORDS * i];
        /* 0: free; even: being claimed (its other words may be the previous holder's) */
        if (!(__atomic_load_n(&s[MEMSEM_LEASE_ID], __ATOMIC_ACQUIRE) & 1)) continue;
        uint64_t exp = __atomic_load_n(&s[MEMSEM_LEASE_EXPIRY], __ATOMIC_ACQUIRE);
        if (exp <= now_ns) continue;
        uint64_t *o = &out[5 * found];
        o[0] = i;
        o[1] = __atomic_load_n(&s[MEMSEM_LEASE_PID], __ATOMIC_ACQUIRE);
        o[2] = __atomic_load_n(&s[MEMSEM_LEASE_START], __ATOMIC_ACQUIRE);
        o[3] = exp;
        o[4] = __atomic_load_n(&s[MEMSEM_LEASE_VERSION], __ATOMIC_ACQUIRE);
        found++;
    }
    return (int)found;
}

/* ---- mappings --------------------------------------------------------------------------- */
int64_t memsem_map(int fd, uint64_t nbytes, int writable) {
    void *a = mmap(NULL, (size_t)nbytes, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    if (a == MAP_FAILED) return -errno;
    return (int64_t)(uintptr_t)a;
}

int memsem_unmap(uint64_t addr, uint64_t nbytes) {
    return munmap((void *)(uintptr_t)addr, (size_t)nbytes) == 0 ? 0 : -errno;
}

int memsem_protect(uint64_t addr, uint64_t nbytes, int writable) {
    return mprotect((void *)(uintptr_t)addr, (size_t)nbytes,
                    PROT_READ | (writable ? PROT_WRITE : 0)) == 0 ? 0 : -errno;
}

uint64_t memsem_monotonic_ns(void) { return ms_now_ns(); }
