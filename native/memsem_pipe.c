/* memsem pipeline movers: staging copies of pipelines' upcoming tiles on native threads that
 * never need the GIL. See the "pipeline movers" block of memsem_native.h for the contract;
 * memsem/pipeline/_movers.py is the only user. (The word "engine" means a transport in memsem;
 * this is not one: it moves through the plan of a resolution the runtime made.)
 *
 * One mover pool per runtime: copy workers started on demand and parked on a futex between
 * jobs. A job is one run of one pipeline: for each of its tiles, wait for the tile's staging slot
 * (the caller released the tile that used it), claim the tile (unless the caller took it), wait
 * for the window's ready words of the tile (when asked; holding the plan's use word, so the
 * control block stays mapped), copy it with memsem_plan_copy (every check of a get: range,
 * permission, lease, generation and sequence before and after, in-flight accounting, telemetry)
 * and hand it over: the tile's result in its slot's word, then the count of finished tiles (a
 * futex the caller sleeps on). Any outcome but a plain success ends the run at that tile: the
 * caller handles it (retries, errors) and may submit a new run at the next tile. All waits are
 * bounded slices that re-check the stop bit. The pipe's and the pool's own words use private
 * futexes: a wake after the last store touches no memory of a pipe its caller may free at once.
 *
 * The caller never waits on a worker the scheduler does not run (a loaded machine): a worker
 * moves itself off the caller's CPU (on one CPU the caller, which computes without sleeping,
 * would starve it), a submit that finds the pool's lock
 * held returns -EAGAIN instead of waiting, a copy far past its modelled time is taken over
 * (memsem_pipe_take_over), and the Python side's close stops a run without joining it (it keeps
 * the memory until a later join finds the run ended).
 */
#define _GNU_SOURCE
#include "memsem_native.h"
#include "memsem_internal.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* memsem_pipe.released: the count of released tiles, and two flags on top */
#define STOP_BIT 0x80000000u    /* end the run (the worker claims no further tile) */
#define CLOSED_BIT 0x40000000u  /* the pipe is stopped for good: no later run */
#define COUNT_MASK 0x3fffffffu
/* memsem_pipe_wait: with patience, a caller whose tile the worker is not copying yet re-checks
 * this often whether it started (and then whether it is late) */
#define RECHECK_NS 1000000ull

/* Futexes (memsem_internal.h): ready words live in segments other processes map (shared); the
 * pipe's and the pool's own words are private. */
#define SHARED 1
#define PRIVATE 0

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int peer_dead(int pidfd) {
    if (pidfd < 0) return 0;
    struct pollfd pfd = {pidfd, POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;  /* a pidfd becomes readable when its process exits */
}

static inline int stopped(memsem_pipe *p) {
    return (__atomic_load_n(&p->released, __ATOMIC_ACQUIRE) & STOP_BIT) != 0;
}

/* ---- a worker off its caller's CPU ----------------------------------------------------------
 * Measured (a 2-core VM, the bench's 16 x 4 MiB host/cma pipeline, /proc/<tid>/stat sampled at
 * every tile): once the worker ran on the caller's CPU it stayed there pipeline after pipeline
 * (the caller's futex wakes pull it back), the caller moved 13-14 of 16 tiles itself and the
 * pipeline ran 10-25% slower than get-then-compute; with the worker on the other CPU it moved
 * 10-12 of 16 even on that loaded machine. Affinity is the one way to keep the scheduler from
 * placing them together; the worker only moves itself (narrows its own affinity to the CPUs it
 * started with but the caller's, which migrates it at once, then widens it again). */
static __thread cpu_set_t w_allowed;  /* the CPUs this worker started with */
static __thread int w_ncpu;          /* how many (< 2: it never moves) */

static void worker_cpus_init(void) {
    CPU_ZERO(&w_allowed);
    w_ncpu = sched_getaffinity(0, sizeof w_allowed, &w_allowed) == 0 ? CPU_COUNT(&w_allowed) : 0;
}

/* Before each tile: record this worker's CPU; leave the caller's when they share it. */
static void avoid_caller(memsem_pipe *p) {
    int me = sched_getcpu();
    int caller = __atomic_load_n(&p->caller_cpu, __ATOMIC_RELAXED);
    if (me >= 0 && me == caller && w_ncpu >= 2 && caller < CPU_SETSIZE && CPU_ISSET(caller, &w_allowed)) {
        cpu_set_t s = w_allowed;
        CPU_CLR(caller, &s);
        if (sched_setaffinity(0, sizeof s, &s) == 0) {  /* migrates this thread before it returns */
            __atomic_fetch_add(&p->cpu_moves, 1, __ATOMIC_RELAXED);
            me = sched_getcpu();
            /* Then every CPU again: a worker held to the other CPU would wait there behind any
             * other process's thread while the caller's CPU idles (measured: a worker held to
             * a CPU another job kept busy was descheduled mid-copy for 1-4 ms, tile after tile;
             * the caller took 13-16 of 16 tiles over). The thread stays where it was moved. */
            sched_setaffinity(0, sizeof w_allowed, &w_allowed);
        }
    }
    __atomic_store_n(&p->worker_cpu, me, __ATOMIC_RELAXED);
}

/* Whether this worker was preempted since it last asked (its involuntary context switches
 * grew): the machine has more runnable threads than CPUs. A spin then burns CPU time its own
 * process (its scheduling group) needs for the caller, and the wake-up it saves is no longer
 * the cost that matters. Measured (the overlap table, load 16 on 2 CPUs, 16 x 4 MiB): the
 * pipeline ran at 0.80-0.96x of get-then-compute with the 200 us spin for every slot. */
static __thread long w_nivcsw = -1;

static int preempted(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) != 0) return 0;
    long was = w_nivcsw;
    w_nivcsw = ru.ru_nivcsw;
    return was >= 0 && ru.ru_nivcsw != was;
}

