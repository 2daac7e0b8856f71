"""The train step on a CUDA stream of its own at the highest priority (`step_stream: high_priority`).

Why: on one GPU, a loader's own GPU work runs beside the step and takes SMs from it. On an
H100, resnet50_mild at 176 px ran at 72-86% of its model-alone rate beside DALI `mixed`
(nvJPEG's CUDA stages, the resize) while it waited for data only 2% of the time. The GPU's
block scheduler dispatches a higher-priority stream's pending blocks first, so the loader's
kernels fill the step's gaps instead of delaying it; a loader that runs well ahead of the
step (DALI there: 4x) can afford to wait. Whether it pays is measured, not assumed:
`tools/compare_settings.py` puts it beside the default in alternating rounds.

How a batch crosses streams: the loader makes it on the current stream; the step stream
waits for that stream first; afterwards the current stream waits for the step stream, so that
the loss read-out, evaluation, checkpoints and the next batch's copies come after this step
(and its reads of the batch). The batch's memory is also recorded as in use on the step
stream, so that the caching allocator does not hand it to work on a third stream while the
step still reads it. The waits are events on the GPU: the host does not block.

`default` changes nothing (no stream is made); on a CPU anything else is a config error.
"""
from __future__ import annotations

import contextlib

import torch

CHOICES = ("default", "high_priority")


class StepStream:
    def __init__(self, device: torch.device, choice: str = "default"):
        if choice not in CHOICES:
            raise ValueError(f"step_stream must be one of {', '.join(CHOICES)}, got {choice!r}")
        if choice != "default" and device.type != "cuda":
            raise ValueError(f"step_stream={choice} needs CUDA (streams are a GPU's); this run is on {device.type}")
        self.choice, self.device = choice, device
        self.stream = None
        if choice == "high_priority":
            _, highest = torch.cuda.Stream.priority_range()   # (lowest, highest); lower numbers are higher
            self.stream = torch.cuda.Stream(device, priority=highest)

    @contextlib.contextmanager
    def around(self, *batch: torch.Tensor):
        """Runs the block (one step on `batch`) on the step stream, ordered after and before the current one."""
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        for tensor in batch:
            if tensor.is_cuda:
                tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)
