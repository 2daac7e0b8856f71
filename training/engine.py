"""The engine: runs the algorithms that match an event, in one documented, deterministic order.

Order: algorithms run in the order they were given (the recipe's order), except on events
that close a span (`Event.closes`: AFTER_LOSS, AFTER_BACKWARD, BATCH_END, EPOCH_END,
EVAL_END, FIT_END), where they run in reverse. With no algorithms, `fire` returns at once:
the loop pays one method call per event and nothing else.
"""
from __future__ import annotations

from typing import Sequence

from algorithms.base import Algorithm, Event


class Engine:
    def __init__(self, algorithms: Sequence[Algorithm] = ()):
        self.algorithms = list(algorithms)
        self._reversed = self.algorithms[::-1]

    def fire(self, event: Event, state) -> None:
        if not self.algorithms:
            return
        for algorithm in (self._reversed if event.closes else self.algorithms):
            if algorithm.match(event, state):
                algorithm.apply(event, state)

    def state_dict(self) -> dict:
        """Each algorithm's state under `<position>:<class name>`, so two of one kind stay apart."""
        return {self._key(i, a): a.state_dict() for i, a in enumerate(self.algorithms)}

    def load_state_dict(self, state: dict) -> None:
        expected = {self._key(i, a) for i, a in enumerate(self.algorithms)}
        if set(state) != expected:
            raise ValueError(f"checkpoint has algorithms {sorted(state)}, this run has {sorted(expected)}")
        for i, algorithm in enumerate(self.algorithms):
            algorithm.load_state_dict(state[self._key(i, algorithm)])

    @staticmethod
    def _key(position: int, algorithm: Algorithm) -> str:
        return f"{position}:{type(algorithm).__name__}"
