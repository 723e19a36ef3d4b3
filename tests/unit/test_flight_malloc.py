"""Flight's message buffers stay in glibc's heap for reuse (``flightwire.tune_malloc``): a
block of a few MiB is no longer mapped and unmapped alone, unless the process chose its own
malloc settings or switched the tuning off."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from pswire import flightwire as fw

# In a child process, so that this one's malloc is left as it is: whether a 6 MiB block
# (between glibc's default threshold, 128 KiB, and ours, 8 MiB) is mapped on its own.
PROBE = textwrap.dedent(
    """
    import ctypes
    from pswire import flightwire as fw

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    tuned = fw.tune_malloc()
    again = fw.tune_malloc()
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(6 << 20)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(ctypes.c_void_p(block))
    print(tuned, again, mapped >= 6 << 20)
    """
)


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def probe(**env: str) -> list[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PS_TUNE_MALLOC", "GLIBC_TUNABLES")
        and k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_few_mib_come_from_the_heap_once_tuned() -> None:
    assert probe() == ["True", "True", "False"]  # tuned (once): not mapped alone
    assert probe(PS_TUNE_MALLOC="0") == ["False", "False", "True"]  # glibc's default
    # The user's own choice wins, whichever way they made it.
    assert probe(MALLOC_MMAP_THRESHOLD_="131072")[0] == "False"
    assert probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")[0] == "False"


@pytest.mark.parametrize(
    ("env", "ours"),
    [
        ({}, True),
        ({"PS_TUNE_MALLOC": "1"}, True),
        ({"PS_TUNE_MALLOC": "0"}, False),
        ({"PS_TUNE_MALLOC": " Off "}, False),
        ({"PS_TUNE_MALLOC": "false"}, False),
        ({"MALLOC_TRIM_THRESHOLD_": "1"}, False),
        ({"MALLOC_MMAP_THRESHOLD_": "1"}, False),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}, False),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True),
    ],
)
def test_who_decides_the_malloc_settings(env: dict[str, str], ours: bool) -> None:
    assert fw._malloc_ours(env) is ours


def test_the_thresholds_cover_a_message_and_keep_a_few() -> None:
    # A batch and its header come from the heap; a model's arrays above are mapped alone.
    assert fw.MALLOC_MMAP_BYTES > fw.PIECE_BYTES
    assert fw.MALLOC_TRIM_BYTES >= 8 * fw.PIECE_BYTES
