"""A character-level LSTM language model trained the modern way (AdamW with weight decay off
for biases and norms, linear warm-up then cosine decay, a GradScaler), made distributed by the
lines marked ``# (distributed)``.

Alone it trains in one process (``mode local``, no servers)::

    python examples/train_lm.py

Under ``psctl local`` every copy is one worker of a parameter-server job (``TF_CONFIG`` and
``PS_MODE`` tell ``psworker.connect()`` where the shards are and how to train)::

    psctl local --servers 2 --workers 2 [--mode async] -- python examples/train_lm.py

With local steps (DiLoCo: AdamW runs in each worker for H steps between outer steps, where
the shards apply Nesterov SGD to the averaged pseudo-gradients; ``--outer-async`` applies each
on arrival, with delayed Nesterov; docs/diloco.md)::

    psctl local --servers 2 --workers 4 --mode diloco -- \
        python examples/train_lm.py --local-steps 25

Without the marked lines (and with ``batches = loader``) this is an ordinary single-process
script: the optimizer, the scheduler and the scaler are plain torch. ``--json`` adds a line of
figures per epoch (validation perplexity, bytes sent and received, seconds) for bench/diloco.py.
"""

import argparse
import builtins
import codecs
import contextlib
import io
import json
import math
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psworker import DistributedOptimizer, connect, shard  # (distributed)

parser = argparse.ArgumentParser(description="a character LSTM, trained distributed")
parser.add_argument("--mode", default=None, help="the job's mode (default: $PS_MODE, else sync)")
parser.add_argument("--local-steps", type=int, default=None, help="DiLoCo's H (--mode diloco)")
parser.add_argument("--outer-async", action="store_true", help="DiLoCo: asynchronous outer steps")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--steps", type=int, default=None, help="stop after this many (this worker)")
parser.add_argument("--slow", type=float, default=1.0, help="this worker's step takes x times")
parser.add_argument(
    "--corpus",
    choices=("zen", "builtins"),
    default="zen",
    help="the Zen, or builtins' docs (26 kB)",
)
parser.add_argument("--json", action="store_true", help="a line of figures (JSON) per epoch")
args = parser.parse_args()
job: dict = {"mode": args.mode}  # DiLoCo's settings beside the mode (or $PS_MODE):
if args.local_steps is not None:
    job["local_steps"] = args.local_steps
if args.outer_async:
    job["outer_sync"] = False

torch.manual_seed(0)
torch.set_num_threads(1)  # copies of this script share the machine's cores
device = "cuda" if torch.cuda.is_available() else "cpu"
with contextlib.redirect_stdout(io.StringIO()):  # it prints itself when imported
    import this
text = codecs.decode(this.s, "rot13")  # the Zen of Python: a small corpus every Python has
if args.corpus == "builtins":  # a larger one: the docstrings of builtins, in name order
    text = "\n".join(
        getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins)) if n[0] != "_"
    )
vocab = sorted(set(text))
ids = torch.tensor([vocab.index(c) for c in text])
windows = torch.stack([ids[i : i + 33] for i in range(0, len(ids) - 33, 3)])
held_out = torch.arange(len(windows)) % 10 == 9  # every tenth window: validation
corpus = TensorDataset(windows[~held_out, :-1], windows[~held_out, 1:])  # next character
validation = (windows[held_out, :-1], windows[held_out, 1:])
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


class Totals:
    """A SummaryWriter stand-in that sums what the optimizer reports (bytes sent, received)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        name = tag.rsplit("/", 1)[-1]  # e.g. bytes_sent
        self.sums[name] = self.sums.get(name, 0.0) + float(value)


totals = Totals()
opt = DistributedOptimizer(model, connect(**job), opt, writer=totals)  # (distributed)
batches = shard(loader, opt.client)  # (distributed)
epochs = args.epochs if args.steps is None else math.ceil(args.steps / len(batches))
started = time.perf_counter()
total, warmup = args.steps or epochs * len(batches), 5
taken = 0
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
        if taken == total:
            break
        taken += 1
        began = time.perf_counter()
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
            loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if args.slow > 1:  # a slower machine: this worker's step takes args.slow times as long
            time.sleep((args.slow - 1) * (time.perf_counter() - began))
    with torch.no_grad():
        x, y = corpus.tensors[0].to(device), corpus.tensors[1].to(device)
        whole = loss_fn(model(x).flatten(0, 1), y.flatten()).item()
        x, y = validation[0].to(device), validation[1].to(device)
        held = loss_fn(model(x).flatten(0, 1), y.flatten()).item()
    lr = opt.param_groups[0]["lr"]
    print(
        f"epoch {epoch}: loss {loss.item():.4f}, corpus loss {whole:.4f} "
        f"(perplexity {math.exp(whole):.2f}), lr {lr:.5f}, validation perplexity "
        f"{math.exp(held):.2f}",
        flush=True,
    )
    if args.json:  # the figures so far, one JSON line (bench/diloco.py reads them)
        figures = {
            "epoch": epoch,
            "perplexity": math.exp(held),
            "bytes_sent": totals.sums.get("bytes_sent", 0.0),
            "bytes_received": totals.sums.get("bytes_received", 0.0),
            "seconds": time.perf_counter() - started,
            "steps": taken,
        }
        print("figures " + json.dumps(figures), flush=True)
