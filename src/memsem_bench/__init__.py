"""memsem's benchmarks: what ``memsem bench`` runs, kept out of the ``memsem`` package.

Every figure is memsem against a baseline measured in the same run (``np.copyto``, plain sockets,
MPI through mpi4py, multiprocessing, gloo, Ray), printed as ratios (docs/performance.md). Needs
the ``bench`` extra (rich, matplotlib, mpi4py, mpich, psutil).

Modules: ``main`` (``memsem bench``: the tables, ``--json``, plots), ``measure`` (the paired
rounds and their statistics), ``tcp``, ``weights``, ``scale``, ``fanout``, ``follow``, ``mpi``
(one table or peer each).
"""
import pathlib

#: the source checkout this package runs from (src/memsem_bench/ -> the repository root): where
#: benchmarks/, tests/netns/ and the test venvs (.venv-tq, .venv-verl) are
CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
