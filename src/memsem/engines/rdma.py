"""RDMA engine: one-sided RDMA READ / WRITE on RC queue pairs through pyverbs.

Owner side: ``register`` registers the window's own memory (a user address, not a pyverbs
buffer) as one memory region per device, with access flags no wider than the window's
permission (a read-only window gets REMOTE_READ only). The descriptor carries the address and,
per device, the rkey, port and GID. ``deregister`` (called by the runtime at every generation
bump) closes the MRs, so an old rkey faults at the device (``IBV_WC_REM_ACCESS_ERR``), which the
runtime turns into ``StaleReferenceError``; a republish registers anew. N consumers of a window
share its one registration (``stats()["registrations"]``).

Connection setup goes through the memsem directory (``Directory.put_entry`` & co.), so it works
wherever the directory is shared (local for one machine, redis for many). Every engine instance
has a random endpoint id ``ep``; an owner's descriptors name its ``ep``. A consumer that needs a
queue pair to an owner:

1. creates an RC QP (RESET) and writes ``rdma/<owner ep>/req/<own ep>.<seq>`` =
   ``{qpn, gid, lid, mtu, device, seq, node, pid}``;
2. the owner's listener thread (started at its first ``register``; it polls its own prefix
   every few ms) creates a responder QP for that consumer (replacing an older one of the same
   consumer), moves it to RTS towards the consumer's QP, writes ``{qpn, gid, lid, mtu, seq}``
   to ``rdma/<consumer ep>/rep/<owner ep>`` and removes the request;
3. the consumer waits (bounded, ``connect_timeout``) for the reply with its ``seq``, moves its
   QP to RTS and removes the reply. No answer in time raises PeerLostError.

One requester QP per (consumer engine, owner engine, device) serves every window of that
owner; all traffic is one-sided, so the owner's CPU is not involved after setup. Any failed
work completion puts both QPs in the error state: the connection is marked broken and the next
operation reconnects with a new request (the owner replaces its QP). ``close`` writes
``rdma/<owner ep>/bye/<own ep>`` so the owner destroys its side.

Completions are polled from a CQ per connection (20 us spin, then short sleeps) until a deadline of
``timeout + bytes / 10 MB/s``; on timeout the QP is moved to the error state and drained (or
destroyed) before raising, so no late DMA can touch a buffer the caller got back. Every bad
``wc.status`` raises EngineError carrying the status name and code; ``IBV_WC_RETRY_EXC_ERR`` /
``IBV_WC_RNR_RETRY_EXC_ERR`` (the peer's QP is gone: process killed, node down) raise
PeerLostError chained from it, within about 0.5 s (ack timeout 67 ms x 7 tries).

Local buffers: transfers up to ``BOUNCE_BYTES`` go through a registered bounce buffer per
connection (one small memcpy); larger ones register the caller's array for the duration of the
call (counted in ``stats()["local_registrations"]``).

Environment: ``MEMSEM_RDMA_DEVICE`` (comma-separated device names, default every device with
an active port 1), ``MEMSEM_RDMA_FORCE=1`` (mark descriptors so that same-node consumers route
through RDMA too; for tests), ``MEMSEM_RDMA_CONNECT_TIMEOUT`` (seconds, default 10).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import EngineError, MemsemError, MemsemTimeoutError, NotSupportedError, PeerLostError
from memsem.engines._base import (
    WATCH_HEADER,
    WATCH_READY,
    Availability,
    ControlWords,
    Descriptor,
    Engine,
    GenerationCheck,
    LocalRegion,
    Op,
    OpKind,
    OpState,
    RemoteRegion,
    Request,
    WatchMode,
    typed_field,
)

log = logging.getLogger(__name__)

PORT = 1
#: send queue depth of a requester QP (work requests in flight per connection)
SQ_DEPTH = 128
#: transfers up to this size go through the connection's registered bounce buffer
BOUNCE_BYTES = 1 << 18
#: largest message of one work request (bigger transfers are split)
MAX_WR_BYTES = 1 << 30
#: QP local ack timeout exponent (4.096 us * 2**14 = 67 ms) and retries: a dead peer is reported
#: after ~0.5 s. rxe treats retry_cnt 7 as "retry forever": never use it.
QP_TIMEOUT = 14
QP_RETRY_CNT = 6
QP_RNR_RETRY = 7
QP_MIN_RNR_TIMER = 12
RD_ATOMIC = 16
#: slowest bandwidth assumed when sizing a completion deadline (bytes/second)
MIN_BANDWIDTH = 10e6
DEFAULT_TIMEOUT = _args.DEFAULT_TIMEOUT_S
DEFAULT_CONNECT_TIMEOUT = 10.0
#: after a peer was lost, reconnect attempts wait at most this long
LOST_CONNECT_TIMEOUT = 2.0
#: seconds of busy CQ polling before the poller sleeps between polls (1/8 of the time waited so
#: far, 50 us .. 1 ms). Longer spinning hurts where the device is emulated in the kernel on the
#: same CPUs (rxe: a spinning poller delays the softirq that would complete the request).
SPIN_SECONDS = 20e-6
#: most control words one descriptor may name (header words; ready words follow the window's
#: tiles, bounded like control blocks' ready words)
MAX_HEADER_WORDS = 4096
MAX_READY_WORDS = 1 << 24
#: owner listener: directory poll interval within 1 s of the last request, within 10 s, after
LISTEN_ACTIVE = 0.003
LISTEN_IDLE = 0.02
LISTEN_QUIET = 0.1


def _verbs() -> types.SimpleNamespace:
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


def _wanted_devices() -> list[str] | None:
    want = os.environ.get("MEMSEM_RDMA_DEVICE", "").strip()
    return [w.strip() for w in want.split(",") if w.strip()] or None


def _sysfs_port_active(dev: str, port: int = PORT) -> bool:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/state") as f:
            return "ACTIVE" in f.read()
    except OSError:
        return False


def _pyverbs_error(exc: BaseException, what: str) -> EngineError:
    code = getattr(exc, "error_code", -1)
    errno = code if isinstance(code, int) and code > 0 else None
    return EngineError(f"{what}: {exc}", errno=errno, name=None if errno else what.split(" ")[0])


def _status_name(v: types.SimpleNamespace, status: int) -> str:
    try:
        return v.e.ibv_wc_status(status).name
    except ValueError:
        return f"IBV_WC_STATUS_{status}"


# ----------------------------------------------------------------------------------------------
class _Device:
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


@dataclasses.dataclass
class _Registration:
    """One window's MRs (one per device); ``region`` keeps its memory alive. ``ctl_mrs``: the
    MRs of its control words (remote read only), ``words`` keeps them alive."""

    reg_id: int
    region: LocalRegion
    access: int
    mrs: dict[str, Any]
    ctl_mrs: list[Any] = dataclasses.field(default_factory=list)
    words: ControlWords | None = None


class _Conn:
    """Consumer-side requester QP to one owner engine on one device."""

    def __init__(self, key: tuple[str, str], dev: _Device, owner: dict[str, Any]) -> None:
        self.key = key
        self.dev = dev
        self.owner = owner  # {"ep", "device", "node", "pid", ...}
        self.lock = threading.Lock()
        self.qp: Any = None
        self.cq: Any = None
        self.bounce = np.empty(BOUNCE_BYTES, np.uint8)
        self.bounce_mr: Any = None
        self.broken = True  # not connected yet
        self.lost = False  # last failure said the peer is gone
        self.seq = 0

    def label(self) -> str:
        o = self.owner
        return f"RDMA peer (pid {o.get('pid')} on node {o.get('node')!r}, {o.get('port')})"

    def destroy(self) -> None:
        for obj in (self.qp, self.cq):
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # already gone with its context
                    log.debug("closing %r failed: %s", obj, exc)
        self.qp = self.cq = None
        self.broken = True


class _RdmaRemote(RemoteRegion):
    """A window of another engine, reached through ``conn`` with ``rkey`` at ``address``."""

    def __init__(self, engine: "RdmaEngine", nbytes: int, conn: _Conn, address: int, rkey: int,
                 writable: bool) -> None:
        super().__init__(engine, nbytes)
        self.conn = conn
        self.address = address
        self.rkey = rkey
        self.writable = writable
        #: the window's control words on the same connection (header words, ready words), when
        #: its owner registered them; never written
        self.ctl_header: _RdmaRemote | None = None
        self.ctl_ready: _RdmaRemote | None = None


@dataclasses.dataclass
class _Item:
    """One op's work: its WRs are ``wr_ids[0] .. wr_ids[-1]``."""

    kind: OpKind
    local: np.ndarray
    remote_addr: int
    rkey: int
    bounce_off: int = -1  # offset in the bounce buffer, or -1: ``mr`` registers ``local``
    mr: Any = None
    error: BaseException | None = None
    wr_ids: list[int] = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------------------------
