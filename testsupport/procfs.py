"""A process's memory figures and CPU time, read from ``/proc`` (Linux only): the benchmarks
measure servers with them, and the tests that bound a server's memory read them too.

- ``proc_status(pid)``: the memory lines of ``/proc/<pid>/status`` in KiB;
- ``proc_cpu_seconds(pid)``: user + system CPU time so far, in seconds (to the clock tick, 10 ms);
- ``proc_run_seconds(pid)``: the live threads' CPU time so far, in seconds to the nanosecond.
"""

from __future__ import annotations

import os


def proc_status(pid: int) -> dict[str, int]:
    """Memory lines of ``/proc/<pid>/status``, in KiB (VmRSS, VmHWM, RssAnon, RssShmem...)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.startswith(("Vm", "Rss")):
                out[name] = int(rest.split()[0])
    return out


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_run_seconds(pid: int) -> float:
    """CPU time of process ``pid``'s live threads so far, to the nanosecond (the scheduler's
    own count, ``/proc/<pid>/task/*/schedstat``): for spans of milliseconds, where
    ``proc_cpu_seconds``' clock ticks (10 ms) say nothing. Threads that have ended are not
    counted."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9
