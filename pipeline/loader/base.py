"""What every loader backend shares: epoch and position bookkeeping, exact mid-epoch resume,
the corrupt-sample count, and the last step of every CPU pipeline (uint8 batch -> device,
normalized, channels_last).

A backend subclasses `Loader` and supplies `__len__`, `_batches(epoch, start)` (the
`(batch_index, images, labels)` of an epoch from batch `start` on; a batch whose samples
were all undecodable is left out, its index still counts) and optionally `_prepare_epoch(epoch)`. The base class
turns that into the public interface: `set_epoch`, `resolution`, iteration, and
`state_dict`/`load_state_dict`, where a state saved after k batches makes the next
iteration yield batches k+1... of the same epoch, as the uninterrupted run would have.
A loader's spec is fixed once the loader is built: a setting is changed by building the
loader from another spec (the trainer settles its specs before it builds its loaders).
"""
from __future__ import annotations

import logging

import torch

from pipeline.transforms.colout import colout_batch, kept_size
from pipeline.transforms.crops import sample_seed
from pipeline.errors import CorruptSample
from pipeline.transforms.normalize import BatchBuffers, normalized_batch
from pipeline.spec import LoaderSpec

log = logging.getLogger(__name__)


HANDOVER_ERRORS = (ConnectionError, EOFError)     # how a batch's handover fails when its worker dies
NAMED_PER_EPOCH = 20        # damaged samples named in a line each, an epoch; the rest only counted


def damaged_labels(labels: torch.Tensor, num_classes: int, name_of) -> tuple[torch.Tensor, list[str]]:
    """A CPU batch's labels that are no class of the dataset (a flipped byte in a label, say): their
    mask, and a message per sample naming it (`name_of(position)`), for the on_corrupt policy;
    else such a label reaches the loss as a target past its last class."""
    bad = (labels < 0) | (labels >= num_classes)
    if not bool(bad.any()):
        return bad, []
    return bad, [not_a_class(name_of(position), int(labels[position]), num_classes)
                 for position in bad.nonzero().view(-1).tolist()]


def not_a_class(name, label: int, num_classes: int) -> str:
    """What is said of a sample whose label is no class of the dataset."""
    return f"{name}: label {label} is not one of the {num_classes} classes, a damaged sample"


class LoaderWorkerDied(RuntimeError):
    """A loader's worker process died mid-epoch (torch's DataLoader noticed): its message is one
    line naming the backend and the likely cause."""

    def __init__(self, backend: str, detail: str, split: str | None = None):
        # A SIGKILL from nowhere is, far most often, the kernel's out-of-memory killer.
        where = f"{backend} loader" + (f", {split} split" if split else "")
        detail = detail.strip().rstrip(".") or "mid-handover of a batch"     # a handover's EOFError says nothing
        super().__init__(f"{where}: a worker process died ({detail}); most likely the "
                         f"out-of-memory killer (dmesg says): lower data.num_workers or data.batch_size, or give "
                         f"the job more memory")

    @staticmethod
    def says_so(error: BaseException) -> bool:
        """torch's DataLoader, on a dead worker: its SIGCHLD handler's RuntimeError (raised in the
        main thread wherever it is) or, while a batch was being handed over (a tensor's file
        descriptor fetched from the worker's resource sharer), a broken connection or an EOFError.
        An error raised inside a worker reaches here with its own type but a message "Caught ...":
        that is the worker's fault, not its death."""
        if isinstance(error, RuntimeError):
            return str(error).startswith("DataLoader worker")
        return isinstance(error, HANDOVER_ERRORS) and not str(error).startswith("Caught ")


