"""The fetch process of a split streamed through memory: it fetches the blocks an epoch's plan
reads, a window of batches ahead of the loader, into slots of memory it shares with the training
process, and lets a slot go once the loader is past the last batch that reads its block.
`pipeline/remote/shared_blocks.py` starts it and reads the slots.

Why a process of its own: a fetch costs little CPU, but in the training process each one is a
few turns of the GIL in a fetch thread, and the training step's thread waits for those turns.
Here the GIL is the fetcher's own; the training process only reads slot numbers from shared memory.

It imports the standard library, numpy, obstore and `pipeline/storage/direct_ranges.py` alone
(the `pipeline` package imports torch), and it is started before its work is known
(`shared_blocks.FetchProcess`), so that its interpreter and libraries load while the loader
builds and plans its first epoch:
`python -P block_fetcher.py CONTROL WAKE MEMORY`, three inherited file descriptors:
- CONTROL, a socket of pickled messages from the loader: ("setup", the fields of a
  `FetcherSettings`), then any number of
  ("plan", blocks, first use, last use, first byte, end byte, window) (its visits, in the order of
  their first use: `block_plan.Visits`), ("stop",) or end of file;
- WAKE, a pipe the loader writes a byte to when its position moves;
- MEMORY, a memfd, sized by the loader before the setup and laid out by `layout`: a header of
  int64 words (the loader's position, written by it; the counters, written here), the span of
  bytes of each block fetched last (first, end), the state of each block (ABSENT, FETCHING,
  FAILED, or the slot holding it) and the slots.

Positions and batch indices are counted on across epochs, so the next epoch's first blocks can
be fetched while this one ends. A block whose fetch failed is FAILED: the loader fetches it
itself, with the retries and the one-line error of `pipeline/storage/object_store.py`.

A visit fetches the bytes its batches read, into the block's slot at their place in the block, so
the loader finds a sample where it would in the whole block. A block is held for one visit at a
time: its next visit is fetched once the loader is past the last batch of the one before, and
this process has seen it pass (it may be late to: a busy node). The loader checks that a held
block's span covers the bytes a batch reads, and waits where it does not.

Each range is read straight into its slot by `direct_ranges.py` (threads of plain HTTP GETs, about
half obstore's CPU) where the store allows it, else by obstore; a range the direct read fails
is read again by obstore, as is every range once the direct reader is no longer `usable`.

Requests in flight: enough to keep up with the loader across the store's round trip (Little's
law: twice the bytes it reads a second times a request's time, in blocks), from the setup's
`least_in_flight` up to `most_in_flight`, raised only while the loader waits for blocks: where the
CPU is what holds fetching back, a request's time is long but more of them would not help. A
fixed 16 caps one loader at 16 blocks a round trip: about 150 MiB/s of 1 MiB blocks at 100 ms,
where a GPU rank reading ImageNet's 110 KB images at 3,000 a second needs over 300.
"""
from __future__ import annotations

import heapq
import importlib.util
import mmap
import os
import queue
import selectors
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Below the training process's threads, and with few runtime threads: a fetch has batches of slack
# (the window), a training step none.
NICENESS = 10
POSITION, REQUESTS, BYTES, HELD_BYTES, PEAK_BYTES, READY, PEAK_IN_FLIGHT, LOADER_WAITS, DIRECT_REQUESTS = range(9)
HEADER_WORDS = 9
ABSENT, FAILED, FETCHING = -1, -2, -3
PAGE = 4096
RATE_EVERY_S = 0.5      # how often the loader's rate and the round trip are measured again


@dataclass
class FetcherSettings:
    """What the fetch process is set up with; it crosses to the process as a dict of its fields
    (the process does not import the `pipeline` package, which imports torch)."""
    url: str                    # the store, as obstore opens it
    store_options: dict
    names: list[str]            # the shards' object names
    block_shard: np.ndarray     # per block: its shard, its first byte and one past its last
    block_start: np.ndarray
    block_end: np.ndarray
    slot_bytes: int             # a slot holds one block
    slots: int
    least_in_flight: int        # requests in flight at least, and at most (Little's law between)
    most_in_flight: int


