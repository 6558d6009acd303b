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

/* ---- use words: the lifetime of a mapping or of a plan, counted by its holders ------------
 * A use word is a 64-bit counter of holders with a CLOSED bit. Whoever makes the word
 * "closed and no holder left" (exactly one caller) releases the resource behind it: the closer
 * when no holder remained, else the last holder to leave. So a mapping is never unmapped under a
 * copy, a view or a lease that still uses it, and nothing is released on a timer. */
#define MEMSEM_USE_CLOSED_BIT 63
/* 0: entered (counted); 1: the word is closed, nothing counted. */
int memsem_use_enter(uint64_t *word);
/* 0; or 1 when this was the last holder of a closed word (the caller releases the resource). */
int memsem_use_leave(uint64_t *word);
/* 1 when no holder remained (the caller releases now); 0 when holders remain (the last of them
 * gets 1 from leave); 2 when the word was already closed. */
int memsem_use_close(uint64_t *word);
/* Block until a closed word has no holder, at most timeout_s: 0 idle, -ETIMEDOUT. */
int memsem_use_wait_idle(uint64_t *word, double timeout_s);

/* ---- the hot path: one call checks and copies ----------------------------------------------
 * A plan is what a resolution of a window precomputes (runtime/_resolve.py fills it in); the
 * Python side only picks the plan and calls memsem_plan_copy. All addresses are integers. */
#define MEMSEM_LAT_BUCKETS 128
typedef struct memsem_plan {
    uint64_t use;            /* use word: copies running through this plan (+ CLOSED bit) */
    uint64_t generation;     /* the generation the plan was resolved for */
    uint64_t gen_addr;       /* address of the window's generation word (control block) */
    uint64_t seq_addr;       /* address of the window's slot sequence words (nslots, consecutive) */
    uint64_t latest_addr;    /* address of the window's latest-version word */
    uint64_t inflight_addr;  /* address of this participant's in-flight counter (control block) */
    uint64_t base;           /* address of window byte 0: here (memcpy) or in pid (vm) */
    uint64_t nbytes;         /* bytes of one data slot of the window */
    uint64_t slot_stride;    /* bytes from one data slot to the next (0 with one slot) */
    uint32_t nslots;         /* data slots: 1, or 2 (double-buffered versions) */
    int32_t pid;             /* owner pid for MEMSEM_COPY_VM */
    int32_t method;          /* MEMSEM_COPY_MEMCPY or MEMSEM_COPY_VM */
    uint32_t flags;          /* MEMSEM_PLAN_* */
    uint64_t checked_addr;   /* address of the owner's word: CLOCK_MONOTONIC ns of its last
                              * liveness check (one word per owner, shared by its plans) */
    uint64_t check_every_ns; /* ask for a liveness re-check when the last is older (0: never) */
    uint64_t check_bytes;    /* ... or after a copy of at least this many bytes (0: never) */
    uint64_t ops[2];         /* telemetry, [0] get [1] put: operations that returned OK */
    uint64_t bytes[2];       /* bytes they moved */
    uint64_t lat_sum[2];     /* sum of the latencies counted in lat, ns */
    uint64_t local_gen;      /* stand-ins for routes without a control block here: gen_addr and */
    uint64_t local_seq;      /* seq_addr point at these (the engine or the owner enforces) */
    /* Last: what every copy touches above lies in the first 200 bytes (3-4 cache lines, one
     * page for most plans), the histograms' one bucket a copy counts in below. */
    uint64_t lat[2][128];    /* latency histograms, MEMSEM_LAT_BUCKETS each (memsem_lat_bucket) */
} memsem_plan;

#define MEMSEM_PLAN_WRITABLE 1   /* the window was published access="rw" */
#define MEMSEM_PLAN_NO_PUT 2     /* puts refused (double-buffered versions: the owner writes) */
#define MEMSEM_COPY_MEMCPY 0
#define MEMSEM_COPY_VM 1

