"""A DiLoCo worker's own state: written whole or not at all, read back as written, and taken
only for this job, this worker and an outer step the shards can resume from."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pswire.errors import ConfigError  # noqa: E402
from psworker.diloco_resume import WorkerState  # noqa: E402


def state(outer_step: int = 3, job: str = "job-a", worker: int = 1) -> WorkerState:
    rng, cuda = WorkerState.generators()
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    inner.step()
    return WorkerState(
        job=job,
        worker=worker,
        outer_step=outer_step,
        inner_step=4 * outer_step + 1,
        done=1,
        model={n: p.detach() for n, p in model.named_parameters()},
        inner=inner.state_dict(),
        rng=rng,
        cuda_rng=cuda,
    )


def test_a_state_reads_back_as_written(tmp_path: Path) -> None:
    written = state()
    path = tmp_path / "w.pt"
    written.save(path)
    read = WorkerState.load(path)
    assert read is not None
    assert (read.job, read.worker, read.outer_step, read.inner_step, read.done) == (
        "job-a", 1, 3, 13, 1,
    )  # fmt: skip
    for name, value in written.model.items():
        assert torch.equal(read.model[name], value)
    assert torch.equal(read.inner["state"][0]["exp_avg"], written.inner["state"][0]["exp_avg"])
    assert torch.equal(read.rng, written.rng)
    assert not path.with_name("w.pt.partial").exists()


def test_no_file_is_no_state_and_a_garbled_one_is_named(tmp_path: Path) -> None:
    assert WorkerState.load(tmp_path / "none.pt") is None
    path = tmp_path / "bad.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"bad\.pt is not a DiLoCo worker state"):
        WorkerState.load(path)


def test_a_state_resumes_its_own_job_and_worker_at_the_shards_step_or_the_one_before() -> None:
    saved = state(outer_step=3)
    assert saved.check_resumable("job-a", 1, 3)
    assert saved.check_resumable("job-a", 1, 4)  # died after its push, before its write
    assert not saved.check_resumable("job-b", 1, 3)  # another job's: ignored
    with pytest.raises(ConfigError, match="holds worker 1's, not worker 2's"):
        saved.check_resumable("job-a", 2, 3)
    for shards_at in (2, 5):
        with pytest.raises(
            ConfigError, match=f"at outer step 3, but the shards hold outer step {shards_at}"
        ):
            saved.check_resumable("job-a", 1, shards_at)


def test_in_an_elastic_job_a_state_behind_the_step_joined_at_is_set_aside(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restarted worker of an elastic job joins afresh at the outer step the job is at: a
    state written before that (the job trained on without it) is set aside, named in a
    warning, and it starts from the job's weights; a state at that step resumes; one ahead
    of it is refused as in a job of fixed size."""
    saved = state(outer_step=3)
    assert saved.check_resumable("job-a", 1, 3, elastic=True)
    for joined_at in (4, 9):
        with caplog.at_level("WARNING"):
            assert not saved.check_resumable("job-a", 1, joined_at, elastic=True)
        assert f"at outer step {joined_at}; its DiLoCo state from outer step 3" in caplog.text
    with pytest.raises(ConfigError, match="at outer step 3, but the shards hold outer step 2"):
        saved.check_resumable("job-a", 1, 2, elastic=True)
