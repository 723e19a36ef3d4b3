"""All-reduce mode: workers average gradients over a ring of peer-to-peer gRPC streams.

``algorithm`` (reduce-scatter and all-gather over an abstract ``peer.Peer``), ``transport``
(the RingPeer gRPC service and its messages), ``ring`` (a process's ``Ring`` over that
transport), ``buckets`` (flat gradient buckets) and ``client`` (``AllReduceClient``).
"""

from psworker.ring.client import AllReduceClient
from psworker.ring.ring import Ring
from psworker.ring.transport import RingServer

__all__ = ["AllReduceClient", "Ring", "RingServer"]
