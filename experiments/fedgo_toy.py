"""FedGO's toy problem (paper Appendix E.1, Fig. 1), with accuracy against the
true labels for the six aggregates: parameter averaging, uniform (FedDF), variance (Fed-ET),
entropy, domain-aware (DaFKD weighting) and FedGO.

Four 2-D Gaussians (covariance 3 I, 300 points each) at (4,4), (-4,-4) [red], (-4,4) [blue],
(4,-4) [green]; four clients, each with 90% of one Gaussian's points and 10 of each other's;
server U: 300 points uniform on [-12, 12]^2. Clients train a 3-layer MLP classifier (Adam 1e-3,
batch 64) and a 3-layer MLP discriminator (own data real, U fake, RMSprop 5e-5, batch 64); the
server starts from the parameter average and distils for E_s epochs (Adam 1e-3, batch 64) on
the distillation set (U, or the clients' 1200 points unlabeled: the paper's text is ambiguous).

Metrics: ``acc`` = server model accuracy on 4000 fresh samples of the mixture against the
component that generated them; ``oracle`` = agreement with the axes rule on a uniform grid of
[-12, 12]^2; ``ens`` = the same accuracy for the ensemble's pseudo-label (argmax) itself;
``weight_tv`` = the mean over those 4000 samples of the total-variation distance
1/2 sum_k |w_k(x) - w*_k(x)| between a method's client weights and the oracle's
w*_k(x) = n_k p_k(x) / sum_j n_j p_j(x) (Theorem 3.4; the clients' densities are known here).

    python experiments/fedgo_toy.py [--seeds 5] [--out experiments/fedgo_toy.json] \
        [--plot experiments/fedgo_toy_weights.png]

The plot shows each method's weights against the oracle's at the 4000 samples (seed 0), for the
paper's training budget and for models trained to convergence.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

import fedkernels
from fedkernels.algorithms.distillation import distill, teacher_logits, train_discriminator
from fedkernels.algorithms.generators import mlp

MEANS = torch.tensor([[4.0, 4.0], [-4.0, -4.0], [-4.0, 4.0], [4.0, -4.0]])
COMPONENT_LABEL = torch.tensor([0, 0, 1, 2])  # red, red, blue, green
CLIENT_COMPONENT = [1, 3, 2, 0]  # client 1 -> Q3, 2 -> Q4, 3 -> Q2, 4 -> Q1
METHODS = ["param_avg", "uniform", "variance", "entropy", "domain", "fedgo", "fedgo_exact"]
WEIGHTED = METHODS[1:]


def weighting_of(method):
    """(weighting, uses discriminators, odds) of a method name."""
    if method == "fedgo_exact":
        return "fedgo", True, "exact"
    return method, method in ("fedgo", "domain"), "double_sigmoid"


def oracle_weights(x, sizes):
    """w*_k(x) = n_k p_k(x) / sum_j n_j p_j(x): client k holds 270/300 of its own component's
    points and 10/300 of each other's, every component N(mean, 3 I)."""
    logp = torch.distributions.MultivariateNormal(
        MEANS, covariance_matrix=3.0 * torch.eye(2)).log_prob(x[:, None, :])  # [N, 4]
    share = torch.full((4, 4), 10 / 300)
    for k, c in enumerate(CLIENT_COMPONENT):
        share[k, c] = 270 / 300
    logpk = torch.logsumexp(logp[None, :, :] + share.log()[:, None, :], dim=-1)  # [K, N]
    return torch.softmax(logpk.double() + sizes.log()[:, None], dim=0)


def sample_mixture(n_per, g):
    x = MEANS.repeat_interleave(n_per, 0) + 3**0.5 * torch.randn(4 * n_per, 2, generator=g)
    comp = torch.arange(4).repeat_interleave(n_per)
    return x, COMPONENT_LABEL[comp], comp


def oracle(x):
    red = (x[:, 0] * x[:, 1]) > 0
    return torch.where(red, 0, torch.where(x[:, 0] < 0, 1, 2))


