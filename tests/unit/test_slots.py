"""The slot allocator: pure bookkeeping, no I/O."""

import pytest

from kvfs.chunkserver.slots import GROW_BYTES, MAX_CLASS, MIN_CLASS, SlotAllocator, SlotRef, size_class
from kvfs.errors import ResourceExhausted

MiB = 1 << 20


class Disk:
    """Records grow calls instead of touching files."""

    def __init__(self, fail: bool = False, room: int = 1 << 30):
        self.calls: list[tuple[int, int, int]] = []  # (cls, file, slots after growing)
        self.fail = fail
        self.room = room

    def __call__(self, cls, file, slots, wanted):
        if self.fail:
            raise ResourceExhausted("disk full (test)")
        add = min(wanted, self.room)
        self.calls.append((cls, file, slots + add))
        return add


@pytest.mark.parametrize("length,cls", [(1, MIN_CLASS), (MIN_CLASS, MIN_CLASS), (MIN_CLASS + 1, 2 * MIN_CLASS),
                                        (MiB, MiB), (MiB + 1, 2 * MiB), (MAX_CLASS, MAX_CLASS)])
def test_size_class_is_smallest_power_of_two_slot(length, cls):
    assert size_class(length) == cls


@pytest.mark.parametrize("length", [0, -1, MAX_CLASS + 1])
def test_size_class_rejects_lengths_outside_limits(length):
    with pytest.raises(ValueError):
        size_class(length)


def test_allocation_grows_in_groups_and_reuses_freed_slots():
    alloc, disk = SlotAllocator(capacity=1 << 30), Disk()
    first = [alloc.allocate(MiB, disk) for _ in range(GROW_BYTES // MiB)]
    assert disk.calls == [(MiB, 0, GROW_BYTES // MiB)]  # one fallocate for the whole group
    assert [r.slot for r in first] == list(range(GROW_BYTES // MiB))
    assert len(set(first)) == len(first)
    alloc.free(first[3])
    assert alloc.allocate(MiB, disk) == first[3]  # lowest free slot is reused before growing
    alloc.allocate(MiB, disk)
    assert disk.calls[-1] == (MiB, 0, 2 * GROW_BYTES // MiB)
    assert alloc.used_slots[MiB] == GROW_BYTES // MiB + 1


def test_capacity_limits_growth_to_what_fits():
    alloc, disk = SlotAllocator(capacity=3 * MiB), Disk()
    refs = [alloc.allocate(MiB, disk) for _ in range(3)]
    assert disk.calls == [(MiB, 0, 3)]
    with pytest.raises(ResourceExhausted, match="capacity full"):
        alloc.allocate(MiB, disk)
    alloc.free(refs[0])
    assert alloc.allocate(MiB, disk) == refs[0]


def test_growth_takes_what_the_disk_can_give():
    alloc, disk = SlotAllocator(capacity=1 << 30), Disk(room=2)
    refs = [alloc.allocate(MiB, disk) for _ in range(3)]
    assert disk.calls == [(MiB, 0, 2), (MiB, 0, 4)]
    assert alloc.allocated_bytes == 4 * MiB and len(set(refs)) == 3


def test_failed_growth_leaves_state_unchanged():
    alloc, disk = SlotAllocator(capacity=1 << 30), Disk(fail=True)
    with pytest.raises(ResourceExhausted):
        alloc.allocate(MiB, disk)
    assert alloc.allocated_bytes == 0
    disk.fail = False
    assert alloc.allocate(MiB, disk) == SlotRef(MiB, 0, 0)


def test_recovery_marks_indexed_slots_used_and_frees_the_rest():
    alloc = SlotAllocator(capacity=1 << 30)
    alloc.add_file(MiB, 4)
    alloc.mark_used(SlotRef(MiB, 0, 0))
    alloc.mark_used(SlotRef(MiB, 0, 2))
    alloc.finish_startup()
    disk = Disk()
    got = {alloc.allocate(MiB, disk), alloc.allocate(MiB, disk)}
    assert got == {SlotRef(MiB, 0, 1), SlotRef(MiB, 0, 3)}
    assert disk.calls == []


@pytest.mark.parametrize("ref", [SlotRef(MiB, 0, 4), SlotRef(MiB, 1, 0), SlotRef(2 * MiB, 0, 0)])
def test_recovery_rejects_index_entries_outside_files(ref):
    alloc = SlotAllocator(capacity=1 << 30)
    alloc.add_file(MiB, 4)
    with pytest.raises(ValueError, match="beyond"):
        alloc.mark_used(ref)


def test_recovery_rejects_a_slot_named_twice():
    alloc = SlotAllocator(capacity=1 << 30)
    alloc.add_file(MiB, 4)
    alloc.mark_used(SlotRef(MiB, 0, 1))
    with pytest.raises(ValueError, match="twice"):
        alloc.mark_used(SlotRef(MiB, 0, 1))