class RdmaEngine(Engine):
    """One-sided RDMA READ/WRITE over RC QPs (pyverbs); see the module docstring.

    Args:
        devices: device names (default ``MEMSEM_RDMA_DEVICE`` or every device with an active port).
        directory: the directory used to exchange QP numbers (default: the runtime's, bound by
            ``bind``).
        force: mark descriptors so same-node consumers use RDMA too (default
            ``MEMSEM_RDMA_FORCE``).
        timeout: base bound in seconds of a completion wait (default: the runtime's timeout).
        connect_timeout: bound in seconds of a connection setup.

    Thread safety: every method may be called from several threads; operations on one
    connection are serialized.
    """

    name = "rdma"
    enforces_generation = GenerationCheck.DEVICE
    batches = True

    @classmethod
    def reach(cls, me, owner, descriptor, cost):  # noqa: D102 - see Engine.reach
        if not me.attrs.get("rdma_port"):
            return "this process has no active RDMA port"
        if me.node == owner.node and not descriptor.field("force", bool, False):
            return "same node: shared memory is cheaper than the NIC"
        return ("rdma", f"different nodes ({me.node!r} -> {owner.node!r}), active ports "
                f"{me.attrs.get('rdma_port')} and {descriptor.field('port', str, '?')}", False)

    @classmethod
    def probe(cls) -> Availability:
        try:
            v = _verbs()
        except ImportError as exc:
            return Availability(False, f"pyverbs is not importable ({exc}); install Debian's "
                                       "python3-pyverbs and link it (tests/rdma/install_pyverbs.sh)")
        try:
            devs = [d.name.decode() for d in v.get_device_list()]
        except v.PyverbsError:
            return Availability(False, "no RDMA devices (the kernel has no RDMA support: "
                                       "ibv_get_device_list failed)")
        if not devs:
            return Availability(False, "no RDMA devices")
        want = _wanted_devices()
        if want:
            missing = [w for w in want if w not in devs]
            if missing:
                return Availability(False, f"MEMSEM_RDMA_DEVICE names {', '.join(missing)}; present: "
                                           f"{', '.join(devs)}")
            devs = want
        active = [d for d in devs if _sysfs_port_active(d)]
        if not active:
            return Availability(False, f"no active port {PORT} on RDMA devices {', '.join(devs)}")
        return Availability(True)

    def __init__(self, *, devices: Sequence[str] | None = None, directory: Any = None,
                 force: bool | None = None, timeout: float | None = None,
                 connect_timeout: float | None = None) -> None:
        super().__init__()
        try:
            self._v = _verbs()
        except ImportError as exc:
            raise NotSupportedError(f"engine 'rdma': pyverbs is not importable ({exc})") from exc
        v = self._v
        if devices is None:
            devices = _wanted_devices()
        if devices is None:
            try:
                names = [d.name.decode() for d in v.get_device_list()]
            except v.PyverbsError as exc:
                raise NotSupportedError("engine 'rdma': no RDMA devices") from exc
            devices = [n for n in names if _sysfs_port_active(n)] or names
        if not devices:
            raise NotSupportedError("engine 'rdma': no RDMA devices")
        self._devices: list[_Device] = []
        try:
            for name in devices:
                try:
                    self._devices.append(_Device(v, name))
                except v.PyverbsError as exc:
                    raise _pyverbs_error(exc, f"opening RDMA device {name}") from exc
        except BaseException:
            for d in self._devices:
                d.close()
            raise
        self._by_name = {d.name: d for d in self._devices}
        self.ep = secrets.token_hex(8)
        self._dir = directory
        self._force = bool(int(os.environ.get("MEMSEM_RDMA_FORCE", "0") or 0)) if force is None else force
        self.timeout = DEFAULT_TIMEOUT if timeout is None else _args.timeout(timeout, "timeout", positive=True)
        env = os.environ.get("MEMSEM_RDMA_CONNECT_TIMEOUT", "") or ""
        if env:
            try:
                env_v = float(env)
            except ValueError:
                raise ValueError(f"MEMSEM_RDMA_CONNECT_TIMEOUT must be a number of seconds, got {env!r}") from None
            self.connect_timeout = _args.timeout(env_v, "MEMSEM_RDMA_CONNECT_TIMEOUT", positive=True)
        else:
            self.connect_timeout = DEFAULT_CONNECT_TIMEOUT if connect_timeout is None else \
                _args.timeout(connect_timeout, "connect_timeout", positive=True)
        self._node = ""
        self._lock = threading.RLock()
        self._regs: dict[int, _Registration] = {}
        self._reg_ids = itertools.count(1)
        self._conns: dict[tuple[str, str], _Conn] = {}
        self._served: dict[str, tuple[int, Any]] = {}  # consumer ep -> (seq, QP)
        self._served_cq: dict[str, Any] = {}
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()
        self._counts = {"registrations": 0, "deregistrations": 0, "local_registrations": 0,
                        "connects": 0, "served": 0, "posted": 0, "failed": 0}
        self.location_attrs = {"rdma_port": ",".join(d.label for d in self._devices)}

    # -- wiring ----------------------------------------------------------------------------------
    def bind(self, context: Any) -> None:
        """Called by the runtime once its directory is open (see ``Engine.bind``)."""
        super().bind(context)
        if self._dir is None:
            self._dir = context.directory
        self.timeout = float(context.timeout)
        self._node = context.identity.node

    def _directory(self) -> Any:
        if self._dir is None:
            raise NotSupportedError("engine 'rdma' needs a directory to exchange QP numbers "
                                    "(use it from a Runtime, or pass directory=)")
        return self._dir

    def stats(self) -> dict[str, int]:
        """Counters: ``registrations`` (window MRs ever registered, one per window per publish,
        whatever the number of consumers), ``live_registrations``, ``local_registrations``
        (caller buffers registered for large transfers), ``connects`` (requester QPs set up),
        ``served`` (responder QPs set up for consumers), ``served_live``, ``posted`` (work
        requests), ``failed`` (bad work completions)."""
        with self._lock:
            out = dict(self._counts)
            out["live_registrations"] = len(self._regs)
            out["served_live"] = len(self._served)
            out["connections"] = sum(1 for c in self._conns.values() if not c.broken)
        return out

    def devices(self) -> list[dict[str, Any]]:
        """The opened devices: name, port, GID, LID, active MTU."""
        return [d.endpoint() for d in self._devices]

    # -- owner side ------------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> Descriptor | None:
        self._check_open()
        if region.nbytes == 0:
            return None  # nothing to register: no route through RDMA
        e = self._v.e
        access = e.IBV_ACCESS_REMOTE_READ
        if region.writable:
            access |= e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        mrs: dict[str, Any] = {}
        try:
            for dev in self._devices:
                try:
                    mrs[dev.name] = self._v.MR(dev.pd, region.nbytes, access, address=region.address)
                except self._v.PyverbsError as exc:
                    raise _pyverbs_error(exc, f"ibv_reg_mr of {region.nbytes} bytes on {dev.name}") from exc
        except BaseException:
            for mr in mrs.values():
                mr.close()
            raise
        with self._lock:
            reg_id = next(self._reg_ids)
            self._regs[reg_id] = _Registration(reg_id, region, access, mrs)
            self._counts["registrations"] += 1
        self._start_listener()
        fields = {
            "ep": self.ep, "reg": reg_id, "addr": region.address, "nbytes": region.nbytes,
            "access": "rw" if region.writable else "r", "port": self._devices[0].label,
            "node": self._node, "pid": os.getpid(), "force": self._force,
            "mrs": [dict(dev.endpoint(), rkey=int(mrs[dev.name].rkey)) for dev in self._devices],
        }
        return Descriptor(self.name, fields)

    def deregister(self, descriptor: Descriptor) -> None:
        """Close the window's MRs: its rkeys stop working at the device from now on."""
        self._check_descriptor(descriptor)
        ep = descriptor.field("ep", str)
        if ep != self.ep:
            raise ValueError(f"rdma descriptor of endpoint {ep!r} was not made by this engine")
        with self._lock:
            reg = self._regs.pop(descriptor.field("reg", int), None)
            if reg is None:
                return
            self._counts["deregistrations"] += 1
        failed: BaseException | None = None
        for mr in [*reg.ctl_mrs, *reg.mrs.values()]:  # every MR, even when one fails
            try:
                mr.close()
            except self._v.PyverbsError as exc:
                failed = failed or exc
        reg.ctl_mrs.clear()
        reg.words = None
        if failed is not None:
            raise _pyverbs_error(failed, "ibv_dereg_mr") from failed

    def on_publish(self, descriptor: Descriptor, n_tiles: int, gva: int,
                   words: ControlWords | None = None) -> None:
        """Register the window's control words (header and ready words) read-only
        (``IBV_ACCESS_REMOTE_READ``, never remote write) on every device and name them in the
        descriptor's ``ctl`` field, so consumers on other nodes read them one-sidedly
        (``read_words``). ``deregister`` closes these MRs with the window's."""
        self._check_descriptor(descriptor)
        if words is None or descriptor.field("ep", str) != self.ep:
            return
        with self._lock:
            reg = self._regs.get(descriptor.field("reg", int))
        if reg is None:
            raise ValueError("rdma descriptor has no live registration in this engine")
        v = self._v
        access = v.e.IBV_ACCESS_REMOTE_READ
        hdr, ready = words.header, words.ready
        made: list[Any] = []
        entries = []
        try:
            for dev in self._devices:
                entry: dict[str, Any] = {"device": dev.name}
                for what, region in (("hdr", hdr), ("ready", ready)):
                    if region is None or region.nbytes == 0:
                        continue
                    try:
                        mr = v.MR(dev.pd, region.nbytes, access, address=region.address)
                    except v.PyverbsError as exc:
                        raise _pyverbs_error(exc, f"ibv_reg_mr of {region.nbytes} bytes of control words "
                                                  f"on {dev.name}") from exc
                    made.append(mr)
                    entry[f"{what}_rkey"] = int(mr.rkey)
                entries.append(entry)
        except BaseException:
            for mr in made:
                mr.close()
            raise
        with self._lock:
            if self._regs.get(reg.reg_id) is not reg:  # deregistered meanwhile
                for mr in made:
                    mr.close()
                return
            reg.ctl_mrs.extend(made)
            reg.words = words
        descriptor.fields["ctl"] = {
            "hdr": hdr.address, "hdr_words": hdr.nbytes // 8,
            "ready": ready.address if ready is not None else 0,
            "ready_words": ready.nbytes // 8 if ready is not None else 0,
            "mrs": entries,
        }

    def registration_access(self, descriptor: Descriptor) -> int:
        """The ibv access flags of the live registration behind ``descriptor`` (owner side)."""
        self._check_descriptor(descriptor)
        with self._lock:
            reg = self._regs.get(descriptor.field("reg", int))
        if reg is None or descriptor.field("ep", str) != self.ep:
            raise ValueError("descriptor has no live registration in this engine")
        return int(reg.access)

    # -- owner side: connection listener ---------------------------------------------------------
    def _start_listener(self) -> None:
        with self._lock:
            if self._listener is not None or self._dir is None:
                return
            self._listener = threading.Thread(target=self._listen, daemon=True,
                                              name=f"memsem-rdma-listen-{self.ep}")
            self._listener.start()

    def _listen(self) -> None:
        prefix = f"rdma/{self.ep}/"
        idle_since = time.monotonic()
        while not self._stop.is_set():
            try:
                ents = self._dir.entries(prefix)
            except Exception as exc:  # directory hiccup: retry, never die silently
                log.warning("rdma listener: reading the directory failed: %s", exc)
                ents = {}
            now = time.monotonic()
            for key, rec in sorted(ents.items(), key=lambda kv: int(kv[1].get("seq", 0))):
                kind, _, rest = key[len(prefix):].partition("/")
                if kind == "req":
                    idle_since = now
                    self._serve(rest.rsplit(".", 1)[0], rec)
                    self._dir.remove_entry(key)
                elif kind == "bye":
                    self._drop_served(rest)
                    self._dir.remove_entry(key)
            quiet = now - idle_since
            self._stop.wait(LISTEN_ACTIVE if quiet < 1.0 else LISTEN_IDLE if quiet < 10.0 else LISTEN_QUIET)

    def _serve(self, consumer: str, rec: dict[str, Any]) -> None:
        v = self._v
        reply_key = f"rdma/{consumer}/rep/{self.ep}"
        seq = int(rec.get("seq", 0))
        try:
            dev = self._by_name.get(str(rec.get("device"))) or self._devices[0]
            with self._lock:
                if self._closed:
                    return
                old = self._served.pop(consumer, None)
                cq = self._served_cq.get(dev.name)
                if cq is None:
                    cq = self._served_cq[dev.name] = v.CQ(dev.ctx, 16)
            if old is not None:
                old[1].close()
            qp = self._new_qp(dev, cq, max_send_wr=1)
            try:
                qp.to_rts(self._qp_attr(dev, rec))
            except BaseException:
                qp.close()
                raise
            with self._lock:
                self._served[consumer] = (seq, qp)
                self._counts["served"] += 1
            reply = dict(dev.endpoint(), qpn=int(qp.qp_num), seq=seq)
        except Exception as exc:
            log.warning("rdma listener: connecting consumer %s failed: %s", consumer, exc)
            reply = {"seq": seq, "error": f"{type(exc).__name__}: {exc}"}
        self._dir.put_entry(reply_key, reply)

    def _drop_served(self, consumer: str) -> None:
        with self._lock:
            old = self._served.pop(consumer, None)
        if old is not None:
            old[1].close()

    # -- QPs -------------------------------------------------------------------------------------
    def _new_qp(self, dev: _Device, cq: Any, *, max_send_wr: int) -> Any:
        v = self._v
        cap = v.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        try:
            return v.QP(dev.pd, v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
        except v.PyverbsError as exc:
            raise _pyverbs_error(exc, f"ibv_create_qp on {dev.name}") from exc

    def _qp_attr(self, dev: _Device, peer: dict[str, Any]) -> Any:
        """RESET -> RTS attributes towards ``peer`` ({qpn, gid, lid, mtu})."""
        v = self._v
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

    # -- consumer side ---------------------------------------------------------------------------
    def attach(self, descriptor: Descriptor, nbytes: int, credential: bytes = b"") -> RemoteRegion:
        self._check_descriptor(descriptor)
        self._check_open()
        d = descriptor
        region_bytes = d.field("nbytes", int)
        if nbytes > region_bytes:
            raise ValueError(f"attach of {nbytes} bytes to an RDMA region of {region_bytes} bytes")
        ep, addr, access = d.field("ep", str), d.field("addr", int), d.field("access", str, "r")
        mrs = d.field("mrs", list)
        if not mrs:
            raise ValueError("rdma descriptor field 'mrs' is empty (no memory registration to reach)")
        for i, m in enumerate(mrs):
            what = f"rdma descriptor mrs[{i}]"
            typed_field(m, "device", str, what)
            typed_field(m, "rkey", int, what)
        entries = {m["device"]: m for m in mrs}
        dev, m = next(((dv, entries[dv.name]) for dv in self._devices if dv.name in entries),
                      (self._devices[0], mrs[0]))
        ctl = self._control_fields(d, dev.name)
        conn = self._conn(ep, dev, dict(m, ep=ep, node=d.field("node", str, None), pid=d.field("pid", int, None)))
        with conn.lock:
            if conn.broken:
                self._reconnect(conn)
        remote = _RdmaRemote(self, nbytes, conn, addr, m["rkey"], access == "rw")
        if ctl is not None:
            hdr, hdr_words, hdr_rkey, ready, ready_words, ready_rkey = ctl
            remote.ctl_header = _RdmaRemote(self, 8 * hdr_words, conn, hdr, hdr_rkey, False)
            if ready_words:
                remote.ctl_ready = _RdmaRemote(self, 8 * ready_words, conn, ready, ready_rkey, False)
        return remote

    @staticmethod
    def _control_fields(d: Descriptor, device: str) -> tuple[int, int, int, int, int, int] | None:
        """The descriptor's control-word MRs as seen from ``device`` (None when it names none).

        Raises:
            ValueError: a malformed ``ctl`` field (names the field).
        """
        ctl = d.field("ctl", dict, None)
        if ctl is None:
            return None
        what = "rdma descriptor ctl"
        hdr, hdr_words = typed_field(ctl, "hdr", int, what), typed_field(ctl, "hdr_words", int, what)
        ready, ready_words = typed_field(ctl, "ready", int, what), typed_field(ctl, "ready_words", int, what)
        if not 0 < hdr_words <= MAX_HEADER_WORDS:
            raise ValueError(f"{what} field 'hdr_words' must be in [1, {MAX_HEADER_WORDS}], got {hdr_words}")
        if not 0 <= ready_words <= MAX_READY_WORDS:
            raise ValueError(f"{what} field 'ready_words' must be in [0, {MAX_READY_WORDS}], got {ready_words}")
        mrs = typed_field(ctl, "mrs", list, what)
        for i, m in enumerate(mrs):
            typed_field(m, "device", str, f"{what} mrs[{i}]")
        m = next((m for m in mrs if m["device"] == device), mrs[0] if mrs else None)
        if m is None:
            raise ValueError(f"{what} field 'mrs' is empty")
        hdr_rkey = typed_field(m, "hdr_rkey", int, f"{what} mrs entry of {m['device']}")
        ready_rkey = typed_field(m, "ready_rkey", int, f"{what} mrs entry of {m['device']}") if ready_words else 0
        return hdr, hdr_words, hdr_rkey, ready, ready_words, ready_rkey

    # -- consumer side: control words ------------------------------------------------------------
    def can_watch(self, remote: RemoteRegion) -> WatchMode:
        """READ for a window whose owner registered its control words (``read_words``)."""
        return WatchMode.READ if isinstance(remote, _RdmaRemote) and remote.ctl_header is not None else WatchMode.NONE

    def read_words(self, remote: RemoteRegion, kind: int, index: int, count: int) -> list[int]:
        """RDMA READ of ``count`` 64-bit control words of ``remote``'s window: header words
        from word ``index`` (``kind`` WATCH_HEADER) or ready words from tile ``index``
        (WATCH_READY), through the connection's registered bounce buffer. Blocks until the
        words are here (one work completion, bounded by the engine's completion deadline).

        Returns:
            the words' values, ``count`` unsigned ints.

        Raises:
            TypeError / ValueError: ``kind``, ``index`` or ``count`` is not an int, or names
                words the descriptor does not (the message names the argument).
            NotSupportedError: the owner registered no control words for this window.
            EngineError / PeerLostError / MemsemTimeoutError: as for ``get`` (a window
                deregistered at its owner, i.e. retired, fails with ``IBV_WC_REM_ACCESS_ERR``).
        """
        for arg, val in (("kind", kind), ("index", index), ("count", count)):
            if type(val) is not int:
                raise TypeError(f"{arg} must be an int, got {type(val).__name__} {val!r:.40}")
        if not isinstance(remote, _RdmaRemote) or remote.engine is not self:
            raise ValueError("remote region was not attached by this rdma engine")
        if kind == WATCH_HEADER:
            sub = remote.ctl_header
        elif kind == WATCH_READY:
            sub = remote.ctl_ready
        else:
            raise ValueError(f"kind must be WATCH_HEADER ({WATCH_HEADER}) or WATCH_READY ({WATCH_READY}), "
                             f"got {kind}")
        if remote.ctl_header is None:
            raise NotSupportedError("the window's owner registered no control words for rdma reads")
        have = 0 if sub is None else sub.nbytes // 8
        if have == 0:
            raise ValueError(f"kind {kind}: the window has no ready words (published without tiles)")
        if not 0 <= index < have:
            raise ValueError(f"index {index} is outside the window's {have} "
                             f"{'header' if kind == WATCH_HEADER else 'ready'} words")
        if not 1 <= count <= have - index:
            raise ValueError(f"count {count} must be in [1, {have - index}] (words from index {index} of {have})")
        out = np.empty(count, np.uint64)
        self._one(Op(OpKind.GET, sub, 8 * index, out.view(np.uint8)))
        return out.tolist()

    def _conn(self, owner_ep: str, dev: _Device, owner: dict[str, Any]) -> _Conn:
        key = (owner_ep, dev.name)
        with self._lock:
            conn = self._conns.get(key)
            if conn is None:
                conn = self._conns[key] = _Conn(key, dev, owner)
            return conn

    def _reconnect(self, conn: _Conn) -> None:
        """(Re)create ``conn``'s QP and exchange QP numbers with the owner. Holds ``conn.lock``."""
        v = self._v
        d = self._directory()
        conn.destroy()
        dev = conn.dev
        try:
            if conn.bounce_mr is None:
                conn.bounce_mr = v.MR(dev.pd, conn.bounce.nbytes, v.e.IBV_ACCESS_LOCAL_WRITE,
                                      address=conn.bounce.ctypes.data)
            conn.cq = v.CQ(dev.ctx, SQ_DEPTH + 8)
        except v.PyverbsError as exc:
            raise _pyverbs_error(exc, f"setting up an RDMA connection on {dev.name}") from exc
        conn.qp = self._new_qp(dev, conn.cq, max_send_wr=SQ_DEPTH)
        conn.seq += 1
        owner_ep = conn.key[0]
        reply_key = f"rdma/{self.ep}/rep/{owner_ep}"
        req_key = f"rdma/{owner_ep}/req/{self.ep}.{conn.seq}"
        d.remove_entry(reply_key)
        d.put_entry(req_key, dict(dev.endpoint(), qpn=int(conn.qp.qp_num), seq=conn.seq,
                                  device=conn.owner.get("device"), node=self._node, pid=os.getpid()))
        limit = LOST_CONNECT_TIMEOUT if conn.lost else self.connect_timeout
        deadline = time.monotonic() + limit
        rep = None
        while True:
            rec = d.get_entry(reply_key)
            if rec is not None and int(rec.get("seq", -1)) == conn.seq:
                rep = rec
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        d.remove_entry(reply_key)
        if rep is None:
            d.remove_entry(req_key)
            conn.destroy()
            conn.lost = True
            raise PeerLostError(f"{conn.label()} did not answer an RDMA connection request within "
                                f"{limit:.1f} s (owner dead or its runtime closed)")
        if "error" in rep:
            conn.destroy()
            raise EngineError(f"{conn.label()} refused the RDMA connection: {rep['error']}",
                              name="RDMA_CONNECT")
        try:
            conn.qp.to_rts(self._qp_attr(dev, rep))
        except v.PyverbsError as exc:
            conn.destroy()
            raise _pyverbs_error(exc, f"moving an RC QP to RTS towards {conn.label()}") from exc
        conn.broken = conn.lost = False
        with self._lock:
            self._counts["connects"] += 1

    # -- data ------------------------------------------------------------------------------------
    def get(self, remote: RemoteRegion, offset: int, dst: np.ndarray) -> None:
        """RDMA READ of ``dst.nbytes`` bytes at byte ``offset`` of ``remote`` into the local
        C-contiguous array ``dst``. Blocks until the bytes are in ``dst``. Thread-safe (calls on
        one connection are serialized).

        Raises:
            EngineError: a bad work completion; ``name``/``code`` carry its status (e.g.
                ``IBV_WC_REM_ACCESS_ERR`` for a revoked rkey).
            PeerLostError: the owner's QP is gone (``IBV_WC_RETRY_EXC_ERR``, ~0.5 s) or the
                owner did not answer a (re)connection request.
            MemsemTimeoutError: no completion by the deadline (the QP was reset first).
            ValueError: the range lies outside the region, or ``dst`` is read-only.
        """
        self._one(Op(OpKind.GET, remote, offset, dst))

    def put(self, remote: RemoteRegion, offset: int, src: np.ndarray) -> None:
        """RDMA WRITE of the local C-contiguous array ``src`` at byte ``offset`` of ``remote``.
        Blocks until the successful work completion: on RC the target acknowledged the data
        (remote completion). Raises like ``get``; a window registered without REMOTE_WRITE
        (published read-only) fails with ``IBV_WC_REM_ACCESS_ERR``."""
        self._one(Op(OpKind.PUT, remote, offset, src))

    def _one(self, op: Op) -> None:
        self._execute([op])
        if op.state != OpState.DONE:
            raise op.error if op.error is not None else EngineError("RDMA operation did not complete")

    def _run_ops(self, req: Request) -> None:
        try:
            self._execute([op for op in req.ops if op.state != OpState.CANCELLED])
        finally:
            req.finish()

    def _execute(self, ops: list[Op]) -> None:
        """Run ``ops`` (grouped by connection, each group posted as one list of work requests);
        every op ends DONE or FAILED with ``error``."""
        groups: dict[int, list[Op]] = {}
        for op in ops:
            op.state = OpState.RUNNING
            try:
                if not isinstance(op.remote, _RdmaRemote) or op.remote.engine is not self:
                    raise ValueError("remote region was not attached by this rdma engine")
                self._check_range(op.remote, op.offset, op.nbytes)
                if op.kind == OpKind.GET and not op.local.flags.writeable:
                    raise ValueError("get destination array is read-only")
                if op.local.nbytes and not op.local.flags.c_contiguous:
                    raise ValueError("local array must be C-contiguous")
                self._check_open()
            except BaseException as exc:
                op.error, op.state = exc, OpState.FAILED
                continue
            if op.nbytes == 0:
                op.state = OpState.DONE
                continue
            groups.setdefault(id(op.remote.conn), []).append(op)
        for group in groups.values():
            conn = group[0].remote.conn
            with conn.lock:
                self._run_group(conn, group, retry=True)

    def _run_group(self, conn: _Conn, ops: list[Op], *, retry: bool) -> None:
        v = self._v
        e = v.e
        try:
            if conn.broken:
                self._reconnect(conn)
        except BaseException as exc:
            for op in ops:
                op.error, op.state = exc, OpState.FAILED
            return
        items: list[_Item] = []
        wrs: list[tuple[int, int, int, int, int, int]] = []  # (item, opcode, laddr, n, lkey, raddr)
        bounce_used = 0
        try:
            for op in ops:
                remote: _RdmaRemote = op.remote  # type: ignore[assignment]
                it = _Item(op.kind, op.local, remote.address + op.offset, remote.rkey)
                n = op.nbytes
                if n <= BOUNCE_BYTES - bounce_used:
                    it.bounce_off = bounce_used
                    bounce_used += -(-n // 64) * 64
                    laddr, lkey = conn.bounce.ctypes.data + it.bounce_off, conn.bounce_mr.lkey
                    if op.kind == OpKind.PUT:
                        conn.bounce[it.bounce_off:it.bounce_off + n] = op.local.reshape(-1).view(np.uint8)
                else:
                    access = e.IBV_ACCESS_LOCAL_WRITE if op.kind == OpKind.GET else 0
                    try:
                        it.mr = v.MR(conn.dev.pd, n, access, address=op.local.ctypes.data)
                    except v.PyverbsError as exc:
                        raise _pyverbs_error(exc, f"ibv_reg_mr of a local buffer of {n} bytes") from exc
                    with self._lock:
                        self._counts["local_registrations"] += 1
                    laddr, lkey = op.local.ctypes.data, it.mr.lkey
                opcode = e.IBV_WR_RDMA_READ if op.kind == OpKind.GET else e.IBV_WR_RDMA_WRITE
                for at in range(0, n, MAX_WR_BYTES):
                    it.wr_ids.append(len(wrs))
                    wrs.append((len(items), opcode, laddr + at, min(MAX_WR_BYTES, n - at), lkey,
                                it.remote_addr + at))
                items.append(it)
            total = sum(w[3] for w in wrs)
            statuses = self._post_and_poll(conn, items, wrs, time.monotonic() + self.timeout + total / MIN_BANDWIDTH)
        except BaseException as exc:
            for it in items:
                if it.mr is not None:
                    it.mr.close()
            for op in ops:
                op.error, op.state = exc, OpState.FAILED
            return
        flushed: list[Op] = []
        for op, it in zip(ops, items):
            if it.mr is not None:
                it.mr.close()
            bad = [statuses[i] for i in it.wr_ids if statuses[i] != e.IBV_WC_SUCCESS]
            if not bad:
                if op.kind == OpKind.GET and it.bounce_off >= 0:
                    op.local.reshape(-1).view(np.uint8)[:] = conn.bounce[it.bounce_off:it.bounce_off + op.nbytes]
                op.state = OpState.DONE
                continue
            status = next((s for s in bad if s not in (e.IBV_WC_WR_FLUSH_ERR, -1)), bad[0])
            if status in (e.IBV_WC_WR_FLUSH_ERR, -1) and retry:
                flushed.append(op)  # failed only because a sibling broke the QP: retry once
                continue
            op.error, op.state = self._wc_error(conn, status, op), OpState.FAILED
        if flushed:
            self._run_group(conn, flushed, retry=False)

    def _post_and_poll(self, conn: _Conn, items: list[_Item], wrs: list[tuple], deadline: float) -> list[int]:
        """Post ``wrs`` (at most SQ_DEPTH outstanding) and poll every completion. Returns a status
        per WR (-1: not posted because the QP broke first). Marks ``conn`` broken on any error."""
        v = self._v
        e = v.e
        statuses = [-2] * len(wrs)
        nxt = outstanding = 0
        t_start = t_idle = time.monotonic()
        failed = False
        qp, cq = conn.qp, conn.cq
        while nxt < len(wrs) or outstanding:
            while not failed and nxt < len(wrs) and outstanding < SQ_DEPTH:
                _, opcode, laddr, n, lkey, raddr = wrs[nxt]
                wr = v.SendWR(wr_id=nxt, opcode=opcode, num_sge=1, sg=[v.SGE(laddr, n, lkey)],
                              send_flags=e.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(items[wrs[nxt][0]].rkey, raddr)
                try:
                    qp.post_send(wr)
                except v.PyverbsError as exc:
                    failed = True
                    conn.broken = True
                    if not outstanding:
                        raise _pyverbs_error(exc, f"ibv_post_send to {conn.label()}") from exc
                    break
                nxt += 1
                outstanding += 1
            if failed and nxt < len(wrs):
                for i in range(nxt, len(wrs)):
                    statuses[i] = -1
                nxt = len(wrs)
            if not outstanding:
                break
            got, wcs = cq.poll(min(outstanding, 32))
            if got:
                for wc in wcs:
                    statuses[wc.wr_id] = wc.status
                    outstanding -= 1
                    if wc.status != e.IBV_WC_SUCCESS:
                        failed = True
                        conn.broken = True
                t_idle = time.monotonic()
                continue
            now = time.monotonic()
            if now >= deadline:
                self._abort(conn, outstanding)
                raise MemsemTimeoutError(
                    f"{outstanding} RDMA work request(s) to {conn.label()} not complete by the "
                    f"deadline ({self.timeout:.1f} s + bytes / {MIN_BANDWIDTH / 1e6:.0f} MB/s); the "
                    "QP was reset", what="RDMA completion", timeout=self.timeout)
            if now - t_idle > SPIN_SECONDS:
                time.sleep(min(1e-3, max(5e-5, (now - t_start) / 8)))
        with self._lock:
            self._counts["posted"] += nxt
            self._counts["failed"] += sum(1 for s in statuses if s not in (e.IBV_WC_SUCCESS, -1, -2))
        return statuses

    def _abort(self, conn: _Conn, outstanding: int) -> None:
        """Stop the QP so no late DMA touches caller buffers: move it to ERR and drain the flush
        completions (bounded), else destroy it."""
        v = self._v
        try:
            conn.qp.modify(v.QPAttr(qp_state=v.e.IBV_QPS_ERR), v.e.IBV_QP_STATE)
            deadline = time.monotonic() + 1.0
            while outstanding and time.monotonic() < deadline:
                got, _ = conn.cq.poll(min(outstanding, 32))
                outstanding -= got
                if not got:
                    time.sleep(1e-3)
        except v.PyverbsError as exc:
            log.debug("moving a QP to ERR failed: %s", exc)
        conn.destroy()

    def _wc_error(self, conn: _Conn, status: int, op: Op) -> MemsemError:
        name = _status_name(self._v, status) if status >= 0 else "NOT_POSTED"
        what = "READ" if op.kind == OpKind.GET else "WRITE"
        base = EngineError(f"RDMA {what} of {op.nbytes} bytes at offset {op.offset} from "
                           f"{conn.label()} failed at the device", code=status, name=name)
        if status in (self._v.e.IBV_WC_RETRY_EXC_ERR, self._v.e.IBV_WC_RNR_RETRY_EXC_ERR):
            conn.lost = True
            err = PeerLostError(f"{conn.label()} is unreachable: RDMA {what} failed with {name} "
                                f"(status {status}): its queue pair is gone (process killed or node down)")
            err.__cause__ = base
            err.name, err.code = name, status  # type: ignore[attr-defined]  # also when re-chained
            return err
        return base

    # -- lifetime --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MemsemError("rdma engine is closed")

    def close(self) -> None:
        """Stop the listener, say goodbye to owners, destroy QPs, MRs and device contexts.
        Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=2.0)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            served = list(self._served.values())
            self._served.clear()
            regs = list(self._regs.values())
            self._regs.clear()
        if regs:
            log.warning("rdma engine closed with %d live registration(s)", len(regs))
        for conn in conns:
            with conn.lock:
                if self._dir is not None and conn.seq:
                    try:
                        self._dir.put_entry(f"rdma/{conn.key[0]}/bye/{self.ep}", {"seq": conn.seq})
                    except Exception as exc:  # best effort: the owner replaces or outlives it
                        log.debug("rdma bye to %s failed: %s", conn.key[0], exc)
                conn.destroy()
        for _, qp in served:
            qp.close()
        for dev in self._devices:
            dev.close()


__all__ = ["RdmaEngine"]
