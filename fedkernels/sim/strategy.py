"""The strategy interface: what an algorithm adds to the shared round loop.

A round of :class:`~fedkernels.sim.run.Simulation` is

1. the participation sampler picks the clients ``S_t`` (recorded in the history);
2. if the strategy sets ``wants_global_loss``, the loss ``f_k(x_t)`` of the current global model
   on each participant's training split is computed (one forward pass, before local training);
3. each participant trains locally from ``x_t``, minimising its cross-entropy plus the
   strategy's :meth:`Strategy.local_penalty`;
4. the strategy's :meth:`Strategy.aggregate` turns the round's :class:`RoundInfo` into the next
   global model. By default it asks :meth:`Strategy.client_weights` for ``w_k`` and lets the
   server apply ``Delta_t = sum_k w_k (x_k - x_t)`` through its optimizer
   (plain: ``x_{t+1} = x_t + eta * Delta_t``), fused in one :func:`fedkernels.aggregate` call.

Devices: the simulation runs on ``config.device`` (:mod:`fedkernels.sim.devices`). The models
a strategy sees (``global_state``, ``client_states``, the server's state, ``SetupInfo.model``),
the clients' samples and ``server_data`` are on that device, ``SetupInfo.device``; a strategy
keeps its own model-sized state there too, and builds freshly initialised modules on the CPU
(from its seeded stream) before moving them, so that they start alike on every device. The
per-client scalars of :class:`RoundInfo` (ids, sample counts, losses) and the weights
:meth:`Strategy.client_weights` returns are float64/int64 tensors on the CPU, as the ops take
weights. :meth:`Strategy.load_state_dict` receives a checkpoint's tensors on the CPU and moves
what it keeps on the device.

A new algorithm subclasses :class:`Strategy`, overrides what it needs, and registers itself in
:mod:`fedkernels.algorithms`. Strategy state that must survive a resume (running estimates,
per-client tables) goes through :meth:`Strategy.state_dict`.

Clients apart from the server (a Flower ClientApp, :mod:`fedkernels.apps`): the server's and
the clients' processes each hold a strategy of the same configuration, set up with
``SetupInfo.role`` ``"server"`` and ``"client"``. The server's calls :meth:`Strategy.aggregate`,
the clients' :meth:`Strategy.train_client` (or the shared trainer), and what crosses between
them besides the global model and the trained states goes through four hooks, all tensors:
:meth:`Strategy.client_payload` (server to client before training, e.g. FedEvg's synthetic
set), :meth:`Strategy.receive_payload`, :meth:`Strategy.reply_extras` (client to server after
training, e.g. FedGO's discriminator) and :meth:`Strategy.receive_reply_extras`. What a client
keeps between its rounds (SuPerFed's local model) goes through
:meth:`Strategy.client_state_dict`; an evaluation that needs it runs on the clients
(``evaluates_on_clients``: :meth:`Strategy.evaluate_client` there,
:meth:`Strategy.combine_client_evaluations` on the server). In one process (``role="both"``)
the hooks are never called and the strategy keeps everything itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from .participation import ParticipationHistory

if TYPE_CHECKING:
    from .server import Server


@dataclass
class SetupInfo:
    """What a strategy may know before the first round."""

    num_clients: int
    train_sizes: Tensor  # n_k of every client, float64 [N]
    num_classes: int
    participation_probabilities: np.ndarray | None  # stationary p_n, or None (full/uniform)
    parameter_names: list[str]  # the model's trainable entries, in state_dict order
    # For strategies that run their own local training (Strategy.train_client):
    model: Any = None  # the initial global nn.Module (do not modify it)
    client_config: Any = None  # sim.config.ClientConfig
    rounds: int = 0  # total rounds R of the run
    seed: int = 0  # the experiment seed
    server_data: Tensor | None = None  # the server's unlabeled rows (data.server_fraction)
    # K of every round when the participation pattern fixes it (full: N, uniform: m), else None
    participants_per_round: int | None = None
    device: torch.device = torch.device("cpu")  # where the models and samples are
    # "both": one process runs server and clients (the simulation); "server"/"client": the
    # halves of a run whose clients run apart (module docstring)
    role: Literal["both", "server", "client"] = "both"
    num_features: int | None = None  # values per sample row


@dataclass
class RoundInfo:
    """Everything a strategy sees when it aggregates round ``round`` (0-based).

    Per-participant tensors are aligned with ``participants`` (sorted client ids); they are on
    the CPU, the models on the run's device.
    """

    round: int
    num_clients: int
    participants: Tensor  # int64 [K]
    num_samples: Tensor  # n_k, float64 [K]
    global_state: Mapping[str, Tensor]  # x_t (read-only)
    client_states: list[dict[str, Tensor]]  # x_k after local training (full state_dicts)
    train_losses: Tensor  # mean local minibatch loss, float64 [K]
    global_losses: Tensor | None  # f_k(x_t) before local training, float64 [K] (wants_global_loss)
    history: ParticipationHistory  # I[tau, n] for tau <= round


class Strategy:
    """Base class of the algorithms. Subclasses set ``config_class`` to a dataclass of their
    parameters (the CLI builds flags ``--<name>.<field>`` from it) and take it in ``__init__``."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type | None] = None
    wants_global_loss: ClassVar[bool] = False
    # False where aggregate does not go through Server.step's weighted mean (robust rules, update
    # memories, ...): central DP (dp.*) is refused before the first round
    supports_central_dp: ClassVar[bool] = True
    # False where a client's reply is not the global model retrained (FedEvg's energy model,
    # FedCVAE's CVAE): attacks that rewrite the replies (signflip, scale, gaussian) are refused
    replies_are_models: ClassVar[bool] = True
    # True where evaluate needs what only the clients keep (SuPerFed's local models): with
    # clients apart, evaluate_client runs on each client and combine_client_evaluations on
    # the server
    evaluates_on_clients: ClassVar[bool] = False
    # Whether the strategy runs with its clients apart (module docstring): None judges by
    # whether it trains or evaluates its own way (train_client, evaluate), for then it may
    # keep client state in this object, which other processes would not see
    runs_apart: ClassVar[bool | None] = None

    def __init__(self, config: Any = None) -> None:
        if self.config_class is None:
            if config is not None:
                raise TypeError(f"{type(self).__name__} takes no configuration")
        elif config is None:
            config = self.config_class()
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}")
        self.config = config

    def setup(self, info: SetupInfo) -> None:
        """Called once, when the :class:`~fedkernels.sim.run.Simulation` is built (on resume,
        before :meth:`load_state_dict`)."""
        self.info = info

    def rounds_dependence(self, old_rounds: int, played: int) -> str | None:
        """Why a run set up for ``old_rounds`` rounds, ``played`` of them played, cannot
        continue as one of ``self.info.rounds`` rounds (a schedule spread over the run, such as
        a cosine learning rate, that gave the played rounds other values than the new total
        would), or ``None`` when its rounds so far are those of the new run too."""
        return None

    def too_few_participants(self, count: int) -> str | None:
        """Why a round of ``count`` (>= 1) participants cannot be aggregated by this strategy
        (Bulyan needs 4f + 3 of them), or ``None``. Such a round is skipped like a round
        nobody joined: no training, the global model unchanged, the reason in its record.
        :meth:`setup` refuses a run in which no round could be aggregated."""
        return None

    def result_caveats(self) -> list[str]:
        """What a reader of the run's results must know about them, as sentences, e.g. that
        the configuration never trains the global model, so its accuracy is an untrained
        model's. They go to results.json's ``summary.caveats`` and the command line prints
        them as warnings. Default none."""
        return []

    def local_penalty(
        self, params: Mapping[str, Tensor], global_params: Mapping[str, Tensor]
    ) -> Tensor | None:
        """A term added to every local minibatch loss, as a function of the client's current
        trainable parameters and the round's global ones (``None``: no term). It must be a pure
        tensor function so that the batched (vmap) client path can trace it."""
        return None

    def transform_local_loss(self, loss: Tensor) -> Tensor:
        """Maps each local minibatch's mean cross-entropy before the penalty is added and the
        gradient taken (PropFair's ``-log(1 - loss/M)``); default: unchanged. It must be a pure
        tensor function (no Python branches on values) so the vmap path can trace it."""
        return loss

    def train_client(
        self, global_state: Mapping[str, Tensor], data: Any, round_index: int, client_id: int
    ) -> Any:
        """Local training of one client done by the strategy itself (a
        :class:`~fedkernels.sim.client.ClientUpdate` whose state is what the server aggregates),
        or ``None`` (the default): the shared trainer's SGD on cross-entropy plus
        :meth:`local_penalty`."""
        return None

    def evaluate(self, global_state: Mapping[str, Tensor], clients: list[Any]) -> dict[str, float]:
        """Extra metrics at each evaluation, e.g. of personalized models on every client's own
        test split (``clients``: the federation's ``ClientData``); default none."""
        return {}

    def client_weights(self, info: RoundInfo) -> Tensor:
        """``w_k`` of the combine ``Delta_t = sum_k w_k (x_k - x_t)``."""
        raise NotImplementedError(f"{type(self).__name__} must define client_weights or aggregate")

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        """Updates ``server``'s global model from the round; returns scalars to log."""
        server.step(info.client_states, self.client_weights(info), info.round)
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values to checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (its tensors arrive on the CPU: see the module
        docstring)."""

    # ---------------------------------------------------------- clients apart (module docstring)

    @classmethod
    def apart_problem(cls) -> str | None:
        """Why this strategy cannot run with its clients in other processes, or None."""
        if cls.runs_apart is not None:
            return None if cls.runs_apart else f"{cls.name} keeps its clients' state in one process"
        own = [m for m in ("train_client", "evaluate")
               if getattr(cls, m) is not getattr(Strategy, m)]
        if not own:
            return None
        return (f"{cls.name} trains or evaluates its clients its own way ({', '.join(own)}) "
                "and may keep their state in the strategy, where a client in another process "
                "would not find it; a strategy that keeps nothing there, or passes it through "
                "client_state_dict and the payload hooks, sets runs_apart = True")

    def client_payload(self, client_id: int, round_index: int) -> dict[str, Tensor]:
        """Server side: the tensors client ``client_id`` needs besides the global model to
        train in round ``round_index`` (default none)."""
        return {}

    def receive_payload(self, client_id: int, payload: Mapping[str, Tensor]) -> None:
        """Client side: installs :meth:`client_payload`'s tensors (on the CPU) before
        :meth:`train_client`."""

    def reply_extras(self, client_id: int) -> dict[str, Tensor]:
        """Client side, after training: the tensors the server needs besides the trained
        state (default none)."""
        return {}

    def receive_reply_extras(self, client_id: int, extras: Mapping[str, Tensor]) -> None:
        """Server side: takes in :meth:`reply_extras`' tensors (on the CPU) before the round
        is aggregated; raises ``ValueError`` for tensors that do not fit."""

    def reply_template(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """The names, shapes and dtypes of a client's reply when it is not a state of the
        global model (``replies_are_models`` false), or None when they are not fixed."""
        return None

    def client_state_dict(self, client_id: int) -> dict[str, Tensor]:
        """Client side: what client ``client_id`` keeps between its rounds (default none)."""
        return {}

    def load_client_state_dict(self, client_id: int, state: Mapping[str, Tensor]) -> None:
        """Client side: restores :meth:`client_state_dict` (empty: the client has none yet)."""

    def evaluate_client(
        self, global_state: Mapping[str, Tensor], client: Any, client_id: int
    ) -> dict[str, Tensor]:
        """Client side (``evaluates_on_clients``): this client's part of :meth:`evaluate`."""
        raise NotImplementedError(f"{type(self).__name__} does not evaluate on the clients")

    def combine_client_evaluations(
        self, global_state: Mapping[str, Tensor], clients: list[Any],
        parts: list[dict[str, Tensor] | None],
    ) -> dict[str, Any]:
        """Server side: :meth:`evaluate`'s metrics from every client's
        :meth:`evaluate_client` (None for a client that did not reply)."""
        raise NotImplementedError(f"{type(self).__name__} does not evaluate on the clients")
