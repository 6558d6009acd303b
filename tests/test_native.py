"""The native layer: atomics, futex wait/wake with timeouts, cross-memory attach, segments."""
from __future__ import annotations

import errno
import os
import stat
import threading
import time

import numpy as np
import pytest

from memsem import EngineError, OutOfMemoryError, native
from memsem.native import Segment


def _word_array(n=4):
    a = np.zeros(n, np.uint64)
    return a, a.__array_interface__["data"][0]


def test_atomics_roundtrip():
    a, base = _word_array()
    native.store_release(base, 41)
    assert native.load_acquire(base) == 41
    assert native.fetch_add(base, 2) == 41
    assert native.fetch_sub(base, 1) == 43
    assert int(a[0]) == 42
    ok, seen = native.compare_exchange(base, 0, 7)
    assert not ok and seen == 42
    ok, seen = native.compare_exchange(base, 42, 7)
    assert ok and int(a[0]) == 7


def test_fetch_add_is_atomic_across_threads():
    a, base = _word_array()

    def work():
        for _ in range(20000):
            native.fetch_add(base, 1)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert int(a[0]) == 80000


def test_futex_times_out_and_wakes():
    a = np.zeros(2, np.uint32)
    addr = a.__array_interface__["data"][0]
    t0 = time.monotonic()
    assert native.futex_wait(addr, 0, 0.05) is False
    assert time.monotonic() - t0 >= 0.04  # it waited (no upper bound: load stretches waits)
    assert native.futex_wait(addr, 5, 1.0) is True  # value differs: returns at once

    def waker():
        time.sleep(0.05)
        a[0] = 1
        native.futex_wake(addr)

    th = threading.Thread(target=waker)
    th.start()
    t0 = time.monotonic()
    assert native.futex_wait(addr, 0, 5.0) is True and a[0] == 1  # woken by the store, not timed out
    th.join(timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        native.futex_wait(addr, 0, -1)


def test_vm_read_write_self_and_errors():
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, np.uint8)
    native.vm_read(os.getpid(), dst.ctypes.data, src.ctypes.data, 256)
    assert (dst == src).all()
    new = np.full(256, 9, np.uint8)
    native.vm_write(os.getpid(), new.ctypes.data, src.ctypes.data, 256)
    assert (src == 9).all()
    with pytest.raises(EngineError) as ei:
        native.vm_read(os.getpid(), dst.ctypes.data, 8, 16)  # unmapped remote address
    assert ei.value.errno == errno.EFAULT


def test_segment_mode_0600_unguessable_and_attach_never_unlinks():
    seg = Segment.create("data", 4096)
    try:
        st = os.stat(seg.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        token = seg.name.rsplit(".", 1)[1]
        assert len(token) == 32 and int(token, 16) >= 0  # 128 random bits
        other = Segment.create("data", 4096)
        assert other.name != seg.name
        other.unlink()
        other.close()
        att = Segment.attach(seg.name)
        with pytest.raises(PermissionError):
            att.unlink()
        att.close()
        assert os.path.exists(seg.path)
    finally:
        seg.unlink()
        seg.close()
    assert not os.path.exists(seg.path)


def test_segment_bad_names_rejected():
    with pytest.raises(ValueError, match="segment name"):
        Segment.attach("../etc/passwd")
    with pytest.raises(ValueError, match="nbytes"):
        Segment.create("data", 0)


def _mounted(path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


def test_small_tmpfs_fails_at_create_not_sigbus(tmp_path, monkeypatch):
    """Case 6: more than the segment directory can hold fails at creation with a clear error.

    The tmpfs is unmounted in every case: the arrays mapping its segments are dropped (and their
    mappings released) first, so a plain umount works; a lazy umount is the last resort if it
    did not (and then the test fails: something kept a mapping alive)."""
    import gc
    import subprocess

    mnt = tmp_path / "shm"
    mnt.mkdir()
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("mounting a small tmpfs needs root; CI runs as root")
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True, timeout=60,
                   capture_output=True)
    plain_umount = None
    try:
        monkeypatch.setenv("MEMSEM_SHM_DIR", str(mnt))
        with pytest.raises(OutOfMemoryError, match="cannot reserve"):
            Segment.create("data", 4 << 20)
        assert os.listdir(mnt) == []  # nothing half-created left behind
        import memsem

        with memsem.Runtime() as rt:
            with pytest.raises(OutOfMemoryError):
                rt.alloc(8 << 20, np.uint8)
            small = rt.alloc(1024, np.uint8)
            small[:] = 1
            assert small.sum() == 1024
        del small  # the last reference to the segment's mapping
        gc.collect()
        assert os.listdir(mnt) == [], os.listdir(mnt)
    finally:
        gc.collect()
        if _mounted(mnt):
            plain_umount = subprocess.run(["umount", str(mnt)], timeout=60, capture_output=True, text=True)
            if plain_umount.returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], timeout=60, capture_output=True)
    assert not _mounted(mnt), f"{mnt} is still mounted"
    assert plain_umount is None or plain_umount.returncode == 0, \
        f"plain umount failed (a mapping outlived its array): {plain_umount.stderr}"


def test_plan_copy_refuses_a_plan_that_maps_nothing():
    """A plan of an engine route (no mapping: base 0) is refused with EFAULT before any check
    or copy: a caller that picks the wrong plan gets an error, never a copy from address 0."""
    from memsem.core import Status

    plan = native.new_plan()
    plan.nbytes = 64
    plan.generation = plan.local_gen = 1
    plan.gen_addr = int(native.ffi.cast("uintptr_t", native.ffi.addressof(plan, "local_gen")))
    plan.seq_addr = int(native.ffi.cast("uintptr_t", native.ffi.addressof(plan, "local_seq")))
    plan.nslots = 1
    dst = np.zeros(64, np.uint8)
    for put in (0, 1):
        rc = native.lib.memsem_plan_copy(plan, put, 0, dst.ctypes.data, 64, 0, 0, 0)
        st, value = rc & native.lib.MEMSEM_RC_STATUS_MASK, rc >> native.lib.MEMSEM_RC_VERSION_SHIFT
        assert st == Status.ERRNO and value == errno.EFAULT, hex(rc)
    assert plan.use == 0  # nothing entered, nothing left counted
    assert not dst.any()
