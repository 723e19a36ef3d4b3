"""``status``: each shard's Status, for a worker or an operator's tool."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.rpc_errors import from_rpc_error
from pswire.security import ClientSecurity


def status(
    addresses: Sequence[str], timeout: float = 10.0, security: ClientSecurity | None = None
) -> list[ps_pb2.StatusResponse]:
    """Status of each shard at ``addresses``.

    ``security`` defaults to the ``$PS_TLS_*`` / ``$PS_TOKEN`` settings, as ``connect`` does.

    Raises:
        PSError: a shard did not answer within ``timeout``.
        ValueError: bad TLS or token settings.
    """
    security = security or ClientSecurity.from_env()
    out = []
    for i, address in enumerate(addresses):
        with security.channel(address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            try:
                out.append(stub.Status(ps_pb2.StatusRequest(), timeout=timeout))
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, f"Status on shard {i} ({address})") from None
    return out