def train_classifier(model, x, y, epochs, seed):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for s in range(0, len(x), 64):
            rows = order[s : s + 64]
            loss = F.cross_entropy(model(x[rows]), y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def run(seed, client_epochs, disc_epochs, server_epochs, distill_on):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x, y, comp = sample_mixture(300, g)
    clients = []
    for k in range(4):
        rows = []
        for c in range(4):
            members = torch.nonzero(comp == c).flatten()
            members = members[torch.randperm(len(members), generator=g)]
            rows.append(members[k * 10 : k * 10 + 10] if c != CLIENT_COMPONENT[k]
                        else members[40 : 40 + 270])
        rows = torch.cat(rows)
        clients.append((x[rows], y[rows]))
    u = 24 * torch.rand(300, 2, generator=g) - 12
    init = mlp(2, [64, 64], 3)
    states, discs = [], []
    for k, (cx, cy) in enumerate(clients):
        model = train_classifier(copy.deepcopy(init), cx, cy, client_epochs, seed * 100 + k)
        states.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        disc = train_discriminator(
            mlp(2, [64, 64], 1), cx, lambda n, gen: u[torch.randint(0, len(u), (n,), generator=gen)],
            epochs=disc_epochs, batch_size=64, lr=5e-5, seed=seed * 100 + 50 + k,
            optimizer="rmsprop")
        discs.append(disc)
    sizes = torch.tensor([float(len(c[0])) for c in clients], dtype=torch.float64)
    avg = fedkernels.aggregate(states, sizes, normalize=True)
    dx = u if distill_on == "server" else torch.cat([c[0] for c in clients])

    test_x, test_y, _ = sample_mixture(1000, torch.Generator().manual_seed(10_000 + seed))
    grid = torch.stack(torch.meshgrid(torch.linspace(-12, 12, 121), torch.linspace(-12, 12, 121),
                                      indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        z_dx = torch.stack([d(dx).squeeze(-1) for d in discs])
        z_test = torch.stack([d(test_x).squeeze(-1) for d in discs])
    results = {}
    w_star = oracle_weights(test_x, sizes)
    weights = {"oracle": w_star}
    for method in METHODS:
        student = copy.deepcopy(init)
        student.load_state_dict(avg)
        ens = tv = float("nan")
        if method != "param_avg":
            weighting, uses_disc, odds = weighting_of(method)
            kw = dict(weighting=weighting, odds=odds,
                      sample_sizes=sizes if weighting == "fedgo" else None)
            y_dx = fedkernels.ensemble_pseudo_labels(
                teacher_logits(init, states, dx), z_dx if uses_disc else None, **kw)
            distill(student, dx, y_dx, epochs=server_epochs, batch_size=64, lr=1e-3,
                    seed=seed * 100 + 99)
            y_test, w_test = fedkernels.ensemble_pseudo_labels(
                teacher_logits(init, states, test_x), z_test if uses_disc else None,
                return_weights=True, **kw)
            ens = float((y_test.argmax(1) == test_y).double().mean())
            tv = float(0.5 * (w_test.double() - w_star).abs().sum(0).mean())
            weights[method] = w_test
        with torch.no_grad():
            acc = float((student(test_x).argmax(1) == test_y).double().mean())
            agree = float((student(grid).argmax(1) == oracle(grid)).double().mean())
        results[method] = {"acc": acc, "oracle": agree, "ens": ens, "weight_tv": tv}
    return results, weights


def plot_weights(weights_by_setting, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(weights_by_setting)
    fig, axes = plt.subplots(len(names), len(WEIGHTED), figsize=(2.3 * len(WEIGHTED), 2.5 * len(names)),
                             squeeze=False, sharex=True, sharey=True)
    for row, name in enumerate(names):
        w = weights_by_setting[name]
        for col, method in enumerate(WEIGHTED):
            ax = axes[row][col]
            ax.scatter(w["oracle"].flatten(), w[method].flatten(), s=1, alpha=0.15)
            ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
            tv = float(0.5 * (w[method].double() - w["oracle"]).abs().sum(0).mean())
            ax.set_title(f"{method}\nTV {tv:.2f}", fontsize=8)
            if row == len(names) - 1:
                ax.set_xlabel("oracle weight w*_k(x)", fontsize=8)
        axes[row][0].set_ylabel(f"{name}\nmethod weight w_k(x)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="experiments/fedgo_toy.json")
    parser.add_argument("--plot", default="experiments/fedgo_toy_weights.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = {
        # The paper's settings (Appendix E.1): 2 client epochs, 1 discriminator epoch, E_s = 2.
        "paper": dict(client_epochs=2, disc_epochs=1, server_epochs=2),
        # Trained to convergence: 100 client epochs, 100 discriminator epochs, E_s = 50.
        "converged": dict(client_epochs=100, disc_epochs=100, server_epochs=50),
    }
    out = {}
    seed0_weights = {}
    for name, s in settings.items():
        for distill_on in ("server", "clients"):
            key = f"{name}/distill_on_{distill_on}"
            start = time.time()
            runs = []
            for seed in range(args.seeds):
                result, weights = run(seed, distill_on=distill_on, **s)
                runs.append(result)
                if seed == 0 and distill_on == "server":
                    seed0_weights[name] = weights
            summary = {}
            for m in METHODS:
                for metric in ("acc", "oracle", "ens", "weight_tv"):
                    vals = torch.tensor([r[m][metric] for r in runs], dtype=torch.float64)
                    summary.setdefault(m, {})[metric] = [float(vals.mean()), float(vals.std())]
            out[key] = {"settings": s, "seeds": args.seeds, "summary": summary, "runs": runs,
                        "seconds": time.time() - start}
            print(key)
            for m in METHODS:
                r = summary[m]
                print(f"  {m:10s} acc {100*r['acc'][0]:5.1f}±{100*r['acc'][1]:4.1f}  "
                      f"oracle {100*r['oracle'][0]:5.1f}±{100*r['oracle'][1]:4.1f}  "
                      f"ens {100*r['ens'][0]:5.1f}±{100*r['ens'][1]:4.1f}  "
                      f"tv {r['weight_tv'][0]:.3f}±{r['weight_tv'][1]:.3f}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    plot_weights(seed0_weights, args.plot)


if __name__ == "__main__":
    main()
