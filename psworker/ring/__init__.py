"""All-reduce mode: workers average gradients over a ring of peer-to-peer Arrow Flight streams.

``algorithm`` (reduce-scatter and all-gather over an abstract ``peer.Peer``),
``flight_transport`` (each rank's Flight ring port and its stream to the right neighbour),
``ring`` (a process's ``Ring`` over that transport), ``buckets`` (flat gradient buckets) and
``client`` (``AllReduceClient``).
"""

from psworker.ring.client import AllReduceClient
from psworker.ring.flight_transport import RingServer
from psworker.ring.ring import Ring

__all__ = ["AllReduceClient", "Ring", "RingServer"]
