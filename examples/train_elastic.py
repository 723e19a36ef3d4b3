"""The digits example as an elastic job: workers join and leave while it trains, and nobody
restarts. The lines marked ``# (distributed)`` are all that differs from a plain torch loop.

A fixed job of two workers::

    psctl local --servers 2 --workers 2 -- python examples/train_elastic.py

The same, elastic (2 to 4 workers); from another terminal add a worker, or kill one::

    PS_HEARTBEAT_TIMEOUT=5 psctl local --servers 2 --workers 2 --elastic 2:4 -- \\
        python examples/train_elastic.py
    psctl local add              # a third worker joins at the step the job is in
    kill -9 <a worker's pid>     # the rest go on once the shards drop it (5 s here)

(``--pace 0.1`` slows each step down, to leave time for both.)

A worker that joins takes the job's current weights and trains the epochs that are left; the
data is re-split among the members at each epoch boundary. Each worker prints, per epoch, the
samples it drew and the members the epoch was split among. Alone (``python
examples/train_elastic.py``) it trains in one process.
"""

import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psworker import SGD, DistributedOptimizer, connect, shard  # (distributed)

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--pace", type=float, default=0.0, help="seconds to wait each step")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)  # copies of this script share the machine's cores
digits = load_digits()
order = torch.randperm(len(digits.target))  # a fixed shuffle (seeded), the same on every worker
x = torch.tensor(digits.images, dtype=torch.float32)[order].unsqueeze(1) / 16.0
y = torch.tensor(digits.target)[order]
train, test = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
loader = DataLoader(train, batch_size=32, shuffle=True)
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(16 * 4 * 4, 10),
)
loss_fn = nn.CrossEntropyLoss()
opt = DistributedOptimizer(model, connect(), SGD(lr=0.05, momentum=0.9))  # (distributed)
data = shard(loader, opt.client)  # (distributed)

for epoch in data.epochs(args.epochs):  # (distributed): a late joiner trains the epochs left
    for group in opt.param_groups:  # a function of the epoch: the same on every worker
        group["lr"] = 0.05 * 0.5 ** (epoch // 3)
    for x_batch, y_batch in data:
        opt.zero_grad()
        loss = loss_fn(model(x_batch), y_batch)
        loss.backward()
        opt.step()
        time.sleep(args.pace)  # time to add and kill workers by hand while it trains
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    split = f", split among workers {list(data.plan.members)}" if data.plan else ""
    print(
        f"epoch {epoch}: loss {loss.item():.4f}, held-out accuracy {accuracy:.4f}, "
        f"{data.samples[epoch]} samples on this worker{split}",
        flush=True,
    )
