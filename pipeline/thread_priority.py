"""A GPU loader's threads yield the CPU to the training step's.

On a GPU node the step's threads (the main one, and autograd's for the backward pass) launch
the device's work: while a decode or fetch thread holds the core one of them wants, every kernel
behind it waits and the GPU idles. So a loader feeding a GPU runs its threads at a lower CPU
priority (a higher nice value; Linux keeps one per thread): the step's threads are scheduled
first, and the loader takes whatever the cores have left, which is most of them. Threads a
lowered thread makes (the decode engine's, made for each batch) inherit its priority.
Training on the CPU leaves them be: there the step's work runs in torch's own thread pool,
and the two are meant to share the cores.
"""
from __future__ import annotations

import os
import threading

LOADER_NICENESS = 10        # above the process's own: CFS then gives a step's thread ~9x a loader's share of a core
_lowered = threading.local()


def lower_this_thread(by: int = LOADER_NICENESS) -> None:
    """This thread's niceness raised `by` (at most 19), once; where threads have no priority
    of their own (not Linux) or the system refuses, nothing changes."""
    if getattr(_lowered, "done", False):
        return
    _lowered.done = True
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except (AttributeError, OSError):
        pass
