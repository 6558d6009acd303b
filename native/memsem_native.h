/* memsem native layer: atomics, futex wait/wake, cross-memory attach, guarded copies.
 *
 * This header is the single source of the declarations: native/build_native.py feeds it to
 * cffi's cdef (preprocessor lines are stripped there) and native/memsem_native.c includes it.
 * All sizes are in bytes. Functions return 0 or a positive count on success and -errno on
 * failure; the Python layer turns negative values into memsem.EngineError.
 */
#ifndef MEMSEM_NATIVE_H
#define MEMSEM_NATIVE_H
#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

/* 64-bit atomics on an 8-byte aligned address (usually inside a shared segment). */
uint64_t memsem_load_acquire(const uint64_t *addr);
void memsem_store_release(uint64_t *addr, uint64_t value);
uint64_t memsem_fetch_add(uint64_t *addr, uint64_t delta);
uint64_t memsem_fetch_sub(uint64_t *addr, uint64_t delta);
/* Returns 1 and stores desired if *addr == *expected; else returns 0 and writes the
 * current value to *expected. */
int memsem_compare_exchange(uint64_t *addr, uint64_t *expected, uint64_t desired);
void memsem_fence_seq_cst(void);

/* Futex on a 32-bit word in a (possibly shared) mapping. timeout_s < 0 means no timeout
 * (the Python layer never passes that). Returns 0 when woken or the word already differs
 * from expected (-EAGAIN is folded into 0), -ETIMEDOUT on timeout, -EINTR on a signal. */
int memsem_futex_wait(uint32_t *addr, uint32_t expected, double timeout_s);
/* Wakes up to n waiters; returns the number woken or -errno. */
int memsem_futex_wake(uint32_t *addr, int n);

/* Cross-memory attach. Returns bytes moved (always nbytes on success) or -errno.
 * A short transfer is reported as -EFAULT, never as success. */
int64_t memsem_vm_read(int pid, void *local, uint64_t remote, uint64_t nbytes);
int64_t memsem_vm_write(int pid, const void *local, uint64_t remote, uint64_t nbytes);

/* Plain copy that releases the GIL (cffi drops it around every call). */
void memsem_memcpy(void *dst, const void *src, uint64_t nbytes);

/* Guarded copy, one call for the hot path: checks that the 64-bit word at guard_addr equals
 * expected, counts itself in the word at inflight_addr (0: none), copies nbytes (method 0:
 * memcpy from src to dst, both mapped here; method 1: process_vm_readv from src in pid into dst;
 * method 2: process_vm_writev from src into dst in pid), drops the in-flight count and checks
 * the guard again. Addresses are passed as integers so the Python side needs no casts.
 * Returns 0 on success, MEMSEM_GUARD_BEFORE when the guard differed before any byte moved,
 * MEMSEM_GUARD_AFTER when it changed during the copy (the bytes are not valid), or -errno. */
#define MEMSEM_GUARD_BEFORE 1
#define MEMSEM_GUARD_AFTER 2
#define MEMSEM_COPY_MEMCPY 0
#define MEMSEM_COPY_VM_READ 1
#define MEMSEM_COPY_VM_WRITE 2
int memsem_guarded_copy(uint64_t guard_addr, uint64_t expected, uint64_t inflight_addr,
                        int method, int pid, uint64_t dst, uint64_t src, uint64_t nbytes);

/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC: one clock for all processes of a node). */
uint64_t memsem_monotonic_ns(void);

/* ---- async word waiter (native/memsem_wait.c) ------------------------------------------------
 * Waits on many shared 32/64-bit words at once, for memsem.runtime._async.AsyncWordWaiter:
 * one background thread blocks here (the GIL is released) until a word leaves its expected
 * value, the waiter's own wake word moves (a waiter was added or removed), or a deadline.
 *
 * Mode MEMSEM_WAIT_WAITV uses Linux futex_waitv (syscall 449, kernel >= 5.16) on all words at
 * once: a 64-bit word is two 32-bit futex entries (both halves), so a change in either half
 * before the thread sleeps is seen by the kernel's own compare; writers wake the word's address.
 * At most MEMSEM_WAITV_MAX entries per call. Mode MEMSEM_WAIT_SLICES (kernels without
 * futex_waitv, or seccomp filters refusing it) waits on one word at a time for at most
 * MEMSEM_WAIT_SLICE_US microseconds and re-checks every word after each slice: a change is seen
 * within one slice. Shared futexes (no private flag): words live in segments many processes map.
 * Every address must stay mapped until the call returns (the Python side holds the mappings). */
#define MEMSEM_WAIT_WAITV 1
#define MEMSEM_WAIT_SLICES 2
#define MEMSEM_WAITV_MAX 128
#define MEMSEM_WAIT_SLICE_US 2000

struct memsem_wait_word {
    uint64_t addr;      /* word address: 4-byte aligned (size 4) or 8-byte aligned (size 8) */
    uint64_t expected;  /* the value being waited away from */
    uint64_t seen;      /* out: the value read last */
    uint32_t size;      /* 4 or 8 (bytes) */
    uint32_t changed;   /* out: 1 when seen != expected */
};

/* 1 when futex_waitv works here; else -errno of the probe (-ENOSYS: kernel too old, -EPERM:
 * refused by a seccomp filter). */
int memsem_wait_probe(void);
/* Block until a word differs from its expected value or the absolute CLOCK_MONOTONIC time
 * deadline_ns passes. Fills seen/changed of every word. Returns the number of changed words
 * (> 0), -ETIMEDOUT at the deadline with none changed, -E2BIG when waitv mode needs more than
 * MEMSEM_WAITV_MAX entries, -EINVAL for a bad size, alignment or mode, or another -errno. */
int memsem_wait_any(struct memsem_wait_word *words, int n, uint64_t deadline_ns, int mode);
/* Atomically increment the 32-bit word and wake every waiter on it (the waiter's wake word). */
void memsem_wait_bump(uint32_t *word);
/* ---- end of async word waiter ---------------------------------------------------------------- */

#endif
