"""Training throughput (samples/s) of a real model against DDP: a ~25M-parameter transformer LM
and a ResNet-style CNN, 2 workers (``--workers``), for DDP with gloo, the torch RPC parameter
server, and ours (sync, async, allreduce) with overlap on and off, and ``overlap="auto"``
(overlap kept only where it measured faster); over loopback and over
emulated links (a network namespace per host, each worker and each shard, joined by veth pairs
to a bridge, each host's link shaped with tc netem: 10 Gbit/s and 1 Gbit/s, 0.2 ms delay).

``python -m bench.training [--quick] [--nets loopback 1gbit ...] [--rounds 3] [--systems ...]
[--modes ...] [--workers 4]``;
``python -m bench --only training``. Systems are interleaved round by round: each round starts
every system once (one process start each, the order reversed every other round), so load
from elsewhere hits them alike; a system's figure is the median of its rounds. Every process
is a subprocess (``--role``) so that it can run inside its host's namespace. Namespaces are
named ``ov29-<pid>-<k>`` and always deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from bench.report import Ratio, Table, check, print_table
from psworker.overlap_trial import TRIAL_STEPS

START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 900.0
# name -> (system, mode, overlap: False, True or "auto"): what a round measures, in this order
# (reversed every other round); ``--systems`` picks some by name.
SYSTEMS: dict[str, tuple[str, str, bool | str]] = {
    "ddp": ("DDP gloo", "ddp", False),
    "rpcps": ("torch RPC PS", "rpcps", False),
    "sync": ("ours sync", "sync", False),
    "sync+overlap": ("ours sync", "sync", True),
    "sync+auto": ("ours sync", "sync", "auto"),
    "async": ("ours async", "async", False),
    "async+overlap": ("ours async", "async", True),
    "async+auto": ("ours async", "async", "auto"),
    "allreduce": ("ours allreduce", "allreduce", False),
    "allreduce+overlap": ("ours allreduce", "allreduce", True),
    "allreduce+auto": ("ours allreduce", "allreduce", "auto"),
}
_HOSTS = itertools.count()  # Hosts made by this process (in the interface names)
_OVERLAP_ARG: dict[bool | str, str] = {False: "off", True: "on", "auto": "auto"}  # --overlap
NETS = {"loopback": None, "10gbit": "10gbit", "1gbit": "1gbit"}
DELAY = "0.2ms"
LR = 0.01


@dataclass(frozen=True)
class Sizes:
    """One benchmark configuration: model size, batch, steps."""

    lm_dim: int
    lm_layers: int
    seq: int
    lm_batch: int
    cnn_width: int
    cnn_batch: int
    warmup: int
    steps: int


FULL = Sizes(
    lm_dim=512, lm_layers=8, seq=64, lm_batch=4, cnn_width=64, cnn_batch=16, warmup=2, steps=6
)
QUICK = Sizes(
    lm_dim=128, lm_layers=2, seq=32, lm_batch=4, cnn_width=16, cnn_batch=8, warmup=1, steps=3
)


# -- the models ------------------------------------------------------------------------------


def build_model(kind: str, sizes: Sizes, seed: int = 0) -> Any:
    """The transformer LM (``lm``: a scaled-up examples/train_lm.py, a decoder over bytes)
    or the ResNet-style CNN (``cnn``)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if kind == "lm":

        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                d = sizes.lm_dim
                self.embed = nn.Embedding(256, d)
                self.pos = nn.Parameter(torch.zeros(sizes.seq, d))
                layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True)
                self.blocks = nn.TransformerEncoder(
                    layer, sizes.lm_layers, enable_nested_tensor=False
                )
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, 256)
                # A plain attribute, not a buffer: buffers travel to the shards, which refuse
                # the mask's -inf.
                self.mask = nn.Transformer.generate_square_subsequent_mask(sizes.seq)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.blocks(self.embed(x) + self.pos, mask=self.mask, is_causal=True)
                return self.head(self.norm(h))

        return LM()

    def block(c_in: int, c_out: int, stride: int) -> nn.Module:
        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
                self.bn1 = nn.BatchNorm2d(c_out)
                self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
                self.bn2 = nn.BatchNorm2d(c_out)
                self.skip = (
                    nn.Sequential(
                        nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
                    )
                    if stride != 1 or c_in != c_out
                    else nn.Identity()
                )

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = torch.relu(self.bn1(self.conv1(x)))
                return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))

        return Block()

    w = sizes.cnn_width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        block(w, w, 1),
        block(w, 2 * w, 2),
        block(2 * w, 4 * w, 2),
        block(4 * w, 8 * w, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8 * w, 10),
    )