/* Whether the caller and the worker last ran on one CPU (then neither spins for the other). */
static inline int shared_cpu(memsem_pipe *p) {
    int w = __atomic_load_n(&p->worker_cpu, __ATOMIC_RELAXED);
    return w >= 0 && w == __atomic_load_n(&p->caller_cpu, __ATOMIC_RELAXED);
}

/* Wait until the caller released tile `need - 1` (released >= need). 1 when stopped. A release
 * due within MEMSEM_PIPE_SLOT_SPIN_NS is spun for: when a tile's compute takes a little longer
 * than its move (the case a double buffer is for), sleeping here puts a futex wake on the
 * caller's release and a wake-up of this core (25-30 us on a VM's idle core, measured) before
 * every tile's move after the fill. A/B (bench_pipeline overlap, 16 x 4 MiB, 4 runs each):
 * pipeline / machine ceiling 1.17 sleeping at once, 1.12 spinning up to 300 us. */
static int wait_slot(memsem_pipe *p, uint32_t need) {
    uint64_t t0 = ms_now_ns();
    uint32_t r0 = __atomic_load_n(&p->released, __ATOMIC_ACQUIRE);
    /* never spun on the caller's CPU (the release could not come meanwhile) nor after a preemption */
    int spin = !(r0 & STOP_BIT) && (r0 & COUNT_MASK) < need && !shared_cpu(p) && !preempted();
    while (spin) {
        uint32_t r = __atomic_load_n(&p->released, __ATOMIC_ACQUIRE);
        if ((r & STOP_BIT) || (r & COUNT_MASK) >= need || ms_now_ns() - t0 >= MEMSEM_PIPE_SLOT_SPIN_NS) break;
        for (int k = 0; k < 64; k++) cpu_relax();
    }
    for (;;) {
        uint32_t r = __atomic_load_n(&p->released, __ATOMIC_SEQ_CST);
        if (r & STOP_BIT) return 1;
        if ((r & COUNT_MASK) >= need) return 0;
        __atomic_store_n(&p->sleeping, 1, __ATOMIC_SEQ_CST);
        r = __atomic_load_n(&p->released, __ATOMIC_SEQ_CST);
        if (!(r & STOP_BIT) && (r & COUNT_MASK) < need) ms_futex_wait(&p->released, r, MEMSEM_PIPE_SLICE_NS, PRIVATE);
        __atomic_store_n(&p->sleeping, 0, __ATOMIC_SEQ_CST);
    }
}

/* Wait for every ready word of window tiles [first, last] to hold the plan's generation, at most
 * timeout_ns in all. Holds the plan's use word meanwhile (the control block stays mapped).
 * Returns MEMSEM_OK, MEMSEM_RC_CLOSED, MEMSEM_RC_GEN_BEFORE | gen, MEMSEM_PIPE_TIMEOUT | word,
 * MEMSEM_PIPE_PEER_LOST or MEMSEM_PIPE_STOPPED, with MEMSEM_RC_LAST_OUT when this worker left a
 * closed plan last. */
