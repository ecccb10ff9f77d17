"""BufferBudget, the data port's bound on the buffers requests hold (reads in direct
mode, writes while their bytes arrive): a host holds at most a quarter, the rest
stays for others, a request alone always proceeds, and a release wakes a waiter."""

import threading
import time

from kvfs.chunkserver.dataport import BufferBudget

MiB = 1 << 20


def test_one_host_holds_a_quarter_and_others_get_the_rest():
    budget = BufferBudget(4 * MiB)
    assert budget.acquire("10.0.0.2", MiB, time.monotonic() + 5)
    # its share is taken: a second request of that host waits out its deadline and is refused
    assert not budget.acquire("10.0.0.2", 1, time.monotonic() + 0.05)
    for host in ("10.0.0.3", "10.0.0.4", "10.0.0.5"):  # other hosts fill the rest
        assert budget.acquire(host, MiB, time.monotonic() + 5)
    assert not budget.acquire("10.0.0.6", 1, time.monotonic() + 0.05)  # nothing left
    assert (budget.used, budget.by_peer["10.0.0.2"]) == (4 * MiB, MiB)
    for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"):
        budget.release(host, MiB)
    assert (budget.used, budget.by_peer) == (0, {})


def test_a_request_alone_proceeds_whatever_its_size():
    budget = BufferBudget(4 * MiB)
    assert budget.acquire("10.0.0.2", 64 * MiB, time.monotonic() + 1)  # nothing else held
    assert not budget.acquire("10.0.0.3", 1, time.monotonic() + 0.05)
    budget.release("10.0.0.2", 64 * MiB)
    assert budget.acquire("10.0.0.3", 1, time.monotonic() + 1)


def test_a_release_wakes_a_waiting_request():
    budget = BufferBudget(4 * MiB)
    assert budget.acquire("10.0.0.2", MiB, time.monotonic() + 1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire("10.0.0.2", MiB, time.monotonic() + 30)))
    waiter.start()
    budget.release("10.0.0.2", MiB)
    waiter.join(30)
    assert got == [True] and budget.by_peer == {"10.0.0.2": MiB}
