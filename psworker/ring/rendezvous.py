"""Ring addresses by rendezvous: each rank binds its ring server on port 0 and publishes the
address in torch's ``TCPStore`` at ``$MASTER_ADDR:$MASTER_PORT`` (what torchrun uses), then
reads every other rank's, so an all-reduce job needs no hand-written TF_CONFIG.

Who hosts the store follows torch's own ``env://`` rule: when the launcher's agent hosts it
(``$TORCHELASTIC_USE_AGENT_STORE=True``: torchrun, ``psctl local --nnodes``) every rank is a
client; otherwise rank 0 hosts it (multi-tenant, so a later ``init_process_group`` in the same
process shares it). torch is imported only here, and only when a rendezvous is needed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pswire.errors import ConfigError, UnavailableError, WaitTimeoutError
from pswire.security import ClientSecurity
from psworker.ring.flight_transport import RingServer

KEY_PREFIX = "psworker/ring"


@dataclass(frozen=True)
class RendezvousSettings:
    """Where the store is, who this rank is, and how long to wait for the others."""

    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float
    agent_store: bool = False  # the launcher hosts the store: rank 0 is a client like the rest
    attempt: str = "0"  # keys are per attempt, so a restarted group never reads stale ones

    @classmethod
    def from_env(
        cls, rank: int, world_size: int, timeout_s: float, env: Mapping[str, str]
    ) -> RendezvousSettings | None:
        """The settings from ``$MASTER_ADDR``/``$MASTER_PORT``; None when they are unset.

        Raises:
            ConfigError: only one of them is set, or the port is not a port number.
        """
        host, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
        if not host and not port:
            return None
        if not host or not port:
            raise ConfigError(
                f"$MASTER_ADDR={host!r} and $MASTER_PORT={port!r}: set both (the rendezvous "
                "store's host and port) or neither"
            )
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"$MASTER_PORT={port!r} is not a port number")
        attempt = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        return cls(
            host=host,
            port=int(port),
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True",
            attempt=attempt,
        )

    @property
    def where(self) -> str:
        return f"the rendezvous store at {self.host}:{self.port} ($MASTER_ADDR:$MASTER_PORT)"


def wait_listening(
    host: str, port: int, timeout_s: float, interrupted: Callable[[], None] | None = None
) -> None:
    """Waits until something accepts TCP connections at ``host:port``.

    TCPStore's own client backs off for up to a minute between tries when the server is not
    up yet; connecting here first, every 0.1 s, joins as soon as it is (and ``interrupted``,
    called between tries, may raise to give up early).

    Raises:
        UnavailableError: nothing listened within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"nothing listens at {host}:{port} after {timeout_s:g} s ({exc}): is the "
                    "rendezvous host (rank or node 0) running, and is the address right?"
                ) from None
        if interrupted is not None:
            interrupted()
        time.sleep(0.1)


def open_store(
    host: str,
    port: int,
    world_size: int,
    is_master: bool,
    timeout_s: float,
    interrupted: Callable[[], None] | None = None,
) -> Any:
    """A ``torch.distributed.TCPStore`` (imported here: only rendezvous needs torch); a client
    first waits for the server to listen (``wait_listening``).

    Raises:
        ConfigError: torch is not installed.
        UnavailableError: no store answered at ``host:port`` within ``timeout_s``.
    """
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:  # pragma: no cover - torch is in every test environment
        raise ConfigError(
            f"rendezvous through {host}:{port} needs torch's TCPStore: install torch, or give "
            "the ring's addresses (addresses=..., TF_CONFIG's cluster.worker)"
        ) from exc
    if not is_master:
        wait_listening(host, port, timeout_s, interrupted)
    try:
        return TCPStore(
            host,
            port,
            world_size,
            is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=is_master,
        )
    except (RuntimeError, OSError) as exc:
        verb = "host" if is_master else "reach"
        raise UnavailableError(
            f"could not {verb} the rendezvous store at {host}:{port} within {timeout_s:g} s: {exc}"
        ) from None


def wait_keys(store: Any, keys: list[str], timeout_s: float, what: str) -> None:
    """Waits until every key is set, or raises naming the ones still missing.

    Raises:
        WaitTimeoutError: some key was not set within ``timeout_s``.
        UnavailableError: the store went away.
    """
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) or others
        try:
            missing = [k for k in keys if not store.check([k])]
        except Exception:
            raise UnavailableError(f"{what}: the rendezvous store went away ({exc})") from None
        if not missing:
            return
        raise WaitTimeoutError(
            f"{what}: still missing after {timeout_s:g} s: {', '.join(missing)}"
        ) from None


def local_host_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (where the other ranks can reach it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))  # UDP: sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def rendezvous_ring(
    settings: RendezvousSettings, security: ClientSecurity | None = None
) -> tuple[RingServer, list[str], Any]:
    """Starts this rank's ring server on port 0, publishes its address, reads the others'.

    Returns:
        The started server (hand it to the ``Ring``), every rank's address in rank order, and
        the store (keep it until the ring closes: rank 0 may be hosting it).

    Raises:
        WaitTimeoutError: some rank did not publish within the timeout (the message names it).
        UnavailableError: the store could not be reached or hosted.
        ConfigError: torch is missing, or the rank is out of range.
    """
    if not 0 <= settings.rank < settings.world_size:
        raise ConfigError(f"rank {settings.rank} is not in [0, {settings.world_size})")
    security = security or ClientSecurity()
    server = RingServer(f"{local_host_towards(settings.host)}:0", security=security.peer_server())
    try:
        store = open_store(
            settings.host,
            settings.port,
            settings.world_size,
            settings.rank == 0 and not settings.agent_store,
            settings.timeout_s,
        )
        prefix = f"{KEY_PREFIX}/{settings.attempt}"
        store.set(f"{prefix}/rank{settings.rank}", server.address)
        keys = [f"{prefix}/rank{r}" for r in range(settings.world_size)]
        wait_keys(
            store,
            keys,
            settings.timeout_s,
            f"rank {settings.rank} waiting for the ring's addresses at {settings.where}",
        )
        addresses = [bytes(store.get(k)).decode() for k in keys]
    except BaseException:
        server.stop(0)
        raise
    return server, addresses, store
