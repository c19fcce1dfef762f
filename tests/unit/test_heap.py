"""common/heap.py: what is alive at the call leaves the collector's reach; what comes after
stays collectable."""
import gc
import weakref

from common.heap import freeze_startup_heap


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected():
    before = gc.get_freeze_count()
    startup = Node()
    frozen = weakref.ref(startup)
    try:
        assert freeze_startup_heap() > before
        del startup
        gc.collect()
        assert frozen() is not None  # out of the collector's walk: not even looked at
        later = Node()
        collectable = weakref.ref(later)
        del later
        gc.collect()
        assert collectable() is None  # a cycle made after the freeze is collected as before
    finally:
        gc.unfreeze()  # the rest of the suite runs with its usual collector