static uint64_t wait_ready(memsem_pipe *p, uint64_t first, uint64_t last) {
    memsem_plan *plan = p->plan;
    if (memsem_use_enter(&plan->use)) return MEMSEM_RC_CLOSED;
    uint64_t rc = MEMSEM_OK;
    uint64_t deadline = ms_now_ns() + p->timeout_ns;
    const uint64_t *gen = (const uint64_t *)(uintptr_t)plan->gen_addr;
    for (uint64_t w = first; w <= last && rc == MEMSEM_OK; w++) {
        uint64_t *word = (uint64_t *)(uintptr_t)(p->ready_base + 8 * w);
        for (;;) {
            uint64_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (v == plan->generation) break;
            if (stopped(p)) { rc = MEMSEM_PIPE_STOPPED; break; }
            uint64_t g = __atomic_load_n(gen, __ATOMIC_ACQUIRE);
            if (g != plan->generation) { rc = MEMSEM_RC_GEN_BEFORE | (g << MEMSEM_RC_VERSION_SHIFT); break; }
            if (__atomic_load_n(&plan->use, __ATOMIC_ACQUIRE) >> MEMSEM_USE_CLOSED_BIT) { rc = MEMSEM_RC_CLOSED; break; }
            if (peer_dead(p->pidfd)) { rc = MEMSEM_PIPE_PEER_LOST; break; }
            uint64_t t = ms_now_ns();
            if (t >= deadline) { rc = MEMSEM_PIPE_TIMEOUT | (w << MEMSEM_RC_VERSION_SHIFT); break; }
            uint64_t left = deadline - t;
            __atomic_store_n(&p->sleep_addr, (uint64_t)(uintptr_t)word, __ATOMIC_SEQ_CST);
            if (!stopped(p))
                ms_futex_wait((uint32_t *)word, (uint32_t)v, left < MEMSEM_PIPE_SLICE_NS ? left : MEMSEM_PIPE_SLICE_NS,
                              SHARED);
            __atomic_store_n(&p->sleep_addr, 0, __ATOMIC_SEQ_CST);
        }
    }
    if (memsem_use_leave(&plan->use)) rc |= MEMSEM_RC_LAST_OUT;
    return rc;
}

static void hand_over(memsem_pipe *p, uint32_t tile, uint64_t rc, uint64_t t0, uint64_t t1) {
    uint32_t s = tile % p->n_slots;
    p->rc[s] = rc;
    p->t_move[2 * s] = t0;
    p->t_move[2 * s + 1] = t1;
    __atomic_store_n(&p->done, tile + 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->caller_waiting, __ATOMIC_SEQ_CST)) ms_futex_wake(&p->done, INT32_MAX, PRIVATE);
}

