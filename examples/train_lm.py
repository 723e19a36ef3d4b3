"""A character-level LSTM language model trained the modern way (AdamW with weight decay off
for biases and norms, linear warm-up then cosine decay, a GradScaler), made distributed by the
lines marked ``# (distributed)``.

Alone it trains in one process (``mode local``, no servers)::

    python examples/train_lm.py

Under ``psctl local`` every copy is one worker of a parameter-server job (``TF_CONFIG`` and
``PS_MODE`` tell ``psworker.connect()`` where the shards are and how to train)::

    psctl local --servers 2 --workers 2 [--mode async] -- python examples/train_lm.py

Without the marked lines (and with ``batches = loader``) this is an ordinary single-process
script: the optimizer, the scheduler and the scaler are plain torch.
"""

import codecs
import contextlib
import io
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psworker import DistributedOptimizer, connect, shard  # (distributed)

torch.manual_seed(0)
torch.set_num_threads(1)  # copies of this script share the machine's cores
device = "cuda" if torch.cuda.is_available() else "cpu"
with contextlib.redirect_stdout(io.StringIO()):  # it prints itself when imported
    import this
text = codecs.decode(this.s, "rot13")  # the Zen of Python: a small corpus every Python has
vocab = sorted(set(text))
ids = torch.tensor([vocab.index(c) for c in text])
windows = torch.stack([ids[i : i + 33] for i in range(0, len(ids) - 33, 3)])
corpus = TensorDataset(windows[:, :-1], windows[:, 1:])  # next-character prediction
loader = DataLoader(corpus, batch_size=16, shuffle=True, drop_last=True)


class CharLSTM(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 32)
        self.lstm = nn.LSTM(32, 96, batch_first=True)
        self.norm = nn.LayerNorm(96)
        self.head = nn.Linear(96, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(x))
        return self.head(self.norm(hidden))


model = CharLSTM(len(vocab)).to(device)
decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices; not biases or norms
no_decay = [p for p in model.parameters() if p.ndim < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
)
opt = DistributedOptimizer(model, connect(), opt)  # (distributed)
batches = shard(loader, opt.client)  # (distributed)
epochs = 8
total, warmup = epochs * len(batches), 5
sched = torch.optim.lr_scheduler.SequentialLR(
    opt,
    [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=1e-3),
    ],
    milestones=[warmup],
)
scaler = torch.amp.GradScaler(device)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(epochs):
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
            loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    with torch.no_grad():
        x, y = corpus.tensors[0].to(device), corpus.tensors[1].to(device)
        whole = loss_fn(model(x).flatten(0, 1), y.flatten()).item()
    lr = opt.param_groups[0]["lr"]
    print(
        f"epoch {epoch}: loss {loss.item():.4f}, corpus loss {whole:.4f} "
        f"(perplexity {math.exp(whole):.2f}), lr {lr:.5f}",
        flush=True,
    )
