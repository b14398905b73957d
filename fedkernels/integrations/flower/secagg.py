"""Flower's SecAgg+ protocol with fedkernels' ring arithmetic (``docs/algorithms/secagg.md``):
:func:`fused_secaggplus_mod` (a ClientApp mod, in place of Flower's ``secaggplus_mod``) and
:class:`FusedSecAggPlusWorkflow` (a ServerApp fit workflow, in place of Flower's
``SecAggPlusWorkflow``), used together.

The stages, messages and record keys are Flower's (setup, share keys, collect masked vectors,
unmask; :mod:`flwr.common.secure_aggregation.secaggplus_constants`), as are the neighbour
graph, the Shamir shares and the legacy ``Strategy.aggregate_fit`` at the end. What changes:

- keys are X25519 (`cryptography`), pairwise mask seeds HKDF-SHA256 of the shared secret, shares
  encrypted with Fernet under another HKDF key (:mod:`fedkernels.privacy.secure_aggregation`);
- a client's masked vector is one pass of :func:`~fedkernels.ops.secagg.secagg_mask`
  (fixed-point codes plus its pairwise masks and self-mask, mod 2^32), not NumPy arrays of masks;
- the server sums the survivors' vectors and removes their self-masks and the dropped clients'
  pairwise masks in one pass of :func:`~fedkernels.ops.secagg.secagg_unmask_sum`.

The fixed point: ``scale = quantization_range / (2 clipping_range)`` steps per unit (Flower's
resolution); each client sends ``[w x, w]`` with ``w = num_examples / max_weight`` rounded to a
multiple of ``1 / scale`` (so the sum of weights is exact), clipped to ``clipping_range``; the
aggregate is the decoded ``sum w x / sum w``. The survivors' ``K quantization_range / 2`` must
stay below 2^31 (the workflow refuses the round otherwise).
"""

from __future__ import annotations

from logging import DEBUG, ERROR, INFO, WARNING
from typing import cast

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod.secure_aggregation.secaggplus_mod import (
    SecAggPlusState,
    check_configs,
    check_stage,
)
from flwr.common import bytes_to_ndarray, ndarray_to_bytes, ndarrays_to_parameters
from flwr.common import parameters_to_ndarrays as _to_ndarrays
from flwr.common.logger import log
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from ...ops.secagg import MAX_CODE, secagg_decode, secagg_mask, secagg_unmask_sum
from ...privacy import secure_aggregation as sk

__all__ = ["fused_secaggplus_mod", "FusedSecAggPlusWorkflow", "fixed_point_scale"]

RING = 2**32


def fixed_point_scale(clipping_range: float, quantization_range: int) -> float:
    """Steps per unit of the codes: Flower's ``quantization_range`` levels over
    ``[-clipping_range, clipping_range]``."""
    return quantization_range / (2.0 * clipping_range)


# ---------------------------------------------------------------- client


