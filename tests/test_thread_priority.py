"""pipeline/thread_priority.py: a loader thread lowered below the training step's, its children
with it, the step's thread untouched, and lowering done once however often asked."""
from __future__ import annotations

import os
import threading

import pytest

from pipeline.thread_priority import LOADER_NICENESS, lower_this_thread


def niceness(thread_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread_id)


@pytest.mark.timeout(30)
def test_a_lowered_thread_and_those_it_makes_yield_to_the_others():
    main = niceness(threading.get_native_id())
    seen = {}

    def child():
        seen["child"] = niceness(threading.get_native_id())

    def loader():
        lower_this_thread()
        lower_this_thread()          # once only: not lowered twice
        seen["loader"] = niceness(threading.get_native_id())
        made = threading.Thread(target=child)
        made.start()
        made.join()

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    assert seen == {"loader": min(19, main + LOADER_NICENESS), "child": min(19, main + LOADER_NICENESS)}
    assert niceness(threading.get_native_id()) == main
