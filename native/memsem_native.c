/* memsem native layer; see memsem_native.h for the contract of every function. */
#define _GNU_SOURCE
#include "memsem_native.h"

#include <errno.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

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
    long rc = syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
    return rc < 0 ? -errno : (int)rc;
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

int memsem_guarded_copy(uint64_t guard_addr, uint64_t expected, uint64_t inflight_addr,
                        int method, int pid, uint64_t dst, uint64_t src, uint64_t nbytes) {
    const uint64_t *guard = (const uint64_t *)(uintptr_t)guard_addr;
    uint64_t *inflight = (uint64_t *)(uintptr_t)inflight_addr;
    int rc = 0;
    if (inflight) __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(guard, __ATOMIC_SEQ_CST) != expected) {
        rc = MEMSEM_GUARD_BEFORE;
        goto out;
    }
    switch (method) {
    case MEMSEM_COPY_MEMCPY:
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)nbytes);
        break;
    case MEMSEM_COPY_VM_READ: {
        int64_t n = vm_transfer(pid, (void *)(uintptr_t)dst, src, nbytes, 0);
        if (n < 0) { rc = (int)n; goto out; }
        break;
    }
    case MEMSEM_COPY_VM_WRITE: {
        int64_t n = vm_transfer(pid, (void *)(uintptr_t)src, dst, nbytes, 1);
        if (n < 0) { rc = (int)n; goto out; }
        break;
    }
    default:
        rc = -EINVAL;
        goto out;
    }
    if (__atomic_load_n(guard, __ATOMIC_ACQUIRE) != expected) rc = MEMSEM_GUARD_AFTER;
out:
    if (inflight) __atomic_fetch_sub(inflight, 1, __ATOMIC_RELEASE);
    return rc;
}

uint64_t memsem_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
