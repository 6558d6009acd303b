"""RDMA engine: one-sided RDMA READ / WRITE on RC queue pairs through pyverbs.

Owner side: ``register`` registers the window's own memory (a user address, not a pyverbs
buffer) as one memory region per device, with access flags no wider than the window's
permission (a read-only window gets REMOTE_READ only). The descriptor carries the address and,
per device, the rkey, port and GID. ``deregister`` (called by the runtime at every generation
bump) closes the MRs, so an old rkey faults at the device (``IBV_WC_REM_ACCESS_ERR``), which the
runtime turns into ``StaleReferenceError``; a republish registers anew. N consumers of a window
share its one registration (``stats()["registrations"]``). ``on_publish`` registers the
window's control words (header, ready words) remote-read only; consumers read them with
``read_words``.

Rooms:

=============  ==================================================================================
``_engine``    ``RdmaEngine``: registration, attach, get / put / batches, control-word reads
``_connect``   the connection manager: QP exchange through the directory (``Directory.
               watch_entries``: no polling), reconnects, the owner's listener and responder QPs
``_post``      posting and polling work requests with a deadline; work-completion errors
``_verbs``     pyverbs import, devices, RC QP attributes, error names, counters
=============  ==================================================================================

Environment: ``MEMSEM_RDMA_DEVICE`` (comma-separated device names, default every device with
an active port 1), ``MEMSEM_RDMA_FORCE=1`` (mark descriptors so that same-node consumers route
through RDMA too; for tests), ``MEMSEM_RDMA_CONNECT_TIMEOUT`` (seconds, default 10).
See docs/rdma.md.
"""
from __future__ import annotations

from memsem.engines.rdma._connect import BOUNCE_BYTES, SQ_DEPTH
from memsem.engines.rdma._engine import RdmaEngine

__all__ = ["BOUNCE_BYTES", "SQ_DEPTH", "RdmaEngine"]
