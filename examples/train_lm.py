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
on arrival, with delayed Nesterov, and ``--dynamic-local-steps`` scales each worker's H by its
pace; docs/diloco.md)::

    psctl local --servers 2 --workers 4 --mode diloco -- \
        python examples/train_lm.py --local-steps 25

Without the marked lines (and with ``batches = loader``) this is an ordinary single-process
script: the optimizer, the scheduler and the scaler are plain torch. ``--json`` adds a line of
figures per epoch, and every ``--eval-every`` steps (validation perplexity, bytes sent and
received, seconds) for bench/diloco.py; ``--text FILE`` trains on a text file of one's own,
with whole blocks of it held out for validation.
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

from psworker import SGD, DistributedOptimizer, connect, shard  # (distributed)

parser = argparse.ArgumentParser(description="a character LSTM, trained distributed")
parser.add_argument("--mode", default=None, help="the job's mode (default: $PS_MODE, else sync)")
parser.add_argument("--local-steps", type=int, default=None, help="DiLoCo's H (--mode diloco)")
parser.add_argument("--outer-async", action="store_true", help="DiLoCo: asynchronous outer steps")
parser.add_argument(
    "--dynamic-local-steps", action="store_true", help="DiLoCo, async: H scaled by each pace"
)
parser.add_argument("--fragments", type=int, default=None, help="Streaming DiLoCo: fragments")
parser.add_argument(
    "--overlap-steps", type=int, default=None, help="Streaming DiLoCo: inner steps per exchange"
)
parser.add_argument("--mix", type=float, default=None, help="Streaming DiLoCo: local share kept")
parser.add_argument("--outer-lr", type=float, default=None, help="DiLoCo: the outer SGD's lr")
parser.add_argument("--outer-momentum", type=float, default=None, help="DiLoCo: its momentum")
parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's peak lr")
parser.add_argument("--hidden", type=int, default=96, help="the LSTM's width")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--steps", type=int, default=None, help="stop after this many (this worker)")
parser.add_argument(
    "--slow", type=float, default=1.0, help="this worker's step takes x times (a sleep)"
)
parser.add_argument(
    "--pace", type=float, default=0.0, help="each step takes at least this many seconds x slow"
)
parser.add_argument(
    "--corpus",
    choices=("zen", "builtins"),
    default="zen",
    help="the Zen, or builtins' docs (26 kB)",
)
parser.add_argument("--text", default=None, help="train on this text file instead")
parser.add_argument("--json", action="store_true", help="a line of figures (JSON) per epoch")
parser.add_argument(
    "--eval-every", type=int, default=0, help="--json: also every n steps (validation only)"
)
args = parser.parse_args()
job: dict = {"mode": args.mode}  # DiLoCo's settings beside the mode (or $PS_MODE):
if args.local_steps is not None:
    job["local_steps"] = args.local_steps
if args.outer_async:
    job["outer_sync"] = False
if args.dynamic_local_steps:
    job["dynamic_local_steps"] = True
for setting in ("fragments", "overlap_steps", "mix"):
    if getattr(args, setting) is not None:
        job[setting] = getattr(args, setting)
if args.outer_lr is not None or args.outer_momentum is not None:  # else the paper's 0.7, 0.9
    momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
    job["outer"] = SGD(lr=args.outer_lr or 0.7, momentum=momentum, nesterov=momentum > 0)

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
if args.text:  # a text file of one's own
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
vocab = sorted(set(text))
index = {c: i for i, c in enumerate(vocab)}
ids = torch.tensor([index[c] for c in text])


def windows(ids: torch.Tensor, stride: int) -> torch.Tensor:
    """Every window of 33 characters starting each ``stride``, wholly inside ``ids``."""
    return ids[:-1].unfold(0, 33, stride) if len(ids) > 33 else ids.new_zeros((0, 33))


