"""The blocks of a split streamed through memory, fetched by a process of their own
(`pipeline/remote/block_fetcher.py`) into memory shared with this one. Here: starting it, giving it each
epoch's plan and the loader's position, and the addresses of the blocks a batch reads.

The process is started (`FetchProcess`) as soon as the split is known to stream, before its first
plan sizes its memory: its interpreter and libraries load while the loader builds and plans, not
while the first batch waits.

A batch's blocks are found by their state in shared memory: no lock, no thread, no message.
A block the fetcher has not got is waited for while it is on its way; one it failed to fetch,
one larger than a slot, or one not in the plan (or all of them, should the fetcher die) is left to
the caller, which fetches it in this process.

A plan is a list of visits: each time a block is read, the batches reading it and the bytes they
read of it (`pipeline/remote/block_plan.py`). A block read at an epoch's start and again at its end is two
visits, fetched twice in parts and let go in between, rather than held all epoch.

The slots are sized from the first plan: the most visits any position holds, from their first
batch less the window to their last, with room to spare; a later plan that needs more gets a
shorter window. What the fetcher holds is bounded as `pipeline/remote/memory_blocks.py` bounds it.
"""
from __future__ import annotations

import mmap
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from pipeline.remote import block_fetcher
from pipeline.remote.block_fetcher import (ABSENT, BYTES, FETCHING, HEADER_WORDS, LOADER_WAITS, PEAK_BYTES, PEAK_IN_FLIGHT,
                                           POSITION, READY, REQUESTS, FetcherSettings)
from pipeline.remote.block_plan import Visits, most_held

FETCHER = Path(block_fetcher.__file__)
START_PATIENCE_S = 20       # for the fetcher to start (a cold interpreter on a busy node)
ISSUE_PATIENCE_S = 2        # for it to begin fetching a block of the plan it has not begun yet
OTHER_VISIT = -4            # a state seen here only: the block is held for other bytes than those read


