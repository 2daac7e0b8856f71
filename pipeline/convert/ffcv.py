"""Convert a dataset, in the form you hold it, to FFCV: OUT/train.beton, OUT/val.beton, OUT/manifest.json.
(The forms it reads: pipeline/convert/sources/.)

    python pipeline/convert/ffcv.py SRC OUT [--max-resolution 512] [--write-mode jpg] ...

Fields: `image` (RGBImageField) and `label` (IntField, index into the manifest's classes).
Options follow ffcv-imagenet's writer. Samples are stored in the source's order, each of FFCV's
workers reading a block of neighbours at once. Samples that do not decode are found by a cheap
first pass (JPEG at 1/8 scale) and left out, because FFCV's writer waits forever for a
worker that raised; should a file still fail in the writer, it is written as a 1x1
placeholder, and the split is written again without it, so no placeholder is ever kept.
A worker that dies in FFCV's own code (a full disk) would also leave the writer waiting:
`_worker_failure_raised` notices its traceback and raises it here instead. Each split's manifest
record holds its .beton's size and sha256 (`bytes`, `sha256`), for a copy to be checked against,
and names the file of its per-sample checksums (`checksums`, `SPLIT.crc32`, with `checksums_bytes`,
`checksums_sha256`, and `layout_crc32` for the rest of the file: pipeline/formats/beton_checksums.py).
FFCV's writer places samples in the file as its processes ask for pages; the .beton is then copied
into the layout one process gives (pipeline/formats/beton_layout.py), so the same source and
options give the same bytes, however many processes wrote it. A killed run writes its split again: FFCV's
writer cannot go on from a part of a file.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import os
import re
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np

from pipeline.convert.cli import common_parser, main_guard, run_options
from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.images import UnusableFile, describe_failure, load_rgb, probe
from pipeline.convert.options import WRITE_MODES, FfcvOptions, RunOptions
from pipeline.convert.parallel import map_samples
from pipeline.convert.sources import Missing, Source
from pipeline.convert.splits import SplitResult, run_conversion
from pipeline.formats.beton_checksums import SAMPLE_CHECKSUM, MappedFile, read_layout, sample_checksums
from pipeline.formats.beton_layout import canonical_copy
from pipeline.storage.atomic_files import replace_atomically, sha256_file, write_bytes_atomic
from pipeline.formats.imagefolder import Skipped
from pipeline.progress import Progress

log = logging.getLogger(__name__)


class SourceForWriter:
    """The indexable dataset FFCV's writer pulls from: (RGB uint8 array, label) per index, the
    source's samples `indices`. FFCV's workers take indices in runs of its chunk size, so a
    worker's first look at a run reads the whole run at once.

    Never raises: a failure is appended to `failure_log` (one `index<TAB>reason` line, an
    append of under PIPE_BUF bytes, so lines from several workers do not interleave) and a
    1x1 placeholder takes the sample's place.
    """

    def __init__(self, source: Source, split: str, indices: np.ndarray, max_resolution: int | None,
                 failure_log: str, read_ahead: int):
        self.source, self.split, self.indices = source, split, indices
        self.labels = source.entries(split).labels
        self.max_resolution, self.failure_log, self.read_ahead = max_resolution, failure_log, read_ahead
        self.held_from, self.held = 0, []

    def __len__(self) -> int:
        return len(self.indices)

    def _bytes(self, index: int):
        if not self.held_from <= index < self.held_from + len(self.held):
            self.held_from = index
            self.held = self.source.read(self.split, self.indices[index:index + self.read_ahead])
        return self.held[index - self.held_from]

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        label = int(self.labels[self.indices[index]])
        try:
            data = self._bytes(index)
            if isinstance(data, Missing):
                raise UnusableFile(data.reason)
            return load_rgb(data, self.max_resolution), label
        except Exception as error:  # noqa: BLE001 - see the class docstring
            with open(self.failure_log, "a", encoding="utf-8") as log:
                log.write(f"{index}\t{describe_failure(error)}\n")
            return np.zeros((1, 1, 3), np.uint8), label


_worker_log: str | None = None      # while FFCV writes, where its forked workers' stderr goes


def _worker_stderr_to_log() -> None:
    if _worker_log:
        fd = os.open(_worker_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(fd, 2)
        os.close(fd)


os.register_at_fork(after_in_child=_worker_stderr_to_log)


class _WorkerDied(Exception):
    pass


@contextlib.contextmanager
def _worker_failure_raised():
    """Inside: FFCV's writer workers write their stderr to a log (their tracebacks never reach
    the user's terminal), and a watcher thread that sees a traceback there interrupts the main
    thread's wait with OSError (the worker's, e.g. ENOSPC) or ConversionFault, after stopping
    the other workers. FFCV's writer itself would wait for the dead worker's samples forever."""
    global _worker_log
    with tempfile.NamedTemporaryFile("rb", prefix="ffcv-writer-", suffix=".log") as log:
        main, done = threading.get_ident(), threading.Event()

        def watch():
            while not done.wait(0.2):
                log.seek(0)
                if b"Traceback" in log.read():
                    signal.pthread_kill(main, signal.SIGUSR2)       # wakes the main thread's sleep
                    return

        def interrupt(signum, frame):
            raise _WorkerDied()

        previous = signal.signal(signal.SIGUSR2, interrupt)
        _worker_log, watcher = log.name, threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield
        except _WorkerDied:
            for worker in multiprocessing.active_children():
                worker.terminate()
            last = Path(log.name).read_text(errors="replace").strip().splitlines()[-1]
            found = re.search(r"\[Errno (\d+)\] ([^:']+)", last)
            if found:
                raise OSError(int(found[1]), found[2].strip()) from None
            raise ConversionFault(f"an FFCV writer worker failed: {last}") from None
        finally:
            done.set()
            watcher.join()
            _worker_log = None
            signal.signal(signal.SIGUSR2, previous)


def write_beton(options: FfcvOptions, run: RunOptions, source: Source, split: str, indices: np.ndarray, path: Path,
                desc: str) -> list[tuple[int, str]]:
    """Write the source's samples `indices` to path with FFCV's DatasetWriter, its progress headed
    `desc`; the (position in indices, reason) of failed samples."""
    import pipeline.formats.ffcv_import  # noqa: F401 - first: FFCV without its typed-dict compile
    import ffcv.writer
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    # FFCV's writer draws a plain tqdm bar, which fills a log file with redraws: ours instead
    # (pipeline/progress.py). It calls only tqdm(total=...), update() and close().
    ffcv.writer.tqdm = lambda total: Progress(total, desc, unit="img")

    image_field = RGBImageField(write_mode=options.write_mode, max_resolution=options.max_resolution or None,
                                smart_threshold=options.smart_threshold, jpeg_quality=options.jpeg_quality,
                                compress_probability=options.compress_probability)
    with tempfile.NamedTemporaryFile("r", prefix=f".{split}.failures.tmp-", dir=path.parent, delete=True) as log:
        dataset = SourceForWriter(source, split, indices, options.max_resolution or None, log.name,
                                  options.chunk_size)
        writer = DatasetWriter(str(path), {"image": image_field, "label": IntField()},
                               num_workers=run.num_workers)
        try:
            with _worker_failure_raised():
                writer.from_indexed_dataset(dataset, chunksize=options.chunk_size)
        except (OSError, ConversionFault):
            shared = getattr(writer, "metadata_sm", None)      # FFCV frees it only when it finishes
            if shared is not None:
                shared.close()
                shared.unlink()
            raise
        return [(int(index), reason) for index, reason in (line.rstrip("\n").split("\t", 1) for line in log)]


def convert_split(options: FfcvOptions, run: RunOptions, source: Source, split: str, out: Path,
                  identity: dict | None = None) -> SplitResult:
    """Write OUT/<split>.beton in one go. `identity` is the webdataset converter's concern."""
    skipped, good = [], []
    for index, reason in map_samples(source, split, probe, run.num_workers, f"{split}: checking"):
        if reason:
            skipped.append(Skipped(source.name(split, index), reason.reason if isinstance(reason, Missing) else reason,
                                   index))
        else:
            good.append(index)
    good = np.array(good, np.int64)
    final = out / f"{split}.beton"
    tmp = out / f".{split}.beton.tmp-{os.getpid()}"
    try:
        for attempt in (1, 2):
            if not len(good):
                break
            log.info("%s: writing %d samples to %s", split, len(good), final)
            failures = write_beton(options, run, source, split, good, tmp, f"{split}: writing")
            if not failures:
                break
            if attempt == 2:
                raise ConversionError(f"{final}: samples kept failing in FFCV's writer: "
                                      f"{[source.name(split, int(good[i])) for i, _ in failures][:5]}")
            log.warning("%s: %d samples failed only in the writer; writing again without them", split, len(failures))
            failed = {i for i, _ in failures}
            skipped += [Skipped(source.name(split, int(good[i])), reason, int(good[i])) for i, reason in failures]
            good = np.array([index for i, index in enumerate(good) if i not in failed], np.int64)
        if not len(good):
            log.warning("warning: %s: no decodable images; %s not written", split, final.name)
            return SplitResult(0, skipped)
        placed = tmp.with_name(tmp.name + "-placed")
        try:
            canonical_copy(tmp, placed)
            os.replace(placed, tmp)
        finally:
            placed.unlink(missing_ok=True)
        checksums = write_checksums(tmp, out / f"{split}.crc32")
        replace_atomically(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return SplitResult(len(good), skipped, [final.name, checksums["checksums"]],
                       {"bytes": final.stat().st_size, "sha256": sha256_file(final), **checksums})


def write_checksums(beton: Path, path: Path) -> dict:
    """Write the per-sample checksums of `beton` to `path`; the manifest entries that describe them."""
    with MappedFile(beton) as buffer:
        layout = read_layout(buffer)
        table = sample_checksums(buffer, layout).astype("<u4").tobytes()
    write_bytes_atomic(path, table)
    return {"checksums": path.name, "checksums_bytes": len(table), "checksums_sha256": hashlib.sha256(table).hexdigest(),
            "layout_crc32": layout.layout_crc32, "sample_checksum": SAMPLE_CHECKSUM}


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--write-mode", choices=WRITE_MODES, default="jpg",
                        help="how images are stored: raw pixels, JPEG, smart (JPEG above --smart-threshold "
                             "bytes of raw pixels), proportion (JPEG with --compress-probability)")
    parser.add_argument("--smart-threshold", type=int, default=None,
                        help="with --write-mode smart: JPEG-encode images whose raw pixels exceed this many bytes")
    parser.add_argument("--compress-probability", type=float, default=0.5,
                        help="with --write-mode proportion: share of images stored as JPEG")
    parser.add_argument("--chunk-size", type=int, default=100, help="samples per writer work item")
    args = parser.parse_args(argv)
    run = run_options(args)
    options = FfcvOptions(max_resolution=args.max_resolution, jpeg_quality=args.jpeg_quality,
                          write_mode=args.write_mode, smart_threshold=args.smart_threshold,
                          compress_probability=args.compress_probability, chunk_size=args.chunk_size)
    return run_conversion(run, options, "ffcv", ("ffcv", "numba"), convert_split)


def command(argv: list[str] | None = None) -> None:
    """The command line (tools/convert_ffcv.py, fastpipe-convert-ffcv): a conversion's error is one
    line on stderr and its exit code."""
    main_guard(lambda: main(argv))


if __name__ == "__main__":
    command()
