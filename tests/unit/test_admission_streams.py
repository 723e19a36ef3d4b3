"""A worker's step streams on one shard: at the limit, a new one waits a moment for one of the
worker's others to end (a call the worker just closed ends on the shard a little later), and
is refused, naming the limit, when none does."""

from __future__ import annotations

import threading
import time

import pytest

from psserver.admission import STREAM_GRACE_S, Admission
from pswire.errors import TooLargeError


def test_a_stream_over_the_limit_gets_the_slot_one_ending_frees() -> None:
    admission = Admission(threads=32, streams_per_worker=2)
    first, second = admission.step_stream(0), admission.step_stream(0)
    first.__enter__()
    second.__enter__()
    threading.Timer(0.2, lambda: first.__exit__(None, None, None)).start()
    started = time.monotonic()
    with admission.step_stream(0):  # waits for the first to end
        assert time.monotonic() - started >= 0.15
        with admission.step_stream(1):  # another worker's own limit
            pass
    second.__exit__(None, None, None)


def test_a_stream_over_the_limit_is_refused_when_none_ends() -> None:
    admission = Admission(threads=32, streams_per_worker=1)
    with admission.step_stream(3):
        started = time.monotonic()
        with (
            pytest.raises(TooLargeError, match=r"worker 3 already holds 1 .*limit 1"),
            admission.step_stream(3),
        ):
            pass
        assert time.monotonic() - started >= STREAM_GRACE_S * 0.9
    with admission.step_stream(3):  # released: free again at once
        pass