/* Status in the low 8 bits of memsem_plan_copy's (and the bracket's) result (>= 0). */
#define MEMSEM_OK 0
#define MEMSEM_RC_CLOSED 1        /* the plan was closed: resolve again (nothing moved) */
#define MEMSEM_RC_GEN_BEFORE 2    /* generation moved before the copy (nothing moved) */
#define MEMSEM_RC_GEN_AFTER 3     /* generation moved during the copy (bytes not valid) */
/* MEMSEM_RC_BUSY: a write section is open on the slot, or the version asked for is not
 * committed yet (nothing moved). */
#define MEMSEM_RC_BUSY 4
#define MEMSEM_RC_TORN 5          /* the slot's sequence moved during the copy (bytes not valid) */
#define MEMSEM_RC_VERSION_GONE 6  /* the version asked for was overwritten (nothing valid) */
#define MEMSEM_RC_LEASE_BEFORE 7  /* the lease was not held / expired before the copy */
#define MEMSEM_RC_LEASE_DURING 8  /* the lease expired during the copy (bytes not valid) */
#define MEMSEM_RC_RANGE 9         /* [offset, offset + nbytes) outside the window */
#define MEMSEM_RC_READONLY 10     /* put to a read-only window (or one whose owner writes) */
#define MEMSEM_RC_ERRNO 11        /* the copy failed natively: errno in bits 16.. */
#define MEMSEM_RC_CHECK_FIRST 12  /* a put while the owner's liveness is due: check, then retry */
/* MEMSEM_RC_BUFFER: (memsem._hot.copy only) the local buffer needs the Python door first: not
 * a plain contiguous buffer of the right size and dtype (nothing was done). */
#define MEMSEM_RC_BUFFER 13
/* MEMSEM_RC_VERSION_RANGE: the version asked for is beyond MEMSEM_VERSION_MAX (nothing moved). */
#define MEMSEM_RC_VERSION_RANGE 14
/* memsem._hot.wire only (a kept wire route's request): the bracket is open and the request
 * sent; the value is the bytes of the reply received so far (the caller reads the rest). */
#define MEMSEM_RC_WIRE_PENDING 15
/* memsem._hot.wire only: the bracket is open and the connection failed (the value: errno, 0
 * when the peer closed it); the caller undoes the bracket and drops the connection. */
#define MEMSEM_RC_WIRE_LOST 16
/* memsem._hot.wire only: the bracket is open and the socket did not take the whole request
 * within the call's slice; the value is the bytes of it sent so far (the caller sends the
 * rest within its deadline, then reads the reply). */
#define MEMSEM_RC_WIRE_SENDING 17
/* memsem._hot.copy keeps the GIL for copies of fewer bytes than this (and releases it above). */
#define MEMSEM_HOT_GIL_BYTES 65536
/* Flags in bits 8-15. */
#define MEMSEM_RC_LAST_OUT 256    /* this call left a closed plan last: the caller releases it */
#define MEMSEM_RC_CHECK_PEER 512  /* the owner's liveness is due for a re-check */
#define MEMSEM_RC_STATUS_MASK 255
#define MEMSEM_RC_ATTENTION 1023  /* any status or flag: the slow path */
#define MEMSEM_RC_VERSION_SHIFT 16
/* The largest version a window has (2**48 - 1): a result's value field holds 48 bits, and a slot's
 * sequence word holds version << 1 (odd while a write section is open). Versions asked for
 * beyond it are MEMSEM_RC_VERSION_RANGE; a write section past it is refused by the owner. */
#define MEMSEM_VERSION_MAX 281474976710655

/* ---- slot layouts of a control block (gva/_control_block.py reads them from here) ---------
 * A lease slot is MEMSEM_LEASE_WORDS 64-bit words: holder pid, holder start time, expiry
 * (CLOCK_MONOTONIC ns), lease id (odd; even: a claim mark in progress; 0: free), the version
 * the lease pins (0: none), and one spare word. An in-flight slot is MEMSEM_INFLIGHT_WORDS
 * words: the holder's identity word (pid | start << 22; 0: free) and its count of copies in
 * flight. */
