"""Prometheus metrics of one shard: RPC traffic and latency, and its state read at scrape time."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pscore.tables import RowSparse
from psserver.handlers import rewrapped
from psserver.shard import Shard

# Latencies from a cached unary call (~0.2 ms) to a sync barrier held by a slow worker (minutes).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
)  # fmt: skip
# Variable groups become label values: a model with thousands of top-level names must not
# become thousands of time series, so groups past this many are counted as OTHER_GROUP.
MAX_GROUPS = 64
OTHER_GROUP = "_other"
# "features.0.weight" -> "features", "emb/part0of2" -> "emb", "buffer:bn.running_mean" -> "bn".
_GROUP_SPLIT = re.compile(r"[./]")


def variable_group(key: str) -> str:
    """The first path component of a variable's name: its top-level module in torch terms."""
    name = key.rpartition(":")[2] or key
    return _GROUP_SPLIT.split(name, maxsplit=1)[0] or name


class ShardMetrics:
    """Every metric of one shard daemon, in its own registry.

    A per-shard ``CollectorRegistry`` (not prometheus_client's global one) lets several shards
    live in one process, as tests run them. Traffic is counted by the servicer and the
    interceptor as it happens; the shard's state (clocks, workers, checkpoints) is read from
    ``Shard.status()`` when Prometheus scrapes, so nothing is kept twice.
    """

    def __init__(self, shard: Shard, name: str = "") -> None:
        self.shard = shard
        # The ``shard`` label; start_server fills it with host:port before serving if empty.
        self.name = name
        self.registry = CollectorRegistry(auto_describe=True)
        self._groups: dict[str, str] = {}
        self._groups_lock = threading.Lock()
        r = self.registry
        self.rpc_seconds = Histogram(
            "psserver_rpc_duration_seconds",
            "Time from a call's arrival to its last response message, by method",
            ["shard", "rpc"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rpcs = Counter(
            "psserver_rpcs",
            "Calls finished, by method and gRPC status code",
            ["shard", "rpc", "code"],
            registry=r,
        )
        self.wait_seconds = Histogram(
            "psserver_barrier_wait_seconds",
            "Time a pull or push spent in the shard: waiting for the consistency rule (sync "
            "barrier, ssp gate, initial values) plus the in-memory copy or update",
            ["shard", "rpc"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pushes = Counter(
            "psserver_pushes",
            "Push requests carrying a variable of the group",
            ["shard", "group"],
            registry=r,
        )
        self.push_bytes = Counter(
            "psserver_push_bytes",
            "Gradient bytes received, by variable group",
            ["shard", "group"],
            registry=r,
        )
        self.pulls = Counter(
            "psserver_pulls",
            "Pull requests answered with a variable of the group",
            ["shard", "group"],
            registry=r,
        )
        self.pull_bytes = Counter(
            "psserver_pull_bytes",
            "Variable bytes sent, by variable group",
            ["shard", "group"],
            registry=r,
        )
        self.pipelined = Counter(
            "psserver_pipelined_replies",
            "Sync replies streamed while their round's pushes still arrived (overlap), by "
            "outcome: held (the predicted weights were the round's) or resent (they could not "
            "be shown to be: the worker sent the step again whole)",
            ["shard", "outcome"],
            registry=r,
        )
        r.register(_StatusCollector(self))
        # The daemon's memory and CPU (process_resident_memory_bytes, ...; Linux only): the
        # dashboard plots each shard's RSS beside the bytes it holds.
        ProcessCollector(registry=r)

    def group(self, key: str) -> str:
        """``variable_group(key)``, or OTHER_GROUP once MAX_GROUPS groups have been seen."""
        group = self._groups.get(key)
        if group is None:
            with self._groups_lock:
                group = variable_group(key)
                if group not in self._groups.values() and len(set(self._groups.values())) >= (
                    MAX_GROUPS
                ):
                    group = OTHER_GROUP
                self._groups[key] = group
        return group

    def pushed(self, grads: Mapping[str, np.ndarray | RowSparse]) -> None:
        """Counts one push request's gradients by variable group."""
        self._count(grads, self.pushes, self.push_bytes)

    def pulled(self, arrays: Mapping[str, np.ndarray | RowSparse]) -> None:
        """Counts one pull reply's variables by variable group."""
        self._count(arrays, self.pulls, self.pull_bytes)

    def _count(
        self, arrays: Mapping[str, np.ndarray | RowSparse], requests: Counter, nbytes: Counter
    ) -> None:
        by_group: dict[str, int] = {}
        for key, array in arrays.items():
            group = self.group(key)
            by_group[group] = by_group.get(group, 0) + int(array.nbytes)
        for group, size in by_group.items():
            requests.labels(self.name, group).inc()
            nbytes.labels(self.name, group).inc(size)

    def waited(self, call: str, seconds: float) -> None:
        """Records the time a pull or push spent in the shard (errors included: a timed-out
        barrier is the wait that most needs seeing)."""
        self.wait_seconds.labels(self.name, call).observe(seconds)

    def observe_rpc(self, rpc: str, code: grpc.StatusCode, seconds: float) -> None:
        self.rpc_seconds.labels(self.name, rpc).observe(seconds)
        self.rpcs.labels(self.name, rpc, code.name).inc()

    def serve(self, host: str, port: int) -> MetricsServer:
        """Serves ``/metrics`` over HTTP on ``host:port`` (0: a free port) in a daemon thread.

        Raises:
            OSError: the address cannot be bound.
        """
        httpd, thread = start_http_server(port, host, registry=self.registry)
        return MetricsServer(httpd, thread)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5.0)


class _StatusCollector(Collector):
    """Reads ``Shard.status()`` at scrape time: one lock hold per scrape, no shard changes."""

    def __init__(self, metrics: ShardMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        # Names only; without describe() registering would call collect() before any job.
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        st = self._metrics.shard.status()
        name = self._metrics.name
        f = families
        f["initialized"].add_metric([name], 1.0 if st.initialized else 0.0)
        f["info"].add_metric(
            [name, st.job.mode if st.job else "", self._metrics.shard.incarnation], 1.0
        )
        f["clock"].add_metric([name], st.clock)
        f["variables"].add_metric([name], len(st.job.variables) if st.job else 0)
        f["variable_bytes"].add_metric([name], st.total_bytes)
        f["workers"].add_metric([name], len(st.workers))
        f["live_workers"].add_metric([name], len(st.live))
        newest = max((steps for steps, _ in st.workers.values()), default=0)
        for worker, (steps, age) in sorted(st.workers.items()):
            labels = [name, str(worker)]
            f["worker_clock"].add_metric(labels, steps)
            f["worker_staleness"].add_metric(labels, newest - steps)
            f["worker_heartbeat_age"].add_metric(labels, age)
            f["worker_live"].add_metric(labels, 1.0 if worker in st.live else 0.0)
        live_steps = [st.workers[w][0] for w in st.live if w in st.workers]
        f["max_staleness"].add_metric(
            [name], max(live_steps) - min(live_steps) if live_steps else 0
        )
        for kind, count in sorted(st.membership_counts.items()):
            f["membership_changes"].add_metric([name, kind], count)
        f["joining_workers"].add_metric([name], len(st.pending))
        f["push_results"].add_metric([name, "applied"], st.pushes_applied)
        f["push_results"].add_metric([name, "duplicate"], st.pushes_duplicate)
        f["push_results"].add_metric([name, "late"], st.pushes_late)
        for table, (rows, nbytes, evictions, _capacity) in sorted(st.tables.items()):
            f["table_rows"].add_metric([name, table], rows)
            f["table_bytes"].add_metric([name, table], nbytes)
            f["table_evictions"].add_metric([name, table], evictions)
        f["checkpoint_step"].add_metric([name], st.checkpoint_step)
        if st.checkpoint_age_s >= 0:
            f["checkpoint_age"].add_metric([name], st.checkpoint_age_s)
        return list(families.values())

    @staticmethod
    def _families() -> dict[str, Any]:
        def gauge(metric: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(metric, doc, labels=["shard", *labels])

        worker = "worker"
        return {
            "initialized": gauge("psserver_initialized", "1 once the job's values are installed"),
            "info": gauge(
                "psserver_info",
                "Always 1; the job's mode and this run's incarnation as labels",
                "mode",
                "incarnation",
            ),
            "clock": gauge("psserver_clock", "Optimizer updates applied by this shard"),
            "variables": gauge("psserver_variables", "Variables (or slices) on this shard"),
            "variable_bytes": gauge("psserver_variable_bytes", "Bytes of variables held"),
            "table_rows": gauge("psserver_table_rows", "Rows an embedding table holds", "table"),
            "table_bytes": gauge(
                "psserver_table_bytes", "Bytes of a table's rows and optimizer state", "table"
            ),
            "table_evictions": CounterMetricFamily(
                "psserver_table_evictions",
                "Rows a dynamic table dropped at its capacity (least recently used)",
                labels=["shard", "table"],
            ),
            "workers": gauge("psserver_workers", "Workers this shard has heard from"),
            "live_workers": gauge(
                "psserver_live_workers", "Workers in the quorum (heard within the timeout)"
            ),
            "worker_clock": gauge("psserver_worker_clock", "Steps a worker finished", worker),
            "worker_staleness": gauge(
                "psserver_worker_staleness_steps",
                "Steps a worker is behind the most advanced worker (observed staleness)",
                worker,
            ),
            "worker_heartbeat_age": gauge(
                "psserver_worker_heartbeat_age_seconds", "Seconds since a worker was heard", worker
            ),
            "worker_live": gauge(
                "psserver_worker_live", "1 while a worker is in the quorum", worker
            ),
            "max_staleness": gauge(
                "psserver_max_staleness_steps", "Clock spread between the live workers"
            ),
            "membership_changes": CounterMetricFamily(
                "psserver_membership_changes",
                "Changes of the job's members: joined (elastic joins), rejoined (a dropped "
                "worker heard again), left (closed its client), dropped (silent past the "
                "heartbeat timeout), replaced (a new process took its id)",
                labels=["shard", "kind"],
            ),
            "joining_workers": gauge(
                "psserver_joining_workers", "Elastic joins prepared and not yet committed"
            ),
            "push_results": CounterMetricFamily(
                "psserver_push_results",
                "Pushes by outcome: applied, duplicate (a retry, acknowledged) or late (a "
                "gradient for a closed sync step, dropped)",
                labels=["shard", "result"],
            ),
            "checkpoint_step": gauge(
                "psserver_checkpoint_step", "Shard clock of the newest checkpoint; -1: none"
            ),
            "checkpoint_age": gauge(
                "psserver_checkpoint_age_seconds",
                "Seconds since the newest checkpoint was written (absent before the first)",
            ),
        }


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Times every call from arrival to its last response message and counts its status code.

    Installed outermost, so calls refused by the token check or rejected as malformed are
    counted too. A streamed reply is timed until the client has taken its last message.
    """

    def __init__(self, metrics: ShardMetrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        rpc = handler_call_details.method.rpartition("/")[2]
        return _timed(handler, rpc, self._metrics)


# Streams whose every request/reply pair is a step of its own, timed and counted as this call.
STEP_CALLS = {"PushPullStream": "PushPull"}


def _timed(handler: grpc.RpcMethodHandler, rpc: str, metrics: ShardMetrics) -> Any:
    def code_of(context: grpc.ServicerContext, failed: bool) -> grpc.StatusCode:
        code = context.code() if hasattr(context, "code") else None
        if isinstance(code, grpc.StatusCode):
            return code
        return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK

    def finish(context: grpc.ServicerContext, start: float, failed: bool) -> None:
        metrics.observe_rpc(rpc, code_of(context, failed), time.perf_counter() - start)

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            failed = True
            try:
                reply = behavior(request, context)
                failed = False
                return reply
            finally:
                finish(context, start, failed)

        return run

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            start = time.perf_counter()
            failed = True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                finish(context, start, failed)

        return run

    def steps(behavior: Callable[..., Any], step_rpc: str) -> Callable[..., Any]:
        """Times each request of a stream until its reply, as a call of ``step_rpc``."""

        def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            arrived: list[float] = []

            def timed_requests() -> Iterator[Any]:
                for request in requests:
                    arrived.append(time.perf_counter())
                    yield request

            try:
                for reply in behavior(timed_requests(), context):
                    took = time.perf_counter() - arrived.pop(0)
                    metrics.observe_rpc(step_rpc, grpc.StatusCode.OK, took)
                    yield reply
            except BaseException:
                if arrived:  # the step that failed
                    took = time.perf_counter() - arrived[0]
                    metrics.observe_rpc(step_rpc, code_of(context, True), took)
                raise

        return run

    def wrap(kind: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not kind.endswith("stream"):
            return unary(behavior)
        if kind == "stream_stream" and rpc in STEP_CALLS:
            behavior = steps(behavior, STEP_CALLS[rpc])
        return streaming(behavior)

    return rewrapped(handler, wrap)