def layout(blocks: int, slots: int, slot_bytes: int) -> tuple[int, int, int, int]:
    """(offset of the blocks' spans, of their states, of the slots, total bytes) of the shared memory."""
    spans = HEADER_WORDS * 8
    states = spans + 16 * blocks
    arena = -(-(states + 4 * blocks) // PAGE) * PAGE
    return spans, states, arena, arena + slots * slot_bytes


class Fetcher:
    """The plan and the slots, kept by whichever thread holds `lock`: the main thread, at the loader's
    messages and wake-ups, and the fetch threads, each at the end of its request, which then issues
    the next. A thread a request in flight, each waiting on its own connection at no CPU; handing a
    request to one costs a queue's put and get, where an asyncio task awaiting an executor cost
    about seven times the CPU (a future, a callback and a wake-up of the loop each way)."""

    def __init__(self, control, wake: int, memory_fd: int, settings: FetcherSettings):
        import obstore.store
        from direct_ranges import direct_ranges     # loaded by `main`, by its path
        self.control, self.wake = control, wake
        self.store = obstore.store.from_url(settings.url, **settings.store_options)
        self.names = settings.names
        self.direct = direct_ranges(self.store, settings.url, settings.store_options)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()     # (block, shard, start, end, into, issued)
        self.threads = 0
        self.block_shard, self.block_start, self.block_end = settings.block_shard, settings.block_start, settings.block_end
        self.slot_bytes = settings.slot_bytes
        self.least_in_flight, self.most_in_flight = settings.least_in_flight, settings.most_in_flight
        self.allowed_in_flight = self.least_in_flight
        self.seconds_per_request = 0.0           # a request's mean time over the last interval, issue to slot
        self.request_seconds, self.requests_timed = 0.0, 0
        self.rate_mark = (0.0, 0, 0)             # (time, bytes let go by then, the loader's waits by then)
        self.let_go_bytes = 0
        blocks, slots = len(self.block_start), settings.slots
        spans_at, states_at, arena_at, total = layout(blocks, slots, self.slot_bytes)
        self.memory = mmap.mmap(memory_fd, total)
        self.header = np.ndarray(HEADER_WORDS, np.int64, self.memory, 0)
        self.span = np.ndarray((blocks, 2), np.int64, self.memory, spans_at)
        self.state = np.ndarray(blocks, np.int32, self.memory, states_at)
        self.arena = memoryview(self.memory)[arena_at:]
        self.free = list(range(slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}            # blocks held or being fetched
        self.visits, self.next, self.window = (np.empty(0, np.int64),) * 5, 0, 0
        self.held: dict[int, tuple[int, int]] = {}   # per block held or being fetched, the bytes of its visit
        self.until: dict[int, int] = {}              # ... and the last batch of that visit
        self.let_go_at: list[tuple[int, int]] = []    # (last use, block): a heap, with stale entries
        self.in_flight = 0
        # Slot bytes are written before the block's state names the slot; taking and leaving the lock
        # orders the two for a reader in another process (a store barrier where CPUs reorder)
        self.lock = threading.Lock()

    def run(self) -> None:
        """Serves the loader's messages until it says stop or is gone, then exits the process."""
        selector = selectors.DefaultSelector()
        selector.register(self.control.fileno(), selectors.EVENT_READ, self._on_control)
        selector.register(self.wake, selectors.EVENT_READ, self._on_wake)
        self.header[READY] = 1
        while True:
            for key, _ in selector.select():
                key.data()

    def _on_control(self) -> None:
        try:
            message = self.control.recv()
        except (EOFError, OSError):     # the loader is gone
            message = ("stop",)
        if message[0] == "stop":
            # Requests in flight are of no use now; the fetch threads end with the process
            os._exit(0)
        with self.lock:
            self._plan(*message[1:])
            self._pump()

    def _on_wake(self) -> None:
        try:
            os.read(self.wake, 4096)
        except BlockingIOError:
            pass
        with self.lock:
            self._pump()

    def _plan(self, blocks: np.ndarray, first: np.ndarray, last: np.ndarray, start: np.ndarray, end: np.ndarray,
              window: int) -> None:
        """A new plan replaces the last. A block held is kept for the plan's first visit of it where
        that visit comes within the window and reads only bytes held; the others are let go at the
        next pump (once fetched, where they are on their way)."""
        self.visits, self.next, self.window = (blocks, first, last, start, end), 0, window
        position = int(self.header[POSITION])
        read, first_visit = np.unique(blocks, return_index=True)     # the first of a block's visits
        first_visit = dict(zip(read.tolist(), first_visit.tolist()))
        for block, (held_start, held_end) in self.held.items():
            visit = first_visit.get(block)
            kept = (visit is not None and first[visit] <= position + window
                    and held_start <= start[visit] and end[visit] <= held_end)
            self.until[block] = int(last[visit]) if kept else -1
        self.let_go_at = [(until, block) for block, until in self.until.items()]
        heapq.heapify(self.let_go_at)

    def _pump(self) -> None:
        """Lets go of the blocks the loader is past and issues the requests the plan allows; `lock` held."""
        position = int(self.header[POSITION])
        while self.let_go_at and self.let_go_at[0][0] <= position:
            _, block = heapq.heappop(self.let_go_at)
            if block in self.slot_of and self.state[block] != FETCHING and self.until[block] <= position:
                self._let_go(block)
        self._measure()
        blocks, first, last, start, end = self.visits
        while self.next < len(blocks) and first[self.next] <= position + self.window and self.free:
            # What the loader's next batch reads it waits for now: asked for beyond the allowance
            # (a first batch reads a block of every lane of the plan at once)
            urgent = first[self.next] <= position + 1
            if self.in_flight >= (self.most_in_flight if urgent else self.allowed_in_flight):
                break
            block, visit = int(blocks[self.next]), self.next
            if block in self.slot_of:
                held_start, held_end = self.held[block]
                if not (held_start <= start[visit] and end[visit] <= held_end):
                    break       # held for its visit before: this one is fetched once that is let go
                self.next += 1
                self.until[block] = max(self.until[block], int(last[visit]))
                heapq.heappush(self.let_go_at, (self.until[block], block))
                continue
            self.next += 1
            self.slot_of[block] = self.free.pop()
            self.held[block], self.until[block] = (int(start[visit]), int(end[visit])), int(last[visit])
            self.span[block] = self.held[block]      # before the state names a slot: the loader checks it
            self.state[block] = FETCHING
            heapq.heappush(self.let_go_at, (self.until[block], block))
            self._issue(block)

    def _issue(self, block: int) -> None:
        start, end = self.held[block]
        at = self.slot_of[block] * self.slot_bytes + start - int(self.block_start[block])
        self.in_flight += 1
        self.header[PEAK_IN_FLIGHT] = max(self.header[PEAK_IN_FLIGHT], self.in_flight)
        if self.threads < self.in_flight:       # as many threads as requests were ever in flight at once
            threading.Thread(target=self._fetching, name=f"ranges_{self.threads}", daemon=True).start()
            self.threads += 1
        self.requests.put((block, int(self.block_shard[block]), start, end, self.arena[at:at + end - start],
                           time.monotonic()))

    def _measure(self) -> None:
        """The requests allowed in flight: what the loader reads a second (the bytes let go), times
        a request's time, twice over, in blocks; more only if the loader waited since the last
        measure. Where fetching holds the loader back, what it reads is what the allowed requests
        bring, so the allowance doubles until the loader is ahead."""
        now = time.monotonic()
        since, let_go_then, waits_then = self.rate_mark
        if now - since < RATE_EVERY_S:
            return
        waits = int(self.header[LOADER_WAITS])
        self.rate_mark = (now, self.let_go_bytes, waits)
        if self.requests_timed:
            self.seconds_per_request = self.request_seconds / self.requests_timed
            self.request_seconds, self.requests_timed = 0.0, 0
        if not since or not self.seconds_per_request:
            return
        rate = (self.let_go_bytes - let_go_then) / (now - since)
        needed = int(np.ceil(2 * rate * self.seconds_per_request / self.slot_bytes))
        if waits == waits_then:
            needed = min(needed, self.allowed_in_flight)
        self.allowed_in_flight = min(self.most_in_flight, max(self.least_in_flight, needed))

    def _let_go(self, block: int) -> None:
        self.state[block] = ABSENT
        self.free.append(self.slot_of.pop(block))
        start, end = self.held.pop(block)
        del self.until[block]
        size = end - start
        self.header[HELD_BYTES] -= size
        self.let_go_bytes += size

    def _fetching(self) -> None:
        """A fetch thread: reads the requests given it into their slots, for the life of the process."""
        while True:
            block, shard, start, end, into, issued = self.requests.get()
            try:
                direct = self._read(shard, start, end, into)
            except Exception:       # noqa: BLE001 - the loader fetches it again and reports what happened
                direct = None
            with self.lock:
                self.in_flight -= 1
                if direct is None:
                    self.state[block] = FAILED
                    self.free.append(self.slot_of.pop(block))
                    del self.held[block], self.until[block]
                else:
                    self._fetched(block, end - start, direct, time.monotonic() - issued)
                self._pump()

    def _fetched(self, block: int, size: int, direct: bool, seconds: float) -> None:
        self.request_seconds += seconds
        self.requests_timed += 1
        self.header[REQUESTS] += 1
        self.header[BYTES] += size
        self.header[DIRECT_REQUESTS] += direct
        self.state[block] = self.slot_of[block]
        self.header[HELD_BYTES] += size
        self.header[PEAK_BYTES] = max(self.header[PEAK_BYTES], self.header[HELD_BYTES])
        if self.until[block] <= self.header[POSITION]:     # passed while it was fetched
            self._let_go(block)

    def _read(self, shard: int, start: int, end: int, into: memoryview) -> bool:
        """Bytes [start, end) of the shard into `into`: True where read directly, False by obstore."""
        if self.direct is not None and self.direct.usable:
            try:
                self.direct.read_into(self.names[shard], start, end, into)
                return True
            except OSError:
                pass
        import obstore
        # get_range rather than get(options={"range": ..., "if_match": ...}), which would pin the
        # object's version: its async form took 22% more CPU than get_range's for 1 MiB ranges from nginx
        data = obstore.get_range(self.store, self.names[shard], start=start, end=end)
        if len(data) != end - start:
            raise ValueError("short response")
        into[:] = memoryview(data)
        return False


def _load_by_path(name: str, path: Path) -> None:
    """The module at `path`, imported as `name`: by its package's name it would import `pipeline`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection
    control, wake, memory_fd = Connection(int(argv[1])), int(argv[2]), int(argv[3])
    os.set_blocking(wake, False)
    os.nice(NICENESS)
    # Read by tokio when obstore first builds its runtime, below
    os.environ.setdefault("TOKIO_WORKER_THREADS", str(max(1, min(4, len(os.sched_getaffinity(0)) // 8))))
    import obstore.store  # noqa: F401 - loaded while the loader plans, not once it waits
    _load_by_path("direct_ranges", Path(__file__).resolve().parents[1] / "storage" / "direct_ranges.py")
    try:
        message = control.recv()
    except (EOFError, OSError):     # the loader never needed it (its split stayed on disk) or is gone
        return
    if message[0] != "setup":       # told to stop before it was needed
        return
    Fetcher(control, wake, memory_fd, FetcherSettings(**message[1])).run()


if __name__ == "__main__":
    main(sys.argv)
