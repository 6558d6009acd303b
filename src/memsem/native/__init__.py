"""Native layer: atomics, futex, cross-memory attach, shared segments, process liveness.

Everything here wraps ``memsem._native`` (cffi, API mode, built from ``native/``). Addresses are
plain integers (bytes); callers keep the memory they point at alive.
"""
from memsem.native._lib import (
    COPY_MEMCPY,
    COPY_VM,
    DELTA_DENSE,
    LAT_BUCKETS,
    UseWord,
    check_rc,
    check_tiles,
    compare_exchange,
    digest,
    digest_tiles,
    fetch_add,
    fetch_sub,
    ffi,
    futex_wait,
    futex_wake,
    lib,
    load_acquire,
    map_fd,
    memcpy,
    monotonic_ns,
    new_plan,
    patch_tiles,
    protect,
    record_tiles,
    unmap,
    store_release,
    vm_read,
    vm_write,
)
from memsem.native._proc import ProcessIdentity, node_id, process_alive, process_start_time
from memsem.native._segment import Segment, segment_dir, segment_prefix

__all__ = [
    "COPY_MEMCPY", "COPY_VM", "DELTA_DENSE", "LAT_BUCKETS", "check_tiles", "digest", "digest_tiles",
    "patch_tiles", "record_tiles", "UseWord", "map_fd", "new_plan", "protect", "unmap",
    "check_rc", "compare_exchange", "fetch_add", "fetch_sub", "ffi", "futex_wait", "futex_wake",
    "lib", "load_acquire", "memcpy", "monotonic_ns", "store_release", "vm_read",
    "vm_write", "ProcessIdentity", "node_id", "process_alive", "process_start_time", "Segment",
    "segment_dir", "segment_prefix",
]
