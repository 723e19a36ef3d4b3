"""The job description's wire form: ``JobSpec`` and its ``VariableSpec``s (tables' with their
``TableSpec``), to and from ``pscore.job.Job``."""

from __future__ import annotations

from pscore.checks import tensor_nbytes
from pscore.job import Job, VarSpec
from pscore.optspec import optimizer_from_spec
from pscore.tables import TableSlice
from pswire.proto import ps_pb2


def job_from_proto(spec: ps_pb2.JobSpec) -> Job:
    """Builds a Job from the wire, validating dtypes and dims.

    Raises:
        InvalidRequestError: bad optimizer, dtype or dims.
    """
    variables = []
    for v in spec.variables:
        # The same dtype and dims checks as a tensor on the wire: a job must not declare a
        # variable that no tensor could ever match (negative or absurd dims).
        tensor_nbytes(v.name, v.dtype, v.shape)
        table = table_from_proto(v) if v.HasField("table") else None
        shape = tuple(int(d) for d in v.shape)
        variables.append(VarSpec(v.name, shape, v.dtype, v.average, table, int(v.group)))
    return Job(
        mode=spec.mode,
        staleness=int(spec.staleness),
        num_workers=int(spec.num_workers),
        optimizer=optimizer_from_spec(spec.optimizer.name, dict(spec.optimizer.params)),
        variables=tuple(variables),
        model_digest=spec.model_digest,
        quorum=int(spec.quorum),
        job_id=spec.job_id,
        groups=tuple(optimizer_from_spec(g.name, dict(g.params)) for g in spec.groups),
        min_workers=int(spec.min_workers),
        max_workers=int(spec.max_workers),
        shard=int(spec.shard),
        num_shards=int(spec.num_shards),
    )


def job_to_proto(job: Job) -> ps_pb2.JobSpec:
    """The JobSpec message of ``job`` (what a worker sends at init, what Status reports)."""
    return ps_pb2.JobSpec(
        mode=job.mode,
        staleness=job.staleness,
        num_workers=job.num_workers,
        optimizer=ps_pb2.OptimizerSpec(name=job.optimizer.name, params=job.optimizer.params()),
        variables=[variable_to_proto(v) for v in job.variables],
        model_digest=job.model_digest,
        quorum=job.quorum,
        job_id=job.job_id,
        groups=[ps_pb2.OptimizerSpec(name=g.name, params=g.params()) for g in job.groups],
        min_workers=job.min_workers,
        max_workers=job.max_workers,
        shard=job.shard,
        num_shards=job.num_shards,
    )


def variable_to_proto(v: VarSpec) -> ps_pb2.VariableSpec:
    if v.table is not None:
        spec = table_to_proto(v.table)
        spec.group = v.group
        return spec
    return ps_pb2.VariableSpec(
        name=v.key, dtype=v.dtype, shape=v.shape, average=v.average, group=v.group
    )


def table_to_proto(t: TableSlice) -> ps_pb2.VariableSpec:
    """The wire form of one shard's slice of a table (a VariableSpec with its TableSpec)."""
    spec = ps_pb2.VariableSpec(name=t.key, dtype=t.dtype, shape=(t.local_rows, t.dim))
    spec.table.CopyFrom(
        ps_pb2.TableSpec(
            num_rows=t.num_rows,
            row_start=t.row_start,
            row_end=t.row_end,
            capacity=t.capacity,
            init=t.init,
            init_scale=t.init_scale,
            seed=t.seed,
            init_from=t.init_from,
        )
    )
    return spec


def table_from_proto(v: ps_pb2.VariableSpec) -> TableSlice:
    """A table slice from its wire form (validated later, by ``TableSlice.check``)."""
    t = v.table
    dim = int(v.shape[1]) if len(v.shape) == 2 else 0
    return TableSlice(
        v.name, dim, v.dtype, int(t.num_rows), int(t.row_start), int(t.row_end),
        int(t.capacity), t.init, float(t.init_scale), int(t.seed), t.init_from,
    )  # fmt: skip
