/* memsem shmem host emulator: a TEST DOUBLE of Ascend SHMEM's host API (libshmem.so).
 *
 * It exports the subset of the aclshmem* symbols that memsem uses, with the same C ABI
 * (see aclshmem_emu.h), so that memsem's MTE engine code can be exercised on machines
 * without an NPU. Nothing here runs on a device: "PEs" are processes on one host, the
 * symmetric heap is POSIX shared memory and every transfer is a host memcpy.
 *
 * Model
 *   - aclshmemx_get_uniqueid draws 64 random bits; the rendezvous segment of a job is
 *     /memsem_shmemu_<16 hex>_ctl and PE k's heap is /memsem_shmemu_<16 hex>_pe<k>.
 *     Segments are created mode 0600.
 *   - aclshmemx_init_attr: every PE maps the control segment, creates and sizes its own heap
 *     (local_mem_size bytes), waits (shm_init_timeout seconds) until all n_pes heaps exist,
 *     maps all of them at the same offsets, and meets the others in a barrier. After that
 *     barrier every name is unlinked (each heap by its creator, the control segment by PE 0):
 *     the mappings stay valid and the kernel frees the memory when the last PE unmaps.
 *     aclshmem_finalize unlinks again (no-op when already gone) and unmaps.
 *   - Crash behaviour: a PE that dies after init leaks nothing (names are already unlinked).
 *     A PE that dies during init, before the init barrier, leaves its named segments (and
 *     the control segment when the survivors also time out before PE 0 unlinks it) in
 *     /dev/shm until removed by hand (rm /dev/shm/memsem_shmemu_*); survivors see
 *     ACLSHMEM_TIMEOUT_ERROR from init and unlink the segments they created themselves.
 *     Waits (barrier, signal wait) poll peer liveness every 50 ms: a dead peer fails a
 *     barrier at once, and fails a signal wait (the value may never come).
 *   - Allocator: deterministic first-fit over the heap, per process. The same sequence of
 *     aclshmem_malloc/calloc/align/free on every PE yields the same offsets. Each call is
 *     collective (barrier, as the real library), and the emulator also checks that all PEs
 *     asked for the same thing (the real library only does so in debug builds).
 *   - Completion: blocking calls copy at once. nbi and *_on_stream calls copy at once too,
 *     unless MEMSEM_SHMEM_EMU_DEFER_NBI=1: then they are queued per stream (NULL = the
 *     default stream) and run at aclshmemx_quiet_on_stream(stream); barrier_all and
 *     signal_wait_until first drain the default stream (the real ones synchronize it).
 *   - Signals are 32-bit words (int32_t, as in the real API), written after the data with
 *     release semantics (store for SET, fetch-add for ADD) and woken with a shared futex.
 *   - Errors: int-returning calls return the real library's codes. Data-plane calls return
 *     void in the real API and only log; here they log too (stderr, unless
 *     MEMSEM_SHMEM_EMU_LOG=0) and record the code for aclshmemx_emu_last_error.
 *
 * Emulator-only extensions (not in libshmem.so): aclshmemx_emu_last_error,
 * aclshmemx_emu_set_wait_timeout_ms, aclshmemx_emu_pending_ops, and the environment
 * variables MEMSEM_SHMEM_EMU_WAIT_TIMEOUT_MS, MEMSEM_SHMEM_EMU_DEFER_NBI, MEMSEM_SHMEM_EMU_LOG.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>
#include <pthread.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#include "aclshmem_emu.h"

#define EXPORT __attribute__((visibility("default")))

_Static_assert(sizeof(aclshmem_init_optional_attr_t) == 24, "optional attr layout");
_Static_assert(offsetof(aclshmemx_init_attr_t, local_mem_size) == 72, "attr layout");
_Static_assert(offsetof(aclshmemx_init_attr_t, option_attr) == 80, "attr layout");
_Static_assert(offsetof(aclshmemx_init_attr_t, comm_args) == 104, "attr layout");
_Static_assert(offsetof(aclshmemx_init_attr_t, instance_id) == 112, "attr layout");
_Static_assert(sizeof(aclshmemx_init_attr_t) == 120, "attr layout");
_Static_assert(sizeof(aclshmemx_uniqueid_t) == 136, "uniqueid layout");

#define EMU_NAME "memsem shmem host emulator (test double)"
#define EMU_MAX_PES 64
#define EMU_MAGIC 0x4d53454du            /* stored in the control segment */
#define EMU_UID_TAG "memsem-shmem-emu"   /* first bytes of uid.internal */
#define EMU_DEFAULT_ALIGN 512
#define EMU_POLL_NS 50000000LL           /* liveness poll period while waiting */
#define EMU_MAX_LOCAL_SIZE (40ULL * 1024 * 1024 * 1024)

/* ------------------------------------------------------------------ errors and logging */

static __thread int t_last_code;
static __thread char t_last_msg[256];

static int emu_log_enabled(void)
{
    const char *v = getenv("MEMSEM_SHMEM_EMU_LOG");
    return !(v && v[0] == '0');
}

__attribute__((format(printf, 3, 4)))
static int emu_fail(const char *func, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(t_last_msg, sizeof t_last_msg, "%s: ", func);
    if (n < 0 || (size_t)n >= sizeof t_last_msg)
        n = 0;
    vsnprintf(t_last_msg + n, sizeof t_last_msg - (size_t)n, fmt, ap);
    va_end(ap);
    t_last_code = code;
    if (emu_log_enabled())
        fprintf(stderr, "[" EMU_NAME "] ERROR %s (code %d)\n", t_last_msg, code);
    return code;
}

/* ------------------------------------------------------------------ shared control block */