if args.text:  # every tenth block of 1,024 characters held out whole: no window overlaps one
    blocks = list(ids.split(1024))
    train_windows = torch.cat([windows(b, 3) for k, b in enumerate(blocks) if k % 10 != 9])
    held_windows = torch.cat([windows(b, 33) for k, b in enumerate(blocks) if k % 10 == 9])
else:  # every tenth window (each overlaps its neighbours: a measure of what was memorised)
    every = windows(ids, 3)
    held_out = torch.arange(len(every)) % 10 == 9
    train_windows, held_windows = every[~held_out], every[held_out]
corpus = TensorDataset(train_windows[:, :-1], train_windows[:, 1:])  # next character
validation = (held_windows[:, :-1], held_windows[:, 1:])
loader = DataLoader(corpus, batch_size=16, shuffle=True, drop_last=True)


class CharLSTM(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 32)
        self.lstm = nn.LSTM(32, args.hidden, batch_first=True)
        self.norm = nn.LayerNorm(args.hidden)
        self.head = nn.Linear(args.hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(x))
        return self.head(self.norm(hidden))


model = CharLSTM(len(vocab)).to(device)
decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices; not biases or norms
no_decay = [p for p in model.parameters() if p.ndim < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr,
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
started, started_at = time.perf_counter(), time.time()  # the second: when, for the bench
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
evaluating = 0.0  # seconds spent measuring, left out of the figures' seconds
overruns = 0  # --pace: steps whose work took longer than the pace


def loss_on(x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return loss_fn(model(x.to(device)).flatten(0, 1), y.to(device).flatten()).item()


def perplexities() -> tuple[float, float]:
    """The loss on (up to 8,192 windows of) the training set, and on the held-out set."""
    return loss_on(corpus.tensors[0][:8192], corpus.tensors[1][:8192]), loss_on(*validation)


def figures(epoch: int, held: float, at: float) -> None:
    """The figures as of ``at`` (when measuring began), one JSON line (bench/diloco.py)."""
    figures = {
        "epoch": epoch,
        "perplexity": math.exp(held),
        "bytes_sent": totals.sums.get("bytes_sent", 0.0),
        "bytes_received": totals.sums.get("bytes_received", 0.0),
        "seconds": at - started - evaluating,
        "started_at": started_at,
        "evaluating": evaluating,
        "steps": taken,
        "overruns": overruns,
    }
    print("figures " + json.dumps(figures), flush=True)


def report(epoch: int) -> None:
    global evaluating
    began = time.perf_counter()
    whole, held = perplexities()
    lr = opt.param_groups[0]["lr"]
    print(
        f"epoch {epoch}: loss {loss.item():.4f}, corpus loss {whole:.4f} "
        f"(perplexity {math.exp(whole):.2f}), lr {lr:.5f}, validation perplexity "
        f"{math.exp(held):.2f}",
        flush=True,
    )
    if args.json:
        figures(epoch, held, began)
    evaluating += time.perf_counter() - began


for epoch in range(epochs):
    for x, y in batches:
        if taken == total:
            break
        taken += 1
        began, cpu = time.perf_counter(), time.thread_time()
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
            loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.report(loss=loss.item())  # the live view's loss chart (psctl dashboard, TensorBoard)
        if args.pace > 0:  # a device of fixed speed: each step takes pace x slow seconds
            left = args.pace * args.slow - (time.perf_counter() - began)
            overruns += left < 0
            time.sleep(max(0.0, left))
        elif args.slow > 1:  # a slower machine: this step's compute (CPU time) again, asleep
            time.sleep((args.slow - 1) * (time.thread_time() - cpu))
        if args.json and args.eval_every and taken % args.eval_every == 0 and taken < total:
            measured = time.perf_counter()
            figures(epoch, loss_on(*validation), measured)
            evaluating += time.perf_counter() - measured
    if epoch < epochs - 1:
        report(epoch)
# DiLoCo: the local steps since the last outer step reach the job (other modes: nothing to do).
opt.synchronize()  # (distributed)
report(epochs - 1)
