"""Byzantine clients in the simulator: who they are, what their replies become, and that every
algorithm receives the corrupted replies."""

from __future__ import annotations

import json

import pytest
import torch

from fedkernels.algorithms.fedavg import FedAvg
from fedkernels.algorithms.registry import build_strategy
from fedkernels.cli import main
from fedkernels.sim.attacks import ByzantineClients, choose_byzantine
from fedkernels.sim.client import ClientUpdate
from fedkernels.sim.config import AttackConfig, ConfigError, ExperimentConfig, from_dict
from fedkernels.sim.run import Simulation

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def small_config(rounds=2, **attack):
    return from_dict(
        ExperimentConfig,
        {
            "rounds": rounds,
            "partition": {"num_clients": 10},
            "participation": {"kind": "full"},
            "model": {"hidden": [8]},
            "client": {"lr": 0.2, "steps": 3},
            "attack": attack or {"kind": "none"},
        },
    )


class Recording(FedAvg):
    """FedAvg that keeps the replies it was given."""

    name = "recording-fedavg"

    def aggregate(self, info, server):
        self.seen = [{n: t.clone() for n, t in s.items()} for s in info.client_states]
        self.base = {n: t.clone() for n, t in info.global_state.items()}
        return super().aggregate(info, server)


def first_round_replies(**attack):
    strategy = Recording()
    Simulation(small_config(rounds=1, **attack), strategy).run()
    return strategy


def test_choice_is_seeded_and_sized():
    chosen = choose_byzantine(20, 0.2, seed=3)
    assert chosen == sorted(chosen) and len(set(chosen)) == 4
    assert all(0 <= k < 20 for k in chosen)
    assert choose_byzantine(20, 0.2, seed=3) == chosen
    assert {tuple(choose_byzantine(20, 0.2, seed=s)) for s in range(5)} != {tuple(chosen)}
    assert choose_byzantine(20, 0.0, seed=3) == []
    assert len(choose_byzantine(7, 0.5, seed=0)) == 4  # round(3.5): to even


@pytest.mark.parametrize("kind", ["signflip", "scale"])
def test_scaled_replies_by_hand(kind):
    attack = ByzantineClients(AttackConfig(kind=kind, fraction=0.5, scale=3.0), 4, seed=0)
    base = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5]), "buf": torch.tensor([9.0])}
    trained = [
        {"w": torch.tensor([2.0, 0.0]), "b": torch.tensor([1.5]), "buf": torch.tensor([7.0])}
        for _ in range(4)
    ]
    updates = [ClientUpdate(s, 0.1) for s in trained]
    replies = attack.corrupt(updates, [0, 1, 2, 3], base, ["w", "b"], round_index=0)
    sign = -1.0 if kind == "signflip" else 1.0
    for k, reply in enumerate(replies):
        if k in attack.clients:
            # x_t + sign * 3 * (x_k - x_t), buffers untouched
            assert torch.equal(reply.state["w"], torch.tensor([1.0 + sign * 3, 2.0 - sign * 6]))
            assert torch.equal(reply.state["b"], torch.tensor([0.5 + sign * 3]))
            assert torch.equal(reply.state["buf"], torch.tensor([7.0]))
        else:
            assert reply is updates[k]
    assert attack.count_in([0, 1, 2, 3]) == 2


def test_gaussian_replies_are_noise_around_the_global_model():
    attack = ByzantineClients(AttackConfig(kind="gaussian", fraction=1.0, std=0.5), 2, seed=1)
    base = {"w": torch.full((200, 100), 3.0)}
    updates = [ClientUpdate({"w": torch.zeros(200, 100)}, 0.0) for _ in range(2)]
    first = attack.corrupt(updates, [0, 1], base, ["w"], round_index=4)
    again = attack.corrupt(updates, [0, 1], base, ["w"], round_index=4)
    later = attack.corrupt(updates, [0, 1], base, ["w"], round_index=5)
    noise = first[0].state["w"] - 3.0
    assert abs(float(noise.mean())) < 0.02
    assert abs(float(noise.std()) - 0.5) < 0.02
    assert torch.equal(first[0].state["w"], again[0].state["w"])  # seeded by (round, client)
    assert not torch.equal(first[0].state["w"], first[1].state["w"])
    assert not torch.equal(first[0].state["w"], later[0].state["w"])


def test_labelflip_changes_only_the_byzantine_training_labels():
    plain = Simulation(small_config(), build_strategy("fedavg"))
    flipped = Simulation(small_config(kind="labelflip", fraction=0.3), build_strategy("fedavg"))
    byzantine = flipped.attack.clients
    assert len(byzantine) == 3
    for k, (a, b) in enumerate(zip(plain.federation.clients, flipped.federation.clients)):
        assert torch.equal(a.test_y, b.test_y)
        expected = 9 - a.train_y if k in byzantine else a.train_y
        assert torch.equal(b.train_y, expected)


