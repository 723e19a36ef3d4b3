"""Unit tests for the benchmark suite's targets table (bench/report.py) and row-create probe."""

from __future__ import annotations

from bench.report import TARGET_COLUMNS, TARGETS, Ratio, Table, target_rows
from bench.sparse import Config, row_create_us


def table(*ratios: Ratio) -> Table:
    return Table(name="t", title="t", columns=[], rows=[], ratios=list(ratios))


def test_every_target_gets_one_row_measured_or_not() -> None:
    tables = [
        table(
            Ratio(
                "steps",
                "1M params, 1 shard",
                "ours",
                "torch",
                0.9,
                target="1M 1 shard vs torch TCP",
            ),
            Ratio("steps", "25M params, 2 shards", "ours", "tcp", 0.4, target="25M vs raw TCP"),
        ),
        # A suite that names no target is matched by (comparison, ours, peer).
        table(
            Ratio("allreduce", "4 workers, 64 MiB", "sdk push", "gloo", 1.4),
            Ratio("allreduce", "4 workers, 64 MiB", "sdk push", "bare ring", 1.2),
            Ratio("allreduce", "4 workers, 64 MiB", "ring", "gloo", 1.0),  # no target's row
        ),
    ]
    rows = {r[0]: dict(zip(TARGET_COLUMNS, r, strict=True)) for r in target_rows(tables)}
    assert list(rows) == [t.name for t in TARGETS]
    assert rows["1M 1 shard vs torch TCP"]["result"] == "met"  # 0.9 >= 0.75
    assert rows["25M vs raw TCP"]["result"] == "MISSED"  # 0.4 < 0.5
    assert rows["ring 64 MiB, 4 workers vs gloo"]["result"] == "met"  # 1.4 <= 1.5
    assert rows["ring 64 MiB, 4 workers vs gloo"]["measured"] == 1.4
    assert rows["ring through the SDK vs the bare ring, 4 workers"]["result"] == "MISSED"
    assert rows["ring through the SDK vs the bare ring, 2 workers"]["result"] == "not measured"
    assert rows["apply Adam vs torch.optim"]["result"] == "not measured"
    assert rows["apply Adam vs torch.optim"]["measured"] is None


def test_row_create_probe_measures_fresh_rows() -> None:
    median_us, per_round = row_create_us(Config(10_000, 8, 256, rounds=1, reps=1), rounds=3)
    assert len(per_round) == 3
    assert median_us == sorted(per_round)[1]