#define MEMSEM_LEASE_WORDS 6
#define MEMSEM_LEASE_PID 0
#define MEMSEM_LEASE_START 1
#define MEMSEM_LEASE_EXPIRY 2
#define MEMSEM_LEASE_ID 3
#define MEMSEM_LEASE_VERSION 4
/* Claim the first free lease slot (id word 0) of the n_slots slots at slots_addr: CAS its id
 * word to `mark` (a claim in progress), store pid, start, version and expiry, publish lease_id
 * (release), fence (seq_cst), then read the window's state word at state_addr. Returns the
 * slot; -1 when no slot was free (the caller reclaims slots of expired or dead holders itself);
 * -2 when the state was not `live` (the slot is freed again and its waiters woken). */
int64_t memsem_lease_claim(uint64_t slots_addr, uint32_t n_slots, uint64_t mark, uint64_t pid, uint64_t start,
                           uint64_t version, uint64_t expiry, uint64_t lease_id, uint64_t state_addr,
                           uint64_t live);
/* Header words of a control block that memsem_pin_latest reads (gva/_control_block.py holds
 * the layout and checks these against it at import). */
#define MEMSEM_CB_GENERATION 4
#define MEMSEM_CB_STATE 5
#define MEMSEM_CB_LATEST 8
#define MEMSEM_CB_SEQ0 16
#define MEMSEM_CB_WRITER 19
/* One try of a reader's pin of the latest version (memsem.core._lease.pin_latest): check the
 * generation word against `generation`, read the latest version v (*version = v), claim a
 * lease slot pinning v (memsem_lease_claim, `live` being the LIVE state), check the generation
 * again, then (Dekker with a writer's intent store and its lease scan) read the writer-intent
 * word and v's slot sequence word (*seq). Returns the lease slot when no writer is about to
 * overwrite v's slot and the sequence word says v is committed there; else -4: the slot is
 * released again (its waiters woken) and the caller waits for the commit. -1: no free lease
 * slot (the caller reclaims slots itself); -2: the window is not LIVE; -3: the generation is
 * not `generation` (the claimed slot, if any, released). */
int64_t memsem_pin_latest(uint64_t cb_base, uint64_t generation, uint64_t n_slots, uint64_t slots_addr,
                          uint32_t n_lease, uint64_t mark, uint64_t pid, uint64_t start, uint64_t expiry,
                          uint64_t lease_id, uint64_t live, uint64_t *version, uint64_t *seq);
#define MEMSEM_INFLIGHT_WORDS 2
#define MEMSEM_INFLIGHT_IDENT 0
#define MEMSEM_INFLIGHT_COUNT 1

/* Copy nbytes between local (an address here) and the window at offset (bytes from window byte
 * 0, within one slot); put=0 reads the window, put=1 writes it. want_version: 0 reads the latest
 * committed version, else exactly that one (at most MEMSEM_VERSION_MAX). lease_slot/lease_id: the
 * address of a lease slot of the window's control block that must hold lease_id, unexpired,
 * before and after the copy (0: no lease). Checks, in order: plan open, range, version range,
 * permission, lease, then (counted in the participant's in-flight word) generation and slot
 * sequence before, the copy, generation, sequence and lease after. Returns status | flags |
 * value << 16 (unsigned: the value has up to 48 bits). The value is: for MEMSEM_OK the version
 * whose bytes were read or overwritten; MEMSEM_RC_GEN_* the generation found; MEMSEM_RC_BUSY /
 * MEMSEM_RC_VERSION_GONE the version the slot holds; MEMSEM_RC_ERRNO the errno. A copy that
 * finds the generation moved (before or after) wakes the owner's retire, which waits on the
 * participants' in-flight counts (futex on the count's low 32 bits).
 * (The caller need not touch the control block afterwards: it may be released by then.) */
