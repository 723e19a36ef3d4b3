"""A GAN with two models and two optimizers (DCGAN's training loop, tiny), made distributed by
the lines marked ``# (distributed)``.

The generator learns a ring of eight Gaussians in the plane from data the script generates.
Alone it trains in one process (``mode local``)::

    python examples/gan.py

Under ``psctl local`` every copy is one worker (sync: two workers and two shards; each step
averages both workers' gradients)::

    psctl local --servers 2 --workers 2 [--mode async] -- python examples/gan.py

What the port changes, against upstream's ``examples/dcgan/main.py``:
- ``DistributedOptimizer.for_models`` wraps both optimizers at once: the two nets are one job,
  each net's variables under its name (both nets may name a layer ``main.0.weight``), and each
  optimizer steps only its own net, as with torch: ``optimizerD.step()`` pushes D's gradients,
  ``optimizerG.step()`` G's (a training step is two pushes).
- ``seed(1, client)`` instead of ``torch.manual_seed(1)``: every worker draws its own noise
  (with one seed both workers would feed the generator the same noise).
- ``shard(loader, client)``: each worker iterates its own part of the data.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psworker import DistributedOptimizer, connect, seed, shard  # (distributed)

NZ = 4  # the generator's noise size
MODES = 8  # Gaussians on a ring of radius 2
BATCH = 64
EPOCHS = int(os.environ.get("GAN_EPOCHS", "12"))
LR, BETAS = 2e-3, (0.5, 0.999)  # DCGAN's betas


def ring_data(n: int = 2048, data_seed: int = 0) -> TensorDataset:
    """``n`` points from ``MODES`` Gaussians (std 0.05) evenly spaced on a circle of radius 2."""
    g = torch.Generator().manual_seed(data_seed)
    angle = torch.randint(0, MODES, (n,), generator=g).float() * (2 * math.pi / MODES)
    centres = torch.stack([2 * torch.cos(angle), 2 * torch.sin(angle)], dim=1)
    return TensorDataset(centres + 0.05 * torch.randn(n, 2, generator=g))


class Net(nn.Module):
    """Layers in ``main``, as DCGAN's nets hold them."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.main = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def make_nets(init_seed: int = 0) -> tuple[Net, Net]:
    """(netD, netG); both name their first layer ``main.0``, as DCGAN's nets do."""
    torch.manual_seed(init_seed)
    net_d = Net(
        nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)
    )
    net_g = Net(nn.Linear(NZ, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    return net_d, net_g


def optimizers(net_d: nn.Module, net_g: nn.Module) -> tuple[torch.optim.Adam, torch.optim.Adam]:
    """The two torch optimizers, as upstream makes them."""
    return (
        torch.optim.Adam(net_d.parameters(), lr=LR, betas=BETAS),
        torch.optim.Adam(net_g.parameters(), lr=LR, betas=BETAS),
    )


def gan_step(
    net_d: nn.Module,
    net_g: nn.Module,
    optimizer_d: torch.optim.Optimizer,
    optimizer_g: torch.optim.Optimizer,
    real: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[float, float]:
    """One DCGAN step, as upstream writes it: D on real and fake, then G; (loss_D, loss_G)."""
    criterion = nn.BCEWithLogitsLoss()
    net_d.zero_grad()
    label = torch.ones(len(real), 1)
    err_d_real = criterion(net_d(real), label)
    err_d_real.backward()
    fake = net_g(noise)
    label.fill_(0.0)
    err_d_fake = criterion(net_d(fake.detach()), label)
    err_d_fake.backward()
    optimizer_d.step()
    net_g.zero_grad()
    label.fill_(1.0)
    err_g = criterion(net_d(fake), label)  # D's gradients too: zeroed before D's next step
    err_g.backward()
    optimizer_g.step()
    return (err_d_real + err_d_fake).item(), err_g.item()


def quality(net_g: nn.Module, n: int = 2000) -> tuple[float, int]:
    """(fraction of generated points within 0.3 of a mode, how many modes hold one of them)."""
    with torch.no_grad():
        points = net_g(torch.randn(n, NZ, generator=torch.Generator().manual_seed(123)))
    angles = torch.arange(MODES).float() * (2 * math.pi / MODES)
    centres = torch.stack([2 * torch.cos(angles), 2 * torch.sin(angles)], dim=1)
    dist, nearest = torch.cdist(points, centres).min(dim=1)
    near = dist < 0.3
    return near.float().mean().item(), len(set(nearest[near].tolist()))


def main() -> None:
    torch.set_num_threads(1)  # copies of this script share the machine's cores
    net_d, net_g = make_nets(0)
    opt_d, opt_g = optimizers(net_d, net_g)
    client = connect()  # (distributed)
    opt_d, opt_g = DistributedOptimizer.for_models(  # (distributed)
        client, D=(net_d, opt_d), G=(net_g, opt_g)
    )
    seed(1, client)  # (distributed)
    loader = DataLoader(ring_data(), batch_size=BATCH, shuffle=True, drop_last=True)
    for epoch in range(EPOCHS):
        for (real,) in shard(loader, client):  # (distributed)
            loss_d, loss_g = gan_step(net_d, net_g, opt_d, opt_g, real, torch.randn(len(real), NZ))
        near, modes = quality(net_g)
        print(
            f"epoch {epoch}: loss_D {loss_d:.4f} loss_G {loss_g:.4f} near a mode {near:.3f} "
            f"modes {modes}/{MODES}",
            flush=True,
        )


if __name__ == "__main__":
    main()