typedef struct {
    uint32_t op;       /* 1 malloc, 2 calloc, 3 align, 4 free */
    uint32_t pad;
    uint64_t a, b;     /* op arguments (size/alignment, or the freed offset) */
    uint64_t seq;
} emu_req_t;

typedef struct {
    uint32_t magic;
    int32_t n_pes;                 /* first PE to arrive sets it; the others must match */
    uint64_t local_mem_size;
    uint32_t joined;               /* PEs that mapped the control segment */
    uint32_t broken;               /* a barrier failed: every later barrier fails at once */
    uint32_t bar_count;
    uint32_t bar_gen;              /* futex word */
    int32_t pid[EMU_MAX_PES];      /* 0: not joined yet or departed (finalized) */
    uint32_t heap_ready[EMU_MAX_PES];
    emu_req_t req[EMU_MAX_PES];
} emu_ctl_t;

typedef struct {
    uint64_t off, size;
    int used;
} emu_block_t;

typedef struct emu_op {
    struct emu_op *next;
    aclrtStream stream;
    int kind;                      /* 0 copy, 1 copy then signal */
    void *dst;
    const void *src;
    size_t n;
    int32_t *sig;
    int32_t sig_val;
    int sig_op;
} emu_op_t;

static struct {
    int inited;
    int my_pe, n_pes;
    uint64_t id;
    size_t heap_size;
    uint32_t init_timeout_s, ctl_timeout_s;
    int engine_type;
    emu_ctl_t *ctl;
    char *heap[EMU_MAX_PES];       /* heap[my_pe] is the local one */
    emu_block_t *blocks;
    size_t n_blocks, cap_blocks;
    uint64_t alloc_seq;
} g = {.inited = 0, .my_pe = -1, .n_pes = -1};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t q_lock = PTHREAD_MUTEX_INITIALIZER;
static emu_op_t *q_head, *q_tail;
static int q_len;
static int64_t g_wait_timeout_ms = -1;   /* -1: not set yet, read the environment */

