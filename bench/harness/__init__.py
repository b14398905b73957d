"""What the benchmarks in bench/ share: how they time, probe, measure memory, name the machine,
write results and compare a run with the committed one.

A bench script imports it from its own folder (``python bench/<script>.py`` puts bench/ first
on ``sys.path``), one module per concern, each name from the module that defines it:

- ``timing``: clocks, timed calls, medians, interleaved rounds
- ``memory``: peak memory of one call, in a child process where cases must not mix
- ``probes``: the read and copy bandwidth probes every table is read against
- ``machine``: the device name of results files, the CPU's identity, the run's environment
- ``results``: where a run's JSON goes (bench/results/runs/, --save, --out)
- ``regression_check``: --check, a fresh run's ratios against the committed ones
- ``cli``: argument types, shared flags, --device, one-line errors
- ``case_runs``: the flags, start and end of an op benchmark's run of cases
- ``peer_comparisons``: the comparisons with a framework's own aggregation
- ``model_shapes``: the parameter shapes of the models the benchmarks aggregate
- ``fedml_files``: FedML's aggregation code, loaded without ``import fedml``
- ``sim_task``: the federated task that bench_simulation.py gives every simulator
"""