uint64_t memsem_plan_copy(memsem_plan *plan, int put, uint64_t offset, uint64_t local,
                         uint64_t nbytes, uint64_t want_version, uint64_t lease_slot,
                         uint64_t lease_id);

/* The same checks around a copy made elsewhere (an engine's get/put, a gather of many ranges,
 * the owner's side of a tcp request): open does everything memsem_plan_copy does before the
 * copy, close everything after. memsem_bracket is the state between the two (one per open
 * bracket; memsem/core/_bracket.py is its one Python user). */
typedef struct memsem_bracket {
    memsem_plan *plan;       /* the plan the bracket was opened on (set by open) */
    uint64_t nbytes;         /* bytes of the copy */
    uint64_t lease_slot;     /* the lease checked before and after (0: none) */
    uint64_t lease_id;
    uint64_t version;        /* out: the version whose bytes the range holds */
    uint64_t seq;            /* the version's slot sequence word at open */
    uint64_t slot;           /* the version's data slot */
    uint64_t start_ns;       /* CLOCK_MONOTONIC ns of the open (latency telemetry) */
    uint64_t address;        /* out: address of the range in the version's slot */
    int32_t put;             /* 1: the copy writes the window */
    int32_t is_open;         /* 1 from a successful open until its close */
} memsem_bracket;

/* Open: returns what memsem_plan_copy would before copying (MEMSEM_OK: b->address and
 * b->version are valid, and the copy is counted in flight until close). After a non-OK open
 * the bracket is not open: do not close it. */
uint64_t memsem_bracket_open(memsem_bracket *b, memsem_plan *plan, int put, uint64_t offset,
                            uint64_t nbytes, uint64_t want_version, uint64_t lease_slot,
                            uint64_t lease_id);
/* Close an open bracket (failed != 0: the copy itself failed, the bracket is just undone):
 * returns what memsem_plan_copy would (MEMSEM_OK with the version; MEMSEM_RC_TORN: the bytes
 * moved are not one version; MEMSEM_RC_GEN_AFTER...). A bracket that is not open: MEMSEM_RC_ERRNO
 * with EBADF, nothing done. */
uint64_t memsem_bracket_close(memsem_bracket *b, int failed);
/* Index of the latency histogram bucket of a duration in ns (4 buckets per power of two). */
int memsem_lat_bucket(uint64_t ns);
/* Lower bound in ns of a bucket (inverse of memsem_lat_bucket). */
uint64_t memsem_lat_bucket_floor(int bucket);

/* ---- scans of a control block's slot tables (one call instead of one per word) ------------
 * Both start with a sequentially consistent fence (the Dekker side of the owner: its state or
 * generation store comes before). memsem_scan_inflight writes (identity, count) of every
 * in-flight slot whose count is not 0; memsem_scan_leases writes (slot, pid, start, expiry,
 * version) of every slot holding a lease (an odd id: even is a claim in progress) whose expiry
 * is after now_ns. Both return how many they found (at most max). Layouts: gva/_control_block.py. */
int memsem_scan_inflight(uint64_t slots, uint32_t n, uint64_t *out, uint32_t max);
int memsem_scan_leases(uint64_t slots, uint32_t n, uint64_t now_ns, uint64_t *out, uint32_t max);

/* ---- mappings without file descriptors ------------------------------------------------------
 * mmap(MAP_SHARED) of fd's first nbytes; the caller closes fd right after: a mapping holds no
 * descriptor, so thousands of windows never approach RLIMIT_NOFILE. Returns the address or
 * -errno. */
int64_t memsem_map(int fd, uint64_t nbytes, int writable);
int memsem_unmap(uint64_t addr, uint64_t nbytes);
/* mprotect a page-aligned range: 1 read-write, 0 read-only (debug mode of write sections). */
int memsem_protect(uint64_t addr, uint64_t nbytes, int writable);

