"""pyverbs helpers of the rdma engine: the lazy import, devices, RC QP setup, error mapping,
and the engine's counters.

Nothing here knows about windows or connections: ``Device`` is one opened device (context,
protection domain, port, GID), ``new_qp`` / ``qp_attr`` make an RC QP and its RESET -> RTS
attributes towards a peer, ``pyverbs_error`` / ``status_name`` name what the device said.
"""
from __future__ import annotations

import os
import threading
import types
from typing import Any

from memsem._errors import EngineError

PORT = 1
#: QP local ack timeout exponent (4.096 us * 2**14 = 67 ms) and retries: a dead peer is reported
#: after ~0.5 s. rxe treats retry_cnt 7 as "retry forever": never use it.
QP_TIMEOUT = 14
QP_RETRY_CNT = 6
QP_RNR_RETRY = 7
QP_MIN_RNR_TIMER = 12
RD_ATOMIC = 16


def verbs() -> types.SimpleNamespace:
    """Import pyverbs (lazily: ``import memsem`` never loads it)."""
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    return types.SimpleNamespace(
        e=e, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context,
        get_device_list=get_device_list, MR=MR, PD=PD, PyverbsError=PyverbsError,
        PyverbsRDMAError=PyverbsRDMAError, QP=QP, QPAttr=QPAttr, QPCap=QPCap,
        QPInitAttr=QPInitAttr, SGE=SGE, SendWR=SendWR)


def wanted_devices() -> list[str] | None:
    """Device names of ``MEMSEM_RDMA_DEVICE`` (comma-separated), or None when unset."""
    want = os.environ.get("MEMSEM_RDMA_DEVICE", "").strip()
    return [w.strip() for w in want.split(",") if w.strip()] or None


def sysfs_port_active(dev: str, port: int = PORT) -> bool:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/state") as f:
            return "ACTIVE" in f.read()
    except OSError:
        return False


def pyverbs_error(exc: BaseException, what: str) -> EngineError:
    """``EngineError`` for a pyverbs exception (its errno when it carries one)."""
    code = getattr(exc, "error_code", -1)
    errno = code if isinstance(code, int) and code > 0 else None
    return EngineError(f"{what}: {exc}", errno=errno, name=None if errno else what.split(" ")[0])


def status_name(v: types.SimpleNamespace, status: int) -> str:
    try:
        return v.e.ibv_wc_status(status).name
    except ValueError:
        return f"IBV_WC_STATUS_{status}"


class Counters:
    """The engine's event counters (``RdmaEngine.stats``), shared by its parts; thread-safe."""

    NAMES = ("registrations", "deregistrations", "local_registrations", "connects", "served",
             "posted", "round_trips", "failed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


# ----------------------------------------------------------------------------------------------
class Device:
    """One opened device: context, protection domain, chosen port and GID."""

    def __init__(self, v: types.SimpleNamespace, name: str) -> None:
        self.name = name
        self.ctx = v.Context(name=name)
        try:
            port = self.ctx.query_port(PORT)
            if port.state != v.e.IBV_PORT_ACTIVE:
                raise EngineError(f"RDMA device {name} port {PORT} is not active (state {port.state})",
                                  name="IBV_PORT_STATE")
            self.mtu = int(port.active_mtu)
            self.lid = int(port.lid)
            self.roce = port.link_layer == v.e.IBV_LINK_LAYER_ETHERNET
            self.gid_index, self.gid = self._pick_gid(v, port.gid_tbl_len)
            dattr = self.ctx.query_device()
            self.max_rd_atomic = max(1, min(RD_ATOMIC, int(dattr.max_qp_init_rd_atom)))
            self.max_dest_rd_atomic = max(1, min(RD_ATOMIC, int(dattr.max_qp_rd_atom)))
            self.pd = v.PD(self.ctx)
        except BaseException:
            self.ctx.close()
            raise

    @property
    def label(self) -> str:
        return f"{self.name}/{PORT}"

    def _pick_gid(self, v: types.SimpleNamespace, tbl_len: int) -> tuple[int, str]:
        """RoCE: an IPv4-mapped RoCE v2 GID, else any RoCE v2, else any non-zero GID.
        InfiniBand: GID 0 (addressing uses the LID)."""
        best: tuple[int, int, str] | None = None
        for i in range(tbl_len):
            try:
                gid = self.ctx.query_gid(PORT, i).gid
                gtype = self.ctx.query_gid_type(PORT, i) if self.roce else None
            except Exception:  # unpopulated entries fail to query
                continue
            if gid.replace("0", "").replace(":", "") == "":
                continue
            if not self.roce:
                return i, gid
            rank = 0 if gtype == v.e.IBV_GID_TYPE_SYSFS_ROCE_V2 and gid.startswith(
                "0000:0000:0000:0000:0000:ffff:") else 1 if gtype == v.e.IBV_GID_TYPE_SYSFS_ROCE_V2 else 2
            if best is None or rank < best[0]:
                best = (rank, i, gid)
        if best is None:
            raise EngineError(f"RDMA device {self.name} port {PORT} has no usable GID "
                              "(RoCE needs an IP address on its netdev)", name="NO_GID")
        return best[1], best[2]

    def endpoint(self) -> dict[str, Any]:
        return {"device": self.name, "port": self.label, "gid": self.gid, "lid": self.lid,
                "mtu": self.mtu}

    def close(self) -> None:
        self.ctx.close()  # closes PD, MRs, CQs, QPs created under it


def new_qp(v: types.SimpleNamespace, dev: Device, cq: Any, *, max_send_wr: int) -> Any:
    """An RC QP (RESET) on ``dev`` whose send and receive completions go to ``cq``."""
    cap = v.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    try:
        return v.QP(dev.pd, v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    except v.PyverbsError as exc:
        raise pyverbs_error(exc, f"ibv_create_qp on {dev.name}") from exc


def qp_attr(v: types.SimpleNamespace, dev: Device, peer: dict[str, Any]) -> Any:
    """RESET -> RTS attributes towards ``peer`` ({qpn, gid, lid, mtu})."""
    e = v.e
    attr = v.QPAttr(port_num=PORT)
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
    attr.path_mtu = min(dev.mtu, int(peer.get("mtu", dev.mtu)))
    attr.dest_qp_num = int(peer["qpn"])
    attr.rq_psn = 0
    attr.sq_psn = 0
    attr.max_dest_rd_atomic = dev.max_dest_rd_atomic
    attr.max_rd_atomic = dev.max_rd_atomic
    attr.min_rnr_timer = QP_MIN_RNR_TIMER
    attr.timeout = QP_TIMEOUT
    attr.retry_cnt = QP_RETRY_CNT
    attr.rnr_retry = QP_RNR_RETRY
    if dev.roce:
        attr.ah_attr = v.AHAttr(port_num=PORT, is_global=1,
                                gr=v.GlobalRoute(dgid=v.GID(str(peer["gid"])), sgid_index=dev.gid_index))
    else:
        attr.ah_attr = v.AHAttr(port_num=PORT, is_global=0, dlid=int(peer["lid"]))
    return attr
