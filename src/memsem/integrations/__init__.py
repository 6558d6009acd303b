"""Integrations of memsem with other systems.

Each integration is a module of its own, imported explicitly (it needs that system installed):

* :mod:`memsem.integrations.transferqueue`: a TransferQueue storage backend named ``Memsem``
  (the ``transferqueue`` extra); see docs/transferqueue.md.
"""

__all__: list[str] = []
