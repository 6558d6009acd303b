"""Standalone pyverbs smoke test for a soft-RoCE (rxe) device.

Run inside the VM (tests/rdma/run_in_vm.sh), with a Python 3.11 venv that has
pyverbs linked in (tests/rdma/install_pyverbs.sh) and numpy:

    tests/rdma/run_in_vm.sh /abs/venv/bin/python tests/rdma/smoke_pyverbs.py [--device rxe0]

In one process it connects two RC QPs on the same device to each other
(loopback through rxe), registers the memory of existing numpy arrays (not
pyverbs-owned buffers), does RDMA WRITE and READ of 64 B and 64 MiB, checks the
bytes and prints latency and bandwidth. Then it shows the work completion
status for: a stale rkey (MR deregistered and registered again), an RDMA WRITE
into an MR registered without REMOTE_WRITE, and a peer QP that was destroyed.
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time

import numpy as np
import pyverbs.enums as e
from pyverbs.addr import AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

PORT = 1
FULL_ACCESS = (
    e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
)
failures: list[str] = []


def check(cond: bool, what: str) -> None:
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def find_roce_v2_gid(ctx: Context) -> tuple[int, str]:
    """Return (index, gid) of the first RoCE v2 GID that is IPv4-mapped, else any RoCE v2."""
    tbl_len = ctx.query_port(PORT).gid_tbl_len
    fallback = None
    for i in range(tbl_len):
        try:
            gid = ctx.query_gid(PORT, i).gid
            gtype = ctx.query_gid_type(PORT, i)
        except Exception:  # unpopulated entries fail to query
            continue
        if gid.replace("0", "").replace(":", "") == "":
            continue
        if gtype != e.IBV_GID_TYPE_SYSFS_ROCE_V2:
            continue
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return i, gid
        if fallback is None:
            fallback = (i, gid)
    if fallback is None:
        raise RuntimeError("no RoCE v2 GID on port 1")
    return fallback


def poll(cq: CQ, n: int = 1, timeout: float = 5.0) -> list:
    """Poll n completions, busy-spinning briefly then yielding; raise on timeout."""
    wcs: list = []
    deadline = time.monotonic() + timeout
    spins = 0
    while len(wcs) < n:
        got, more = cq.poll(n - len(wcs))
        if got:
            wcs.extend(more)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(wcs)}/{n} completions after {timeout}s")
        spins += 1
        if spins > 1000:
            time.sleep(0.0001)
    return wcs


def status_name(wc) -> str:
    return f"{e.ibv_wc_status(wc.status).name}({wc.status})"


class Pair:
    """Two RC QPs on one PD/CQ each, connected to each other."""

    def __init__(self, ctx: Context, pd: PD, gid_index: int, mtu: int, timeout: int = 14,
                 retry_cnt: int = 6):
        self.ctx, self.pd, self.gid_index, self.mtu = ctx, pd, gid_index, mtu
        self.timeout, self.retry_cnt = timeout, retry_cnt
        self.cq_a = CQ(ctx, 256)
        self.cq_b = CQ(ctx, 256)
        cap = QPCap(max_send_wr=128, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp_a = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq_a, rcq=self.cq_a, cap=cap))
        self.qp_b = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq_b, rcq=self.cq_b, cap=cap))
        self.connect()

    def _attr(self, dest_qpn: int) -> QPAttr:
        gid = self.ctx.query_gid(PORT, self.gid_index)
        attr = QPAttr(port_num=PORT)  # to_init uses pkey_index=0, port_num, qp_access_flags
        attr.qp_access_flags = FULL_ACCESS  # what the *remote* side may do to this QP's MRs
        attr.path_mtu = self.mtu
        attr.dest_qp_num = dest_qpn
        attr.rq_psn = 0
        attr.sq_psn = 0
        attr.max_dest_rd_atomic = 16  # responder: outstanding READs accepted
        attr.max_rd_atomic = 16  # requester: outstanding READs issued
        attr.min_rnr_timer = 12
        attr.timeout = self.timeout  # 4.096 us * 2**timeout per retry
        attr.retry_cnt = self.retry_cnt  # NB: rxe treats 7 as "retry forever"
        attr.rnr_retry = 7
        attr.ah_attr = AHAttr(
            port_num=PORT, is_global=1, gr=GlobalRoute(dgid=gid, sgid_index=self.gid_index)
        )
        return attr

    def connect(self) -> None:
        # to_rts() walks RESET -> INIT -> RTR -> RTS with pyverbs' masks for RC.
        self.qp_a.to_rts(self._attr(self.qp_b.qp_num))
        self.qp_b.to_rts(self._attr(self.qp_a.qp_num))

    def reset(self) -> None:
        """Bring both QPs back from ERR: modify to RESET, then to RTS again."""
        for qp in (self.qp_a, self.qp_b):
            qp.modify(QPAttr(qp_state=e.IBV_QPS_RESET), e.IBV_QP_STATE)
        self.connect()

    def state(self, qp: QP) -> str:
        attr, _ = qp.query(e.IBV_QP_STATE)
        return e.ibv_qp_state(attr.qp_state).name


def post(qp: QP, opcode: int, local: MR, laddr: int, nbytes: int, rkey: int, raddr: int, wr_id=1):
    sge = SGE(laddr, nbytes, local.lkey)
    wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, raddr)
    qp.post_send(wr)


def reg(pd: PD, arr: np.ndarray, access: int) -> MR:
    """Register an existing numpy array's memory (pyverbs does not keep arr alive)."""
    return MR(pd, arr.nbytes, access, address=arr.ctypes.data)