/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC: one clock for all processes of a node). */
uint64_t memsem_monotonic_ns(void);

/* ---- pipeline movers (native/memsem_pipe.c) -------------------------------------------------
 * Staging copies of pipelines' upcoming tiles on native threads that never need the GIL
 * (memsem/pipeline/_movers.py). A memsem_mover_pool is one runtime's pool of copy workers
 * (created on demand, up to max_workers, parked on a futex between jobs, joined by
 * memsem_mover_pool_shutdown); not an engine (a transport): it copies through the plan of a
 * resolution. A memsem_pipe is one pipeline's job: the caller fills it (zeroed, then the "set by
 * the caller" fields), submits runs of it, and keeps everything it points at alive and mapped
 * until memsem_pipe_join returned 0: the plan (its resolution), the destination, the rc/t_move
 * arrays, the lease slot.
 *
 * Tile i (bytes [i * tile_bytes, ...) of the ref) goes to slot i % n_slots. A run copies tiles
 * first..n_tiles-1 in order; tile i waits until the caller released tile i - n_slots
 * (memsem_pipe_release, once per tile, in order: a slot is reused only after its tile was
 * released), then claims it (claim: the next tile nobody started, taken by compare-and-swap; a
 * caller that finds the tile it waits for unclaimed takes it and copies it itself, so a late or
 * descheduled worker never makes the caller wait longer than copying the tile would), then,
 * with ready_base set, waits until the window's ready words of every window tile the tile
 * overlaps hold the plan's generation (at most timeout_ns per tile; holding the plan's use word,
 * so the control block stays mapped; re-checking the generation, the stop bit and, with
 * pidfd >= 0, the owner's liveness every MEMSEM_PIPE_SLICE_NS), then copies it with
 * memsem_plan_copy (every check of a get; of version `version` when set: the version a pinned
 * lease keeps) and hands it over: rc[slot] = the copy's result (or a MEMSEM_PIPE_* status), then
 * done = i + 1. Any status but MEMSEM_OK, or MEMSEM_RC_LAST_OUT, ends the run after that tile is
 * handed over: the caller handles it (in Python, with the general path's retries and errors) and
 * may submit a new run at a later tile.
 *
 * The caller never waits long for a worker that is not running: a worker copying the tile the
 * caller waits for for longer than the caller's patience (descheduled on a loaded machine) makes
 * memsem_pipe_wait return MEMSEM_PIPE_LATE; memsem_pipe_take_over then ends the run (the worker
 * finishes the copy in progress, hands that tile over and claims no other) and says whether the
 * tile is the caller's to copy (into memory the worker does not write: its slot is the worker's
 * until the run ended).
 *
 * A worker never shares the caller's CPU when another is allowed: before each tile, a worker
 * that finds itself on the CPU the caller last ran on moves itself off it (narrows its own
 * affinity to the CPUs it started with but that one, which migrates it, then widens it again:
 * it is held to no CPU; cpu_moves counts the moves). On one CPU the two would only take turns:
 * the caller computes without sleeping, so the worker would run only when the caller's slice
 * ends, late, and every tile would be the caller's. Neither side spins for the other while
 * they share a CPU. */
