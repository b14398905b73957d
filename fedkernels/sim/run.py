"""The round loop shared by every algorithm, with checkpoint and resume.

>>> from fedkernels.sim import ExperimentConfig, Simulation
>>> from fedkernels.algorithms import build_strategy
>>> simulation = Simulation(ExperimentConfig(rounds=20), build_strategy("fedavg"))
>>> result = simulation.run()  # doctest: +SKIP
>>> result.rounds[-1]["test_accuracy"]  # doctest: +SKIP

One round is described in :mod:`fedkernels.sim.strategy`. All randomness comes from the seeded
streams of :mod:`fedkernels.sim.seeding`; the one stateful generator (participation) is saved
in the checkpoint together with the global model, the server optimizer's moments, the
strategy's state, the participation history and the metrics so far. A run resumed from a
checkpoint therefore ends with the same numbers as an uninterrupted run with the same seed (on
the same device: a checkpoint also resumes on another device, see ``docs/guide/gpu.md``).

Everything runs on ``config.device`` (:mod:`fedkernels.sim.devices`): the clients' samples are
moved there once, when the simulation is built, and so are the model, the server's state and
every strategy's model-sized state.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from .atomic_files import replacing
from .attacks import ByzantineClients, build_attack
from .central_dp import CentralPrivacy, sampling_rate
from .client import ClientUpdate, LocalTrainer
from .config import (
    SECTIONS,
    AttackConfig,
    ConfigError,
    ExperimentConfig,
    PartitionConfig,
    PrivacyConfig,
    applicable_dict,
    from_dict,
)
from .data import load_dataset, stratified_split
from .dataset import Dataset
from .devices import (
    device_name,
    peak_memory_bytes,
    reproducible_numerics,
    reset_peak_memory,
    resolve_device,
    synchronize,
)
from .federation import Federation, build_federation
from .metrics import ClientEvaluation, evaluate_clients, evaluation_metrics
from .models import build_model
from .participation import ParticipationHistory, build_sampler
from .results import RunResult
from .server import Server, build_server_optimizer
from .strategy import RoundInfo, SetupInfo, Strategy
from .vmap import BatchedTrainer

CHECKPOINT_FORMAT = 1


@dataclass
class PreparedData:
    """The clients of a run as :func:`prepare_data` builds them, for the server's process and
    for every client's alike."""

    federation: Federation  # on the run's device, labels poisoned where the attack says
    dataset_name: str
    data_file: dict[str, Any] | None  # a CSV file's size and SHA-256, else None
    attack: ByzantineClients | None

    def initial_model(self, config: ExperimentConfig, model: nn.Module | None = None
                      ) -> nn.Module:
        """The initial global model on the federation's device: ``config.model`` built from
        the seed, or a copy of ``model``."""
        fed = self.federation
        if model is None:
            model = build_model(
                config.model, fed.num_features, fed.num_classes, fed.image_shape, config.seed,
                vocab_size=fed.vocab_size,
            )
        else:
            model = copy.deepcopy(model)
        device = fed.clients[0].train_x.device if fed.clients else torch.device("cpu")
        return model.to(device)


def prepare_data(
    config: ExperimentConfig, device: torch.device, dataset: Dataset | None = None
) -> PreparedData:
    """Loads ``config.data`` (or takes ``dataset``), partitions it among the clients, moves
    their samples to ``device`` and poisons the labels the attack names: the same clients,
    bit for bit, in every process that calls it with the same configuration."""
    seed = config.seed
    data_file = None  # the CSV file's size and hash, so that a resumed run refuses a new file
    if dataset is None:
        dataset = load_dataset(config.data, config.partition.num_clients, seed)
        if config.data.name == "csv":
            data_file = file_fingerprint(config.data.path)
            _warn_client_column_as_feature(dataset, config)
    _check_client_sizes(dataset, config.partition)
    federation = build_federation(
        dataset, config.partition, config.data.test_fraction, seed, config.data.server_fraction,
        label_noise=config.data.label_noise, noise_rate=config.data.noise_rate,
        use_official_split=config.data.official_split,
        stratify=stratified_split(config.data),
    ).to(device)
    attack = build_attack(config.attack, federation.num_clients, seed)
    if attack is not None:
        attack.poison_labels(federation)
    return PreparedData(federation, dataset.name, data_file, attack)


