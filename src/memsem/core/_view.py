"""Zero-copy views: an array over the window's memory itself, held under a lease."""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from memsem import _dtypes
from memsem._errors import MemsemError, NotSupportedError
from memsem.gva import RefSpec
from memsem.core import _translate as tr
from memsem.core._lease import Lease, acquire_on

if TYPE_CHECKING:
    from memsem.core._runtime_core import RuntimeCore


def view(core: "RuntimeCore", spec: RefSpec, *, lease: Lease | None = None) -> np.ndarray:
    """Zero-copy array over the window itself (see ``memsem.TensorRef.view``).

    The array holds what it shows: on host/shm a pin on the mapped segment, on loopback the
    published object; a slice or reshape of it holds the same. It also holds a lease (``lease``,
    which then refuses ``release`` while the view lives, or one of its own, released when the
    last array over the view is collected), so the owner cannot retire the window under it.
    The view's own lease pins the version it shows (``Versions.pin``; so does ``lease`` when it
    pins one): the owner's write sections wait for it (up to their timeout, then
    ``LeaseHeldError``), so a view never shows the bytes of two versions. A ``lease`` that pins
    no version is joined by a pin of the view's own.
    """
    t0 = time.perf_counter_ns()
    resolver = core.resolver
    for _ in range(3):  # one resolution for the whole view (checks, pin, lease, mapping)
        res = resolver.resolve(spec)
        if res.enter():  # held: nothing releases its mappings under the pin and the export
            break
        # the resolution is being dropped (evicted, or its window retired): resolve again
    else:
        raise tr.stale(spec, None)
    pin: Lease | None = None
    try:
        if not res.own_cb and not res.peer.alive_recently():  # a cached resolution may outlive its owner
            raise res.peer.lost(spec.label)
        cb = res.cb
        if not res.route.zero_copy:
            raise NotSupportedError(f"view() of {spec.label} is not possible on route {res.route.kind} "
                                    f"({res.route.reason}); use get()")
        if cb is not None and cb.n_slots > 1:
            raise NotSupportedError(f"view() of {spec.label} is not possible: it is a double-buffered "
                                    "versioned window (its owner rewrites the slots); use get()")
        if lease is not None:
            if lease.spec.gva != spec.gva:
                raise ValueError(f"lease is for {lease.spec.label}, not {spec.label}")
            lease.check("at view()")
        if lease is None or (not lease.version and cb is not None):
            # the bytes shown are one version's: pinned, so no write section changes them
            # meanwhile (a lease held until released, acquired here: it needs no expiry check)
            pin = core.versions.pin_on(res, spec, 0, None, core.timeout) if cb is not None \
                else acquire_on(Lease(core, spec, None), res)
        raw = res.engine.view(res.remote)
        if cb is not None and cb.generation != spec.generation:
            raise tr.stale(spec, cb.generation)
        flat = raw[spec.offset:spec.offset + spec.nbytes]
        if not spec.writable and flat.flags.writeable:
            flat = flat.view()
            flat.flags.writeable = False
        arr = flat.view(_dtypes.numpy_dtype(spec.dtype_code)).reshape(spec.shape)
    except BaseException:
        if pin is not None:
            pin.release()
        raise
    finally:
        res.leave()
    own_lease = lease is None
    if own_lease:
        lease = pin
    else:
        lease.add_view()  # refuses the caller's release while the view lives
    # The lease is tied to the object under every array derived from this view (a slice or
    # reshape of ``arr`` outlives ``arr`` itself and must keep the lease).
    holder = raw.base if raw.base is not None and not isinstance(raw.base, np.ndarray) else raw
    weakref.finalize(holder, _view_gone, lease, own_lease, None if own_lease else pin)
    core.telemetry.record("view", res.route.kind, 0, time.perf_counter_ns() - t0)
    return arr


def _view_gone(lease: Lease, own: bool, pin: Lease | None) -> None:
    if not own:
        lease.drop_view()
    for held in ((lease,) if own else ()) + ((pin,) if pin is not None else ()):
        try:
            held.release()
        except MemsemError:
            pass