/* ------------------------------------------------------------------ time, futex, liveness */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void futex_wait_ns(uint32_t *addr, uint32_t expected, int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    /* Shared futex (no FUTEX_PRIVATE_FLAG): the word lives in a MAP_SHARED segment that is
     * mapped at different addresses in different processes. */
    syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake_all(uint32_t *addr)
{
    syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* A process that exited but was not reaped yet (a zombie) counts as dead. */
static int pid_dead(int pid)
{
    if (kill(pid, 0) != 0)
        return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    const char *rp = strrchr(buf, ')');   /* "pid (comm) S ..." */
    return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

/* Returns the first PE (other than me) whose registered process is gone, else -1. */
static int dead_peer(void)
{
    for (int pe = 0; pe < g.n_pes; pe++) {
        if (pe == g.my_pe)
            continue;
        int pid = __atomic_load_n(&g.ctl->pid[pe], __ATOMIC_ACQUIRE);
        if (pid > 0 && pid_dead(pid))
            return pe;
    }
    return -1;
}

static int departed_peer(void)
{
    for (int pe = 0; pe < g.n_pes; pe++)
        if (pe != g.my_pe && __atomic_load_n(&g.ctl->pid[pe], __ATOMIC_ACQUIRE) == 0)
            return pe;
    return -1;
}

/* ------------------------------------------------------------------ barrier */

static int emu_barrier(const char *func, uint32_t timeout_s)
{
    emu_ctl_t *c = g.ctl;
    if (__atomic_load_n(&c->broken, __ATOMIC_ACQUIRE))
        return emu_fail(func, ACLSHMEM_INNER_ERROR,
                        "an earlier barrier failed (timeout or lost peer); the team is unusable");
    uint32_t gen = __atomic_load_n(&c->bar_gen, __ATOMIC_ACQUIRE);
    uint32_t arrived = __atomic_add_fetch(&c->bar_count, 1, __ATOMIC_ACQ_REL);
    if (arrived == (uint32_t)g.n_pes) {
        __atomic_store_n(&c->bar_count, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&c->bar_gen, 1, __ATOMIC_ACQ_REL);
        futex_wake_all(&c->bar_gen);
        return ACLSHMEM_SUCCESS;
    }
    int64_t deadline = now_ns() + (int64_t)timeout_s * 1000000000LL;
    for (;;) {
        if (__atomic_load_n(&c->bar_gen, __ATOMIC_ACQUIRE) != gen)
            return ACLSHMEM_SUCCESS;
        if (__atomic_load_n(&c->broken, __ATOMIC_ACQUIRE)) {
            if (__atomic_load_n(&c->bar_gen, __ATOMIC_ACQUIRE) != gen)
                return ACLSHMEM_SUCCESS;
            return emu_fail(func, ACLSHMEM_INNER_ERROR,
                            "barrier broken by another PE (timeout or lost peer)");
        }
        int pe = dead_peer();
        if (pe < 0)
            pe = departed_peer();
        /* The last arriver bumps bar_gen before it can depart or exit: look again. */
        if (pe >= 0 && __atomic_load_n(&c->bar_gen, __ATOMIC_ACQUIRE) != gen)
            return ACLSHMEM_SUCCESS;
        if (pe >= 0) {
            __atomic_store_n(&c->broken, 1, __ATOMIC_RELEASE);
            futex_wake_all(&c->bar_gen);
            return emu_fail(func, ACLSHMEM_BOOTSTRAP_ERROR,
                            "PE %d is gone (process exited or finalized) while PE %d waits in a barrier",
                            pe, g.my_pe);
        }
        int64_t left = deadline - now_ns();
        if (left <= 0) {
            __atomic_store_n(&c->broken, 1, __ATOMIC_RELEASE);
            futex_wake_all(&c->bar_gen);
            return emu_fail(func, ACLSHMEM_TIMEOUT_ERROR,
                            "barrier timed out after %u s on PE %d (%u of %d PEs arrived)",
                            timeout_s, g.my_pe, __atomic_load_n(&c->bar_count, __ATOMIC_RELAXED),
                            g.n_pes);
        }
        futex_wait_ns(&c->bar_gen, gen, left < EMU_POLL_NS ? left : EMU_POLL_NS);
    }
}

/* ------------------------------------------------------------------ segments */

static void seg_name(char *buf, size_t len, uint64_t id, int pe)
{
    if (pe < 0)
        snprintf(buf, len, "/memsem_shmemu_%016llx_ctl", (unsigned long long)id);
    else
        snprintf(buf, len, "/memsem_shmemu_%016llx_pe%d", (unsigned long long)id, pe);
}

static void *map_segment(const char *name, size_t size, int create, int *err)
{
    int fd = shm_open(name, O_RDWR | (create ? O_CREAT : 0), 0600);
    if (fd < 0) {
        *err = errno;
        return NULL;
    }
    if (create) {
        struct stat st;
        if (fstat(fd, &st) != 0 || ((size_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0)) {
            *err = errno;
            close(fd);
            return NULL;
        }
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    *err = errno;
    close(fd);
    return p == MAP_FAILED ? NULL : p;
}

static void unmap_all(int unlink_own)
{
    char name[96];
    for (int pe = 0; pe < g.n_pes && pe < EMU_MAX_PES; pe++) {
        if (g.heap[pe]) {
            munmap(g.heap[pe], g.heap_size);
            g.heap[pe] = NULL;
        }
    }
    if (unlink_own) {
        seg_name(name, sizeof name, g.id, g.my_pe);
        shm_unlink(name);
        if (g.my_pe == 0) {
            seg_name(name, sizeof name, g.id, -1);
            shm_unlink(name);
        }
    }
    if (g.ctl) {
        munmap(g.ctl, sizeof(emu_ctl_t));
        g.ctl = NULL;
    }
}

/* ------------------------------------------------------------------ init */

EXPORT int aclshmemx_init_status(void)
{
    return g.inited ? ACLSHMEM_STATUS_IS_INITIALIZED : ACLSHMEM_STATUS_NOT_INITIALIZED;
}

EXPORT int aclshmem_my_pe(void) { return g.inited ? g.my_pe : -1; }
EXPORT int aclshmem_n_pes(void) { return g.inited ? g.n_pes : -1; }

EXPORT void aclshmem_info_get_version(int *major, int *minor)
{
    if (!major || !minor) {
        emu_fail(__func__, ACLSHMEM_INVALID_PARAM, "NULL argument");
        return;
    }
    *major = 1;   /* ACLSHMEM_MAJOR_VERSION / ACLSHMEM_MINOR_VERSION of the mirrored headers */
    *minor = 1;
}

EXPORT void aclshmem_info_get_name(char *name)
{
    if (!name) {
        emu_fail(__func__, ACLSHMEM_INVALID_PARAM, "NULL argument");
        return;
    }
    snprintf(name, 256, "%s", EMU_NAME);
}

EXPORT int aclshmemx_get_uniqueid(aclshmemx_uniqueid_t *uid)
{
    if (!uid)
        return emu_fail(__func__, ACLSHMEM_INVALID_PARAM, "uid is NULL");
    uint64_t id = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, &id, sizeof id) != (ssize_t)sizeof id) {
        if (fd >= 0)
            close(fd);
        return emu_fail(__func__, ACLSHMEM_INNER_ERROR, "cannot read /dev/urandom: %s", strerror(errno));
    }
    close(fd);
    memset(uid, 0, sizeof *uid);
    uid->version = (1 << 16) + (int32_t)sizeof(aclshmemx_uniqueid_t);
    memcpy(uid->internal, EMU_UID_TAG, sizeof EMU_UID_TAG);   /* includes the NUL */
    memcpy(uid->internal + 24, &id, sizeof id);
    int32_t pid = (int32_t)getpid();
    memcpy(uid->internal + 32, &pid, sizeof pid);
    return ACLSHMEM_SUCCESS;
}

EXPORT int aclshmemx_set_attr_uniqueid_args(int my_pe, int n_pes, int64_t local_mem_size,
                                            aclshmemx_uniqueid_t *uid, aclshmemx_init_attr_t *attr)
{
    /* Same fields as the real call: comm_args, my_pe, n_pes, local_mem_size. It does NOT
     * fill option_attr (a C++ default initializer does that in the real header). */
    if (!attr)
        return emu_fail(__func__, ACLSHMEM_INVALID_PARAM, "attr is NULL");
    if (local_mem_size > (int64_t)EMU_MAX_LOCAL_SIZE || n_pes > 16384 || my_pe >= 16384)
        return emu_fail(__func__, ACLSHMEM_INVALID_VALUE, "value out of range");
    attr->comm_args = uid;
    attr->my_pe = my_pe;
    attr->n_pes = n_pes;
    attr->local_mem_size = (uint64_t)local_mem_size;
    return ACLSHMEM_SUCCESS;
}

static int check_attr(const aclshmemx_init_attr_t *a)
{
    const char *f = "aclshmemx_init_attr";
    if (a->my_pe < 0)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "my_pe is less than zero");
    if (a->n_pes <= 0)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "n_pes is less than or equal to zero");
    if (a->n_pes > EMU_MAX_PES)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "n_pes %d exceeds the emulator's limit of %d",
                        a->n_pes, EMU_MAX_PES);
    if (a->my_pe >= a->n_pes)
        return emu_fail(f, ACLSHMEM_INVALID_PARAM, "my_pe is greater than or equal to n_pes");
    if (a->local_mem_size == 0 || a->local_mem_size > EMU_MAX_LOCAL_SIZE)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "local_mem_size %llu out of (0, 40 GiB]",
                        (unsigned long long)a->local_mem_size);
    if (a->option_attr.shm_init_timeout == 0)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "shm_init_timeout is zero (fill option_attr)");
    if (a->option_attr.control_operation_timeout == 0)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "control_operation_timeout is zero (fill option_attr)");
    uint32_t t = (uint32_t)a->option_attr.data_op_engine_type;
    if (t == 0 || (t & ~0xfu) != 0)
        return emu_fail(f, ACLSHMEM_INVALID_VALUE, "data_op_engine_type %d is invalid",
                        a->option_attr.data_op_engine_type);
    return ACLSHMEM_SUCCESS;
}