def global_losses(model: nn.Module, global_state: dict[str, Tensor], clients: list[Any]
                  ) -> Tensor:
    """``f_k(x_t)``: the global model's mean loss on each client's training split (float64
    ``[K]`` on the CPU), computed with ``model`` (its weights are replaced)."""
    model.load_state_dict(global_state)
    return evaluate_clients(model, [c.train_x for c in clients], [c.train_y for c in clients]).loss


@dataclass
class RoundPlan:
    """One round between :meth:`Simulation.open_round` and :meth:`Simulation.finish_round`."""

    round: int
    mask: Tensor  # the sampler's draw, bool [N]
    participants: list[int]  # the clients to train, sorted ([] when nobody trains)
    global_state: dict[str, Tensor]  # x_t, a copy ({} when nobody trains)
    record: dict[str, Any]  # the round's metrics so far
    trained: int = 0  # updates aggregated (close_round)
    time_client: float = 0.0
    time_aggregate: float = 0.0


class Simulation:
    """A federated experiment: data, clients, model, server and a strategy.

    Args:
        config: the experiment. ``config.algorithm``/``algorithm_params`` are replaced by the
            strategy's own name and parameters.
        strategy: the algorithm (see :mod:`fedkernels.algorithms`).
        dataset: user data instead of ``config.data`` (see :meth:`Dataset.from_tensors`).
        model: any ``nn.Module`` mapping ``[B, d]`` rows to logits, instead of ``config.model``;
            its current weights are the initial global model (a copy of it is moved to
            ``config.device``; ``model`` itself stays where it is).
        checkpoint: file to write after every ``config.checkpoint_every`` rounds and to resume from.
        role: ``"server"`` where the clients train elsewhere (:mod:`fedkernels.apps`): the
            strategy is set up as the server's half, and the rounds are played through
            :meth:`open_round`, :meth:`close_round` and :meth:`finish_round` with the
            clients' updates from :class:`ClientRuntime`.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        strategy: Strategy,
        *,
        dataset: Dataset | None = None,
        model: nn.Module | None = None,
        checkpoint: str | os.PathLike | None = None,
        role: Literal["both", "server"] = "both",
    ) -> None:
        strategy_config = getattr(strategy, "config", None)
        params = dataclasses.asdict(strategy_config) if strategy_config is not None else {}
        self.config = dataclasses.replace(config, algorithm=strategy.name, algorithm_params=params)
        self.device = resolve_device(config.device)
        reset_peak_memory(self.device)
        seed = config.seed
        data = prepare_data(config, self.device, dataset)
        self.data_file = data.data_file
        self.dataset_name = data.dataset_name
        self.federation = fed = data.federation
        self.attack = data.attack
        model = data.initial_model(config, model)
        self.sampler = build_sampler(config.participation, fed, seed)
        fixed_count = self.sampler.fixed_count
        _check_strategy_fits(strategy, config)
        private = None
        if config.dp.enabled:
            rate = sampling_rate(config.participation.kind, self.sampler.probabilities)
            private = CentralPrivacy(config.dp, fed.num_clients, seed, rate)
            # the noise of the adaptive clip needs enough clients per round: checked here for
            # the round's K when the pattern fixes it, else for the largest K (N)
            private.noise_levels(fed.num_clients if fixed_count is None else fixed_count)
        self.server = Server(model, build_server_optimizer(config.server), private)
        self.history = ParticipationHistory(fed.num_clients)
        self.strategy = strategy
        trainer_class = BatchedTrainer if config.vmap else LocalTrainer
        self.trainer = trainer_class(model, config.client, strategy, seed,
                                     image_shape=fed.image_shape)
        self.eval_model = copy.deepcopy(model)
        self.records: list[dict[str, Any]] = []
        self.next_round = 0
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        with reproducible_numerics(self.device):  # some strategies train while set up
            strategy.setup(SetupInfo(
                fed.num_clients,
                fed.train_sizes(),
                fed.num_classes,
                self.sampler.probabilities,
                list(self.server.parameter_names),
                model=model,
                client_config=config.client,
                rounds=config.rounds,
                seed=seed,
                server_data=fed.server_x,
                participants_per_round=fixed_count,
                device=self.device,
                role=role,
                num_features=fed.num_features,
            ))

    # ------------------------------------------------------------------ the loop

    def run(
        self, *, resume: bool = False, on_round: Callable[[dict[str, Any]], None] | None = None
    ) -> RunResult:
        """Plays the rounds up to ``config.rounds`` (from the checkpoint when ``resume``) and
        returns the result. ``on_round`` is called with each round's metrics."""
        if resume:
            self.load_checkpoint()
        with reproducible_numerics(self.device):
            return self._run(on_round)

    def _run(self, on_round: Callable[[dict[str, Any]], None] | None) -> RunResult:
        for t in range(self.next_round, self.config.rounds):
            record = self.play_round(t)
            self.records.append(record)
            self.next_round = t + 1
            last = t + 1 == self.config.rounds
            if self.checkpoint is not None and (
                last or (t + 1) % self.config.checkpoint_every == 0
            ):
                self.save_checkpoint()
            if on_round is not None:
                on_round(record)
        return self.result()

    def play_round(self, t: int) -> dict[str, Any]:
        """One round (see :mod:`fedkernels.sim.strategy`); returns its metrics, with
        ``wall_time_s``, the round's time from start to end (evaluation included)."""
        with reproducible_numerics(self.device):
            started = time.perf_counter()
            record = self._play_round(t)
            synchronize(self.device)
            record["wall_time_s"] = time.perf_counter() - started
        return record

    def _play_round(self, t: int) -> dict[str, Any]:
        plan = self.open_round(t)
        updates: list[ClientUpdate] = []
        global_losses = None
        time_client = 0.0
        if plan.participants:
            clients = [self.federation.clients[i] for i in plan.participants]
            if self.strategy.wants_global_loss:
                global_losses = self.global_losses(plan.global_state, clients)
            start = time.perf_counter()
            updates, batched = self._train(plan.global_state, clients, t, plan.participants)
            synchronize(self.device)
            time_client = time.perf_counter() - start
            if self.config.vmap:  # a strategy that trains its own clients leaves vmap unused
                plan.record["vmap"] = batched
        self.close_round(plan, plan.participants, updates, global_losses, time_client)
        return self.finish_round(plan)

    # The server's half of a round, in three calls: the clients' half between open_round and
    # close_round is this process's (_play_round) or other processes' (fedkernels.apps).

    def open_round(self, t: int) -> RoundPlan:
        """Draws round ``t``'s participants; the plan says whom to train from which model
        (nobody where none was drawn or the strategy refuses their number)."""
        mask = torch.from_numpy(self.sampler.sample())
        ids = mask.nonzero().flatten().tolist()
        # rounds are numbered from 1 wherever a user reads them (results.json, plots, messages)
        record: dict[str, Any] = {"round": t + 1, "participants": len(ids)}
        too_few = self.strategy.too_few_participants(len(ids)) if ids else None
        if too_few is not None:
            record["skipped"] = f"{too_few}; the round drew {len(ids)}"
            ids = []
        global_state = {k: v.clone() for k, v in self.server.state.items()} if ids else {}
        return RoundPlan(t, mask, ids, global_state, record)

    def global_losses(self, global_state: dict[str, Tensor], clients: list[Any]) -> Tensor:
        """``f_k(x_t)`` of the round's clients (:func:`global_losses`)."""
        return global_losses(self.eval_model, global_state, clients)

    def close_round(
        self,
        plan: RoundPlan,
        ids: list[int],
        updates: list[ClientUpdate],
        global_losses: Tensor | None,
        time_client: float = 0.0,
    ) -> None:
        """Records who took part and aggregates ``updates`` (those of clients ``ids``, a
        subset of the plan's participants in its order: the others' replies were lost) into
        the global model. With no update the global model stays as it is."""
        record = plan.record
        mask = plan.mask
        if list(ids) != plan.participants:
            mask = torch.zeros_like(plan.mask)
            mask[list(ids)] = True
            lost = sorted(set(plan.participants) - set(ids))
            record["participants"] = len(ids)
            record["lost_participants"] = lost
        self.history.record(mask)
        time_aggregate = 0.0
        if updates:
            id_tensor = torch.tensor(list(ids), dtype=torch.int64, device="cpu")
            if self.attack is not None:
                updates = self.attack.corrupt(
                    updates, list(ids), plan.global_state, self.server.parameter_names, plan.round
                )
                record["byzantine_participants"] = self.attack.count_in(list(ids))
            info = RoundInfo(
                round=plan.round,
                num_clients=self.federation.num_clients,
                participants=id_tensor,
                num_samples=torch.tensor([self.federation.clients[i].num_train for i in ids],
                                         dtype=torch.float64, device="cpu"),
                global_state=plan.global_state,
                client_states=[u.state for u in updates],
                train_losses=torch.tensor([u.train_loss for u in updates], dtype=torch.float64,
                                          device="cpu"),
                global_losses=global_losses,
                history=self.history,
            )
            start = time.perf_counter()
            extra = self.strategy.aggregate(info, self.server)
            synchronize(self.device)
            time_aggregate = time.perf_counter() - start
            record["train_loss"] = float(info.train_losses.mean())
            if global_losses is not None:
                record["global_loss_before"] = float(global_losses.mean())
            record.update({f"strategy_{k}": float(v) for k, v in extra.items()})
        plan.trained = len(updates)
        plan.time_client, plan.time_aggregate = time_client, time_aggregate

    def evaluation_due(self, t: int) -> bool:
        """Whether round ``t`` (0-based) ends with an evaluation."""
        return (t + 1) % self.config.eval_every == 0 or t + 1 == self.config.rounds

    def finish_round(
        self, plan: RoundPlan,
        strategy_evaluation: Callable[[], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The round's record, with the evaluation when one is due; ``strategy_evaluation``
        gives the strategy's metrics in place of :meth:`Strategy.evaluate` (the clients'
        evaluation, :meth:`Strategy.combine_client_evaluations`)."""
        record = plan.record
        if self.server.private is not None:
            trained = plan.trained if "skipped" not in record else 0
            record.update(self.server.private.take_round_record(trained))
        record["time_client"] = plan.time_client
        record["time_aggregate"] = plan.time_aggregate
        if self.evaluation_due(plan.round):
            start = time.perf_counter()
            record.update(evaluation_metrics(self.evaluate()))
            if strategy_evaluation is None:
                record.update(self.strategy.evaluate(self.server.state, self.federation.clients))
            else:
                record.update(strategy_evaluation())
            record["time_eval"] = time.perf_counter() - start
        bad = non_finite_keys(record)
        if bad:
            record["non_finite"] = bad
        return record

    def _train(self, global_state, clients, t: int, ids: list[int]
               ) -> tuple[list[ClientUpdate], bool]:
        """The participants' updates, and whether the batched (vmap) trainer made them."""
        own = [self.strategy.train_client(global_state, c, t, i) for c, i in zip(clients, ids)]
        if all(u is not None for u in own):
            return own, False
        if isinstance(self.trainer, BatchedTrainer):
            return self.trainer.train(global_state, clients, t, ids), True
        return [self.trainer.train(global_state, c, t, i) for c, i in zip(clients, ids)], False

    def evaluate(self) -> ClientEvaluation:
        """The global model on every client's own test split (loss, accuracy, AUROC, ECE, MCE)."""
        self.eval_model.load_state_dict(self.server.state)
        clients = self.federation.clients
        with reproducible_numerics(self.device):
            return evaluate_clients(
                self.eval_model, [c.test_x for c in clients], [c.test_y for c in clients],
                auroc=True, calibration=True,
            )

    def result(self, strategy_metrics: dict[str, Any] | None = None) -> RunResult:
        """Config, per-round metrics, and per-client metrics of the current global model; the
        summary names the device (``device``, ``device_name``) and its peak memory
        (:func:`~fedkernels.sim.devices.peak_memory_bytes`). ``strategy_metrics`` replaces
        :meth:`Strategy.evaluate` of the current model (the clients' evaluation of it)."""
        with reproducible_numerics(self.device):
            return self._result(strategy_metrics)

    def _result(self, strategy_metrics: dict[str, Any] | None = None) -> RunResult:
        evaluation = self.evaluate()
        counts = self.history.counts()
        probabilities = self.sampler.probabilities
        clients = []
        for k, c in enumerate(self.federation.clients):
            entry = {
                "client": k,
                "num_train": c.num_train,
                "num_test": c.num_test,
                "test_accuracy": float(evaluation.accuracy[k]),
                "test_loss": float(evaluation.loss[k]),
                "test_auroc": _auroc_or_none(evaluation, k),
                "rounds_participated": int(counts[k]),
            }
            if probabilities is not None:
                entry["participation_probability"] = float(probabilities[k])
            if self.attack is not None:
                entry["byzantine"] = k in self.attack.clients
            clients.append(entry)
        summary = {
            **evaluation_metrics(evaluation),
            **(self.strategy.evaluate(self.server.state, self.federation.clients)
               if strategy_metrics is None else strategy_metrics),
            "rounds_completed": self.next_round,
            "time_client_total": sum(r["time_client"] for r in self.records),
            "time_aggregate_total": sum(r["time_aggregate"] for r in self.records),
            "device": str(self.device),
            "device_name": device_name(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }
        if self.config.vmap:
            summary["vmap_rounds"] = sum(bool(r.get("vmap")) for r in self.records)
        skipped = sum("skipped" in r for r in self.records)
        if skipped:
            summary["rounds_skipped"] = skipped
        caveats = self.strategy.result_caveats()
        if caveats:
            summary["caveats"] = list(caveats)
        if self.attack is not None:
            summary["byzantine_clients"] = list(self.attack.clients)
        if self.server.private is not None:
            summary.update(self.server.private.summary())
        # NaN or infinity stays in results.json as it came out, but never unflagged: the keys
        # are listed, and a global model with non-finite entries or an infinite test loss is
        # called diverged (its accuracies are those of overflowed logits, not of a trained model)
        bad = non_finite_keys(summary)
        if bad:
            summary["non_finite"] = bad
        finite_model = all(bool(torch.isfinite(v).all()) for v in self.server.state.values()
                           if v.is_floating_point())
        if not finite_model or "test_loss" in bad:
            summary["diverged"] = True
        return RunResult(
            applicable_dict(self.config),
            self.dataset_name,
            list(self.records),
            clients,
            summary,
            data_preparation={**self.federation.data_info, **(self.data_file or {})},
        )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        """Writes the checkpoint atomically (a temporary file renamed over the old one)."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "next_round": self.next_round,
            "server": self.server.state_dict(),
            "strategy": self.strategy.state_dict(),
            "sampler": self.sampler.state_dict(),
            "history": self.history.state_dict(),
            "records": self.records,
        }
        if self.data_file is not None:
            state["data_file"] = self.data_file
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        with replacing(self.checkpoint) as partial:
            # by name, not through an open file: torch then writes with its own C++ file, and a
            # Ctrl-C inside torch.save cannot leave a writer that finishes into a closed Python
            # file when it is collected (that aborts the interpreter)
            torch.save(state, os.fspath(partial))

    def load_checkpoint(self) -> None:
        """Restores the state saved by :meth:`save_checkpoint`. The saved config must equal
        this run's, except ``rounds``, which may grow to continue a finished run, and the CSV
        file's path when the file there has the checkpoint's size and SHA-256. A missing,
        truncated or foreign file raises :class:`ConfigError` naming it."""
        if self.checkpoint is None or not self.checkpoint.is_file():
            raise ConfigError(f"cannot resume: no checkpoint at {self.checkpoint}")
        damaged = f"cannot resume: {self.checkpoint} is not a usable checkpoint"
        try:
            with warnings.catch_warnings():  # torch's warnings about a foreign pickle
                warnings.simplefilter("ignore")
                # on the CPU: a checkpoint of a GPU run resumes where no GPU is, and each part
                # moves what it keeps on the run's device (Server, Strategy.load_state_dict)
                state = torch.load(self.checkpoint, weights_only=True, map_location="cpu")
        except Exception as err:  # torch reports truncation and garbage with many types
            raise ConfigError(
                f"{damaged} (truncated, corrupt or not written by fedkernels: "
                f"{_first_sentence(err)})"
            ) from None
        if not isinstance(state, dict):
            raise ConfigError(f"{damaged} (it holds a {type(state).__name__}, not a mapping)")
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(
                f"{damaged} (unknown checkpoint format {state.get('format')!r})"
            )
        missing = [key for key in _CHECKPOINT_KEYS if key not in state]
        if missing or not isinstance(state["config"], dict) or not isinstance(
            state["next_round"], int
        ):
            raise ConfigError(f"{damaged} (missing or malformed: {', '.join(missing) or 'config'})")
        saved, current = dict(state["config"]), self.config.to_dict()
        # checkpoints written before the attack and dp sections existed ran without either
        saved.setdefault("attack", dataclasses.asdict(AttackConfig()))
        saved.setdefault("dp", dataclasses.asdict(PrivacyConfig()))
        # rounds may grow; the device may change (the numbers then continue as that device's)
        for key in ("rounds", "device"):
            saved.pop(key, None), current.pop(key)
        unread = _unread_keys(self.config)
        try:
            unread &= _unread_keys(from_dict(ExperimentConfig, saved))
        except ConfigError:
            unread = set()  # a configuration of an older version: compared field by field
        # a setting that neither configuration reads (partition.alpha of an iid run, which
        # config.json leaves out) changes nothing
        changed = sorted(set(_differences(saved, current)) - unread)
        saved_file = state.get("data_file")  # absent in checkpoints of built-in data sets
        if "data.path" in changed and saved_file is not None and self.data_file is not None:
            # a moved file (the same bytes at a new place) is the run's data; another file is
            # refused below, as a changed one
            changed.remove("data.path")
        if changed:
            keys = ", ".join(changed)
            raise ConfigError(
                f"cannot resume: the configuration differs from the checkpoint's in {keys}"
            )
        if saved_file is not None and self.data_file is not None and saved_file != self.data_file:
            saved_path = (state["config"].get("data") or {}).get("path")
            path = self.config.data.path
            what = (f"the data file {path} has changed since the checkpoint was written"
                    if saved_path == path else
                    f"the data file {path} is not the one the run read ({saved_path})")
            raise ConfigError(
                f"cannot resume: {what} ({saved_file.get('file_size')} bytes, SHA-256 "
                f"{str(saved_file.get('file_sha256'))[:12]}... then; {self.data_file['file_size']} "
                f"bytes, {self.data_file['file_sha256'][:12]}... now); resume with the same file "
                "or start a new run"
            )
        if state["next_round"] > self.config.rounds:
            raise ConfigError(
                f"cannot resume: the checkpoint is at round {state['next_round']}, "
                f"past rounds={self.config.rounds}"
            )
        saved_rounds = state["config"].get("rounds")
        if isinstance(saved_rounds, int) and saved_rounds != self.config.rounds:
            reason = self.strategy.rounds_dependence(saved_rounds, state["next_round"])
            if reason is not None:
                raise ConfigError(
                    f"cannot resume with rounds={self.config.rounds}: the run was set up for "
                    f"rounds={saved_rounds} and {reason}, so its rounds so far would not be "
                    f"those of a {self.config.rounds}-round run; resume without --rounds, or "
                    f"start a new run with --rounds {self.config.rounds}"
                )
        try:
            self.server.load_state_dict(state["server"])
            self.strategy.load_state_dict(state["strategy"])
            self.sampler.load_state_dict(state["sampler"])
            self.history.load_state_dict(state["history"])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(f"{damaged} ({type(err).__name__}: {_first_sentence(err)})") from None
        self.records = list(state["records"])
        if self.records and self.records[0].get("round") == 0:
            # a checkpoint from before rounds were numbered from 1 (its first record is round 0)
            self.records = [{**r, "round": r["round"] + 1} for r in self.records]
        self.next_round = state["next_round"]


_CHECKPOINT_KEYS = ("config", "next_round", "server", "strategy", "sampler", "history", "records")

_REPLY_ATTACKS = ("signflip", "scale", "gaussian")


def _check_strategy_fits(strategy: Strategy, config: ExperimentConfig) -> None:
    """Refuses, before any training, the dp and attack settings the strategy cannot honour."""
    if config.dp.enabled and not strategy.supports_central_dp:
        raise ConfigError(
            f"dp.* (central DP) clips and noises a weighted mean of the clients' models; "
            f"{strategy.name} is not one (it aggregates its own way), so the two cannot be "
            "combined"
        )
    kind = config.attack.kind
    if kind in _REPLY_ATTACKS and not strategy.replies_are_models:
        raise ConfigError(
            f"attack.kind={kind} rewrites the clients' replies as updates of the global model, "
            f"but {strategy.name}'s clients reply with models of their own; use "
            "attack.kind=labelflip (or none)"
        )


def non_finite_keys(mapping: dict[str, Any]) -> list[str]:
    """The keys of ``mapping`` whose value is a float NaN or infinity, sorted."""
    return sorted(k for k, v in mapping.items() if isinstance(v, float) and not math.isfinite(v))


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"file_size": bytes, "file_sha256": hex digest}`` of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(os.path.expanduser(path), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"file_size": size, "file_sha256": digest.hexdigest()}


def _check_client_sizes(dataset: Dataset, partition: PartitionConfig) -> None:
    """The natural partition of a CSV file: a client with too few rows is named by its value
    in the client column (the partition only knows clients by index)."""
    clients = dataset.info.get("clients")
    if partition.kind != "natural" or clients is None or dataset.groups is None:
        return
    counts = np.bincount(dataset.groups, minlength=len(clients["mapping"]))
    small = [(value, int(counts[k])) for value, k in clients["mapping"].items()
             if counts[k] < partition.min_samples]
    if small:
        value, count = small[0]
        raise ConfigError(
            f"{len(small)} clients have fewer than partition.min_samples={partition.min_samples} "
            f"rows (client {value!r} of column {clients['column']!r} has {count})"
        )


def _warn_client_column_as_feature(dataset: Dataset, config: ExperimentConfig) -> None:
    """A column named ``client`` is the client column of the natural partition only; under
    another partition, unless named in data.client_column, it is read as a feature (the
    clients' identity then leaks into the inputs), which is said."""
    features = dataset.info.get("features", {})
    found = "client" in features.get("numeric", {}) or "client" in features.get("one_hot", {})
    if config.data.client_column is None and found:
        from .tabular import DataWarning

        warnings.warn(DataWarning(
            f"column 'client' is read as a feature (partition.kind={config.partition.kind} "
            "does not use a client column); name it with data.client_column to keep it out of "
            "the features, or with data.ignore_columns"), stacklevel=3)


def _first_sentence(err: BaseException) -> str:
    """The start of an exception's message (torch's run to several sentences of advice)."""
    text = " ".join(str(err).split())
    return text.split(". ")[0].rstrip(".") if text else type(err).__name__


def _unread_keys(config: ExperimentConfig) -> set[str]:
    """``section.field`` of every field ``config`` leaves unread."""
    return {f"{section}.{name}" for section in SECTIONS
            for name in getattr(config, section).inapplicable()}


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    keys = set(a) | set(b)
    out = []
    for k in keys:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict) and k != "algorithm_params":
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def _auroc_or_none(evaluation: ClientEvaluation, k: int) -> float | None:
    """Client k's AUROC, or None (``null`` in results.json) when its test split holds a single
    class and the AUROC is undefined."""
    if evaluation.auroc is None or bool(evaluation.auroc[k].isnan()):
        return None
    return float(evaluation.auroc[k])
