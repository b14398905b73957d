"""ClientApp: trains the global model on this node's shard of the digits and replies with the
new weights and the number of examples FedAvg weighs them by. Plain Flower: nothing here
changes when the server aggregates with fedkernels."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_fedavg.task import load_partition, make_model, train

app = ClientApp()


@app.train()
def train_on_shard(msg: Message, context: Context) -> Message:
    # simulation sets partition-id and num-partitions; a SuperNode gets them from --node-config
    partition = int(context.node_config["partition-id"])
    x, y = load_partition(partition, int(context.node_config["num-partitions"]))
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    server_round = int(msg.content["config"]["server-round"])
    loss = train(model, x, y, epochs=int(context.run_config["local-epochs"]),
                 batch_size=int(context.run_config["batch-size"]),
                 lr=float(context.run_config["lr"]), seed=1000 * server_round + partition)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)
