"""Progress of long work (training epochs, conversion, sample data) that reads well wherever it goes.

On a terminal: a tqdm bar, redrawn in place. Anywhere else (`make demo > log`, CI, a Slurm
output file): plain lines, one when the work starts, one every `PROGRESS_EVERY_S` seconds
(default 30) and one at the end, with the same figures and never a carriage return, so a log
file holds a few readable lines instead of thousands of redraws.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

DEFAULT_EVERY_S = 30.0

log = logging.getLogger(__name__)


def _every_s() -> float:
    text = os.environ.get("PROGRESS_EVERY_S", "")
    try:
        return max(0.0, float(text)) if text else DEFAULT_EVERY_S
    except ValueError:
        log.warning("warning: PROGRESS_EVERY_S=%r is not a number of seconds; using %g", text, DEFAULT_EVERY_S)
        return DEFAULT_EVERY_S


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or closed
        return False


class Progress:
    """`update(n)`, `set_postfix(**figures)` and `close()`, as a bar or as lines (see above).
    `closing_line=False` leaves the last line to the caller (the trainer prints its own per epoch)."""

    def __init__(self, total: int, desc: str, unit: str = "it", initial: int = 0, file: TextIO | None = None,
                 enabled: bool = True, closing_line: bool = True):
        self.file = file or sys.stderr
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.postfix: dict = {}
        self.closing_line, self.closed = closing_line, not enabled
        self.bar = None
        if enabled and is_terminal(self.file):
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.file,
                            dynamic_ncols=True, leave=closing_line, mininterval=0.5)
        elif enabled:
            self.every_s, self.start = _every_s(), time.perf_counter()
            self.last_line = self.start
            self._line()

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        elif not self.closed:
            self.n += n
            if n and time.perf_counter() - self.last_line >= self.every_s:
                self._line()

    def set_postfix(self, **figures) -> None:
        if self.bar is not None:
            self.bar.set_postfix(figures, refresh=False)
        else:
            self.postfix = figures

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.closed and self.closing_line:
            self._line()
        self.closed = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self) -> None:
        now = time.perf_counter()
        self.last_line, elapsed, done = now, now - self.start, self.n - self.initial
        rate = done / elapsed if elapsed > 0 and done else None
        parts = [f"{self.n:,}/{self.total:,} {self.unit}" + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")]
        if rate:
            parts.append(f"{rate:,.1f} {self.unit}/s")
        parts.append(f"{tqdm.format_interval(elapsed)} elapsed")
        if rate and self.n < self.total:
            parts.append(f"{tqdm.format_interval((self.total - self.n) / rate)} left")
        figures = ", ".join(f"{key} {value}" for key, value in self.postfix.items())
        print(f"{self.desc}: {', '.join(parts)}" + (f"; {figures}" if figures else ""), file=self.file, flush=True)