def transfer(p: Pair, opcode: int, local_mr: MR, local: np.ndarray, remote_mr: MR,
             remote: np.ndarray, nbytes: int, timeout: float = 60.0):
    post(p.qp_a, opcode, local_mr, local.ctypes.data, nbytes, remote_mr.rkey, remote.ctypes.data)
    (wc,) = poll(p.cq_a, 1, timeout)
    return wc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="rxe0")
    ap.add_argument("--iters", type=int, default=200, help="64 B round trips to time")
    ap.add_argument("--big-mib", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=14, help="QP local ack timeout exponent")
    ap.add_argument("--retry", type=int, default=6, help="QP retry_cnt (7 = forever on rxe)")
    args = ap.parse_args()

    t_all = time.perf_counter()
    try:
        devs = [d.name.decode() for d in get_device_list()]
    except Exception as exc:  # PyverbsRDMAError when the kernel has no RDMA at all
        print(f"no RDMA devices: {type(exc).__name__}: {exc}")
        return 2
    print("devices:", devs)
    ctx = Context(name=args.device)
    port = ctx.query_port(PORT)
    gid_index, gid = find_roce_v2_gid(ctx)
    mtu = port.active_mtu
    print(f"port {PORT}: state={e.ibv_port_state(port.state).name} active_mtu={e.ibv_mtu(mtu).name} "
          f"gid_tbl_len={port.gid_tbl_len} -> gid_index={gid_index} gid={gid}")
    dattr = ctx.query_device()
    print(f"device: max_mr_size={dattr.max_mr_size} max_qp_rd_atom={dattr.max_qp_rd_atom} "
          f"max_qp_wr={dattr.max_qp_wr}")
    pd = PD(ctx)
    p = Pair(ctx, pd, gid_index, mtu, args.timeout, args.retry)
    print(f"QPs {p.qp_a.qp_num} <-> {p.qp_b.qp_num}: {p.state(p.qp_a)}/{p.state(p.qp_b)}")

    # --- 64 B ---------------------------------------------------------------
    small = 64
    src = np.arange(small, dtype=np.uint8)
    dst = np.zeros(small, dtype=np.uint8)
    src_mr, dst_mr = reg(pd, src, FULL_ACCESS), reg(pd, dst, FULL_ACCESS)
    check(src_mr.buf == src.ctypes.data, "MR.buf is the numpy array's address")
    wc = transfer(p, e.IBV_WR_RDMA_WRITE, src_mr, src, dst_mr, dst, small)
    check(wc.status == e.IBV_WC_SUCCESS and np.array_equal(src, dst), f"64 B WRITE {status_name(wc)}")
    back = np.zeros(small, dtype=np.uint8)
    back_mr = reg(pd, back, FULL_ACCESS)
    wc = transfer(p, e.IBV_WR_RDMA_READ, back_mr, back, dst_mr, dst, small)
    check(wc.status == e.IBV_WC_SUCCESS and np.array_equal(back, src), f"64 B READ {status_name(wc)}")
    for opcode, name in ((e.IBV_WR_RDMA_WRITE, "WRITE"), (e.IBV_WR_RDMA_READ, "READ")):
        lat = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            wc = transfer(p, opcode, src_mr, src, dst_mr, dst, small)
            lat.append(time.perf_counter() - t0)
            if wc.status != e.IBV_WC_SUCCESS:
                check(False, f"64 B {name} loop {status_name(wc)}")
                break
        lat.sort()
        print(f"64 B {name}: median {statistics.median(lat) * 1e6:.0f} us, "
              f"p10 {lat[len(lat) // 10] * 1e6:.0f} us, p90 {lat[9 * len(lat) // 10] * 1e6:.0f} us "
              f"({len(lat)} iters, post+poll)")

    # --- 64 MiB -------------------------------------------------------------
    big = args.big_mib << 20
    bsrc = np.random.default_rng(1).integers(0, 256, big, dtype=np.uint8)
    bdst = np.zeros(big, dtype=np.uint8)
    bback = np.zeros(big, dtype=np.uint8)
    t0 = time.perf_counter()
    bsrc_mr, bdst_mr, bback_mr = (reg(pd, a, FULL_ACCESS) for a in (bsrc, bdst, bback))
    print(f"register 3 x {args.big_mib} MiB: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    wc = transfer(p, e.IBV_WR_RDMA_WRITE, bsrc_mr, bsrc, bdst_mr, bdst, big, timeout=120)
    dt = time.perf_counter() - t0
    check(wc.status == e.IBV_WC_SUCCESS and np.array_equal(bsrc, bdst),
          f"{args.big_mib} MiB WRITE {status_name(wc)}: {dt:.2f} s, {big / dt / 1e6:.0f} MB/s")
    t0 = time.perf_counter()
    wc = transfer(p, e.IBV_WR_RDMA_READ, bback_mr, bback, bdst_mr, bdst, big, timeout=120)
    dt = time.perf_counter() - t0
    check(wc.status == e.IBV_WC_SUCCESS and np.array_equal(bsrc, bback),
          f"{args.big_mib} MiB READ {status_name(wc)}: {dt:.2f} s, {big / dt / 1e6:.0f} MB/s")
    for mr in (bsrc_mr, bdst_mr, bback_mr):
        mr.close()
    del bsrc, bdst, bback

    # --- stale rkey -----------------------------------------------------------
    old_rkey = dst_mr.rkey
    dst_mr.close()
    dst_mr = reg(pd, dst, FULL_ACCESS)
    print(f"re-registered: old rkey {old_rkey:#x}, new rkey {dst_mr.rkey:#x}")
    t0 = time.perf_counter()
    post(p.qp_a, e.IBV_WR_RDMA_WRITE, src_mr, src.ctypes.data, small, old_rkey, dst.ctypes.data)
    (wc,) = poll(p.cq_a, 1, 10)
    check(wc.status == e.IBV_WC_REM_ACCESS_ERR,
          f"stale rkey WRITE -> {status_name(wc)} vendor_err={wc.vendor_err} "
          f"in {(time.perf_counter() - t0) * 1e3:.1f} ms; QP states after: "
          f"{p.state(p.qp_a)}/{p.state(p.qp_b)}")
    post(p.qp_a, e.IBV_WR_RDMA_READ, back_mr, back.ctypes.data, small, dst_mr.rkey, dst.ctypes.data)
    (wc,) = poll(p.cq_a, 1, 10)
    check(wc.status == e.IBV_WC_WR_FLUSH_ERR, f"next WR on the errored QP -> {status_name(wc)}")
    ncq_b = p.cq_b.poll(16)[0]
    print(f"responder CQ had {ncq_b} completions (one-sided ops give none on the target)")
    p.reset()
    wc = transfer(p, e.IBV_WR_RDMA_READ, back_mr, back, dst_mr, dst, small)
    check(wc.status == e.IBV_WC_SUCCESS, f"after QP reset (RESET->RTS) READ {status_name(wc)}")
    post(p.qp_a, e.IBV_WR_RDMA_READ, back_mr, back.ctypes.data, small, old_rkey, dst.ctypes.data)
    (wc,) = poll(p.cq_a, 1, 10)
    check(wc.status == e.IBV_WC_REM_ACCESS_ERR, f"stale rkey READ -> {status_name(wc)}")
    p.reset()

    # --- read-only window: MR without REMOTE_WRITE ------------------------------
    ro = np.arange(small, dtype=np.uint8)
    ro.flags.writeable = False  # numpy read-only flag; the pages stay writable
    ro_mr = reg(pd, ro, e.IBV_ACCESS_REMOTE_READ)
    wc = transfer(p, e.IBV_WR_RDMA_READ, back_mr, back, ro_mr, ro, small)
    check(wc.status == e.IBV_WC_SUCCESS, f"READ from REMOTE_READ-only MR {status_name(wc)}")
    wc = transfer(p, e.IBV_WR_RDMA_WRITE, src_mr, src, ro_mr, ro, small)
    check(wc.status == e.IBV_WC_REM_ACCESS_ERR,
          f"WRITE into REMOTE_READ-only MR -> {status_name(wc)}; QPs {p.state(p.qp_a)}/{p.state(p.qp_b)}")
    ro_mr.close()
    p.reset()
    for flags, label in ((mmap.MAP_SHARED, "MAP_SHARED"), (mmap.MAP_PRIVATE, "MAP_PRIVATE")):
        ro_map = mmap.mmap(-1, mmap.PAGESIZE, flags=flags, prot=mmap.PROT_READ)
        ro_pg = np.frombuffer(ro_map, dtype=np.uint8)
        for access, alabel in ((e.IBV_ACCESS_REMOTE_READ, "REMOTE_READ"), (FULL_ACCESS, "RW")):
            try:
                reg(pd, ro_pg, access).close()
                print(f"info PROT_READ {label} page, {alabel} MR: registered")
            except Exception as exc:
                print(f"info PROT_READ {label} page, {alabel} MR: {exc}")
        del ro_pg

    # --- peer QP destroyed ------------------------------------------------------
    for timeout_exp, retry in ((14, 6), (12, 3), (10, 2)):
        q = Pair(ctx, pd, gid_index, mtu, timeout=timeout_exp, retry_cnt=retry)
        wc = transfer(q, e.IBV_WR_RDMA_WRITE, src_mr, src, dst_mr, dst, small)
        check(wc.status == e.IBV_WC_SUCCESS, f"fresh pair (timeout={timeout_exp}) works")
        q.qp_b.close()
        t0 = time.perf_counter()
        post(q.qp_a, e.IBV_WR_RDMA_WRITE, src_mr, src.ctypes.data, small, dst_mr.rkey, dst.ctypes.data)
        try:
            (wc,) = poll(q.cq_a, 1, 20)
            check(wc.status == e.IBV_WC_RETRY_EXC_ERR,
                  f"peer QP destroyed, timeout={timeout_exp} retry_cnt={retry} -> {status_name(wc)} "
                  f"after {(time.perf_counter() - t0) * 1e3:.0f} ms")
        except TimeoutError as exc:
            check(False, f"peer QP destroyed, timeout={timeout_exp} retry_cnt={retry}: {exc}")
        q.qp_a.close()

    ctx.close()  # closes PD, MRs, CQs, QPs it created
    print(f"total {time.perf_counter() - t_all:.1f} s; {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
