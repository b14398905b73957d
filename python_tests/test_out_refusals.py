"""Refusals of the robust and private APIs that must come before anything is written: an
``out`` that aliases any of the K clients (also one the rule does not select), an ``out`` entry
that requires grad at any position, clients on the meta device for the rules whose selection
or clipping reads values, and an adaptive clip norm that underflows to 0."""

from __future__ import annotations

import pytest
import torch

import fedkernels as fk
from fedkernels import robust

K = 7  # Bulyan with f = 1 needs K >= 7


def _clients(kind: str, outlier: int = K - 1):
    """K clients, client ``outlier`` far from the others (no rule selects it)."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(2, 3, generator=g) for _ in range(K)]
    rows[outlier] = rows[outlier] + 100.0
    if kind == "tensor":
        return [r.reshape(-1) for r in rows]
    if kind == "flat":
        return torch.stack([r.reshape(-1) for r in rows])
    if kind == "list":
        return [[r[0], r[1]] for r in rows]
    return [{"a": r[0], "n": torch.tensor(k), "b": r[1]} for k, r in enumerate(rows)]


def _snapshot(model):
    if isinstance(model, torch.Tensor):
        return [model.detach().clone()]
    values = model.values() if isinstance(model, dict) else model
    return [t.detach().clone() for t in values]


def _unchanged(model, before) -> bool:
    return all(torch.equal(a.detach(), b) for a, b in zip(_snapshot(model), before))


SELECTING = {
    "bulyan": lambda c, out: robust.bulyan(c, 1, out=out),
    "bulyan multikrum": lambda c, out: robust.bulyan(c, 1, selection="multikrum", out=out),
    "krum": lambda c, out: robust.krum(c, 1, out=out),
    "multikrum": lambda c, out: robust.krum(c, 1, 3, out=out),
}


@pytest.mark.parametrize("kind", ["tensor", "flat", "list", "dict"])
@pytest.mark.parametrize("rule", sorted(SELECTING))
def test_out_aliasing_an_unselected_client_is_refused(rule, kind):
    clients = _clients(kind)
    victim = clients[K - 1]
    before = _snapshot(victim)
    with pytest.raises(ValueError, match=rf"fedkernels\.(bulyan|krum): out tensor .* overlaps "
                                         rf"client {K - 1}"):
        SELECTING[rule](clients, victim)
    assert _unchanged(victim, before)


@pytest.mark.parametrize("rule", sorted(SELECTING))
def test_out_overlapping_part_of_an_unselected_client_is_refused(rule):
    clients = _clients("tensor")
    buffer = torch.cat([clients[K - 1], torch.zeros(6)])
    clients[K - 1] = buffer[:6]
    out = buffer[3:9]  # its last three elements are the outlier's first three
    before = buffer.clone()
    with pytest.raises(ValueError, match=f"overlaps client {K - 1}"):
        SELECTING[rule](clients, out)
    assert torch.equal(buffer, before)
    SELECTING[rule](clients, buffer[6:].clone())  # beside it, not over it: accepted


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("rule", sorted(SELECTING) + ["median", "trimmed"])
def test_out_entry_requiring_grad_is_refused_before_any_write(rule, position):
    calls = dict(SELECTING, median=lambda c, out: robust.coordinate_median(c, out=out),
                 trimmed=lambda c, out: robust.trimmed_mean(c, 0.2, out=out))
    clients = [dict(a=c["a"], b=c["b"], c=c["a"] * 2) for c in _clients("dict")]
    out = {name: torch.zeros(3) for name in "abc"}
    name = "abc"[position]
    out[name] = torch.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"fedkernels\.\w+: out tensor '{name}' is a leaf "
                                           "that requires grad"):
        calls[rule](clients, out)
    assert all(torch.equal(t.detach(), torch.zeros(3)) for t in out.values())
    with torch.no_grad():  # as PyTorch's in-place ops: allowed there
        calls[rule](clients, out)
    assert not all(torch.equal(t.detach(), torch.zeros(3)) for t in out.values())


def test_private_aggregate_out_requiring_grad_is_refused_before_any_write():
    clients = [{"a": torch.randn(3), "b": torch.randn(3)} for _ in range(3)]
    base = {"a": torch.zeros(3), "b": torch.zeros(3)}
    out = {"a": torch.zeros(3), "b": torch.zeros(3, requires_grad=True)}
    with pytest.raises(RuntimeError, match="private_aggregate: out tensor 'b' is a leaf"):
        fk.private_aggregate(clients, base=base, clip_norm=1.0, noise_std=0.0, out=out)
    assert torch.equal(out["a"], torch.zeros(3))


@pytest.mark.parametrize("call", ["krum", "multikrum", "bulyan", "private_aggregate"])
def test_value_dependent_rules_refuse_meta_clients_by_name(call):
    meta = [torch.empty(5, device="meta") for _ in range(K)]
    calls = {
        "krum": lambda: robust.krum(meta, 1),
        "multikrum": lambda: robust.krum(meta, 1, 2),
        "bulyan": lambda: robust.bulyan(meta, 1),
        "private_aggregate": lambda: fk.private_aggregate(
            meta, base=torch.empty(5, device="meta"), clip_norm=1.0, noise_std=0.0),
    }
    name = "krum" if "krum" in call else call
    with pytest.raises(ValueError, match=rf"fedkernels\.{name}: the clients are on the meta "
                                         "device"):
        calls[call]()
    with pytest.raises(ValueError, match="krum_scores: distances is on the meta device"):
        robust.krum_scores(torch.empty(K, K, device="meta"), 1)


def test_value_free_rules_still_give_meta_results():
    meta = [torch.empty(5, device="meta") for _ in range(K)]
    for result in (robust.coordinate_median(meta), robust.trimmed_mean(meta, 0.2),
                   robust.nearest_to_median_mean(meta, 3),
                   fk.update_norms(meta, torch.empty(5, device="meta"))):
        assert result.device.type == "meta"


def test_adaptive_clip_norm_refuses_underflow_as_it_refuses_overflow():
    args = dict(target_quantile=0.0, clipped_count_stddev=0.0)
    with pytest.raises(ValueError, match="adaptive_clip_norm: .* underflows to 0"):
        fk.adaptive_clip_norm(1e-300, [1.0] * 10, clip_norm_lr=1000.0, **args)
    with pytest.raises(ValueError, match="adaptive_clip_norm: .* beyond the float64 range"):
        fk.adaptive_clip_norm(1e300, [0.0] * 10, clip_norm_lr=1000.0, target_quantile=1.0,
                              clipped_count_stddev=0.0)
    # Whatever it returns, private_aggregate accepts as a clip norm.
    for lr in (1.0, 10.0, 700.0):
        c = fk.adaptive_clip_norm(1.0, [2.0] * 4, clip_norm_lr=lr, **args)
        fk.private_aggregate([torch.ones(2)] * 4, base=torch.zeros(2), clip_norm=c,
                             noise_std=0.0)


def test_weighted_partial_result_refuses_out_before_writing_any_entry():
    from fedkernels.integrations.distributed import WeightedPartial

    clients = [{"a": torch.randn(3), "b": torch.randn(3)} for _ in range(2)]
    partial = WeightedPartial.from_clients(clients, [1.0, 2.0])
    out = {"a": torch.zeros(3), "b": torch.zeros(3, requires_grad=True)}
    with pytest.raises(RuntimeError, match="distributed: out tensor 'b' requires grad"):
        partial.result(out=out)
    assert torch.equal(out["a"], torch.zeros(3))
    buffer = torch.zeros(5)
    with pytest.raises(ValueError, match="out tensors 'a' and 'b' overlap"):
        partial.result(out={"a": buffer[:3], "b": buffer[2:]})
    assert torch.equal(buffer, torch.zeros(5))
    base = {"a": torch.zeros(3), "b": torch.zeros(3)}
    delta = WeightedPartial.from_clients(clients, [1.0, 2.0], base=base)
    delta.result(out=base)  # the base itself, in place: allowed


@pytest.mark.parametrize("out, message", [
    (torch.zeros(4, dtype=torch.float64), "has dtype Double"),
    (torch.empty(4, device="meta"), "out is on meta"),
])
def test_aggregate_errors_name_aggregate_not_the_op(out, message):
    with pytest.raises((TypeError, ValueError), match=rf"^fedkernels\.aggregate: .*{message}"):
        fk.aggregate([torch.ones(4), torch.ones(4)], [1.0, 1.0], out=out)