/* One run of one pipe (a worker's job). */
static void run(memsem_pipe *p) {
    for (uint32_t i = p->first; i < p->n_tiles; i++) {
        avoid_caller(p);
        uint64_t t = ms_now_ns();
        if (i >= p->n_slots) {
            __atomic_store_n(&p->hold_since, t, __ATOMIC_RELAXED);
            int stop = wait_slot(p, i - p->n_slots + 1);
            __atomic_store_n(&p->hold_since, 0, __ATOMIC_RELAXED);
            if (stop) break;
        } else if (stopped(p)) {
            break;
        }
        uint64_t t1 = ms_now_ns();
        __atomic_fetch_add(&p->hold_ns, t1 - t, __ATOMIC_RELAXED);
        uint32_t want = i;
        if (!__atomic_compare_exchange_n(&p->claim, &want, i + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            /* The caller took tile i (and maybe more) itself: go on after the last it took. */
            if (want >= p->n_tiles) break;
            i = want - 1;
            continue;
        }
        uint64_t off = (uint64_t)i * p->tile_bytes;
        uint64_t n = p->ref_nbytes - off < p->tile_bytes ? p->ref_nbytes - off : p->tile_bytes;
        if (p->ready_base) {
            uint64_t start = p->ref_offset + off;
            uint64_t first = start / p->window_tile_bytes;
            uint64_t last = (start + (n ? n : 1) - 1) / p->window_tile_bytes;
            if (last > p->n_ready - 1) last = p->n_ready - 1;
            uint64_t rc = wait_ready(p, first, last);
            uint64_t t2 = ms_now_ns();
            __atomic_fetch_add(&p->ready_wait_ns, t2 - t1, __ATOMIC_RELAXED);
            t1 = t2;
            if ((rc & MEMSEM_RC_STATUS_MASK) == MEMSEM_PIPE_STOPPED) break;
            if (rc != MEMSEM_OK) {
                hand_over(p, i, rc, t1, t1);
                break;
            }
        }
        uint64_t dst = p->slot_bytes ? p->dst + (uint64_t)(i % p->n_slots) * p->slot_bytes : p->dst + off;
        /* The caller may take a late copy over (memsem_pipe_take_over): it watches these. */
        __atomic_store_n(&p->active_since, t1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->active, i + 1, __ATOMIC_SEQ_CST);
        uint64_t rc = memsem_plan_copy(p->plan, 0, p->ref_offset + off, dst, n, p->version, p->lease_slot,
                                       p->lease_id);
        __atomic_store_n(&p->active, 0, __ATOMIC_SEQ_CST);
        uint64_t t2 = ms_now_ns();
        __atomic_fetch_add(&p->move_ns, t2 - t1, __ATOMIC_RELAXED);
        if ((rc & MEMSEM_RC_STATUS_MASK) == MEMSEM_OK) {
            __atomic_fetch_add(&p->bytes_moved, n, __ATOMIC_RELAXED);
            __atomic_fetch_add(&p->tiles_moved, 1, __ATOMIC_RELAXED);
        }
        hand_over(p, i, rc, t1, t2);
        if (rc & (MEMSEM_RC_STATUS_MASK | MEMSEM_RC_LAST_OUT)) break;
    }
}

/* ---- the mover pool: copy workers and a queue of runs --------------------------------------- */
struct memsem_mover_pool {
    pthread_mutex_t lock;       /* the queue, the counts, the worker table */
    memsem_pipe *head, *tail;   /* runs no worker took yet */
    uint32_t jobs;              /* futex parked workers sleep on: bumped per submit and at stop */
    uint32_t stop;
    uint32_t queued, idle;      /* runs queued; workers parked */
    uint32_t n_workers, max_workers;
    pthread_t *threads;         /* max_workers */
    uint8_t *joined;            /* max_workers */
    memsem_pipe **current;      /* max_workers: the run each worker is in, or NULL */
};

struct worker_arg {
    memsem_mover_pool *pool;
    uint32_t index;
};

static void *worker(void *arg) {
    struct worker_arg wa = *(struct worker_arg *)arg;
    free(arg);
    pthread_setname_np(pthread_self(), "memsem-mover");  /* as top -H and /proc/<pid>/task show it */
    worker_cpus_init();
    memsem_mover_pool *pool = wa.pool;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        memsem_pipe *p = pool->head;
        if (p) {
            pool->head = p->next;
            if (!pool->head) pool->tail = NULL;
            p->next = NULL;
            pool->queued--;
            __atomic_store_n(&p->state, MEMSEM_PIPE_RUNNING, __ATOMIC_SEQ_CST);
            pool->current[wa.index] = p;
            pthread_mutex_unlock(&pool->lock);
            run(p);
            pthread_mutex_lock(&pool->lock);
            pool->current[wa.index] = NULL;
            /* The last touch of p: its caller may free it once it reads FREE (the private wakes
             * below need no memory of it). */
            __atomic_store_n(&p->state, MEMSEM_PIPE_FREE, __ATOMIC_SEQ_CST);
            ms_futex_wake(&p->state, INT32_MAX, PRIVATE);
            ms_futex_wake(&p->done, INT32_MAX, PRIVATE);
            continue;
        }
        if (pool->stop) break;
        uint32_t seq = __atomic_load_n(&pool->jobs, __ATOMIC_SEQ_CST);
        pool->idle++;
        pthread_mutex_unlock(&pool->lock);
        ms_futex_wait(&pool->jobs, seq, MEMSEM_PIPE_PARK_NS, PRIVATE);
        pthread_mutex_lock(&pool->lock);
        pool->idle--;
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

memsem_mover_pool *memsem_mover_pool_new(uint32_t max_workers) {
    if (max_workers == 0) max_workers = 1;
    memsem_mover_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->threads = calloc(max_workers, sizeof *pool->threads);
    pool->joined = calloc(max_workers, 1);
    pool->current = calloc(max_workers, sizeof *pool->current);
    if (!pool->threads || !pool->joined || !pool->current) {
        free(pool->threads);
        free(pool->joined);
        free(pool->current);
        free(pool);
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    pool->max_workers = max_workers;
    return pool;
}

uint32_t memsem_mover_pool_workers(memsem_mover_pool *pool) {
    pthread_mutex_lock(&pool->lock);
    uint32_t n = pool->n_workers;
    pthread_mutex_unlock(&pool->lock);
    return n;
}

/* Under pool->lock. 0 or -errno of pthread_create. */
static int start_worker(memsem_mover_pool *pool) {
    struct worker_arg *wa = malloc(sizeof *wa);
    if (!wa) return -ENOMEM;
    wa->pool = pool;
    wa->index = pool->n_workers;
    /* Workers take no signals: they are the interpreter's, in its own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&pool->threads[pool->n_workers], NULL, worker, wa);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        free(wa);
        return -err;
    }
    pool->n_workers++;
    return 0;
}

int memsem_mover_pool_submit(memsem_mover_pool *pool, memsem_pipe *p) {
    if (p->n_slots == 0 || p->tile_bytes == 0 || p->first >= p->n_tiles || p->plan == NULL ||
        p->rc == NULL || p->t_move == NULL ||
        (p->ready_base && (p->window_tile_bytes == 0 || p->n_ready == 0)))
        return -EINVAL;
    /* Never wait for the pool's lock: a worker descheduled while holding it (a loaded machine)
     * would hold the caller for a scheduler period; the caller copies the tile itself instead. */
    if (pthread_mutex_trylock(&pool->lock)) return -EAGAIN;
    if (pool->stop || (__atomic_load_n(&p->released, __ATOMIC_SEQ_CST) & CLOSED_BIT)) {
        pthread_mutex_unlock(&pool->lock);
        return -ESHUTDOWN;
    }
    if (__atomic_load_n(&p->state, __ATOMIC_SEQ_CST) != MEMSEM_PIPE_FREE) {
        pthread_mutex_unlock(&pool->lock);
        return -EBUSY;
    }
    __atomic_fetch_and(&p->released, ~STOP_BIT, __ATOMIC_SEQ_CST);  /* a run the caller ended */
    __atomic_store_n(&p->active, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->caller_cpu, sched_getcpu(), __ATOMIC_RELAXED);
    __atomic_store_n(&p->worker_cpu, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&p->done, p->first, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->claim, p->first, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->state, MEMSEM_PIPE_QUEUED, __ATOMIC_SEQ_CST);
    p->next = NULL;
    if (pool->tail) pool->tail->next = p;
    else pool->head = p;
    pool->tail = p;
    pool->queued++;
    int rc = 0;
    if (pool->queued > pool->idle && pool->n_workers < pool->max_workers) {
        rc = start_worker(pool);
        if (rc && pool->n_workers > 0) rc = 0;  /* the workers there are will take it */
    }
    if (rc) {  /* no worker at all (none could start): take the run back */
        pool->head = pool->tail = NULL;
        pool->queued = 0;
        __atomic_store_n(&p->state, MEMSEM_PIPE_FREE, __ATOMIC_SEQ_CST);
    } else {
        __atomic_fetch_add(&pool->jobs, 1, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&pool->lock);
    if (!rc) ms_futex_wake(&pool->jobs, 1, PRIVATE);
    return rc;
}

int memsem_mover_pool_shutdown(memsem_mover_pool *pool, double timeout_s) {
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    /* Runs nobody took are dropped; runs in progress are asked to stop. */
    for (memsem_pipe *p = pool->head; p;) {
        memsem_pipe *n = p->next;
        p->next = NULL;
        __atomic_store_n(&p->state, MEMSEM_PIPE_FREE, __ATOMIC_SEQ_CST);
        ms_futex_wake(&p->state, INT32_MAX, PRIVATE);
        p = n;
    }
    pool->head = pool->tail = NULL;
    pool->queued = 0;
    for (uint32_t i = 0; i < pool->n_workers; i++)
        if (pool->current[i]) memsem_pipe_stop(pool->current[i]);
    __atomic_fetch_add(&pool->jobs, 1, __ATOMIC_SEQ_CST);
    uint32_t n = pool->n_workers;
    pthread_mutex_unlock(&pool->lock);
    ms_futex_wake(&pool->jobs, INT32_MAX, PRIVATE);
    struct timespec abs;
    clock_gettime(CLOCK_REALTIME, &abs);
    uint64_t ns = (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    abs.tv_sec += (time_t)(ns / 1000000000ull);
    abs.tv_nsec += (long)(ns % 1000000000ull);
    if (abs.tv_nsec >= 1000000000L) {
        abs.tv_sec += 1;
        abs.tv_nsec -= 1000000000L;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (pool->joined[i]) continue;
        int err = pthread_timedjoin_np(pool->threads[i], NULL, &abs);
        if (err == ETIMEDOUT) return -ETIMEDOUT;
        pool->joined[i] = 1;
    }
    return 0;
}

void memsem_mover_pool_free(memsem_mover_pool *pool) {
    pthread_mutex_destroy(&pool->lock);
    free(pool->threads);
    free(pool->joined);
    free(pool->current);
    free(pool);
}

/* ---- the pipe, caller side ------------------------------------------------------------------ */
static void end_run(memsem_pipe *p, uint32_t bits) {
    __atomic_fetch_or(&p->released, bits, __ATOMIC_SEQ_CST);
    ms_futex_wake(&p->released, INT32_MAX, PRIVATE);
    uint64_t a = __atomic_load_n(&p->sleep_addr, __ATOMIC_SEQ_CST);
    if (a) ms_futex_wake((uint32_t *)(uintptr_t)a, INT32_MAX, SHARED);  /* a ready word: waking its other waiters is harmless */
}

void memsem_pipe_stop(memsem_pipe *p) {
    end_run(p, STOP_BIT | CLOSED_BIT);
}

uint64_t memsem_pipe_take_over(memsem_pipe *p, uint32_t tile) {
    /* The stop bit first, then the count: a worker that had not handed the tile over when the
     * bit became visible claims nothing after it (it checks the bit before every claim). */
    end_run(p, STOP_BIT);
    if (__atomic_load_n(&p->done, __ATOMIC_SEQ_CST) > tile) return p->rc[tile % p->n_slots];
    return MEMSEM_PIPE_LATE;
}

uint64_t memsem_pipe_result(memsem_pipe *p, uint32_t tile) {
    return p->rc[tile % p->n_slots];
}

int memsem_pipe_join(memsem_mover_pool *pool, memsem_pipe *p, double timeout_s) {
    uint32_t st0 = __atomic_load_n(&p->state, __ATOMIC_SEQ_CST);
    if (st0 == MEMSEM_PIPE_FREE) return 0;
    if (st0 == MEMSEM_PIPE_QUEUED) {
        /* Off the queue (under the lock: a worker may be taking it). Without a timeout, a lock
         * held by a descheduled worker is not waited for: join again later. */
        if (timeout_s > 0) pthread_mutex_lock(&pool->lock);
        else if (pthread_mutex_trylock(&pool->lock)) return -ETIMEDOUT;
    } else {
        goto wait;
    }
    if (__atomic_load_n(&p->state, __ATOMIC_SEQ_CST) == MEMSEM_PIPE_QUEUED) {
        memsem_pipe **at = &pool->head, *prev = NULL;
        while (*at && *at != p) {
            prev = *at;
            at = &(*at)->next;
        }
        if (*at) {
            *at = p->next;
            if (pool->tail == p) pool->tail = prev;
            pool->queued--;
        }
        p->next = NULL;
        __atomic_store_n(&p->state, MEMSEM_PIPE_FREE, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&pool->lock);
wait:;
    uint64_t deadline = ms_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    for (;;) {
        uint32_t st = __atomic_load_n(&p->state, __ATOMIC_SEQ_CST);
        if (st == MEMSEM_PIPE_FREE) return 0;
        uint64_t t = ms_now_ns();
        if (t >= deadline) return -ETIMEDOUT;
        ms_futex_wait(&p->state, st, deadline - t, PRIVATE);
    }
}

static int take(memsem_pipe *p, uint32_t tile) {
    uint32_t want = tile;
    return __atomic_load_n(&p->claim, __ATOMIC_SEQ_CST) == tile &&
           __atomic_compare_exchange_n(&p->claim, &want, tile + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* 1 when the worker has been copying tile for longer than patience_ns; else 0, and *left the ns
 * until it would be (or RECHECK_NS when it is not copying the tile). */
static int late(memsem_pipe *p, uint32_t tile, uint64_t patience_ns, uint64_t now, uint64_t *left) {
    *left = RECHECK_NS;
    if (!patience_ns || __atomic_load_n(&p->active, __ATOMIC_SEQ_CST) != tile + 1) return 0;
    /* The route's model may be far slower than this machine (4 MiB over host/cma: 0.7 ms
     * modelled, 0.17-0.3 ms measured): waiting five moves for a descheduled worker before the
     * caller copies the tile itself cost more than the copy. The mean of the worker's copies,
     * not the fastest: copies slowed by other jobs' memory traffic are not late (measured: with
     * twice the fastest, 1-2 of 16 tiles per pipeline were taken over from a running worker and
     * copied twice). */
    uint64_t copies = __atomic_load_n(&p->tiles_moved, __ATOMIC_RELAXED);
    if (copies) {
        uint64_t measured = MEMSEM_PIPE_PATIENCE_X * (__atomic_load_n(&p->move_ns, __ATOMIC_RELAXED) / copies);
        if (measured < MEMSEM_PIPE_PATIENCE_MIN_NS) measured = MEMSEM_PIPE_PATIENCE_MIN_NS;
        if (measured < patience_ns) patience_ns = measured;
    }
    uint64_t since = __atomic_load_n(&p->active_since, __ATOMIC_RELAXED);
    if (now >= since + patience_ns) return 1;
    *left = since + patience_ns - now;
    return 0;
}

uint64_t memsem_pipe_wait(memsem_pipe *p, uint32_t tile, double timeout_s, uint64_t patience_ns) {
    uint32_t d = __atomic_load_n(&p->done, __ATOMIC_ACQUIRE);
    if (d > tile) return p->rc[tile % p->n_slots];
    __atomic_store_n(&p->caller_cpu, sched_getcpu(), __ATOMIC_RELAXED);
    if (take(p, tile)) return MEMSEM_PIPE_YOURS;
    /* The worker has the tile: a tile about to land is cheaper to spin for than to sleep for
     * (unless it runs on this CPU: then only sleeping lets it finish). */
    uint64_t t0 = ms_now_ns(), left;
    while (!shared_cpu(p) && (d = __atomic_load_n(&p->done, __ATOMIC_ACQUIRE)) <= tile &&
           __atomic_load_n(&p->state, __ATOMIC_ACQUIRE) != MEMSEM_PIPE_FREE && ms_now_ns() - t0 < MEMSEM_PIPE_SPIN_NS)
        for (int k = 0; k < 64; k++) cpu_relax();
    if (d <= tile) {
        uint64_t deadline = ms_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
        __atomic_store_n(&p->caller_waiting, 1, __ATOMIC_SEQ_CST);
        for (;;) {
            d = __atomic_load_n(&p->done, __ATOMIC_SEQ_CST);
            if (d > tile) break;
            if (__atomic_load_n(&p->state, __ATOMIC_SEQ_CST) == MEMSEM_PIPE_FREE) {
                d = __atomic_load_n(&p->done, __ATOMIC_SEQ_CST);
                if (d > tile) break;
                __atomic_store_n(&p->caller_waiting, 0, __ATOMIC_SEQ_CST);
                return take(p, tile) ? MEMSEM_PIPE_YOURS : MEMSEM_PIPE_IDLE;
            }
            uint64_t t = ms_now_ns();
            if (late(p, tile, patience_ns, t, &left)) {
                __atomic_store_n(&p->caller_waiting, 0, __ATOMIC_SEQ_CST);
                return MEMSEM_PIPE_LATE;
            }
            if (t >= deadline) {
                __atomic_store_n(&p->caller_waiting, 0, __ATOMIC_SEQ_CST);
                return MEMSEM_PIPE_WAITING;
            }
            uint64_t ns = deadline - t;
            if (patience_ns && left < ns) ns = left;
            ms_futex_wait(&p->done, d, ns, PRIVATE);
        }
        __atomic_store_n(&p->caller_waiting, 0, __ATOMIC_SEQ_CST);
    }
    return p->rc[tile % p->n_slots];
}

void memsem_pipe_release(memsem_pipe *p) {
    __atomic_store_n(&p->caller_cpu, sched_getcpu(), __ATOMIC_RELAXED);
    __atomic_fetch_add(&p->released, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->sleeping, __ATOMIC_SEQ_CST)) ms_futex_wake(&p->released, INT32_MAX, PRIVATE);
}