class Loader:
    def __init__(self, spec: LoaderSpec, num_classes: int):
        self.spec = spec
        self.num_classes = num_classes
        self.epoch = 0
        self.position = 0                 # batches yielded so far in this epoch
        self._resume_from = 0
        self.corrupt_in_epoch = 0         # damaged samples skipped (undecodable, failing their checksum or class), this epoch
        self.corrupt_total = 0
        self.device = torch.device(spec.device)
        self._mean = 255 * torch.tensor(spec.mean, device=self.device).view(1, 3, 1, 1)
        self._inv_std = 1 / (255 * torch.tensor(spec.std, device=self.device).view(1, 3, 1, 1))
        self._float_batches = BatchBuffers()   # CPU device: normalized batches, reused once released
        self._prepare_epoch(0)

    # --- what backends supply -------------------------------------------------------
    def __len__(self) -> int:
        raise NotImplementedError

    def _batches(self, epoch: int, start: int):
        raise NotImplementedError

    def _prepare_epoch(self, epoch: int) -> None:
        pass

    # --- the interface ----------------------------------------------------------------
    @property
    def side(self) -> int:
        """The square side this epoch's images are cropped to, before ColOut."""
        return self.spec.resolution_at(self.epoch)

    @property
    def resolution(self) -> tuple[int, int]:
        if self.spec.colout and self.spec.train:
            return kept_size(self.side, self.side, *self.spec.colout)
        return self.side, self.side

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._resume_from = epoch, 0, 0
        self._prepare_epoch(epoch)

    def __iter__(self):
        start, self._resume_from = self._resume_from, 0
        self.position, self.corrupt_in_epoch = start, 0
        try:
            for index, images, labels in self._batches(self.epoch, start):
                self.position = index + 1
                yield images, labels
        except (RuntimeError, *HANDOVER_ERRORS) as error:
            if not LoaderWorkerDied.says_so(error):
                raise
            raise LoaderWorkerDied(self.spec.backend, str(error), self.spec.split) from None
        if self.corrupt_in_epoch:
            log.warning("%s loader, %s split, epoch %d: skipped %d damaged samples (%d so far)",
                        self.spec.backend, self.spec.split, self.epoch, self.corrupt_in_epoch, self.corrupt_total)

    def state_dict(self) -> dict:
        return {"backend": self.spec.backend, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state.get("backend", self.spec.backend) != self.spec.backend:
            raise ValueError(f"loader state is from backend {state['backend']!r}, this loader is {self.spec.backend!r}")
        self.set_epoch(state["epoch"])
        self._resume_from = self.position = state["position"]

    # --- helpers for backends -----------------------------------------------------------
    def _undecodable(self, errors: list[str]) -> None:
        """Damaged samples of a batch: raise the first, or name the first few of an epoch and count them all."""
        if errors and self.spec.on_corrupt == "raise":
            raise CorruptSample(f"{errors[0]} (on_corrupt='skip' skips and counts such samples)")
        for message in errors[:max(0, NAMED_PER_EPOCH - self.corrupt_in_epoch)]:
            log.warning("%s loader, %s split: skipped %s", self.spec.backend, self.spec.split, message)
        self.corrupt_in_epoch += len(errors)
        self.corrupt_total += len(errors)

    def _batch_generator(self, batch_index: int) -> torch.Generator:
        """A generator for batch-level randomness, the same for a batch however it was reached."""
        seed = sample_seed(self.spec.seed + 7919 * self.spec.rank, self.epoch, batch_index)
        return torch.Generator().manual_seed(seed)

    def _colout(self, images: torch.Tensor, batch_index: int) -> torch.Tensor:
        """Batch-form ColOut for backends whose samples never pass through Python (FFCV, DALI)."""
        if not (self.spec.colout and self.spec.train):
            return images
        return colout_batch(images, *self.spec.colout, generator=self._batch_generator(batch_index))

    def _to_model_input(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 on the host, any memory layout -> normalized, channels_last, on the
        device: on a CPU by `pipeline/transforms/normalize.py` into memory reused once the caller has
        let go of it, on a GPU after the copy (a quarter of the bytes a float batch would move).
        A float batch already normalized (the decode engine's, on a CPU) passes through as it is.
        Either way the caller's batch is never overwritten while anything still holds it."""
        if images.dtype == torch.uint8 and self.device.type == "cpu":
            count, _, height, width = images.shape
            images = normalized_batch(images.permute(0, 2, 3, 1).numpy(), self.spec.mean, self.spec.std,
                                      out=self._float_batches.take((count, height, width, 3)))
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.float().sub_(self._mean).mul_(self._inv_std)
        return images.to(self.spec.dtype).contiguous(memory_format=torch.channels_last)

    def _to_device_labels(self, labels: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and labels.device.type == "cpu" and not labels.is_pinned():
            # From pageable memory a "non-blocking" copy blocks;
            # the type changes on the device, after the copy, so the pinned source is what moves.
            labels = labels.pin_memory()
        return labels.to(self.device, non_blocking=True).to(torch.int64).view(-1)