def batch(kind: str, sizes: Sizes, rank: int, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "lm":
        x = torch.randint(0, 256, (sizes.lm_batch, sizes.seq + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    return torch.randn(sizes.cnn_batch, 3, 32, 32, generator=g), torch.randint(
        0, 10, (sizes.cnn_batch,), generator=g
    )


def loss_of(kind: str, model: Any, x: Any, y: Any) -> Any:
    import torch

    out = model(x)
    if kind == "lm":
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return torch.nn.functional.cross_entropy(out, y)


# -- the processes ---------------------------------------------------------------------------

_RPC_PARAMS: dict[str, Any] = {}


def _rpc_update_and_fetch(grads: dict[str, Any]) -> dict[str, Any]:
    """torch's PS tutorial's fused call: SGD on the pushed gradients, the new weights back."""
    for name, grad in grads.items():
        _RPC_PARAMS[name].add_(grad, alpha=-LR)
    return _RPC_PARAMS


def _rpc_options(master: str, port: int) -> Any:
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8, rpc_timeout=RUN_TIMEOUT_S, init_method=f"tcp://{master}:{port}"
    )


def run_worker(args: argparse.Namespace) -> None:
    """One training process: ``args.steps`` timed steps after ``args.warmup``; writes its
    elapsed seconds and samples to ``args.out``."""
    import torch

    torch.set_num_threads(1)  # 2 cores shared by every process of the run
    landed: Any = lambda: None  # noqa: E731
    overlapping: Any = lambda: False  # noqa: E731
    sizes = Sizes(**json.loads(args.sizes))
    warmup = sizes.warmup
    model = build_model(args.model, sizes)
    n = sizes.lm_batch if args.model == "lm" else sizes.cnn_batch
    mode = args.mode
    if mode == "rpcps":
        from torch.distributed import rpc

        if args.rank == args.world:  # the parameter server
            _RPC_PARAMS.update({k: v.detach().clone() for k, v in model.named_parameters()})
            rpc.init_rpc(
                "ps",
                rank=0,
                world_size=args.world + 1,
                rpc_backend_options=_rpc_options(args.master, args.port),
            )
            rpc.shutdown()
            return
        rpc.init_rpc(
            f"trainer{args.rank}",
            rank=args.rank + 1,
            world_size=args.world + 1,
            rpc_backend_options=_rpc_options(args.master, args.port),
        )
        params = dict(model.named_parameters())

        def step(t: int) -> None:
            model.zero_grad()
            loss_of(args.model, model, *batch(args.model, sizes, args.rank, t)).backward()
            grads = {k: p.grad for k, p in params.items()}
            fresh = rpc.rpc_sync("ps", _rpc_update_and_fetch, args=(grads,))
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(fresh[k])

        closer: Any = rpc.shutdown
    elif mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{args.master}:{args.port}",
            rank=args.rank,
            world_size=args.world,
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)

        def step(t: int) -> None:
            opt.zero_grad()
            loss_of(args.model, ddp, *batch(args.model, sizes, args.rank, t)).backward()
            opt.step()

        closer = dist.destroy_process_group
    else:
        import psworker
        from psworker.torch import DistributedOptimizer

        if mode == "allreduce":
            os.environ.update(
                MASTER_ADDR=args.master, MASTER_PORT=str(args.port), RANK=str(args.rank)
            )
            client = psworker.connect(worker_id=args.rank, num_workers=args.world, mode=mode)
        else:
            client = psworker.connect(
                args.shards.split(","), worker_id=args.rank, num_workers=args.world, mode=mode
            )
        overlap = {arg: value for value, arg in _OVERLAP_ARG.items()}[args.overlap]
        dopt = DistributedOptimizer(
            model, client, torch.optim.SGD(model.parameters(), lr=LR), overlap=overlap
        )
        overlapping = lambda: dopt.overlapping  # noqa: E731
        if overlap == "auto":  # timed in its steady state: after the trial's choice
            warmup = max(warmup, TRIAL_STEPS)

        def step(t: int) -> None:
            dopt.zero_grad()
            loss_of(args.model, model, *batch(args.model, sizes, args.rank, t)).backward()
            dopt.step()

        landed = dopt.synchronize  # overlap: the last step's weights are in the model
        closer = client.close
    for t in range(warmup):
        step(t)
    # The timer starts with no step in flight: with overlap the last warm-up step's weights
    # may still be landing, and a window opened now would count that step's communication
    # beside its own steps' (one step more than the serial systems'). Each window then ends
    # with the weights of its last step landed, so the next one starts the same way.
    landed()
    windows = []  # the rounds: one process start for all of them (a start costs more)
    busy = []  # the machine's CPUs: the share of their time spent running anything
    busy_s = []  # the machine's CPU seconds spent running anything (every process, kernel)
    own_s = []  # this process's CPU seconds (all its threads)
    for r in range(args.rounds):
        started, cpus, own = time.perf_counter(), machine_cpu(), time.process_time()
        for t in range(sizes.steps):
            step(warmup + r * sizes.steps + t)
        landed()
        windows.append(time.perf_counter() - started)
        own_s.append(time.process_time() - own)
        (busy_before, all_before), (busy_after, all_after) = cpus, machine_cpu()
        busy.append((busy_after - busy_before) / max(1, all_after - all_before))
        busy_s.append((busy_after - busy_before) / _TICKS_PER_S)
    Path(args.out).write_text(
        json.dumps(
            {
                "elapsed": windows,
                "samples": n * sizes.steps,
                "machine_busy": busy,
                "machine_busy_s": busy_s,
                "cpu_s": own_s,
                "steps": sizes.steps,
                "overlapping": overlapping(),
            }
        )
    )
    closer()


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu() -> tuple[int, int]:
    """This machine's CPU time so far, in clock ticks over all CPUs: (busy, all), busy being
    all but idle and iowait (``/proc/stat``: the same in every network namespace); (0, 0)
    where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


# -- hosts: loopback or a namespace each -----------------------------------------------------


class Hosts:
    """``count`` hosts: loopback (every host is 127.0.0.1), or one network namespace each,
    joined by veth pairs to one bridge, each host's link shaped (both directions) by netem."""

    def __init__(self, count: int, rate: str | None) -> None:
        self.count = count
        self.rate = rate
        # Unique per instance too: a net's veths may outlive its namespaces for a moment.
        self.tag = f"{os.getpid() % 100000}{next(_HOSTS) % 10}"
        self.names = [f"ov29-{self.tag}-{k}" for k in range(count)]
        self.bridge = f"ov29b{self.tag}"
        self._made: list[str] = []
        self.delayed = False  # whether netem's delay is on the links (not every kernel has it)

    def address(self, k: int) -> str:
        return "127.0.0.1" if self.rate is None else f"10.29.0.{k + 1}"

    def prefix(self, k: int) -> list[str]:
        return [] if self.rate is None else ["ip", "netns", "exec", self.names[k]]

    def env(self, k: int) -> dict[str, str]:
        # gloo and TensorPipe pick an interface by hostname otherwise (not in the namespace).
        return (
            {} if self.rate is None else {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
        )

    def __enter__(self) -> Hosts:
        if self.rate is None:
            return self
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("link", "set", self.bridge, "up")
            for k, ns in enumerate(self.names):
                outer, inner = f"ov29v{self.tag}{k}", f"ov29p{self.tag}{k}"
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("-n", ns, "link", "set", inner, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                # The host's link, both ways: its egress and its ingress (the bridge port's
                # egress) shaped by tbf. netem (the 0.2 ms delay) is not in this kernel: the
                # delay is tried and left out, said in the table's notes, when refused.
                burst = "2mb" if self.rate == "10gbit" else "256kb"
                shape = ["tbf", "rate", self.rate, "burst", burst, "latency", "20ms"]
                _run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", *shape]
                )
                try:
                    _run(
                        [
                            "tc",
                            "-n",
                            ns,
                            "qdisc",
                            "add",
                            "dev",
                            "eth0",
                            "parent",
                            "1:1",
                            "handle",
                            "10:",
                            "netem",
                            "delay",
                            DELAY,
                        ]
                    )
                    self.delayed = True
                except RuntimeError:
                    self.delayed = False
                _run(["tc", "qdisc", "add", "dev", outer, "root", *shape])
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_shard(
        self,
        k: int,
        port_file: Path,
        env: dict[str, str],
        procs: list[subprocess.Popen[str]],
        stderr: int | None = subprocess.STDOUT,
        cwd: Path | None = None,
    ) -> str:
        """Starts ``python -m psserver`` on host ``k`` (added to ``procs`` at once, so the
        caller stops it whatever happens) and returns its address once its port is known.
        ``stderr``: its log (default: dropped with its stdout; ``None``: the caller's).
        ``cwd``: where it starts (``-m`` imports from there before ``$PYTHONPATH``).

        Raises:
            RuntimeError: it exited, or wrote no port within ``START_TIMEOUT_S``.
        """
        cmd = [*self.prefix(k), sys.executable, "-m", "psserver"]
        cmd += ["--host", self.address(k), "--port-file", str(port_file)]
        procs.append(
            subprocess.Popen(
                cmd,
                env={**env, **self.env(k)},
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
                cwd=cwd,
            )
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the shard on host {k} did not start")
            time.sleep(0.05)
        time.sleep(0.05)  # the port file's content is written before the rename
        return f"{self.address(k)}:{int(port_file.read_text())}"

    def __exit__(self, *exc: object) -> None:
        for made in reversed(self._made):
            if made == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            else:  # deleting the namespace deletes its veth pair
                subprocess.run(["ip", "netns", "del", made], capture_output=True, check=False)
        self._made.clear()


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def netns_available() -> bool:
    """Whether this process may make namespaces and shape links (root, iproute2)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


# -- one run ---------------------------------------------------------------------------------


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """A list for the run's child processes; on leaving (an error, or SIGTERM to this process
    too: it exits through here instead of dying with its children orphaned) each is
    terminated, then killed after 10 s."""
    procs: list[subprocess.Popen[str]] = []
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        signal.signal(signal.SIGTERM, previous)


def _free_port() -> int:
    from bench.torchps import free_port

    return free_port()


class Run(NamedTuple):
    """One job's figures, over its workers' timed steps."""

    rates: list[float]  # samples/s per round: every worker's samples over the slowest's time
    # The share of the machine's CPU time busy (the workers' mean): near 1, the run is
    # CPU-bound and overlap has no idle time to fill.
    busy: float
    overlapping: int  # workers overlapping at the end (``overlap="auto"``: those that kept it)
    worker_cpu_s: float  # a worker's CPU seconds per step (all its threads; the workers' mean)
    # The machine's other busy CPU seconds per step: the shards (or the RPC PS), network work
    # the kernel charged to no worker, anything else running. On hosts with CPUs of their own
    # the shards' part would not slow the workers.
    other_cpu_s: float


def run_once(
    hosts: Hosts,
    model: str,
    mode: str,
    overlap: bool | str,
    workers: int,
    shards: int,
    sizes: Sizes,
    rounds: int,
    tree: Path | None = None,
) -> Run:
    """One job's figures (``Run``). ``tree``: the checkout whose code the shards and workers
    run (default: this one), so two commits compare interleaved in one run."""
    root = tree or Path(__file__).resolve().parents[1]
    env_base = {**os.environ, "PYTHONPATH": str(root)}
    with tempfile.TemporaryDirectory(prefix="ov29-") as tmp, processes() as procs:
        shard_addrs = []
        if mode in ("sync", "async"):
            for j in range(shards):
                port_file = Path(tmp) / f"shard{j}.port"
                shard_addrs.append(
                    hosts.start_shard(workers + j, port_file, env_base, procs, cwd=root)
                )
        port = _free_port()
        roles = list(range(workers)) + ([workers] if mode == "rpcps" else [])
        workers_procs = []
        for rank in roles:
            k = rank if rank < workers else workers  # the RPC PS runs on the first shard host
            master = hosts.address(workers if mode == "rpcps" else 0)
            cmd = [
                *hosts.prefix(k),
                sys.executable,
                "-m",
                "bench.training",
                "--role",
                "worker",
                "--model",
                model,
                "--mode",
                mode,
                "--rank",
                str(rank),
                "--world",
                str(workers),
                "--master",
                master,
                "--port",
                str(port),
                "--shards",
                ",".join(shard_addrs),
                "--sizes",
                json.dumps(sizes.__dict__),
                "--out",
                str(Path(tmp) / f"w{rank}.json"),
                "--rounds",
                str(rounds),
                "--overlap",
                _OVERLAP_ARG[overlap],
            ]
            p = subprocess.Popen(
                cmd,
                env={**env_base, **hosts.env(k)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=root,  # ``-m`` imports from the working directory first
            )
            procs.append(p)
            workers_procs.append(p)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for p in workers_procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{mode} worker did not finish in {RUN_TIMEOUT_S}s") from None
            if p.returncode:
                raise RuntimeError(f"{mode} (overlap={overlap}) worker failed:\n{out[-3000:]}")
        results = [json.loads((Path(tmp) / f"w{r}.json").read_text()) for r in range(workers)]
    total = sum(r["samples"] for r in results)
    busy = statistics.mean(b for r in results for b in r["machine_busy"])
    overlapping = sum(bool(r["overlapping"]) for r in results)
    rates = [total / max(r["elapsed"][i] for r in results) for i in range(rounds)]
    steps = rounds * results[0]["steps"]
    worker_cpu = statistics.mean(sum(r["cpu_s"]) for r in results) / steps
    machine = statistics.mean(sum(r["machine_busy_s"]) for r in results) / steps
    return Run(rates, busy, overlapping, worker_cpu, max(0.0, machine - workers * worker_cpu))


# -- the suite -------------------------------------------------------------------------------


def measure(
    quick: bool,
    nets: Sequence[str] = ("loopback", "10gbit", "1gbit"),
    models: Sequence[str] = ("lm", "cnn"),
    rounds: int = 3,
    workers: int = 2,
    shards: int = 2,
    systems: Sequence[str] = tuple(SYSTEMS),
    modes: Sequence[str] | None = None,
) -> Table:
    """samples/s per (model, network, system, overlap): medians of ``rounds`` rounds, each
    round one process start per system, systems interleaved; the issue's "Must show" ratios.
    ``systems``: by name (``SYSTEMS``); ``modes``: of those, only the systems of these modes
    (``ddp``, ``rpcps``, ``sync``, ``async``, ``allreduce``)."""
    sizes = QUICK if quick else FULL
    if not netns_available():
        nets = [n for n in nets if n == "loopback"]
    systems = [n for n in systems if modes is None or SYSTEMS[n][1] in modes]
    if any(SYSTEMS[n][2] == "auto" for n in systems):
        # Every system warms up as long as overlap="auto"'s trial: the timed steps come after
        # its choice, and no system's figure counts more start-up steps than another's.
        sizes = replace(sizes, warmup=max(sizes.warmup, TRIAL_STEPS))
    chosen = [SYSTEMS[name] for name in systems]
    started = time.perf_counter()
    samples: dict[tuple[str, str, str, bool | str], list[float]] = {}
    cpu_busy: dict[tuple[str, str, str, bool | str], list[float]] = {}
    # per round: (a worker's CPU s/step, the rest of the machine's), as ``Run``
    cpu_step: dict[tuple[str, str, str, bool | str], list[tuple[float, float]]] = {}
    chose: dict[tuple[str, str, str, bool | str], list[int]] = {}  # auto: workers that kept it
    loads: list[float] = []
    failures: list[str] = []
    links: list[str] = []
    for net in nets:
        with Hosts(workers + shards, NETS[net]) as hosts:
            if hosts.rate is not None:
                delay = f"netem delay {DELAY}" if hosts.delayed else "no delay (no netem here)"
                links.append(f"{net}: each host's link tbf {hosts.rate} both ways, {delay}")
            for model in models:
                if net != "loopback" and model != "lm" and not quick:
                    continue  # the emulated-link figures are the LM's; time is short
                for r in range(rounds):
                    for label, mode, overlap in chosen if r % 2 == 0 else chosen[::-1]:
                        key = (model, net, label, overlap)
                        loads.append(os.getloadavg()[0])
                        try:
                            run = run_once(hosts, model, mode, overlap, workers, shards, sizes, 1)
                        except RuntimeError as exc:
                            failures.append(f"{key} round {r}: {str(exc)[-400:]}")
                            print(f"  FAILED {key}: {str(exc)[-2000:]}", flush=True)
                            continue
                        samples.setdefault(key, []).append(run.rates[0])
                        cpu_busy.setdefault(key, []).append(run.busy)
                        cpu_step.setdefault(key, []).append((run.worker_cpu_s, run.other_cpu_s))
                        if overlap == "auto":
                            chose.setdefault(key, []).append(run.overlapping)
                        print(
                            f"  round {r} {model} {net} {label} overlap={overlap}: "
                            f"{run.rates[0]:.2f} samples/s (load {loads[-1]:.1f}, CPUs "
                            f"{run.busy:.0%} busy in the timed steps; CPU s/step: "
                            f"{run.worker_cpu_s:.3f} a worker, {run.other_cpu_s:.3f} the rest"
                            + (
                                f"; {run.overlapping}/{workers} workers kept overlap"
                                if overlap == "auto"
                                else ""
                            )
                            + ")",
                            flush=True,
                        )
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [
        [
            model,
            net,
            label,
            _OVERLAP_ARG[overlap],
            med[key],
            f"{min(samples[key]):.3g}-{max(samples[key]):.3g}",
            len(samples[key]),
            round(statistics.median(w for w, _ in cpu_step[key]), 3),
            round(statistics.median(o for _, o in cpu_step[key]), 3),
        ]
        for model in models
        for net in nets
        for label, _, overlap in chosen
        if (key := (model, net, label, overlap)) in med
    ]

    def ratio(
        comparison: str,
        ours: tuple[str, str, str, bool | str],
        peer: tuple[str, str, str, bool | str],
        goal: str,
    ) -> Ratio:
        value = med[ours] / med[peer] if ours in med and peer in med else None
        name = lambda k: f"{k[2]} overlap {_OVERLAP_ARG[k[3]]} ({k[0]}, {k[1]})"  # noqa: E731
        return Ratio(
            "training",
            comparison,
            name(ours),
            name(peer),
            value,
            "samples/s, >1: ours faster",
            goal,
            check(value, goal),
        )

    ratios = []
    for model in models:
        for net in nets:
            s_on, s_off = (model, net, "ours sync", True), (model, net, "ours sync", False)
            a_on, a_off = (model, net, "ours async", True), (model, net, "ours async", False)
            ar, ddp = (model, net, "ours allreduce", False), (model, net, "DDP gloo", False)
            ar_on = (model, net, "ours allreduce", True)
            s_auto, a_auto = (model, net, "ours sync", "auto"), (model, net, "ours async", "auto")
            no_loss = ">= 1.0" if net == "loopback" else ""
            goal_vs_off = ">= 1.3" if (net == "1gbit" and model == "lm") else ">= 1.0"
            ratios.append(ratio("sync overlap / sync no overlap", s_on, s_off, goal_vs_off))
            ratios.append(
                ratio(
                    "async overlap / async no overlap",
                    a_on,
                    a_off,
                    ">= 1.0" if net == "loopback" else "",
                )
            )
            ddp_goal = {"1gbit": ">= 1.0", "10gbit": ">= 0.95"}.get(net, "")
            ratios.append(ratio("async overlap / DDP gloo", a_on, ddp, ddp_goal))
            ratios.append(ratio("allreduce no overlap / DDP gloo", ar, ddp, ""))
            ratios.append(ratio("allreduce overlap / DDP gloo", ar_on, ddp, ddp_goal))
            ratios.append(
                ratio(
                    "allreduce overlap / allreduce no overlap",
                    ar_on,
                    ar,
                    ">= 1.0" if net == "loopback" else "",
                )
            )
            ratios.append(
                ratio("sync overlap / DDP gloo", s_on, ddp, ">= 0.95" if net == "10gbit" else "")
            )
            ratios.append(
                ratio("sync overlap / torch RPC PS", s_on, (model, net, "torch RPC PS", False), "")
            )
            ar_auto = (model, net, "ours allreduce", "auto")
            autos = {"sync": (s_auto, s_off), "async": (a_auto, a_off), "allreduce": (ar_auto, ar)}
            for m, (auto, off) in autos.items():
                ratios.append(ratio(f"{m} overlap auto / {m} no overlap", auto, off, no_loss))
                ratios.append(ratio(f"{m} overlap auto / DDP gloo", auto, ddp, ddp_goal))
    ratios = [r for r in ratios if r.ratio is not None]
    params = {m: sum(p.numel() for p in build_model(m, sizes).parameters()) for m in models}
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"
    notes = [
        f"{workers} workers, {shards} shards (one host each on emulated links), models: "
        + ", ".join(f"{m} {params[m] / 1e6:.1f}M parameters" for m in models)
        + f"; {sizes.warmup} warm-up + {sizes.steps} timed steps per process start (the timer "
        "starts with no step in flight and stops once the last step's weights have landed); the "
        f"median of {rounds} rounds, each round one start per system, systems interleaved "
        "(the order reversed every other round); min-max: the rounds' spread",
        f"1-minute load average when each run started: {load}",
        "every process shares this machine's CPUs (torch threads = 1 each): compute is slow, "
        "so communication is a smaller share of a step than on GPUs",
        "CPU s/step (medians): worker, one worker process's CPU per step (all its threads); "
        "rest, the machine's other busy CPU per step (the shards or the RPC PS, network work "
        "the kernel charged to no worker, anything else running). Here every host shares "
        "these CPUs, so the rest slows the workers; with hosts of their own it would not",
        *(
            [
                "allreduce with overlap starts each gradient bucket's ring all-reduce from "
                "backward's hooks (DDP's way)"
            ]
            if "allreduce+overlap" in systems
            else []
        ),
        *(
            [
                f"overlap auto times serial, then overlapped steps, and keeps the faster: its "
                f"trial takes {TRIAL_STEPS} steps, so every system warms up that long; "
                "auto_kept_overlap in the raw figures: per round, the workers that kept it"
            ]
            if any(SYSTEMS[n][2] == "auto" for n in systems)
            else []
        ),
        *(
            ["torch RPC PS applies each trainer's gradient at once (the tutorial's async PS)"]
            if "rpcps" in systems
            else []
        ),
        *links,
        *failures,
    ]
    return Table(
        "training",
        "training throughput, samples/s (higher is better)",
        [
            "model",
            "network",
            "system",
            "overlap",
            "samples/s",
            "min-max",
            "rounds",
            "worker CPU s/step",
            "rest CPU s/step",
        ],
        rows,
        notes=notes,
        ratios=ratios,
        plot=((2, 3, 0, 1), 4, "samples/s"),
        raw={
            "samples": {" | ".join(map(str, k)): v for k, v in samples.items()},
            "cpu_busy": {" | ".join(map(str, k)): v for k, v in cpu_busy.items()},
            "cpu_s_per_step": {" | ".join(map(str, k)): v for k, v in cpu_step.items()},
            "auto_kept_overlap": {" | ".join(map(str, k)): v for k, v in chose.items()},
            "sizes": sizes.__dict__,
            "load": loads,
        },
        elapsed_s=time.perf_counter() - started,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__)
    parser.add_argument("--role", default="suite", choices=("suite", "worker"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    parser.add_argument("--models", nargs="+", default=["lm", "cnn"], choices=["lm", "cnn"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="workers per job (2 shards)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=sorted({m for _, m, _ in SYSTEMS.values()}),
        help="of --systems, only these modes' (e.g. --modes allreduce: overlap off and on)",
    )
    parser.add_argument("--out-json", default=None, help="write the table here")
    # a worker's
    parser.add_argument("--model", default="lm")
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--overlap", default="off", choices=sorted(set(_OVERLAP_ARG.values())))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--master", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shards", default="")
    parser.add_argument("--sizes", default="{}")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.role == "worker":
        run_worker(args)
        return 0
    table = measure(
        args.quick,
        args.nets,
        args.models,
        args.rounds,
        args.workers,
        systems=args.systems,
        modes=args.modes,
    )
    print_table(table)
    for r in table.ratios:
        shown = "n/a" if r.ratio is None else f"{r.ratio:.2f}"
        print(
            f"{r.comparison} [{r.ours} vs {r.peer}]: {shown} {r.goal} "
            + {None: "", True: "met", False: "NOT met"}[r.met]
        )
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(table.to_json(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
