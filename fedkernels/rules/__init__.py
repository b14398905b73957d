"""Framework-neutral rules shared by the simulator (:mod:`fedkernels.sim`,
:mod:`fedkernels.algorithms`) and the integrations (:mod:`fedkernels.integrations`): how
clients are weighted and how the server moves the global model. They sit below ``sim/`` so
that an integration uses them without importing the simulator.

- :mod:`.server_optimizers`: plain SGD, FedAvgM, FedAdagrad, FedAdam, FedYogi on the round's
  averaged update;
- :mod:`.fairness_weights`: weights from the clients' losses (q-FFL, q-FedAvg, TERM,
  (Semi-)VRed, CVaR);
- :mod:`.participation_weights`: FedAU's participation-interval estimate;
- :mod:`.aaggff`: AAggFF's online decision over the clients;
- :mod:`.simplex`: the simplex projection and QP those rules solve.
"""
