"""The shmem host emulator (a test double of Ascend SHMEM) and the cffi ABI binding to it.

Every PE is a separate process (multiprocessing spawn) that loads the emulator through
``memsem.engines.mte._binding.load_aclshmem``, the same path a real libshmem.so takes. Every wait
is bounded: process joins and result queues have timeouts, the emulator's barriers use the
attr's control_operation_timeout, and signal waits use the emulator-only wait bound.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import memsem.engines.mte._binding  # noqa: F401
except ImportError:  # not installed: use the source tree (spawned children inherit sys.path)
    sys.path.insert(0, str(ROOT / "src"))

from memsem._errors import EngineError, NotSupportedError  # noqa: E402
from memsem.engines.mte import _binding as _aclshmem  # noqa: E402
from memsem.engines.mte._binding import emu_last_error, load_aclshmem  # noqa: E402

pytestmark = pytest.mark.npu   # needs the Ascend SHMEM library: here its host emulator

EMU_DIR = ROOT / "native" / "shmem_emu"
PROC_TIMEOUT = 60.0
HEAP = 1 << 20


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def emu_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("no C compiler to build the shmem host emulator")
    out = tmp_path_factory.mktemp("shmem_emu")
    subprocess.run(["sh", str(EMU_DIR / "build.sh"), str(out)], check=True, timeout=120,
                   capture_output=True)
    return str(out / "libshmem_host_emu.so")


@pytest.fixture(autouse=True)
def _quiet_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    # The emulator logs every error to stderr like the real library; the tests provoke many.
    monkeypatch.setenv("MEMSEM_SHMEM_EMU_LOG", "0")


def _shm_names(uid_hex: str) -> list[str]:
    try:
        return [n for n in os.listdir("/dev/shm") if uid_hex in n]
    except FileNotFoundError:
        return []


# --------------------------------------------------------------------------- PE side

class _PE:
    """One initialized PE inside a worker process."""

    def __init__(self, lib_path: str, pe: int, n: int, uid_bytes: bytes, *, heap: int = HEAP,
                 init_timeout: int = 30, ctl_timeout: int = 30) -> None:
        self.ffi, self.lib = load_aclshmem(lib_path)
        ffi, lib = self.ffi, self.lib
        self.pe, self.n, self.heap_size = pe, n, heap
        self.uid = ffi.new("aclshmemx_uniqueid_t *")
        ffi.memmove(self.uid, uid_bytes, len(uid_bytes))
        self.attr = ffi.new("aclshmemx_init_attr_t *")
        assert lib.aclshmemx_set_attr_uniqueid_args(pe, n, heap, self.uid, self.attr) == 0
        fill_option_attr(ffi, lib, self.attr, init_timeout, ctl_timeout)
        rc = lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, self.attr)
        assert rc == 0, (rc, emu_last_error(ffi, lib))
        assert lib.aclshmemx_init_status() == lib.ACLSHMEM_STATUS_IS_INITIALIZED
        assert (lib.aclshmem_my_pe(), lib.aclshmem_n_pes()) == (pe, n)
        lib.aclshmemx_emu_set_wait_timeout_ms(20000)
        self.base = self.addr(lib.aclshmemx_get_heap_base(lib.DEVICE_SIDE))
        assert self.base != 0

    def addr(self, p) -> int:
        return int(self.ffi.cast("uintptr_t", p))

    def off(self, p) -> int:
        return self.addr(p) - self.base

    def ok(self) -> None:
        code, msg = emu_last_error(self.ffi, self.lib)
        assert code == 0, (code, msg)

    def err(self) -> tuple[int, str]:
        return emu_last_error(self.ffi, self.lib)

    def local(self, p, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.ffi.buffer(p, nbytes), dtype=np.uint8)

    def barrier(self) -> None:
        self.lib.aclshmem_barrier_all()
        self.ok()


def fill_option_attr(ffi, lib, attr, init_timeout: int = 120, ctl_timeout: int = 120) -> None:
    # The C++ header's default member initializer; from C it must be written by hand.
    o = attr.option_attr
    o.version = (1 << 16) + ffi.sizeof("aclshmem_init_optional_attr_t")
    o.data_op_engine_type = lib.ACLSHMEM_DATA_OP_MTE
    o.shm_init_timeout = init_timeout
    o.shm_create_timeout = init_timeout
    o.control_operation_timeout = ctl_timeout


def _scenario_rma(s: _PE, defer: bool = False) -> dict:
    ffi, lib, pe, n = s.ffi, s.lib, s.pe, s.n
    right, left = (pe + 1) % n, (pe - 1) % n
    a = lib.aclshmem_malloc(4096)
    b = lib.aclshmem_malloc(10000)
    c = lib.aclshmem_calloc(16, 64)
    d = lib.aclshmem_align(65536, 100)
    s.ok()
    assert ffi.NULL not in (a, b, c, d)
    offsets = [s.off(x) for x in (a, b, c, d)]
    assert offsets[3] % 65536 == 0
    assert not s.local(c, 1024).any()
    lib.aclshmem_free(b)
    b = lib.aclshmem_malloc(10000)
    s.ok()
    assert s.off(b) == offsets[1], "free + same malloc must give the same offset back"

    # blocking put / get
    src = np.full(4096, pe + 1, dtype=np.uint8)
    lib.aclshmem_putmem(a, ffi.from_buffer(src), 4096, right)
    s.ok()
    s.barrier()
    assert (s.local(a, 4096) == left + 1).all()
    got = np.zeros(4096, dtype=np.uint8)
    lib.aclshmem_getmem(ffi.from_buffer(got), a, 4096, right)
    s.ok()
    assert (got == pe + 1).all()

    # nbi put + quiet
    pattern = ((np.arange(10000) + 7 * pe) % 251).astype(np.uint8)
    lib.aclshmem_putmem_nbi(b, ffi.from_buffer(pattern), 10000, right)
    s.ok()
    assert lib.aclshmemx_emu_pending_ops() == (1 if defer else 0)
    lib.aclshmemx_quiet_on_stream(ffi.NULL)
    assert lib.aclshmemx_emu_pending_ops() == 0
    s.barrier()
    assert (s.local(b, 10000) == ((np.arange(10000) + 7 * left) % 251)).all()
    got = np.zeros(10000, dtype=np.uint8)
    lib.aclshmem_getmem_nbi(ffi.from_buffer(got), b, 10000, right)
    lib.aclshmemx_quiet_on_stream(ffi.NULL)
    s.ok()
    assert (got == pattern).all()

    # on-stream variants with an opaque stream handle
    stream = ffi.cast("void *", 0x5000 + pe)
    small = np.arange(100, dtype=np.uint8) ^ pe
    lib.aclshmemx_putmem_on_stream(d, ffi.from_buffer(small), 100, right, stream)
    lib.aclshmemx_quiet_on_stream(ffi.NULL)          # another stream: must not complete it
    assert lib.aclshmemx_emu_pending_ops() == (1 if defer else 0)
    lib.aclshmemx_quiet_on_stream(stream)
    s.ok()
    s.barrier()
    assert (s.local(d, 100) == (np.arange(100, dtype=np.uint8) ^ left)).all()
    got = np.zeros(100, dtype=np.uint8)
    lib.aclshmemx_getmem_on_stream(ffi.from_buffer(got), d, 100, right, stream)
    lib.aclshmemx_quiet_on_stream(stream)
    s.ok()
    assert (got == small).all()

    # aclshmem_ptr: direct load/store into every peer's heap
    assert lib.aclshmem_ptr(a, pe) == a
    for q in range(n):
        p = lib.aclshmem_ptr(a, q)
        s.ok()
        assert p != ffi.NULL
        assert (s.local(p, 4096) == ((q - 1) % n) + 1).all()

    # bad PE: NULL, named
    for bad in (n, -1, 1 << 20):
        assert lib.aclshmem_ptr(a, bad) == ffi.NULL
        code, msg = s.err()
        assert code == lib.ACLSHMEM_INVALID_PARAM and f"PE {bad}" in msg, msg
    # a range outside the symmetric heap
    end = ffi.cast("char *", lib.aclshmemx_get_heap_base(lib.DEVICE_SIDE)) + s.heap_size
    assert lib.aclshmem_ptr(end, 0) == ffi.NULL
    code, msg = s.err()
    assert code == lib.ACLSHMEM_INVALID_PARAM and "outside the symmetric heap" in msg, msg
    lib.aclshmem_putmem(end - 10, ffi.from_buffer(src), 100, right)
    code, msg = s.err()
    assert code == lib.ACLSHMEM_INVALID_PARAM and "dst range" in msg, msg
    lib.aclshmem_getmem(ffi.from_buffer(got), end - 10, 100, right)
    code, msg = s.err()
    assert code == lib.ACLSHMEM_INVALID_PARAM and "src range" in msg, msg
    lib.aclshmem_putmem_nbi(ffi.from_buffer(got), ffi.from_buffer(src), 100, right)  # private dst
    code, msg = s.err()
    assert code == lib.ACLSHMEM_INVALID_PARAM and "outside the symmetric heap" in msg, msg
    assert lib.aclshmemx_emu_pending_ops() == 0
    # out of heap memory: NULL, same on every PE
    assert lib.aclshmem_malloc(2 * s.heap_size) == ffi.NULL
    assert s.err()[0] == lib.ACLSHMEM_MALLOC_FAILED
    s.barrier()
    return {"offsets": offsets}


def _scenario_signal(s: _PE) -> dict:
    ffi, lib, pe, n = s.ffi, s.lib, s.pe, s.n
    sig = lib.aclshmem_calloc(1, 8)
    cnt = lib.aclshmem_calloc(1, 8)
    data = lib.aclshmem_malloc(4096)
    data2 = lib.aclshmem_malloc(64 * n)
    s.ok()
    sigp = ffi.cast("int32_t *", sig)
    s.barrier()
    # SET: PE 0 sends a payload plus signal to every other PE
    if pe == 0:
        for q in range(1, n):
            payload = np.full(4096, 100 + q, dtype=np.uint8)
            lib.aclshmemx_putmem_signal(data, ffi.from_buffer(payload), 4096, sig, 7 + q,
                                        lib.ACLSHMEM_SIGNAL_SET, q)
            s.ok()
    else:
        lib.aclshmem_signal_wait_until(sigp, lib.ACLSHMEM_CMP_EQ, 7 + pe)
        s.ok()
        assert (s.local(data, 4096) == 100 + pe).all(), "data must be visible once the signal is"
    # ADD: every PE adds 1 to PE 0's counter after its 64-byte slot
    mine = np.full(64, pe + 1, dtype=np.uint8)
    lib.aclshmemx_putmem_signal_nbi(ffi.cast("char *", data2) + 64 * pe, ffi.from_buffer(mine), 64,
                                    cnt, 1, lib.ACLSHMEM_SIGNAL_ADD, 0)
    lib.aclshmemx_quiet_on_stream(ffi.NULL)
    s.ok()
    if pe == 0:
        lib.aclshmem_signal_wait_until(ffi.cast("int32_t *", cnt), lib.ACLSHMEM_CMP_GE, n)
        s.ok()
        slots = s.local(data2, 64 * n).reshape(n, 64)
        assert all((slots[q] == q + 1).all() for q in range(n))
    s.barrier()
    # every comparison, satisfied at once
    sigp[0] = 5
    for cmp, val in (("EQ", 5), ("NE", 4), ("GT", 4), ("GE", 5), ("LT", 6), ("LE", 5)):
        lib.aclshmem_signal_wait_until(sigp, getattr(lib, f"ACLSHMEM_CMP_{cmp}"), val)
        s.ok()
    # bad compare op
    lib.aclshmem_signal_wait_until(sigp, 6, 0)
    assert s.err()[0] == lib.ACLSHMEM_INVALID_PARAM
    # the emulator-only bound turns a never-satisfied wait into a timeout error
    assert lib.aclshmemx_emu_set_wait_timeout_ms(200) == 0
    t0 = time.monotonic()
    lib.aclshmem_signal_wait_until(sigp, lib.ACLSHMEM_CMP_EQ, 12345)
    elapsed = time.monotonic() - t0
    code, msg = s.err()
    assert code == lib.ACLSHMEM_TIMEOUT_ERROR, (code, msg)
    assert 0.19 <= elapsed < 60, elapsed  # no tight upper bound: load stretches waits
    lib.aclshmemx_emu_set_wait_timeout_ms(20000)
    # a signal word outside the heap is refused
    local_word = ffi.new("int32_t *", 0)
    lib.aclshmemx_putmem_signal(data, ffi.from_buffer(mine), 64, local_word, 1,
                                lib.ACLSHMEM_SIGNAL_SET, 0)
    code, msg = s.err()
    assert code == lib.ACLSHMEM_INVALID_PARAM and "sig_addr" in msg, msg
    s.barrier()
    return {}


def _scenario_asymmetric(s: _PE) -> dict:
    p = s.lib.aclshmem_malloc(100 * (s.pe + 1))
    code, msg = s.err()
    assert p == s.ffi.NULL and code == s.lib.ACLSHMEM_INVALID_PARAM and "asymmetric" in msg, msg
    return {}


def _scenario_barrier_timeout(s: _PE, timed_out: str) -> dict:
    """PE 1 joins the barrier only once PE 0's barrier timed out (PE 0 creates the file
    ``timed_out`` then): the order is forced, not hoped for with a sleep."""
    lib = s.lib
    if s.pe == 0:
        t0 = time.monotonic()
        lib.aclshmem_barrier_all()
        elapsed = time.monotonic() - t0
        open(timed_out, "x").close()
        code, msg = s.err()
        assert code == lib.ACLSHMEM_TIMEOUT_ERROR and "timed out" in msg, (code, msg)
        assert 0.9 <= elapsed < 60, elapsed  # no tight upper bound: load stretches waits
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(timed_out):  # never joins the barrier in time
            assert time.monotonic() < deadline, "PE 0's barrier never returned"
            time.sleep(0.01)
        lib.aclshmem_barrier_all()
        code, msg = s.err()
        assert code == lib.ACLSHMEM_INNER_ERROR and "barrier" in msg, (code, msg)
    rc = lib.aclshmem_finalize()   # its barrier fails too, but it cleans up and returns
    assert rc != 0
    assert lib.aclshmemx_init_status() == lib.ACLSHMEM_STATUS_NOT_INITIALIZED
    return {"finalized": True}


def _scenario_peer_crash(s: _PE, q=None) -> dict:
    lib = s.lib
    if s.pe == 1:
        q.put((s.pe, "ok", {"crashed": True}))
        q.close()
        q.join_thread()
        os._exit(3)
    time.sleep(0.5)
    # Each call below returns only because the emulator noticed PE 1's death (an error naming
    # it); one that did not would block forever and the scenario's own process bound ends it:
    # no wall-clock bound is asserted here.
    lib.aclshmem_barrier_all()
    code, msg = s.err()
    assert code == lib.ACLSHMEM_BOOTSTRAP_ERROR and "PE 1" in msg, (code, msg)
    sig = s.ffi.cast("int32_t *", lib.aclshmemx_get_heap_base(lib.DEVICE_SIDE))
    lib.aclshmem_signal_wait_until(sig, lib.ACLSHMEM_CMP_EQ, 777)
    code, msg = s.err()
    assert code == lib.ACLSHMEM_BOOTSTRAP_ERROR and "died" in msg, (code, msg)
    assert lib.aclshmem_finalize() != 0
    return {}


def _scenario_init_errors(lib_path: str, uid_bytes: bytes) -> dict:
    ffi, lib = load_aclshmem(lib_path)
    assert lib.aclshmemx_init_status() == lib.ACLSHMEM_STATUS_NOT_INITIALIZED
    assert (lib.aclshmem_my_pe(), lib.aclshmem_n_pes()) == (-1, -1)
    assert lib.aclshmem_malloc(64) == ffi.NULL
    assert emu_last_error(ffi, lib)[0] == lib.ACLSHMEM_NOT_INITED
    name = ffi.new("char[256]")
    lib.aclshmem_info_get_name(name)
    assert b"test double" in ffi.string(name)
    uid = ffi.new("aclshmemx_uniqueid_t *")
    ffi.memmove(uid, uid_bytes, len(uid_bytes))
    attr = ffi.new("aclshmemx_init_attr_t *")
    assert lib.aclshmemx_set_attr_uniqueid_args(0, 1, HEAP, uid, attr) == 0
    # option_attr left zeroed (as ffi.new leaves it): refused like the real check_attr
    assert lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, attr) == lib.ACLSHMEM_INVALID_VALUE
    assert "shm_init_timeout" in emu_last_error(ffi, lib)[1]
    fill_option_attr(ffi, lib, attr, 10, 10)
    attr.option_attr.data_op_engine_type = 16
    assert lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, attr) == lib.ACLSHMEM_INVALID_VALUE
    attr.option_attr.data_op_engine_type = lib.ACLSHMEM_DATA_OP_MTE
    attr.my_pe = 1
    assert lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, attr) == lib.ACLSHMEM_INVALID_PARAM
    attr.my_pe = 0
    assert lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_MPI, attr) == lib.ACLSHMEM_NOT_SUPPORTED
    assert lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, attr) == 0
    assert lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, attr) == lib.ACLSHMEM_INNER_ERROR
    assert lib.aclshmemx_get_heap_base(lib.HOST_SIDE) == ffi.NULL
    assert emu_last_error(ffi, lib)[0] == lib.ACLSHMEM_NOT_SUPPORTED
    assert lib.aclshmem_finalize() == 0
    assert lib.aclshmemx_init_status() == lib.ACLSHMEM_STATUS_NOT_INITIALIZED
    assert lib.aclshmem_finalize() == 0
    return {}


_SCENARIOS = {
    "rma": _scenario_rma,
    "signal": _scenario_signal,
    "asymmetric": _scenario_asymmetric,
    "barrier_timeout": _scenario_barrier_timeout,
    "peer_crash": _scenario_peer_crash,
}


def _pe_main(lib_path, pe, n, uid_bytes, scenario, opts, env, q) -> None:
    try:
        os.environ.update(env)
        if scenario == "init_errors":
            result = _scenario_init_errors(lib_path, uid_bytes)
        else:
            s = _PE(lib_path, pe, n, uid_bytes, **opts.pop("pe_opts", {}))
            if scenario == "peer_crash":
                opts["q"] = q
            result = _SCENARIOS[scenario](s, **opts)
            if s.lib.aclshmemx_init_status() == s.lib.ACLSHMEM_STATUS_IS_INITIALIZED:
                rc = s.lib.aclshmem_finalize()
                assert rc == 0, (rc, s.err())
        q.put((pe, "ok", result))
    except BaseException:
        q.put((pe, "error", traceback.format_exc()))


# --------------------------------------------------------------------------- parent side

def _new_uid(lib_path: str) -> tuple[bytes, str]:
    ffi, lib = load_aclshmem(lib_path)
    uid = ffi.new("aclshmemx_uniqueid_t *")
    assert lib.aclshmemx_get_uniqueid(uid) == 0
    assert uid.version == (1 << 16) + ffi.sizeof("aclshmemx_uniqueid_t")
    raw = bytes(ffi.buffer(uid))
    uid_hex = "%016x" % int.from_bytes(raw[12 + 24:12 + 32], "little")
    return raw, uid_hex


def run_pes(lib_path: str, n: int, scenario: str, *, env: dict | None = None,
            timeout: float = PROC_TIMEOUT, **opts) -> dict[int, dict]:
    """Run ``scenario`` on n PEs (spawned processes); return {pe: result}; leak-check /dev/shm."""
    uid_bytes, uid_hex = _new_uid(lib_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env = {"MEMSEM_SHMEM_EMU_LOG": "0", **(env or {})}
    procs = [ctx.Process(target=_pe_main, args=(lib_path, pe, n, uid_bytes, scenario, dict(opts), env, q),
                         daemon=True) for pe in range(n)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                pe, status, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
                continue
            results[pe] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {pe: r[1] for pe, r in results.items() if r[0] != "ok"}
    assert not errors, "\n".join(f"--- PE {pe}\n{tb}" for pe, tb in sorted(errors.items()))
    missing = sorted(set(range(n)) - set(results))
    assert not missing, f"PEs {missing} gave no result within {timeout} s " \
                        f"(exit codes {[p.exitcode for p in procs]})"
    assert _shm_names(uid_hex) == [], f"leaked segments: {_shm_names(uid_hex)}"
    return {pe: r[1] for pe, r in results.items()}  # type: ignore[misc]


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [1, 2, 4])
def test_rma_ptr_and_symmetric_heap(emu_lib: str, n: int) -> None:
    results = run_pes(emu_lib, n, "rma")
    offsets = {pe: r["offsets"] for pe, r in results.items()}
    assert len({tuple(o) for o in offsets.values()}) == 1, offsets


@pytest.mark.multiproc
def test_rma_with_deferred_completion(emu_lib: str) -> None:
    # nbi / on-stream work completes only at quiet: a missing quiet would show.
    run_pes(emu_lib, 2, "rma", env={"MEMSEM_SHMEM_EMU_DEFER_NBI": "1"}, defer=True)


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [2, 4])
def test_put_signal_and_wait_until(emu_lib: str, n: int) -> None:
    run_pes(emu_lib, n, "signal")


@pytest.mark.multiproc
def test_asymmetric_malloc_is_refused(emu_lib: str) -> None:
    run_pes(emu_lib, 2, "asymmetric")


@pytest.mark.multiproc
def test_barrier_times_out_instead_of_hanging(emu_lib: str, tmp_path) -> None:
    run_pes(emu_lib, 2, "barrier_timeout", pe_opts={"ctl_timeout": 1}, timed_out=str(tmp_path / "pe0"))


@pytest.mark.multiproc
def test_peer_crash_fails_waits_and_leaks_nothing(emu_lib: str) -> None:
    run_pes(emu_lib, 2, "peer_crash")


@pytest.mark.multiproc
def test_init_errors_and_single_pe_lifecycle(emu_lib: str) -> None:
    run_pes(emu_lib, 1, "init_errors")


@pytest.mark.multiproc
def test_init_times_out_when_a_pe_never_joins(emu_lib: str) -> None:
    # PE 1 of 2 never starts: PE 0's init must fail within shm_init_timeout and clean up.
    uid_bytes, uid_hex = _new_uid(emu_lib)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_init_alone, args=(emu_lib, uid_bytes, q), daemon=True)
    p.start()
    try:
        status, payload = q.get(timeout=PROC_TIMEOUT)
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert status == "ok", payload
    assert _shm_names(uid_hex) == []


def _init_alone(lib_path: str, uid_bytes: bytes, q) -> None:
    try:
        os.environ["MEMSEM_SHMEM_EMU_LOG"] = "0"
        ffi, lib = load_aclshmem(lib_path)
        uid = ffi.new("aclshmemx_uniqueid_t *")
        ffi.memmove(uid, uid_bytes, len(uid_bytes))
        attr = ffi.new("aclshmemx_init_attr_t *")
        lib.aclshmemx_set_attr_uniqueid_args(0, 2, HEAP, uid, attr)
        fill_option_attr(ffi, lib, attr, 1, 1)
        t0 = time.monotonic()
        rc = lib.aclshmemx_init_attr(lib.ACLSHMEMX_INIT_WITH_UNIQUEID, attr)
        elapsed = time.monotonic() - t0
        code, msg = emu_last_error(ffi, lib)
        assert rc == lib.ACLSHMEM_TIMEOUT_ERROR and "PE 1 did not join" in msg, (rc, msg)
        assert 0.9 <= elapsed < 60, elapsed  # no tight upper bound: load stretches waits
        assert lib.aclshmemx_init_status() == lib.ACLSHMEM_STATUS_NOT_INITIALIZED
        q.put(("ok", None))
    except BaseException:
        q.put(("error", traceback.format_exc()))


# --------------------------------------------------------------------------- loader and ABI

def test_cdef_layouts_match_the_real_headers(emu_lib: str) -> None:
    ffi, lib = load_aclshmem(emu_lib)
    # hicann/shmem include/host/shmem_host_def.h, LP64
    assert ffi.sizeof("aclshmem_init_optional_attr_t") == 24
    assert ffi.sizeof("aclshmemx_init_attr_t") == 120
    assert [ffi.offsetof("aclshmemx_init_attr_t", f) for f in
            ("my_pe", "n_pes", "ip_port", "local_mem_size", "option_attr", "comm_args", "instance_id")] \
        == [0, 4, 8, 72, 80, 104, 112]
    assert ffi.sizeof("aclshmemx_uniqueid_t") == 136
    assert ffi.offsetof("aclshmemx_uniqueid_t", "internal") == 12
    assert (lib.ACLSHMEM_DATA_OP_MTE, lib.ACLSHMEM_DATA_OP_SDMA, lib.ACLSHMEM_DATA_OP_ROCE,
            lib.ACLSHMEM_DATA_OP_UDMA) == (1, 2, 4, 8)
    assert (lib.ACLSHMEM_SIGNAL_SET, lib.ACLSHMEM_SIGNAL_ADD) == (0, 1)
    assert [lib.ACLSHMEM_CMP_EQ, lib.ACLSHMEM_CMP_NE, lib.ACLSHMEM_CMP_GT, lib.ACLSHMEM_CMP_GE,
            lib.ACLSHMEM_CMP_LT, lib.ACLSHMEM_CMP_LE] == list(range(6))
    assert str(ffi.typeof(lib.aclshmem_signal_wait_until)) == \
        "<ctype 'void(*)(int32_t *, int, int32_t)'>"
    assert str(ffi.typeof(lib.aclshmemx_putmem_signal)) == \
        "<ctype 'void(*)(void *, void *, size_t, void *, int32_t, int, int)'>"
    assert _aclshmem.is_test_double(lib)
    assert "aclshmem_quiet" not in _aclshmem.required_symbols()   # device-only in the real API


def test_emulator_header_matches_the_binding_cdef(emu_lib: str) -> None:
    from cffi import FFI
    header = FFI()
    header.cdef((EMU_DIR / "aclshmem_emu.h").read_text())
    hlib = header.dlopen(emu_lib)
    ffi, lib = load_aclshmem(emu_lib)
    names = _aclshmem.required_symbols() + _aclshmem.optional_symbols()
    assert len(names) == len(set(names)) and len(_aclshmem.required_symbols()) == 26
    if shutil.which("nm"):   # the cdef parser sees exactly what the emulator exports
        out = subprocess.run(["nm", "-D", "--defined-only", emu_lib], check=True, timeout=60,
                             capture_output=True, text=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
        assert exported == set(names)
    for name in names:
        assert str(header.typeof(getattr(hlib, name))) == str(ffi.typeof(getattr(lib, name))), name
    for t in ("aclshmemx_init_attr_t", "aclshmemx_uniqueid_t", "aclshmem_init_optional_attr_t"):
        assert header.sizeof(t) == ffi.sizeof(t)


def _build_stub_lib(tmp_path: pathlib.Path, names: list[str], libname: str) -> str:
    src = tmp_path / f"{libname}.c"
    src.write_text("".join(f"void {n}(void) {{}}\n" for n in names))
    out = tmp_path / f"{libname}.so"
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(out), str(src)],
                   check=True, timeout=60)
    return str(out)


def test_library_missing_a_symbol_is_named(emu_lib: str, tmp_path: pathlib.Path) -> None:
    required = _aclshmem.required_symbols()
    lib_path = _build_stub_lib(tmp_path, [n for n in required if n != "aclshmem_signal_wait_until"],
                               "libshmem_missing_one")
    with pytest.raises(NotSupportedError, match=r"lacks required symbol 'aclshmem_signal_wait_until'$"):
        load_aclshmem(lib_path)
    tiny = _build_stub_lib(tmp_path, ["aclshmem_my_pe"], "libshmem_tiny")
    with pytest.raises(NotSupportedError) as info:
        load_aclshmem(tiny)
    assert "'aclshmemx_init_status'" in str(info.value) and "24 more" in str(info.value)
    assert "libshmem_tiny.so" in str(info.value)


def test_absent_or_broken_library(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                  emu_lib: str) -> None:
    for var in ("MEMSEM_SHMEM_LIB", "SHMEM_HOME_PATH", "ASCEND_HOME_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(NotSupportedError, match="are unset"):
        load_aclshmem()
    monkeypatch.setenv("MEMSEM_SHMEM_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(NotSupportedError, match="nope.so"):
        load_aclshmem()
    monkeypatch.delenv("MEMSEM_SHMEM_LIB")
    toolkit = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    toolkit.mkdir(parents=True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(toolkit))
    with pytest.raises(NotSupportedError, match="tried .*shmem/latest/shmem/lib/libshmem.so"):
        load_aclshmem()
    installed = tmp_path / "Ascend" / "shmem" / "latest" / "shmem" / "lib" / "libshmem.so"
    installed.parent.mkdir(parents=True)
    shutil.copy(emu_lib, installed)
    assert _aclshmem.find_library() == installed
    ffi, lib = load_aclshmem()
    assert _aclshmem.is_test_double(lib)
    monkeypatch.setenv("MEMSEM_SHMEM_LIB", emu_lib)      # the variable wins
    assert _aclshmem.find_library() == pathlib.Path(emu_lib)
    junk = tmp_path / "libjunk.so"
    junk.write_bytes(b"not an ELF file")
    with pytest.raises(EngineError, match="dlopen"):
        load_aclshmem(junk)