static int init_locked(unsigned int flags, aclshmemx_init_attr_t *a)
{
    const char *f = "aclshmemx_init_attr";
    if (!a)
        return emu_fail(f, ACLSHMEM_INVALID_PARAM, "attributes is NULL");
    if (g.inited)
        return emu_fail(f, ACLSHMEM_INNER_ERROR,
                        "SHMEM has been initialized, do not call init interface repeatedly");
    int rc = check_attr(a);
    if (rc)
        return rc;
    if (a->instance_id != 0)
        return emu_fail(f, ACLSHMEM_NOT_SUPPORTED, "multi-instance mode is not emulated");
    if (flags & ACLSHMEMX_INIT_WITH_MPI)
        return emu_fail(f, ACLSHMEM_NOT_SUPPORTED, "MPI bootstrap is not emulated");
    if (!(flags & (ACLSHMEMX_INIT_WITH_UNIQUEID | ACLSHMEMX_INIT_WITH_DEFAULT)))
        return emu_fail(f, ACLSHMEM_INVALID_PARAM, "bootstrap_flags 0x%x not recognised", flags);
    const aclshmemx_uniqueid_t *uid = (const aclshmemx_uniqueid_t *)a->comm_args;
    if (!uid)
        return emu_fail(f, ACLSHMEM_NOT_SUPPORTED,
                        "only unique-id bootstrap is emulated (comm_args is NULL; ip_port mode unsupported)");
    if (memcmp(uid->internal, EMU_UID_TAG, sizeof EMU_UID_TAG) != 0)
        return emu_fail(f, ACLSHMEM_INVALID_PARAM,
                        "comm_args is not a unique id from this emulator's aclshmemx_get_uniqueid");

    memset(g.heap, 0, sizeof g.heap);
    memcpy(&g.id, uid->internal + 24, sizeof g.id);
    g.my_pe = a->my_pe;
    g.n_pes = a->n_pes;
    g.heap_size = (size_t)a->local_mem_size;
    g.init_timeout_s = a->option_attr.shm_init_timeout;
    g.ctl_timeout_s = a->option_attr.control_operation_timeout;
    g.engine_type = a->option_attr.data_op_engine_type;

    char name[96];
    int err = 0;
    seg_name(name, sizeof name, g.id, -1);
    g.ctl = map_segment(name, sizeof(emu_ctl_t), 1, &err);
    if (!g.ctl)
        return emu_fail(f, ACLSHMEM_SMEM_ERROR, "cannot map %s: %s", name, strerror(err));
    emu_ctl_t *c = g.ctl;
    uint32_t zero = 0;
    __atomic_compare_exchange_n(&c->magic, &zero, EMU_MAGIC, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    int32_t np0 = 0;
    if (!__atomic_compare_exchange_n(&c->n_pes, &np0, g.n_pes, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
        && np0 != g.n_pes) {
        rc = emu_fail(f, ACLSHMEM_INVALID_PARAM, "n_pes %d differs from %d given by another PE",
                      g.n_pes, np0);
        goto fail;
    }
    uint64_t sz0 = 0;
    if (!__atomic_compare_exchange_n(&c->local_mem_size, &sz0, (uint64_t)g.heap_size, 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
        && sz0 != g.heap_size) {
        rc = emu_fail(f, ACLSHMEM_INVALID_PARAM,
                      "local_mem_size %zu differs from %llu given by another PE (the heap is symmetric)",
                      g.heap_size, (unsigned long long)sz0);
        goto fail;
    }
    int32_t pid0 = 0;
    if (!__atomic_compare_exchange_n(&c->pid[g.my_pe], &pid0, (int32_t)getpid(), 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        rc = emu_fail(f, ACLSHMEM_INVALID_PARAM, "my_pe %d was already taken by pid %d",
                      g.my_pe, pid0);
        goto fail;
    }
    __atomic_add_fetch(&c->joined, 1, __ATOMIC_ACQ_REL);

    /* Own heap: created exclusively, sized, then announced. */
    seg_name(name, sizeof name, g.id, g.my_pe);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        rc = emu_fail(f, ACLSHMEM_SMEM_ERROR, "cannot create %s: %s", name, strerror(errno));
        __atomic_store_n(&c->pid[g.my_pe], 0, __ATOMIC_RELEASE);
        goto fail;
    }
    if (ftruncate(fd, (off_t)g.heap_size) != 0) {
        err = errno;
        close(fd);
        shm_unlink(name);
        rc = emu_fail(f, ACLSHMEM_SMEM_ERROR, "cannot size %s to %zu bytes: %s", name,
                      g.heap_size, strerror(err));
        __atomic_store_n(&c->pid[g.my_pe], 0, __ATOMIC_RELEASE);
        goto fail;
    }
    void *own = mmap(NULL, g.heap_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = errno;
    close(fd);
    if (own == MAP_FAILED) {
        shm_unlink(name);
        rc = emu_fail(f, ACLSHMEM_SMEM_ERROR, "cannot map %s: %s", name, strerror(err));
        __atomic_store_n(&c->pid[g.my_pe], 0, __ATOMIC_RELEASE);
        goto fail;
    }
    g.heap[g.my_pe] = own;
    __atomic_store_n(&c->heap_ready[g.my_pe], 1, __ATOMIC_RELEASE);

    /* Map every peer's heap once it exists. */
    int64_t deadline = now_ns() + (int64_t)g.init_timeout_s * 1000000000LL;
    for (int pe = 0; pe < g.n_pes; pe++) {
        if (pe == g.my_pe)
            continue;
        while (!__atomic_load_n(&c->heap_ready[pe], __ATOMIC_ACQUIRE)) {
            if (now_ns() > deadline) {
                rc = emu_fail(f, ACLSHMEM_TIMEOUT_ERROR,
                              "PE %d did not join within shm_init_timeout=%u s", pe, g.init_timeout_s);
                goto fail_unlink;
            }
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
        seg_name(name, sizeof name, g.id, pe);
        g.heap[pe] = map_segment(name, g.heap_size, 0, &err);
        if (!g.heap[pe]) {
            rc = emu_fail(f, ACLSHMEM_SMEM_ERROR, "cannot map heap of PE %d (%s): %s", pe, name,
                          strerror(err));
            goto fail_unlink;
        }
    }

    g.blocks = calloc(16, sizeof(emu_block_t));
    if (!g.blocks) {
        rc = emu_fail(f, ACLSHMEM_MALLOC_FAILED, "out of host memory");
        goto fail_unlink;
    }
    g.cap_blocks = 16;
    g.n_blocks = 1;
    g.blocks[0] = (emu_block_t){0, g.heap_size, 0};
    g.alloc_seq = 0;
    g.inited = 1;

    rc = emu_barrier(f, g.init_timeout_s);
    if (rc) {
        g.inited = 0;
        free(g.blocks);
        g.blocks = NULL;
        goto fail_unlink;
    }
    /* Everyone has mapped everything: the names are no longer needed. */
    seg_name(name, sizeof name, g.id, g.my_pe);
    shm_unlink(name);
    if (g.my_pe == 0) {
        seg_name(name, sizeof name, g.id, -1);
        shm_unlink(name);
    }
    return ACLSHMEM_SUCCESS;

fail_unlink:
    __atomic_store_n(&c->pid[g.my_pe], 0, __ATOMIC_RELEASE);
    unmap_all(1);
    g.my_pe = g.n_pes = -1;
    return rc;
fail:
    munmap(g.ctl, sizeof(emu_ctl_t));
    g.ctl = NULL;
    g.my_pe = g.n_pes = -1;
    return rc;
}

EXPORT int aclshmemx_init_attr(unsigned int bootstrap_flags, aclshmemx_init_attr_t *attributes)
{
    pthread_mutex_lock(&g_lock);
    int rc = init_locked(bootstrap_flags, attributes);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static void drain_queue(aclrtStream stream, int all);

EXPORT int aclshmem_finalize(void)
{
    pthread_mutex_lock(&g_lock);
    if (!g.inited) {
        pthread_mutex_unlock(&g_lock);
        return ACLSHMEM_SUCCESS;   /* as the real library: finalize without init succeeds */
    }
    drain_queue(NULL, 1);
    int rc = emu_barrier("aclshmem_finalize", g.ctl_timeout_s);
    __atomic_store_n(&g.ctl->pid[g.my_pe], 0, __ATOMIC_RELEASE);   /* departed */
    unmap_all(1);
    free(g.blocks);
    g.blocks = NULL;
    g.n_blocks = g.cap_blocks = 0;
    g.inited = 0;
    g.my_pe = g.n_pes = -1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------ symmetric allocator */

static int blocks_insert(size_t at, emu_block_t b)
{
    if (g.n_blocks == g.cap_blocks) {
        emu_block_t *nb = realloc(g.blocks, 2 * g.cap_blocks * sizeof *nb);
        if (!nb)
            return -1;
        g.blocks = nb;
        g.cap_blocks *= 2;
    }
    memmove(&g.blocks[at + 1], &g.blocks[at], (g.n_blocks - at) * sizeof *g.blocks);
    g.blocks[at] = b;
    g.n_blocks++;
    return 0;
}

static void blocks_remove(size_t at)
{
    memmove(&g.blocks[at], &g.blocks[at + 1], (g.n_blocks - at - 1) * sizeof *g.blocks);
    g.n_blocks--;
}

/* First fit; returns the offset or UINT64_MAX. Deterministic in the call sequence. */
static uint64_t heap_alloc(uint64_t size, uint64_t align)
{
    size = (size + 63) & ~(uint64_t)63;
    for (size_t i = 0; i < g.n_blocks; i++) {
        emu_block_t b = g.blocks[i];
        if (b.used)
            continue;
        uint64_t start = (b.off + align - 1) & ~(align - 1);
        if (start < b.off || start - b.off > b.size || b.size - (start - b.off) < size)
            continue;
        uint64_t head = start - b.off, tail = b.size - head - size;
        g.blocks[i] = (emu_block_t){start, size, 1};
        if (tail && blocks_insert(i + 1, (emu_block_t){start + size, tail, 0}) != 0)
            return UINT64_MAX;
        if (head && blocks_insert(i, (emu_block_t){b.off, head, 0}) != 0)
            return UINT64_MAX;
        return start;
    }
    return UINT64_MAX;
}

static int heap_release(uint64_t off)
{
    for (size_t i = 0; i < g.n_blocks; i++) {
        if (g.blocks[i].off != off || !g.blocks[i].used)
            continue;
        g.blocks[i].used = 0;
        if (i + 1 < g.n_blocks && !g.blocks[i + 1].used) {
            g.blocks[i].size += g.blocks[i + 1].size;
            blocks_remove(i + 1);
        }
        if (i > 0 && !g.blocks[i - 1].used) {
            g.blocks[i - 1].size += g.blocks[i].size;
            blocks_remove(i);
        }
        return 0;
    }
    return -1;
}

/* Collective: announce the request, barrier, compare with every PE, barrier. */
static int collective_check(const char *func, uint32_t op, uint64_t a, uint64_t b)
{
    emu_ctl_t *c = g.ctl;
    uint64_t seq = ++g.alloc_seq;
    c->req[g.my_pe] = (emu_req_t){op, 0, a, b, seq};
    int rc = emu_barrier(func, g.ctl_timeout_s);
    if (rc)
        return rc;
    int mismatch = -1;
    for (int pe = 0; pe < g.n_pes; pe++) {
        emu_req_t r = c->req[pe];
        if (r.op != op || r.a != a || r.b != b || r.seq != seq) {
            mismatch = pe;
            break;
        }
    }
    rc = emu_barrier(func, g.ctl_timeout_s);
    if (rc)
        return rc;
    if (mismatch >= 0)
        return emu_fail(func, ACLSHMEM_INVALID_PARAM,
                        "asymmetric call: PE %d did not make the same heap call (#%llu) as PE %d",
                        mismatch, (unsigned long long)seq, g.my_pe);
    return ACLSHMEM_SUCCESS;
}

static void *sym_alloc(const char *func, uint32_t op, uint64_t size, uint64_t align)
{
    pthread_mutex_lock(&g_lock);
    void *res = NULL;
    if (!g.inited) {
        emu_fail(func, ACLSHMEM_NOT_INITED, "Memory Heap Not Initialized");
        goto out;
    }
    if (collective_check(func, op, size, align) != ACLSHMEM_SUCCESS)
        goto out;
    if (size == 0)
        goto out;   /* NULL, as OpenSHMEM specifies for a zero-size request */
    if (align == 0 || (align & (align - 1)) != 0) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM, "alignment %llu is not a power of two",
                 (unsigned long long)align);
        goto out;
    }
    uint64_t off = heap_alloc(size, align);
    if (off == UINT64_MAX) {
        emu_fail(func, ACLSHMEM_MALLOC_FAILED,
                 "cannot allocate %llu bytes from the %zu-byte symmetric heap",
                 (unsigned long long)size, g.heap_size);
        goto out;
    }
    res = g.heap[g.my_pe] + off;
out:
    pthread_mutex_unlock(&g_lock);
    return res;
}

EXPORT void *aclshmem_malloc(size_t size)
{
    return sym_alloc(__func__, 1, size, EMU_DEFAULT_ALIGN);
}

EXPORT void *aclshmem_calloc(size_t nmemb, size_t size)
{
    if (size && nmemb > SIZE_MAX / size) {
        emu_fail(__func__, ACLSHMEM_INVALID_PARAM, "nmemb * size overflows");
        return NULL;
    }
    void *p = sym_alloc(__func__, 2, (uint64_t)nmemb * size, EMU_DEFAULT_ALIGN);
    if (p)
        memset(p, 0, nmemb * size);
    return p;
}

EXPORT void *aclshmem_align(size_t alignment, size_t size)
{
    return sym_alloc(__func__, 3, size, alignment < 64 && alignment ? 64 : alignment);
}

EXPORT void aclshmem_free(void *ptr)
{
    pthread_mutex_lock(&g_lock);
    if (!g.inited) {
        emu_fail(__func__, ACLSHMEM_NOT_INITED, "Memory Heap Not Initialized");
        goto out;
    }
    uint64_t off = ptr ? (uint64_t)((char *)ptr - g.heap[g.my_pe]) : UINT64_MAX;
    if (collective_check(__func__, 4, off, 0) != ACLSHMEM_SUCCESS || !ptr)
        goto out;
    if ((char *)ptr < g.heap[g.my_pe] || off >= g.heap_size || heap_release(off) != 0)
        emu_fail(__func__, ACLSHMEM_INVALID_PARAM, "%p is not an allocation of the symmetric heap", ptr);
out:
    pthread_mutex_unlock(&g_lock);
}

EXPORT void *aclshmemx_get_heap_base(int mem_type)
{
    if (!g.inited) {
        emu_fail(__func__, ACLSHMEM_NOT_INITED, "not initialized");
        return NULL;
    }
    if (mem_type != DEVICE_SIDE) {
        emu_fail(__func__, ACLSHMEM_NOT_SUPPORTED, "only the DEVICE_SIDE heap is emulated");
        return NULL;
    }
    return g.heap[g.my_pe];
}

/* ------------------------------------------------------------------ address translation */

/* Translate [ptr, ptr + n) of the local heap to PE pe's mapping, or NULL (error recorded). */
static char *translate(const char *func, const void *ptr, size_t n, int pe, const char *what)
{
    if (!g.inited) {
        emu_fail(func, ACLSHMEM_NOT_INITED, "not initialized");
        return NULL;
    }
    if (pe < 0 || pe >= g.n_pes) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM, "PE %d out of range [0, %d)", pe, g.n_pes);
        return NULL;
    }
    const char *base = g.heap[g.my_pe];
    uintptr_t p = (uintptr_t)ptr, b = (uintptr_t)base;
    if (p < b || p - b >= g.heap_size || n > g.heap_size - (p - b)) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM,
                 "%s range [%p, +%zu) is outside the symmetric heap [%p, +%zu)", what, ptr, n,
                 (const void *)base, g.heap_size);
        return NULL;
    }
    if (!g.heap[pe]) {
        emu_fail(func, ACLSHMEM_INNER_ERROR, "heap of PE %d is not mapped", pe);
        return NULL;
    }
    return g.heap[pe] + (p - b);
}

EXPORT void *aclshmem_ptr(void *ptr, int pe)
{
    return translate(__func__, ptr, 0 + (ptr != NULL), pe, "address");
}

/* ------------------------------------------------------------------ operations and queue */

static void signal_apply(int32_t *sig, int32_t val, int op)
{
    if (op == ACLSHMEM_SIGNAL_ADD)
        __atomic_fetch_add(sig, val, __ATOMIC_SEQ_CST);
    else
        __atomic_store_n(sig, val, __ATOMIC_SEQ_CST);
    futex_wake_all((uint32_t *)sig);
}

static void op_run(const emu_op_t *o)
{
    if (o->n)
        memmove(o->dst, o->src, o->n);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    if (o->kind == 1)
        signal_apply(o->sig, o->sig_val, o->sig_op);
}

static int defer_enabled(void)
{
    const char *v = getenv("MEMSEM_SHMEM_EMU_DEFER_NBI");
    return v && v[0] == '1';
}

/* Run now, or queue on stream when deferral is on and the call is nbi / on-stream. */
static void submit(const char *func, emu_op_t o, int deferrable)
{
    if (!(deferrable && defer_enabled())) {
        op_run(&o);
        return;
    }
    emu_op_t *q = malloc(sizeof *q);
    if (!q) {
        emu_fail(func, ACLSHMEM_MALLOC_FAILED, "out of host memory (ran the operation now)");
        op_run(&o);
        return;
    }
    *q = o;
    q->next = NULL;
    pthread_mutex_lock(&q_lock);
    if (q_tail)
        q_tail->next = q;
    else
        q_head = q;
    q_tail = q;
    q_len++;
    pthread_mutex_unlock(&q_lock);
}

static void drain_queue(aclrtStream stream, int all)
{
    pthread_mutex_lock(&q_lock);
    emu_op_t **pp = &q_head, *prev = NULL;
    while (*pp) {
        emu_op_t *o = *pp;
        if (all || o->stream == stream) {
            op_run(o);
            *pp = o->next;
            if (q_tail == o)
                q_tail = prev;
            q_len--;
            free(o);
        } else {
            prev = o;
            pp = &o->next;
        }
    }
    pthread_mutex_unlock(&q_lock);
}

static void rma(const char *func, int put, void *dst, void *src, size_t n, int pe,
                aclrtStream stream, int deferrable)
{
    if (n == 0 && g.inited)
        return;
    if ((!dst || !src) && g.inited) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM, "NULL %s", dst ? "src" : "dst");
        return;
    }
    emu_op_t o = {0};
    o.stream = stream;
    o.n = n;
    if (put) {
        o.dst = translate(func, dst, n, pe, "dst");
        o.src = src;
        if (!o.dst)
            return;
    } else {
        o.src = translate(func, src, n, pe, "src");
        o.dst = dst;
        if (!o.src)
            return;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    submit(func, o, deferrable);
}

