"""ServerApp: Flower's FedAvg workflow with fedkernels' FedAvg, a drop-in for
``flwr.serverapp.strategy.FedAvg`` whose weighted mean of the replies is one fused pass. The
server evaluates the global model on the held-out digits before the first round and after
every round, and logs each round's wall time."""

from __future__ import annotations

import json
import time

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedkernels.integrations.flower import FedAvg  # was: from flwr.serverapp.strategy import FedAvg
from flower_fedavg.task import evaluate, load_test, make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    model = make_model()
    x_test, y_test = load_test()
    history: list[dict[str, float]] = []
    last = [time.perf_counter()]

    def central_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # called before round 1 and after every round: the time between two calls is a round
        now = time.perf_counter()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, x_test, y_test)
        history.append({"round": server_round, "loss": loss, "accuracy": accuracy,
                        "seconds": now - last[0] if server_round else 0.0})
        print(f"round {server_round}: test accuracy {accuracy:.3f}, loss {loss:.3f}"
              + (f", {now - last[0]:.2f} s" if server_round else ""), flush=True)
        last[0] = time.perf_counter()
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    min_nodes = int(config["min-nodes"])
    strategy = FedAvg(fraction_train=float(config["fraction-train"]), fraction_evaluate=0.0,
                      min_train_nodes=min_nodes, min_available_nodes=min_nodes)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=int(config["num-server-rounds"]),
                            evaluate_fn=central_evaluation)
    model.load_state_dict(result.arrays.to_torch_state_dict())
    if config["result-path"]:
        with open(str(config["result-path"]), "w") as f:
            json.dump({"rounds": history}, f, indent=1)
