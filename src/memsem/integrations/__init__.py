"""Integrations of memsem with other systems.

Each integration is a module of its own, imported explicitly (it needs that system installed):

* :mod:`memsem.integrations.transferqueue`: a TransferQueue storage backend named ``Memsem``
  (the ``transferqueue`` extra); see docs/transferqueue.md.
* :mod:`memsem.integrations.ray_transport`: memsem as a Ray tensor transport,
  ``@ray.method(tensor_transport="memsem")`` (needs Ray 2.60's ``register_tensor_transport``); see
  docs/ray-transport.md.
"""

__all__: list[str] = []