EXPORT void aclshmem_putmem(void *dst, void *src, size_t n, int32_t pe)
{
    rma(__func__, 1, dst, src, n, pe, NULL, 0);
}

EXPORT void aclshmem_getmem(void *dst, void *src, size_t n, int32_t pe)
{
    rma(__func__, 0, dst, src, n, pe, NULL, 0);
}

EXPORT void aclshmem_putmem_nbi(void *dst, void *src, size_t n, int32_t pe)
{
    rma(__func__, 1, dst, src, n, pe, NULL, 1);
}

EXPORT void aclshmem_getmem_nbi(void *dst, void *src, size_t n, int32_t pe)
{
    rma(__func__, 0, dst, src, n, pe, NULL, 1);
}

EXPORT void aclshmemx_putmem_on_stream(void *dst, void *src, size_t n, int32_t pe, aclrtStream stream)
{
    rma(__func__, 1, dst, src, n, pe, stream, 1);
}

EXPORT void aclshmemx_getmem_on_stream(void *dst, void *src, size_t n, int32_t pe, aclrtStream stream)
{
    rma(__func__, 0, dst, src, n, pe, stream, 1);
}

EXPORT void aclshmemx_quiet_on_stream(aclrtStream stream)
{
    if (!g.inited) {
        emu_fail(__func__, ACLSHMEM_NOT_INITED, "not initialized");
        return;
    }
    drain_queue(stream, 0);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static void put_signal(const char *func, void *dst, void *src, size_t n, void *sig_addr,
                       int32_t signal, int sig_op, int pe, int deferrable)
{
    if (sig_op != ACLSHMEM_SIGNAL_SET && sig_op != ACLSHMEM_SIGNAL_ADD) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM, "sig_op %d is neither SET (0) nor ADD (1)", sig_op);
        return;
    }
    if (((uintptr_t)sig_addr & 3) != 0) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM, "sig_addr %p is not 4-byte aligned", sig_addr);
        return;
    }
    if (n && (!dst || !src)) {
        emu_fail(func, ACLSHMEM_INVALID_PARAM, "NULL %s", dst ? "src" : "dst");
        return;
    }
    emu_op_t o = {0};
    o.kind = 1;
    o.n = n;
    o.src = src;
    o.sig_val = signal;
    o.sig_op = sig_op;
    o.sig = (int32_t *)translate(func, sig_addr, sizeof(int32_t), pe, "sig_addr");
    if (!o.sig)
        return;
    if (n) {
        o.dst = translate(func, dst, n, pe, "dst");
        if (!o.dst)
            return;
    }
    submit(func, o, deferrable);
}