@pytest.mark.parametrize("kind", ["signflip", "gaussian", "scale"])
def test_the_strategy_receives_the_corrupted_replies(kind):
    honest = first_round_replies()
    attacked = first_round_replies(kind=kind, fraction=0.3, scale=2.0, std=0.1)
    byzantine = choose_byzantine(10, 0.3, seed=0)
    base = honest.base
    for k in range(10):
        for n in base:
            trained, reply = honest.seen[k][n], attacked.seen[k][n]
            if k not in byzantine:
                assert torch.equal(reply, trained)
            elif kind == "signflip":
                torch.testing.assert_close(reply, base[n] - 2.0 * (trained - base[n]))
            elif kind == "scale":
                torch.testing.assert_close(reply, base[n] + 2.0 * (trained - base[n]))
            else:
                assert abs(float((reply - base[n]).std()) - 0.1) < 0.05


def test_signflip_hurts_fedavg_and_results_name_the_byzantine_clients(tmp_path):
    config = dict(rounds=8, eval_every=8, client={"lr": 0.3, "epochs": 2, "steps": None})
    clean = Simulation(
        from_dict(ExperimentConfig, {**small_config().to_dict(), **config}), build_strategy("fedavg")
    ).run()
    tree = {**small_config(kind="signflip", fraction=0.3, scale=10.0).to_dict(), **config}
    attacked = Simulation(from_dict(ExperimentConfig, tree), build_strategy("fedavg")).run()
    assert attacked.summary["test_accuracy"] < clean.summary["test_accuracy"] - 0.2
    byzantine = choose_byzantine(10, 0.3, seed=0)
    assert attacked.summary["byzantine_clients"] == byzantine
    assert [c["client"] for c in attacked.clients if c["byzantine"]] == byzantine
    assert all(r["byzantine_participants"] == 3 for r in attacked.rounds)
    assert "byzantine_clients" not in clean.summary


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "run"
    code = main([
        "run", "--rounds", "2", "--partition.num_clients", "10", "--model.name", "logreg",
        "--attack.kind", "gaussian", "--attack.fraction", "0.2", "--attack.std", "0.3",
        "--seed", "5", "--out", str(out), "--no-progress", "--no-plots",
    ])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    # the fields gaussian reads (scale is signflip's and scale's)
    assert results["config"]["attack"] == {"kind": "gaussian", "fraction": 0.2, "std": 0.3}
    assert results["summary"]["byzantine_clients"] == choose_byzantine(10, 0.2, seed=5)


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"kind": "sybil"}, "attack.kind: 'sybil' is not one of"),
        ({"fraction": 1.5}, "attack.fraction must be in"),
        ({"scale": 0}, "attack.scale must be > 0"),
        ({"std": -1}, "attack.std must be > 0"),
    ],
)
def test_bad_attack_settings(tree, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(ExperimentConfig, {"attack": tree})


def test_checkpoints_from_before_the_attack_and_dp_sections_resume(tmp_path):
    path = tmp_path / "checkpoint.pt"
    Simulation(small_config(rounds=1), build_strategy("fedavg"), checkpoint=path).run()
    state = torch.load(path, weights_only=True)
    del state["config"]["attack"], state["config"]["dp"]
    torch.save(state, path)
    resumed = Simulation(small_config(rounds=2), build_strategy("fedavg"), checkpoint=path)
    assert len(resumed.run(resume=True).rounds) == 2
    attacked = Simulation(small_config(rounds=2, kind="signflip"), build_strategy("fedavg"),
                          checkpoint=path)
    with pytest.raises(ConfigError, match="differs from the checkpoint's in attack.kind"):
        attacked.run(resume=True)


class OwnTraining(Recording):
    """Trains its clients itself: every client returns the global model plus 1."""

    name = "own-training-test"

    def train_client(self, global_state, data, round_index, client_id):
        return ClientUpdate({n: t + 1.0 for n, t in global_state.items()}, 0.0)


def test_strategies_that_train_their_own_clients_are_attacked_too():
    strategy = OwnTraining()
    Simulation(small_config(rounds=1, kind="signflip", fraction=0.3, scale=2.0), strategy).run()
    byzantine = choose_byzantine(10, 0.3, seed=0)
    for k, reply in enumerate(strategy.seen):
        for n, base in strategy.base.items():
            expected = base - 2.0 if k in byzantine else base + 1.0
            torch.testing.assert_close(reply[n], expected)
