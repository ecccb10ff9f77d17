"""Reads first on the CPU: threads that do write work run at a lower scheduling
priority than the ones that serve restores.

On a host whose cores restores and write-backs share (a chunkserver serving
both, an engine restoring one prompt while writing another back), the kernel's
scheduler decides who runs; a write-back's copies and sends then take cores a
restore is waiting for, however its queues are ordered. A niceness of 10 gives
a thread about a tenth of the CPU weight of one at 0 while both want it, and all
of it when nothing else does, so writes still run at full speed on an idle host.

Niceness ranks threads within one scheduling group (a cgroup: a systemd service,
a Kubernetes pod), so it orders a process's own threads and those of processes
beside it, not a pod against another. A thread a nicer one starts inherits its
niceness, and a nicer thread holding the GIL still keeps the others of its
process waiting for it: the threads lowered here do their heavy work in calls
that let go of the GIL (xxh3, pwrite, sendall, the commit's wait).

Linux sets the niceness of one thread with setpriority(PRIO_PROCESS, its tid);
raising it (lowering the priority) needs no privilege, and it cannot be taken
back without one, so only threads that do nothing but write work are lowered.
Elsewhere the call is refused and logged, and writes run at the caller's
priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

MAX_NICE = 19
WRITE_NICE = 10  # the default for write threads, the SDK's and the chunkservers'
COMPACTION_NICE = 10  # the default for the metaserver's RocksDB compaction threads
_refused_logged = False


def thread_nice(tid: int | None = None) -> int:
    """The niceness of a thread of this process (the calling one by default)."""
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())


def lower_thread_priority(by: int) -> bool:
    """Raises the calling thread's niceness by `by` (capped at 19), for this thread
    only; True if it now runs at that lower priority. `by` <= 0 changes nothing."""
    if by <= 0:
        return False
    if not sys.platform.startswith("linux"):  # elsewhere PRIO_PROCESS would lower the whole process
        return _refused(f"per-thread niceness is Linux's ({sys.platform} here)")
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, thread_nice(tid) + by))
    except OSError as err:
        return _refused(f"setpriority refused ({err.strerror})")
    return True


def lower_threads_named(prefix: str, by: int) -> int:
    """Sets every thread of this process whose name (its /proc comm, as a native
    library names its own threads: RocksDB's compaction pool is "rocksdb:low")
    begins with `prefix` to the process's niceness plus `by` (capped at 19); returns
    how many now run there. Idempotent: a thread already that nice is counted, not
    lowered again. `by` <= 0 changes nothing."""
    if by <= 0:
        return 0
    if not sys.platform.startswith("linux"):
        _refused(f"per-thread niceness is Linux's ({sys.platform} here)")
        return 0
    target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + by)
    lowered = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith(prefix):
                    continue
            if thread_nice(int(tid)) < target:
                os.setpriority(os.PRIO_PROCESS, int(tid), target)
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        except OSError as err:
            _refused(f"setpriority refused ({err.strerror})")
            continue
        lowered += 1
    return lowered


def _refused(why: str) -> bool:
    """Logs, once per process, why write threads keep their priority; False."""
    global _refused_logged
    if not _refused_logged:
        _refused_logged = True
        log.warning("write threads keep their priority: %s", why)
    return False