#define MEMSEM_PIPE_TIMEOUT 32    /* a ready word was not set in time (value: its window tile) */
#define MEMSEM_PIPE_PEER_LOST 33  /* the owner's pidfd says it exited while the worker waited */
#define MEMSEM_PIPE_STOPPED 34    /* (internal) stop was asked while the worker waited */
#define MEMSEM_PIPE_WAITING 35    /* memsem_pipe_wait: the tile is not finished within its timeout */
#define MEMSEM_PIPE_IDLE 36       /* memsem_pipe_wait: the run ended without finishing the tile */
#define MEMSEM_PIPE_YOURS 37      /* memsem_pipe_wait: the tile was unclaimed; the caller claimed it */
#define MEMSEM_PIPE_LATE 38       /* memsem_pipe_wait / take_over: the worker's copy of the tile is late */
#define MEMSEM_PIPE_SLICE_NS 20000000   /* longest sleep of a worker between re-checks */
#define MEMSEM_PIPE_SPIN_NS 20000       /* memsem_pipe_wait spins this long before sleeping */
#define MEMSEM_PIPE_SLOT_SPIN_NS 200000 /* a worker spins this long for a slot before sleeping */
#define MEMSEM_PIPE_PARK_NS 1000000000  /* a parked worker re-checks the pool's stop this often */
#define MEMSEM_PIPE_PATIENCE_X 3        /* patience: at most this many times the worker's mean tile copy ... */
#define MEMSEM_PIPE_PATIENCE_MIN_NS 100000  /* ... and at least this long */
/* memsem_pipe.state */
#define MEMSEM_PIPE_FREE 0        /* no run submitted, or the last one finished */
#define MEMSEM_PIPE_QUEUED 1      /* submitted, no worker took it yet */
#define MEMSEM_PIPE_RUNNING 2     /* a worker runs it */

typedef struct memsem_mover_pool memsem_mover_pool;  /* opaque */

typedef struct memsem_pipe {
    /* set by the caller before memsem_mover_pool_submit */
    memsem_plan *plan;          /* the resolution's plan the tiles are copied through */
    uint64_t ref_offset;        /* the ref's first byte in the window */
    uint64_t ref_nbytes;        /* bytes of the ref */
    uint64_t tile_bytes;        /* bytes per tile (the last may be shorter) */
    uint64_t dst;               /* staging: slot 0's address; out mode: the address of ref byte 0 */
    uint64_t slot_bytes;        /* bytes from one slot to the next; 0: out mode (tile i at dst + its offset) */
    uint32_t n_tiles;           /* tiles of the ref */
    uint32_t n_slots;           /* staging slots (the look-ahead) */
    uint32_t first;             /* first tile of the run */
    int32_t pidfd;              /* the owner's pidfd, checked while waiting; -1: none */
    uint64_t lease_slot;        /* memsem_plan_copy's lease arguments (0, 0: no lease) */
    uint64_t lease_id;
    uint64_t ready_base;        /* address of the window's ready word 0; 0: no ready waits */
    uint64_t window_tile_bytes; /* bytes per window tile (ready word) */
    uint64_t n_ready;           /* ready words of the window */
    uint64_t timeout_ns;        /* bound of one tile's wait for its ready words */
    uint64_t version;           /* the version every tile is read at (a pinned lease's); 0: the latest */
    uint64_t *rc;               /* n_slots words: the result of the tile in each slot */
    uint64_t *t_move;           /* 2 * n_slots words: CLOCK_MONOTONIC ns its copy started, ended */
    /* shared by the caller and the worker */
    uint32_t done;              /* tiles [0, done) are handed over (futex the caller sleeps on) */
    uint32_t released;          /* tiles the caller released (futex the worker sleeps on); top bit: stop */
    uint32_t sleeping;          /* the worker sleeps on released */
    uint32_t caller_waiting;    /* the caller sleeps on done */
    uint32_t state;             /* MEMSEM_PIPE_FREE / QUEUED / RUNNING (futex: join sleeps on it) */
    uint32_t claim;             /* the next tile nobody started copying (compare-and-swap) */
    uint32_t active;            /* tile + 1 of the tile the worker is copying now, or 0 */
    int32_t caller_cpu;         /* the CPU the caller last ran on (submit, wait, release); -1: unknown */
    int32_t worker_cpu;         /* the CPU the worker last ran on (each tile); -1: unknown */
    uint32_t cpu_moves;         /* times the worker left the caller's CPU (see memsem_pipe.c) */
    uint64_t active_since;      /* CLOCK_MONOTONIC ns that copy began */

    uint64_t sleep_addr;        /* the ready word the worker sleeps on (woken by stop), or 0 */
    struct memsem_pipe *next;   /* the pool's queue (under its lock) */
    /* counters, read by the caller at any time */
    uint64_t move_ns;           /* time in memsem_plan_copy */
    uint64_t ready_wait_ns;     /* time waiting for ready words */
    uint64_t hold_ns;           /* time waiting for the caller to release a slot (ended waits) */
    uint64_t hold_since;        /* CLOCK_MONOTONIC ns the wait in progress for a slot began, or 0 */
    uint64_t bytes_moved;
    uint64_t tiles_moved;
} memsem_pipe;

