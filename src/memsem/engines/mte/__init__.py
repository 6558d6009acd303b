"""The MTE engine: one-sided copies between the PEs of an Ascend SHMEM team.

* :class:`MteEngine` (``_engine``): the engine;
* :func:`init_team`, :func:`new_uniqueid`, :class:`ShmemTeam` (``_team``): the process's team
  and its symmetric heap;
* ``_binding``: the cffi ABI binding of ``libshmem.so`` (declarations in ``_aclshmem_cdef.h``),
  or of its host emulator (a test double).

See docs/mte.md.
"""
from memsem.engines.mte._engine import MteEngine
from memsem.engines.mte._team import ShmemTeam, SymmetricAllocation, current_team, init_team, new_uniqueid, signal_value

__all__ = ["MteEngine", "ShmemTeam", "SymmetricAllocation", "current_team", "init_team", "new_uniqueid",
           "signal_value"]
