"""NVFlare components for the simulator runs of ``test_nvflare_simulator.py``: a persistor and a
controller that save the final global model to a ``.npz`` file, and client executors whose
updates depend on the site and the round (so the weights of the mean matter).

Each site ``site-i`` returns arrays drawn from a generator seeded by (i, round), a
``NUM_STEPS_CURRENT_ROUND`` of ``i + 1`` and, for the FedAvg path, a ``loss`` metric."""

from __future__ import annotations

import time

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey, make_model_learnable
from nvflare.app_common.abstract.model_persistor import ModelPersistor
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.fedavg import FedAvg

SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 72), "fc.bias": (10,)}


def initial_model() -> dict:
    rng = np.random.default_rng(1234)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def site_index(fl_ctx: FLContext) -> int:
    return int(fl_ctx.get_identity_name().rsplit("-", 1)[1])


def site_update(index: int, current_round: int, params: dict) -> dict:
    """What site ``index`` sends back: a step of the global model by site-specific noise."""
    rng = np.random.default_rng([index, current_round])
    return {k: (np.asarray(v, np.float32) * 0.9
                + rng.standard_normal(v.shape).astype(np.float32)) for k, v in params.items()}


class SavingPersistor(ModelPersistor):
    """Loads :func:`initial_model`; every save writes the global model to ``out_path``."""

    def __init__(self, out_path: str):
        super().__init__()
        self.out_path = out_path

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        return make_model_learnable(initial_model(), {})

    def save_model(self, model_learnable: ModelLearnable, fl_ctx: FLContext):
        np.savez(self.out_path, **model_learnable[ModelLearnableKey.WEIGHTS])


class DiffTrainer(Executor):
    """Scatter-and-gather client: replies a WEIGHT_DIFF DXO of its update."""

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
                abort_signal: Signal) -> Shareable:
        if task_name != AppConstants.TASK_TRAIN:
            return make_reply(ReturnCode.TASK_UNKNOWN)
        dxo = from_shareable(shareable)
        current_round = shareable.get_header(AppConstants.CURRENT_ROUND)
        index = site_index(fl_ctx)
        new = site_update(index, current_round, dxo.data)
        diff = {k: new[k] - np.asarray(dxo.data[k], np.float32) for k in new}
        return DXO(DataKind.WEIGHT_DIFF, data=diff,
                   meta={MetaKey.NUM_STEPS_CURRENT_ROUND: index + 1}).to_shareable()


class DroppingDiffTrainer(DiffTrainer):
    """:class:`DiffTrainer`, but site ``drop_site`` stops answering in round ``drop_round``: it
    goes silent for ``silent_s`` seconds (longer than the server waits for a straggler) and
    then sends a reply the server must refuse as late, before it takes the next task."""

    def __init__(self, drop_site: int, drop_round: int, silent_s: float):
        super().__init__()
        self.drop_site, self.drop_round, self.silent_s = drop_site, drop_round, silent_s

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
                abort_signal: Signal) -> Shareable:
        current_round = shareable.get_header(AppConstants.CURRENT_ROUND)
        if site_index(fl_ctx) == self.drop_site and current_round == self.drop_round:
            end = time.monotonic() + self.silent_s
            while time.monotonic() < end and not abort_signal.triggered:
                time.sleep(0.1)
        return super().execute(task_name, shareable, fl_ctx, abort_signal)


class ModelTrainer(Executor):
    """FedAvg client: replies an FLModel with the full updated params and a loss metric."""

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
                abort_signal: Signal) -> Shareable:
        model = FLModelUtils.from_shareable(shareable)
        index = site_index(fl_ctx)
        new = site_update(index, model.current_round, model.params)
        reply = FLModel(params_type=ParamsType.FULL, params=new,
                        metrics={"loss": float(index) + 0.25 * model.current_round},
                        meta={MetaKey.NUM_STEPS_CURRENT_ROUND: index + 1})
        return FLModelUtils.to_shareable(reply)


class SavingFedAvg(FedAvg):
    """NVFlare's FedAvg controller; the global model and metrics of every round go to ``out_path``."""

    def __init__(self, *args, out_path: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.out_path = out_path

    def save_model(self, model: FLModel):
        arrays = {k: np.asarray(v) for k, v in model.params.items()}
        arrays["metric.loss"] = np.asarray((model.metrics or {}).get("loss", np.nan))
        np.savez(self.out_path, **arrays)

    def load_model(self) -> FLModel:
        return FLModel(params=initial_model())