/* A new mover pool of at most max_workers workers (none started yet); NULL when out of memory. */
memsem_mover_pool *memsem_mover_pool_new(uint32_t max_workers);
/* Queue a run of p (tiles first..n_tiles-1) for a worker; wakes a parked one or starts one
 * (signals blocked) when none is free. 0, -EAGAIN (the pool's lock is held: nothing queued, the
 * caller moves tiles itself and may submit later; never waited for), -EBUSY (p has a run not yet
 * joined), -EINVAL (bad geometry), -ESHUTDOWN (the pool or p is shut down) or -errno of
 * pthread_create (then no worker exists at all: the caller moves the tiles itself). Records the
 * caller's CPU: a worker leaves it (see above). */
int memsem_mover_pool_submit(memsem_mover_pool *pool, memsem_pipe *p);
/* Stop every worker (they end after the copy in progress: stop each pipe first) and join them,
 * at most timeout_s: 0, or -ETIMEDOUT (a worker is still in a copy: the pool must then never
 * be freed; memsem_mover_pool_shutdown may be called again). Later submits fail. */
int memsem_mover_pool_shutdown(memsem_mover_pool *pool, double timeout_s);
/* Free a shut-down pool (after memsem_mover_pool_shutdown returned 0). */
void memsem_mover_pool_free(memsem_mover_pool *pool);
/* Workers started so far (alive or joined). */
uint32_t memsem_mover_pool_workers(memsem_mover_pool *pool);
/* Stop p for good (sets the stop and closed bits, wakes the worker): its run ends after the copy
 * in progress and later submits of p fail with -ESHUTDOWN. */
void memsem_pipe_stop(memsem_pipe *p);
/* Wait at most timeout_s until no worker uses p: a queued run is taken off the queue at once;
 * a running one is waited for. 0 (also when nothing was submitted), -ETIMEDOUT (keep everything
 * alive and join later; with timeout_s 0 also when the pool's lock is held). */
int memsem_pipe_join(memsem_mover_pool *pool, memsem_pipe *p, double timeout_s);
/* The result of tile (what the worker handed over), after waiting at most timeout_s (a short
 * spin, then the done futex); MEMSEM_PIPE_YOURS when nobody had started it (the caller claimed
 * it: it copies the tile itself); MEMSEM_PIPE_LATE when the worker has been copying it for more
 * than patience_ns (0: wait however long it takes), or, once the worker copied a tile of this
 * pipe, for more than MEMSEM_PIPE_PATIENCE_X times its mean copy (at least
 * MEMSEM_PIPE_PATIENCE_MIN_NS) when that is shorter; MEMSEM_PIPE_WAITING when not finished in
 * time; MEMSEM_PIPE_IDLE when the run ended without finishing it (stopped). The caller asks for
 * tiles in order, each once all earlier ones were handed to it. */
uint64_t memsem_pipe_wait(memsem_pipe *p, uint32_t tile, double timeout_s, uint64_t patience_ns);
/* After MEMSEM_PIPE_LATE for tile: end the run (the worker claims no further tile; p may be
 * submitted again once memsem_pipe_join returned 0). The tile's result when the worker handed it
 * over meanwhile, else MEMSEM_PIPE_LATE: the caller copies the tile itself, not into its slot
 * (the worker may still write there until the run ended), and ignores the worker's result for
 * it but for MEMSEM_RC_LAST_OUT (memsem_pipe_result once the run ended). */
