"""A plain PyTorch training loop made distributed by the lines marked ``# (distributed)``.

Alone it trains in one process (``mode local``, no servers)::

    python examples/train_digits.py

Under ``psctl local`` every copy is one worker of a parameter-server job (``TF_CONFIG`` and
``PS_MODE`` tell ``psworker.connect()`` where the shards are and how to train)::

    psctl local --servers 2 --workers 2 [--mode async] -- python examples/train_digits.py

Under torchrun each rank is a worker: with no ``PS_*`` variable at all they average gradients
over a ring they find through torchrun's ``MASTER_ADDR:MASTER_PORT`` (mode allreduce); with the
shards' addresses they are workers of those shards::

    torchrun --nproc-per-node 2 examples/train_digits.py
    PS_SHARDS=127.0.0.1:7000,127.0.0.1:7001 torchrun --nproc-per-node 2 examples/train_digits.py
    PS_SHARDS=127.0.0.1:7000,127.0.0.1:7001 torchrun --nproc-per-node 2 examples/train_digits.py \
        --mode async

``--mode`` (sync, async, ssp, allreduce, local) picks the mode where no launcher says it
(``psctl local --mode`` sets ``$PS_MODE``, which ``connect()`` reads when ``--mode`` is absent).

Without the marked lines (and with ``opt = torch.optim.SGD(model.parameters(), lr=0.05,
momentum=0.9)`` and ``for x_batch, y_batch in loader:``) this is an ordinary single-process script.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psworker import SGD, DistributedOptimizer, connect, shard  # (distributed)

parser = argparse.ArgumentParser(description="digits CNN, made distributed")
parser.add_argument("--mode", default=None, help="sync, async, ssp, allreduce or local")
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
opt = DistributedOptimizer(model, connect(mode=args.mode), SGD(0.05, momentum=0.9))  # (distributed)

for epoch in range(5):
    for x_batch, y_batch in shard(loader, opt.client):  # (distributed)
        opt.zero_grad()
        loss = loss_fn(model(x_batch), y_batch)
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    print(f"epoch {epoch}: loss {loss.item():.4f}, held-out accuracy {accuracy:.4f}", flush=True)