EXPORT void aclshmemx_putmem_signal(void *dst, void *src, size_t n, void *sig_addr,
                                    int32_t signal, int sig_op, int pe)
{
    put_signal(__func__, dst, src, n, sig_addr, signal, sig_op, pe, 0);
}

EXPORT void aclshmemx_putmem_signal_nbi(void *dst, void *src, size_t n, void *sig_addr,
                                        int32_t signal, int sig_op, int pe)
{
    put_signal(__func__, dst, src, n, sig_addr, signal, sig_op, pe, 1);
}

static int cmp_ok(int32_t v, int cmp, int32_t ref)
{
    switch (cmp) {
    case ACLSHMEM_CMP_EQ: return v == ref;
    case ACLSHMEM_CMP_NE: return v != ref;
    case ACLSHMEM_CMP_GT: return v > ref;
    case ACLSHMEM_CMP_GE: return v >= ref;
    case ACLSHMEM_CMP_LT: return v < ref;
    default: return v <= ref;   /* ACLSHMEM_CMP_LE */
    }
}

EXPORT int aclshmemx_emu_set_wait_timeout_ms(int64_t timeout_ms)
{
    if (timeout_ms < 0)
        return emu_fail(__func__, ACLSHMEM_INVALID_VALUE, "timeout_ms must be >= 0 (0: no bound)");
    __atomic_store_n(&g_wait_timeout_ms, timeout_ms, __ATOMIC_RELEASE);
    return ACLSHMEM_SUCCESS;
}