class ControlSender:
    """The loader's messages to the fetch process, sent in order by a thread of their own. A
    socket holds about 200 KB, and a set-up message (a CA bundle alone is 220 KB) or a plan (MBs
    at ImageNet's size) is larger: sent by the loader, it would wait for the process to read it,
    which at the first plan is still loading its libraries while the first batch waits.
    `send` raises OSError once a send has failed: the process has ended."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: OSError | None = None
        self._thread = threading.Thread(target=self._send_in_turn, name="fetch-process-control", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        if self._failed is not None:
            raise self._failed
        self._queue.put(message)

    def _send_in_turn(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._connection.send(message)
            except OSError as error:
                self._failed = error
                return

    def close(self) -> None:
        """Sends what is queued (a process that ended refuses it at once), then closes the socket."""
        self._queue.put(None)
        self._thread.join()
        self._connection.close()


class FetchProcess:
    """The fetch process, started with its shared memory still empty: `SharedBlocks` sizes it and
    sets the process up once the first plan says how many slots it needs. One dropped without
    `close` is closed as it goes (a split that stayed on disk, a build that failed)."""

    def __init__(self):
        self.memory_fd = os.memfd_create("fastpipe-blocks", os.MFD_CLOEXEC)
        ours, theirs = socket.socketpair()
        connection = Connection(ours.detach())
        wake_read, self.wake = os.pipe()
        os.set_blocking(self.wake, False)
        fds = (theirs.fileno(), wake_read, self.memory_fd)
        try:
            # One BLAS thread: numpy's pool would spin up on the cores the loader is building with
            self.process = subprocess.Popen([sys.executable, "-P", str(FETCHER), *map(str, fds)], pass_fds=fds,
                                            stdin=subprocess.DEVNULL, close_fds=True,
                                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        except OSError:
            connection.close()
            os.close(self.wake)
            os.close(self.memory_fd)
            raise
        finally:      # the process's copies: ours would keep its end of each open
            theirs.close()
            os.close(wake_read)
        self.control = ControlSender(connection)
        self.started = time.monotonic()
        self._stop = weakref.finalize(self, _stop_process, os.getpid(), self.process, self.control, self.wake,
                                      self.memory_fd)

    def close(self) -> None:
        """Stops the process (told to, else killed after 5 s) and closes this end of everything shared."""
        self._stop()


def _stop_process(pid: int, process: subprocess.Popen, control: ControlSender, wake: int, memory_fd: int) -> None:
    if os.getpid() != pid:      # a forked child's copy: not its to close
        return
    try:
        control.send(("stop",))
    except OSError:       # it ended already
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    control.close()
    os.close(wake)
    os.close(memory_fd)


class SharedBlocks:
    def __init__(self, settings: FetcherSettings, process: FetchProcess | None = None):
        """Sets `process` (default: one started now) up to fetch the blocks `settings` describe."""
        self.fetch_process = process or FetchProcess()
        self.process = self.fetch_process.process
        self.slot_bytes, self.slots = settings.slot_bytes, settings.slots
        self.block_sizes = settings.block_end - settings.block_start
        self._pid = os.getpid()
        blocks = len(settings.block_start)
        spans_at, states_at, arena_at, total = block_fetcher.layout(blocks, self.slots, self.slot_bytes)
        os.ftruncate(self.fetch_process.memory_fd, total)
        self._memory = mmap.mmap(self.fetch_process.memory_fd, total)
        self.header = np.ndarray(HEADER_WORDS, np.int64, self._memory, 0)
        self.span = np.ndarray((blocks, 2), np.int64, self._memory, spans_at)
        self.state = np.ndarray(blocks, np.int32, self._memory, states_at)
        self.state[:] = ABSENT
        self._arena = np.ndarray(self.slots * self.slot_bytes, np.uint8, self._memory, arena_at)
        self.arena_address = self._arena.ctypes.data
        self.planned = np.zeros(blocks, bool)
        self._control, self._wake = self.fetch_process.control, self.fetch_process.wake
        self._control.send(("setup", asdict(settings)))
        self._started = self.fetch_process.started
        self._counted = (0, 0)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def plan(self, visits: Visits, window: int, position: int) -> set[int]:
        """The fetcher's plan from here on, the loader at `position`; the window shrinks where the
        slots would not hold it. Returns the blocks left out, those larger than a slot, for the
        caller to fetch."""
        fits = self.block_sizes[visits.blocks] <= self.slot_bytes
        left_out = set(visits.blocks[~fits].tolist())
        visits = visits.select(fits)
        while window > 1 and most_held(visits.first, visits.last, window) > self.slots:
            window //= 2
        if not self.alive:
            raise OSError("the fetch process has ended")
        self.planned[:] = False
        self.planned[visits.blocks] = True
        self.header[POSITION] = position
        self._control.send(("plan", *visits, window))
        return left_out

    def at(self, position: int) -> None:
        """The loader has handed out batch `position`: the fetcher may go on, and let go of the
        blocks only the batches up to it read."""
        self.header[POSITION] = position
        try:
            os.write(self._wake, b"\0")
        except BlockingIOError:       # the pipe is full of wake-ups the fetcher has yet to read
            pass
        except BrokenPipeError:       # it ended: the blocks are fetched here (`addresses` gives 0)
            pass

    def addresses(self, blocks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The address of each block's bytes, of which the caller reads those from `starts` to
        `ends` (offsets in its shard), waiting for those on their way; 0 where the caller is to
        fetch the block itself."""
        states = self._states(blocks, starts, ends)
        if (states < 0).any():
            states = self._wait(blocks, states, starts, ends)
        return np.where(states >= 0, self.arena_address + states.astype(np.int64) * self.slot_bytes, 0).astype(np.uint64)

    def has(self, blocks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> bool:
        """Whether the fetcher holds the blocks' bytes read (offsets in their shards), or is fetching them."""
        states = self._states(blocks, starts, ends)
        return bool(((states >= 0) | (states == FETCHING)).all())

    def _states(self, blocks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The blocks' states, OTHER_VISIT where a block is held for bytes other than those read
        (its earlier visit, which the fetcher has yet to let go). The states are read again after
        the spans, so that a slot let go and taken again in between is not believed."""
        while True:
            states = self.state[blocks]
            spans = self.span[blocks]
            if np.array_equal(states, self.state[blocks]):
                break
        covered = (spans[:, 0] <= starts) & (ends <= spans[:, 1])
        return np.where((states >= 0) & ~covered, OTHER_VISIT, states)

    def view(self, block: int) -> memoryview | None:
        """The block's bytes where the fetcher has them, else None: of them, those of the visit it
        is held for, which a batch of that visit reads."""
        state = int(self.state[block])
        if state < 0:
            return None
        return memoryview(self._arena)[state * self.slot_bytes:state * self.slot_bytes + int(self.block_sizes[block])]

    def _wait(self, blocks: np.ndarray, states: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        waited_from, pause, checked = time.monotonic(), 0.0002, time.monotonic()
        counted = False
        while True:
            now = time.monotonic()
            ready = self.header[READY] or now - self._started > START_PATIENCE_S
            issue_patience = ISSUE_PATIENCE_S if ready else START_PATIENCE_S
            pending = (states == FETCHING) | (((states == ABSENT) | (states == OTHER_VISIT)) & self.planned[blocks] &
                                              (now - waited_from < issue_patience))
            if not pending.any():
                return states
            if now - checked > 0.1:
                checked = now
                if not self.alive:
                    return np.minimum(states, ABSENT)
            if not counted:     # the fetcher allows more requests in flight only while this grows
                self.header[LOADER_WAITS] += 1
                counted = True
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
            states = self._states(blocks, starts, ends)

    def counted(self) -> tuple[int, int]:
        """(requests, bytes) the fetcher made since the last call."""
        now = int(self.header[REQUESTS]), int(self.header[BYTES])
        delta = now[0] - self._counted[0], now[1] - self._counted[1]
        self._counted = now
        return delta

    @property
    def bytes_held(self) -> int:
        return int(self.header[block_fetcher.HELD_BYTES])

    @property
    def peak_bytes(self) -> int:
        return int(self.header[PEAK_BYTES])

    @property
    def requests_made(self) -> int:
        """All the fetcher's requests so far (`counted` gives those since its last call)."""
        return int(self.header[REQUESTS])

    @property
    def direct_requests(self) -> int:
        """Of `requests_made`, those read directly (`direct_ranges.py`), not through obstore."""
        return int(self.header[block_fetcher.DIRECT_REQUESTS])

    @property
    def peak_in_flight(self) -> int:
        """The most requests the fetcher has had in flight at once."""
        return int(self.header[PEAK_IN_FLIGHT])

    def held_blocks(self) -> set[int]:
        return set(np.flatnonzero(self.state >= 0).tolist())

    def close(self) -> None:
        if os.getpid() != self._pid or self._memory is None:      # a forked child's copy: not its to close
            return
        self.fetch_process.close()
        self.header = self.state = self._arena = None
        try:
            self._memory.close()
        except BufferError:      # a view of a block is still held somewhere: the mapping goes with it
            pass
        self._memory = None