uint64_t memsem_pipe_take_over(memsem_pipe *p, uint32_t tile);
/* What the worker handed over for tile (its slot's word), once the run ended. */
uint64_t memsem_pipe_result(memsem_pipe *p, uint32_t tile);
/* The caller released its oldest held tile (one call per tile, in tile order). */
void memsem_pipe_release(memsem_pipe *p);
/* ---- end of pipeline movers ------------------------------------------------------------------ */

/* ---- async word waiter (native/memsem_wait.c) ------------------------------------------------
 * Waits on many shared 32/64-bit words at once, for memsem.core._async.AsyncWordWaiter:
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

/* ---- delta versions (native/memsem_delta.c; memsem/sync/_delta*.py) ------------------------
 * A tile is a run of at most 65536 elements of one tensor (a patch's element indices are
 * uint16). The *_tiles calls take parallel arrays indexed by tile (addresses as integers) and
 * allocate nothing; callers split the tiles among threads (cffi drops the GIL around each). */
#define MEMSEM_DELTA_DENSE 4294967295  /* a tile's count: changed, and moved whole */
/* 64-bit digest of nbytes at addr (built like XXH3's long-input path): not cryptographic. */
uint64_t memsem_digest(uint64_t addr, uint64_t nbytes, uint64_t seed);
/* out[i] = memsem_digest(addr[i], nbytes[i], 0) for every tile. */
void memsem_digest_tiles(const uint64_t *addr, const uint64_t *nbytes, uint64_t n, uint64_t *out);
/* Which implementation of the digest's bulk runs (every one computes the same function):
 * which = 0 the fastest this CPU has (the default, chosen at the first digest), 1 the base
 * (SSE2 or plain C), 2 AVX2, -1 none (a query). Returns the one in use (1 or 2), or -1 when
 * which is not one of these or the CPU lacks it (nothing changed). */
int memsem_digest_impl(int which);
/* What changed in each tile since the previous version, in one pass over it (the tile stays in
 * cache): digest[i] = its digest at new_addr[i]; count[i] = 0 when it equals prev_digest[i]
 * (prev_digest may be NULL: none), else the elements (itemsize[i] bytes: 1, 2, 4 or 8) that differ
 * from old_addr[i], written as a patch at out (patches one after another, in tile order: count
 * uint16 element indices, ascending, padded to 8 bytes, then the count new values, padded to 8;
 * padding zeroed), or MEMSEM_DELTA_DENSE when there is no old_addr[i] (0), more than limit[i]
 * differ, or the patch would take the patches past out_cap bytes. Returns the bytes written. */
uint64_t memsem_record_tiles(const uint64_t *new_addr, const uint64_t *old_addr, const uint64_t *nbytes,
                             const uint32_t *itemsize, const uint32_t *limit, const uint64_t *prev_digest, uint64_t n,
                             uint64_t *digest, uint32_t *count, uint64_t out, uint64_t out_cap);
/* Apply the patch at patch[i] (record_tiles' layout) to the tile at dst[i] (nbytes[i] bytes) for
 * every tile whose count is neither 0 nor MEMSEM_DELTA_DENSE. An index past its tile is not
 * written; returns how many there were (0 normally: else the patch is not the writer's). */
uint64_t memsem_patch_tiles(const uint64_t *dst, const uint64_t *nbytes, const uint32_t *itemsize,
                            const uint32_t *count, const uint64_t *patch, uint64_t n);
/* patch_tiles (count may be NULL: no patches), each tile then digested while in cache and
 * compared with expected[i]: returns the tiles that do not match (a patch index past its tile
 * counts as a mismatch). */
uint64_t memsem_check_tiles(const uint64_t *dst, const uint64_t *nbytes, const uint32_t *itemsize,
                            const uint32_t *count, const uint64_t *patch, const uint64_t *expected, uint64_t n);
/* ---- end of delta versions ------------------------------------------------------------------ */

#endif
