"""Click-through-rate prediction with an embedding table that lives on the parameter servers.

Synthetic data with a known generator: 8 categorical fields (user, item, ad, ...), each value
drawn from a power law; a click happens with probability sigmoid(logit), where the logit is a
factorization machine (a weight per value plus dot products of latent vectors between fields).
So the best AUC any model can reach on this data is the AUC of the true logit, and the script
prints both.

The model is a factorization machine over one embedding table indexed by feature hashes
(``hash(field, value)``, the hashing trick): by default 2**26 hash buckets of 9 floats, 2.25 GiB
of rows plus as much again of Adagrad state, which live only on the shards; each step moves
only the batch's rows, and the next batch's rows come back with the step's push
(``Embedding.prefetch``): one round trip per shard per step. ``--table-rows 0`` makes the table
dynamic instead: any 64-bit hash is an id and the shards make a row the first time a worker
touches it. As a parameter-server job (``psctl status`` shows the table per shard meanwhile)::

    psctl local --servers 2 --workers 2 -- python examples/ctr.py

Alone it trains in one process (``mode local``), which then holds the whole table::

    python examples/ctr.py --table-rows 0
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import psworker
from psworker.torch import DistributedOptimizer, Embedding

CARDINALITIES = (20_000, 5_000, 2_000, 500, 100, 50, 20, 8)
LATENT = 4  # the generator's latent size


def feature_ids(values: np.ndarray) -> np.ndarray:
    """64-bit ids of (field, value) pairs: what a production pipeline's feature hashing gives."""
    fields = np.arange(values.shape[1], dtype=np.uint64)[None, :]
    mixed = (values.astype(np.uint64) << np.uint64(8)) | fields
    with np.errstate(over="ignore"):
        mixed = (mixed ^ (mixed >> np.uint64(31))) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed ^ (mixed >> np.uint64(29))).view(np.int64)


def generate(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(feature ids (samples, fields), clicks, the true logits) from the known generator."""
    rng = np.random.default_rng(seed)
    values = np.stack(
        [np.minimum(rng.zipf(1.3, samples) - 1, c - 1) for c in CARDINALITIES], axis=1
    )
    truth = np.random.default_rng(1234)  # the generator's parameters: fixed across runs
    weights = [truth.normal(0, 0.5, c) for c in CARDINALITIES]
    latents = [truth.normal(0, 0.35, (c, LATENT)) for c in CARDINALITIES]
    logit = np.full(samples, -1.0)
    vectors = np.zeros((samples, LATENT))
    squares = np.zeros(samples)
    for f in range(len(CARDINALITIES)):
        logit += weights[f][values[:, f]]
        v = latents[f][values[:, f]]
        vectors += v
        squares += (v * v).sum(axis=1)
    logit += 0.5 * ((vectors * vectors).sum(axis=1) - squares)  # sum over field pairs
    clicks = (rng.random(samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return feature_ids(values), clicks, logit


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2  # average rank of a tie
    positives = labels > 0.5
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class FactorizationMachine(torch.nn.Module):
    """logit = bias + sum of per-feature weights + sum over field pairs of <v_i, v_j>."""

    def __init__(
        self, client: psworker.PSClient | psworker.LocalClient, rows: int | None, dim: int
    ) -> None:
        super().__init__()
        # One row per feature: its weight, then its latent vector. Each forward pulls only the
        # batch's distinct rows from the shards.
        self.features = Embedding(rows, dim + 1, client, name="features", init_scale=0.01)
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        per_feature = self.features(ids)  # (batch, fields, dim + 1)
        linear = per_feature[..., 0].sum(dim=1)
        v = per_feature[..., 1:]
        pairs = 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)
        return self.bias + linear + pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400_000, help="training samples")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=8, help="the model's latent size")
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    parser.add_argument(
        "--table-rows", type=int, default=1 << 26, help="hash buckets; 0: a dynamic table"
    )
    parser.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="pull each batch's rows in its forward, not with the step before",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # copies of this script share the machine's cores

    train_ids, train_clicks, _ = generate(args.samples, seed=1)
    test_ids, test_clicks, test_logit = generate(100_000, seed=2)
    if args.table_rows:  # the hashing trick: fold the 64-bit hashes into the table's buckets
        train_ids, test_ids = train_ids % args.table_rows, test_ids % args.table_rows
    best = auc(test_logit, test_clicks)
    dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(train_ids), torch.from_numpy(train_clicks)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True)

    client = psworker.connect()
    model = FactorizationMachine(client, args.table_rows or None, args.dim)
    opt = DistributedOptimizer(model, client, psworker.Adagrad(lr=args.lr))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        started, samples = time.perf_counter(), 0
        batches = iter(psworker.shard(loader, client))
        batch = next(batches, None)
        while batch is not None:
            ids, clicks = batch
            batch = next(batches, None)  # the loader knows the next batch's ids: its rows
            if batch is not None and args.prefetch:  # come back with this step's push
                model.features.prefetch(batch[0])
            opt.zero_grad()
            loss = loss_fn(model(ids), clicks)
            loss.backward()
            opt.step()
            samples += len(ids)
        rate = samples / (time.perf_counter() - started)
        with torch.no_grad():
            scores = torch.cat([model(chunk) for chunk in torch.from_numpy(test_ids).split(8192)])
        got = auc(scores.numpy(), test_clicks)
        print(
            f"epoch {epoch}: loss {loss.item():.4f}, test AUC {got:.4f} "
            f"(the generator's own logit: {best:.4f}, gap {100 * (best - got):.1f} points); "
            f"{rate:.0f} samples/s",
            flush=True,
        )
    rows = [(s.tables[0].rows, s.tables[0].bytes) for s in client.status() if s.tables]
    if rows:
        held = ", ".join(
            f"shard {i}: {r} rows, {b / 2**20:.1f} MiB" for i, (r, b) in enumerate(rows)
        )
        print(f"table 'features' on the shards: {held}", flush=True)
    client.close()


if __name__ == "__main__":
    main()