def fused_secaggplus_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """The client half of SecAgg+ (module docstring); other messages than ``train`` pass."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    records = ctxt.state.config_records
    if RECORD_KEY_STATE not in records:
        records[RECORD_KEY_STATE] = ConfigRecord({})
    state = SecAggPlusState(**records[RECORD_KEY_STATE])
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    check_stage(state.current_stage, configs)
    state.current_stage = cast(str, configs.pop(Key.STAGE))
    check_configs(state.current_stage, configs)
    content = RecordDict()
    if state.current_stage == Stage.SETUP:
        state.nid = msg.metadata.dst_node_id
        reply = _setup(state, configs)
    elif state.current_stage == Stage.SHARE_KEYS:
        reply = _share_keys(state, configs)
    elif state.current_stage == Stage.COLLECT_MASKED_VECTORS:
        content = call_next(msg, ctxt).content
        fitres = compat.recorddict_to_fitres(content, keep_input=True)
        reply = _masked_vector(state, configs, fitres.num_examples,
                               _to_ndarrays(fitres.parameters))
        for arrays in content.array_records.values():
            arrays.clear()  # the update leaves only masked
    else:
        reply = _unmask(state, configs)
    records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(reply, False)
    return Message(content, reply_to=msg)


def _setup(state: SecAggPlusState, configs: ConfigRecord) -> dict:
    state.sample_num = cast(int, configs[Key.SAMPLE_NUMBER])
    state.share_num = cast(int, configs[Key.SHARE_NUMBER])
    state.threshold = cast(int, configs[Key.THRESHOLD])
    state.clipping_range = cast(float, configs[Key.CLIPPING_RANGE])
    state.target_range = cast(int, configs[Key.TARGET_RANGE])
    state.mod_range = cast(int, configs[Key.MOD_RANGE])
    state.max_weight = cast(float, configs[Key.MAX_WEIGHT])
    if state.mod_range != RING:
        raise ValueError(f"fused SecAgg+ masks mod 2^32; the server asked for mod_range "
                         f"{state.mod_range}")
    state.rd_seed_share_dict, state.sk1_share_dict, state.ss2_dict = {}, {}, {}
    state.sk1, state.pk1 = sk.generate_keypair()  # mask agreement
    state.sk2, state.pk2 = sk.generate_keypair()  # share encryption
    return {Key.PUBLIC_KEY_1: state.pk1, Key.PUBLIC_KEY_2: state.pk2}


def _share_keys(state: SecAggPlusState, configs: ConfigRecord) -> dict:
    state.public_keys_dict = {int(nid): (pk1, pk2) for nid, (pk1, pk2) in configs.items()}
    if len(state.public_keys_dict) < state.threshold:
        raise ValueError("fewer neighbours than the reconstruction threshold")
    publics = [pk for pair in state.public_keys_dict.values() for pk in pair]
    if len(set(publics)) != len(publics):
        raise ValueError("two neighbours sent the same public key")
    if state.nid not in state.public_keys_dict:  # KeyError, as Flower's mod raises
        raise KeyError(f"the server's public key list leaves out this client ({state.nid})")
    if state.public_keys_dict[state.nid] != (state.pk1, state.pk2):
        raise ValueError("the server relayed this client's own public keys wrongly")
    state.rd_seed = sk.self_seed()
    n = len(state.public_keys_dict)
    seed_shares = sk.share_secret(state.rd_seed, state.threshold, n)
    key_shares = sk.share_secret(state.sk1, state.threshold, n)
    dsts, ciphertexts = [], []
    for i, (nid, (_, pk2)) in enumerate(state.public_keys_dict.items()):
        if nid == state.nid:
            state.rd_seed_share_dict[nid] = seed_shares[i]
            state.sk1_share_dict[nid] = key_shares[i]
            continue
        key = sk.encryption_key(state.sk2, pk2)
        state.ss2_dict[nid] = key
        plain = share_keys_plaintext_concat(state.nid, nid, seed_shares[i], key_shares[i])
        dsts.append(nid)
        ciphertexts.append(sk.encrypt(key, plain))
    return {Key.DESTINATION_LIST: dsts, Key.CIPHERTEXT_LIST: ciphertexts}


def _masked_vector(state: SecAggPlusState, configs: ConfigRecord, num_examples: int,
                   arrays: list[np.ndarray]) -> dict:
    srcs = cast(list[int], configs[Key.SOURCE_LIST])
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError("fewer neighbours left than the reconstruction threshold")
    for src, ciphertext in zip(srcs, ciphertexts, strict=True):
        actual, dst, seed_share, key_share = share_keys_plaintext_separate(
            sk.decrypt(state.ss2_dict[src], ciphertext))
        if actual != src or dst != state.nid:
            raise ValueError(f"node {state.nid}: a share from {actual} to {dst} came as "
                             f"{src}'s")
        state.rd_seed_share_dict[src] = seed_share
        state.sk1_share_dict[src] = key_share
    scale = fixed_point_scale(state.clipping_range, state.target_range)
    ratio = num_examples / state.max_weight
    if ratio > 1:
        log(WARNING, "num_examples (%s) exceeds max_weight (%s): the weighted update is "
            "clipped", num_examples, state.max_weight)
    w = round(ratio * scale) / scale
    tensors = [torch.from_numpy(np.asarray(a, dtype=np.float64) * w) for a in arrays]
    tensors.append(torch.tensor([w], dtype=torch.float64, device="cpu"))
    peers = {nid: state.public_keys_dict[nid][0] for nid in srcs}
    seeds, signs = sk.client_masks(state.nid, state.sk1, peers, state.rd_seed)
    masked = secagg_mask(tensors, clip=state.clipping_range, scale=scale, seeds=seeds,
                         signs=signs)
    return {Key.MASKED_PARAMETERS: [ndarray_to_bytes(m.numpy()) for m in masked]}


def _unmask(state: SecAggPlusState, configs: ConfigRecord) -> dict:
    active = cast(list[int], configs[Key.ACTIVE_NODE_ID_LIST])
    dead = cast(list[int], configs[Key.DEAD_NODE_ID_LIST])
    if len(active) < state.threshold:
        raise ValueError("fewer survivors than the reconstruction threshold")
    # A survivor's self-mask seed, a dropped client's mask key: never both for one client.
    shares = [state.rd_seed_share_dict[n] for n in active] + [state.sk1_share_dict[n]
                                                              for n in dead]
    return {Key.NODE_ID_LIST: active + dead, Key.SHARE_LIST: shares}


# ---------------------------------------------------------------- server


class FusedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's ``SecAggPlusWorkflow`` (same arguments, and the same stages and messages) with
    the masked vectors kept as int32 tensors and unmasked in one fused pass (module
    docstring); clients run :func:`fused_secaggplus_mod`. ``modulus_range`` must be 2^32
    (Flower's default), the ring the fused ops wrap in."""

    def __init__(self, num_shares: int | float, reconstruction_threshold: int | float, *,
                 max_weight: float = 1000.0, clipping_range: float = 8.0,
                 quantization_range: int = 4194304, modulus_range: int = RING,
                 timeout: float | None = None) -> None:
        if modulus_range != RING:
            raise ValueError(f"FusedSecAggPlusWorkflow masks mod 2^32 (modulus_range="
                             f"{RING}); got modulus_range={modulus_range}")
        super().__init__(num_shares, reconstruction_threshold, max_weight=max_weight,
                         clipping_range=clipping_range, quantization_range=quantization_range,
                         modulus_range=RING, timeout=timeout)
        self.scale = fixed_point_scale(clipping_range, quantization_range)

    def share_keys_stage(self, grid, context, state) -> bool:
        ok = super().share_keys_stage(grid, context, state)
        # Only the clients whose shares went out have pairwise masks with their neighbours.
        state.keyed_node_ids = set(state.active_node_ids)
        return ok

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:
        round_id = str(context.state.config_records[MAIN_CONFIGS_RECORD][
            WorkflowKey.CURRENT_ROUND])

        def request(nid: int) -> Message:
            content = state.nid_to_fitins[nid]
            content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: state.forward_ciphertexts[nid],
                Key.SOURCE_LIST: state.forward_srcs[nid],
            })
            return Message(content=content, dst_node_id=nid, message_type=MessageType.TRAIN,
                           group_id=round_id)

        replies = list(grid.send_and_receive(
            [request(nid) for nid in state.active_node_ids], timeout=self.timeout))
        del state.forward_ciphertexts, state.forward_srcs, state.nid_to_fitins
        state.masked = {}
        for reply in replies:
            if reply.has_error():
                state.failures.append(Exception(reply.error))
                continue
            nid = reply.metadata.src_node_id
            blobs = cast(list[bytes], reply.content.config_records[RECORD_KEY_CONFIGS][
                Key.MASKED_PARAMETERS])
            state.masked[nid] = [torch.from_numpy(bytes_to_ndarray(b)) for b in blobs]
            fitres = compat.recorddict_to_fitres(reply.content, True)
            state.legacy_results.append((state.nid_to_proxies[nid], fitres))
        state.active_node_ids = set(state.masked)
        log(DEBUG, "[Stage 2] Received masked vectors from %s clients.", len(state.masked))
        return self._check_threshold(state)

    def unmask_stage(self, grid, context, state) -> bool:
        current_round = cast(int, context.state.config_records[MAIN_CONFIGS_RECORD][
            WorkflowKey.CURRENT_ROUND])
        survivors = set(state.active_node_ids)
        dropped = set(getattr(state, "keyed_node_ids", state.sampled_node_ids)) - survivors
        if len(survivors) * self.quantization_range / 2 > MAX_CODE:
            log(ERROR, "%s survivors at quantization_range %s overflow the int32 sum",
                len(survivors), self.quantization_range)
            return False

        def request(nid: int) -> Message:
            nb = state.nid_to_neighbours[nid]
            return Message(
                content=RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
                    Key.STAGE: Stage.UNMASK,
                    Key.ACTIVE_NODE_ID_LIST: sorted(nb & survivors),
                    Key.DEAD_NODE_ID_LIST: sorted(nb & dropped)})}),
                dst_node_id=nid, message_type=MessageType.TRAIN, group_id=str(current_round))

        replies = list(grid.send_and_receive([request(n) for n in survivors],
                                             timeout=self.timeout))
        shares: dict[int, list[bytes]] = {n: [] for n in survivors | dropped}
        for reply in replies:
            if reply.has_error():
                state.failures.append(Exception(reply.error))
                continue
            cfg = reply.content.config_records[RECORD_KEY_CONFIGS]
            for owner, share in zip(cast(list[int], cfg[Key.NODE_ID_LIST]),
                                    cast(list[bytes], cfg[Key.SHARE_LIST]), strict=True):
                shares[owner].append(share)
        if any(len(s) < state.threshold for s in shares.values()):
            log(ERROR, "Not enough shares to rebuild the masks' secrets")
            return False
        self_seeds = {n: sk.combine_shares(shares[n]) for n in survivors}
        dropped_keys = {n: sk.combine_shares(shares[n]) for n in dropped}
        publics = {n: pk[0] for n, pk in state.nid_to_publickeys.items()}
        neighbours = {n: set(nb) for n, nb in state.nid_to_neighbours.items()}
        seeds, signs = sk.server_masks(self_seeds, dropped_keys, publics, neighbours, survivors)
        ring_sum = secagg_unmask_sum([state.masked[n] for n in sorted(survivors)], seeds=seeds,
                                     signs=signs)
        del state.masked
        decoded = secagg_decode(ring_sum, self.scale, torch.float64)
        total_weight = float(decoded[-1][0])
        if total_weight <= 0:
            log(ERROR, "The survivors' total weight is %s", total_weight)
            return False
        aggregate = [(d / total_weight).numpy().astype(np.float32) for d in decoded[:-1]]

        parameters = ndarrays_to_parameters(aggregate)
        for _, fitres in state.legacy_results:
            fitres.parameters = parameters
        log(INFO, "aggregate_fit: received %s results and %s failures",
            len(state.legacy_results), len(state.failures))
        params, metrics = context.strategy.aggregate_fit(current_round, state.legacy_results,
                                                         state.failures)
        if params:
            context.state.array_records[MAIN_PARAMS_RECORD] = \
                compat.parameters_to_arrayrecord(params, True)
            context.history.add_metrics_distributed_fit(server_round=current_round,
                                                        metrics=metrics)
        return True