static int64_t wait_timeout_ms(void)
{
    int64_t t = __atomic_load_n(&g_wait_timeout_ms, __ATOMIC_ACQUIRE);
    if (t >= 0)
        return t;
    const char *v = getenv("MEMSEM_SHMEM_EMU_WAIT_TIMEOUT_MS");
    if (v && *v) {
        char *end;
        long long x = strtoll(v, &end, 10);
        if (*end == '\0' && x >= 0)
            return x;
    }
    return 120000;
}

EXPORT void aclshmem_signal_wait_until(int32_t *sig_addr, int cmp, int32_t cmp_val)
{
    const char *f = __func__;
    if (cmp < 0 || cmp > 5) {
        emu_fail(f, ACLSHMEM_INVALID_PARAM, "compare op %d is invalid (EQ..LE = 0..5)", cmp);
        return;
    }
    if (((uintptr_t)sig_addr & 3) != 0) {
        emu_fail(f, ACLSHMEM_INVALID_PARAM, "sig_addr %p is not 4-byte aligned", (void *)sig_addr);
        return;
    }
    int32_t *w = (int32_t *)translate(f, sig_addr, sizeof(int32_t), g.inited ? g.my_pe : 0, "sig_addr");
    if (!w)
        return;
    drain_queue(NULL, 0);   /* the real call synchronizes the default stream */
    int64_t tmo = wait_timeout_ms();
    int64_t deadline = tmo ? now_ns() + tmo * 1000000LL : INT64_MAX;
    for (;;) {
        int32_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (cmp_ok(v, cmp, cmp_val))
            return;
        int pe = dead_peer();
        if (pe >= 0 && cmp_ok(__atomic_load_n(w, __ATOMIC_ACQUIRE), cmp, cmp_val))
            return;   /* it signalled just before it died */
        if (pe >= 0) {
            emu_fail(f, ACLSHMEM_BOOTSTRAP_ERROR,
                     "PE %d died while PE %d waits on signal %p (value %d, cmp %d, want %d)", pe,
                     g.my_pe, (void *)sig_addr, v, cmp, cmp_val);
            return;
        }
        int64_t left = deadline - now_ns();
        if (left <= 0) {
            emu_fail(f, ACLSHMEM_TIMEOUT_ERROR,
                     "emulator wait bound of %lld ms expired on PE %d (signal %p = %d, cmp %d, want %d)",
                     (long long)tmo, g.my_pe, (void *)sig_addr, v, cmp, cmp_val);
            return;
        }
        futex_wait_ns((uint32_t *)w, (uint32_t)v, left < EMU_POLL_NS ? left : EMU_POLL_NS);
    }
}

EXPORT void aclshmem_barrier_all(void)
{
    if (!g.inited) {
        emu_fail(__func__, ACLSHMEM_NOT_INITED, "not initialized");
        return;
    }
    drain_queue(NULL, 0);   /* the real call synchronizes the default stream */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    emu_barrier(__func__, g.ctl_timeout_s);
}

/* ------------------------------------------------------------------ emulator-only */

EXPORT int aclshmemx_emu_last_error(char *msg, size_t msg_len)
{
    int code = t_last_code;
    if (msg && msg_len) {
        size_t n = strnlen(t_last_msg, sizeof t_last_msg);
        if (n >= msg_len)
            n = msg_len - 1;
        memcpy(msg, t_last_msg, n);
        msg[n] = '\0';
    }
    t_last_code = 0;
    t_last_msg[0] = '\0';
    return code;
}

EXPORT int aclshmemx_emu_pending_ops(void)
{
    pthread_mutex_lock(&q_lock);
    int n = q_len;
    pthread_mutex_unlock(&q_lock);
    return n;
}
