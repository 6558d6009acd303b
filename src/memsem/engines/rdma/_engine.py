"""``RdmaEngine``: registration of windows, attach, one-sided get/put and control-word reads.

The parts it is given: ``Connections`` (``_connect``: QP exchange through the directory,
reconnects, the owner's listener), ``Poster`` (``_post``: work requests posted and polled) and
the pyverbs helpers (``_verbs``). See the package docstring for the semantics.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from memsem import _args
from memsem._errors import EngineError, MemsemError, NotSupportedError
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
from memsem.engines.rdma._connect import DEFAULT_CONNECT_TIMEOUT, Conn, Connections
from memsem.engines.rdma._post import Poster
from memsem.engines.rdma._verbs import (
    PORT,
    Counters,
    Device,
    pyverbs_error,
    sysfs_port_active,
    verbs,
    wanted_devices,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = _args.DEFAULT_TIMEOUT_S
#: most control words one descriptor may name (header words; ready words follow the window's
#: tiles, bounded like control blocks' ready words)
MAX_HEADER_WORDS = 4096
MAX_READY_WORDS = 1 << 24


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


class _RdmaRemote(RemoteRegion):
    """A window of another engine, reached through ``conn`` with ``rkey`` at ``address``."""

    def __init__(self, engine: "RdmaEngine", nbytes: int, conn: Conn, address: int, rkey: int,
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


# ----------------------------------------------------------------------------------------------
class RdmaEngine(Engine):
    """One-sided RDMA READ/WRITE over RC QPs (pyverbs); see the package docstring.

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
            v = verbs()
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
        want = wanted_devices()
        if want:
            missing = [w for w in want if w not in devs]
            if missing:
                return Availability(False, f"MEMSEM_RDMA_DEVICE names {', '.join(missing)}; present: "
                                           f"{', '.join(devs)}")
            devs = want
        active = [d for d in devs if sysfs_port_active(d)]
        if not active:
            return Availability(False, f"no active port {PORT} on RDMA devices {', '.join(devs)}")
        return Availability(True)

    def __init__(self, *, devices: Sequence[str] | None = None, directory: Any = None,
                 force: bool | None = None, timeout: float | None = None,
                 connect_timeout: float | None = None) -> None:
        super().__init__()
        try:
            self._v = verbs()
        except ImportError as exc:
            raise NotSupportedError(f"engine 'rdma': pyverbs is not importable ({exc})") from exc
        v = self._v
        if devices is None:
            devices = wanted_devices()
        if devices is None:
            try:
                names = [d.name.decode() for d in v.get_device_list()]
            except v.PyverbsError as exc:
                raise NotSupportedError("engine 'rdma': no RDMA devices") from exc
            devices = [n for n in names if sysfs_port_active(n)] or names
        if not devices:
            raise NotSupportedError("engine 'rdma': no RDMA devices")
        self._devices: list[Device] = []
        try:
            for name in devices:
                try:
                    self._devices.append(Device(v, name))
                except v.PyverbsError as exc:
                    raise pyverbs_error(exc, f"opening RDMA device {name}") from exc
        except BaseException:
            for d in self._devices:
                d.close()
            raise
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
            connect = _args.timeout(env_v, "MEMSEM_RDMA_CONNECT_TIMEOUT", positive=True)
        else:
            connect = DEFAULT_CONNECT_TIMEOUT if connect_timeout is None else \
                _args.timeout(connect_timeout, "connect_timeout", positive=True)
        self._node = ""
        self._lock = threading.RLock()
        self._regs: dict[int, _Registration] = {}
        self._reg_ids = itertools.count(1)
        self._counts = Counters()
        self._connections = Connections(v, self._devices, self.ep, self._counts, connect)
        self._poster = Poster(v, self._counts, self._connections.reconnect)
        if directory is not None:
            self._connections.bind(directory, self._node)
        self.location_attrs = {"rdma_port": ",".join(d.label for d in self._devices)}

    @property
    def connect_timeout(self) -> float:
        """Bound in seconds of one connection setup."""
        return self._connections.connect_timeout

    # -- wiring ----------------------------------------------------------------------------------
    def bind(self, context: Any) -> None:
        """Called by the runtime once its directory is open (see ``Engine.bind``)."""
        super().bind(context)
        if self._dir is None:
            self._dir = context.directory
        self.timeout = float(context.timeout)
        self._node = context.identity.node
        self._connections.bind(self._dir, self._node)

    def stats(self) -> dict[str, int]:
        """Counters: ``registrations`` (window MRs ever registered, one per window per publish,
        whatever the number of consumers), ``live_registrations``, ``local_registrations``
        (caller buffers registered for large transfers), ``connects`` (requester QPs set up),
        ``served`` (responder QPs set up for consumers), ``served_live``, ``connections``
        (requester QPs up now), ``posted`` (work requests), ``round_trips`` (post-and-wait
        cycles: one per get, put, control-word read or posted batch), ``failed`` (bad work
        completions)."""
        out = self._counts.snapshot()
        with self._lock:
            out["live_registrations"] = len(self._regs)
        out.update(self._connections.stats())
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
                    raise pyverbs_error(exc, f"ibv_reg_mr of {region.nbytes} bytes on {dev.name}") from exc
        except BaseException:
            for mr in mrs.values():
                mr.close()
            raise
        with self._lock:
            reg_id = next(self._reg_ids)
            self._regs[reg_id] = _Registration(reg_id, region, access, mrs)
        self._counts.add("registrations")
        self._connections.start_listener()
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
        self._counts.add("deregistrations")
        failed: BaseException | None = None
        for mr in [*reg.ctl_mrs, *reg.mrs.values()]:  # every MR, even when one fails
            try:
                mr.close()
            except self._v.PyverbsError as exc:
                failed = failed or exc
        reg.ctl_mrs.clear()
        reg.words = None
        if failed is not None:
            raise pyverbs_error(failed, "ibv_dereg_mr") from failed

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
                        raise pyverbs_error(exc, f"ibv_reg_mr of {region.nbytes} bytes of control words "
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
        conn = self._connections.get(ep, dev, dict(m, ep=ep, node=d.field("node", str, None),
                                                   pid=d.field("pid", int, None)))
        with conn.lock:
            if conn.broken:
                self._connections.reconnect(conn)
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
                self._poster.run_group(conn, group, self.timeout)

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
        self._connections.close()
        with self._lock:
            regs = list(self._regs.values())
            self._regs.clear()
        if regs:
            log.warning("rdma engine closed with %d live registration(s)", len(regs))
        for dev in self._devices:
            dev.close()
