"""fedkernels' algorithms as applications of other frameworks, where server and clients run in
separate processes.

- :mod:`fedkernels.apps.flower`: any registered algorithm as a Flower ``ServerApp`` and
  ``ClientApp`` (Message API), for Flower's simulation engine and for a deployment of
  SuperLink and SuperNodes; :mod:`fedkernels.apps.in_process` drives the pair in one process.

The apps reuse the simulator's halves of a round (:class:`fedkernels.sim.Simulation` with
``role="server"`` and :class:`fedkernels.sim.client_runtime.ClientRuntime`), so that a run
gives the metrics of ``fedkernels run`` with the same configuration. Nothing here is imported
by ``import fedkernels``.
"""
