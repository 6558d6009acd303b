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

#endif
