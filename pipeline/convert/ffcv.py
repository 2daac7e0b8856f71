"""Convert an ImageNet-layout folder to FFCV: OUT/train.beton, OUT/val.beton, OUT/manifest.json.

    python pipeline/convert/ffcv.py SRC OUT [--max-resolution 512] [--write-mode jpg] ...

Fields: `image` (RGBImageField) and `label` (IntField, index into the manifest's classes).
Options follow ffcv-imagenet's writer. Files that do not decode are found by a cheap
first pass (JPEG at 1/8 scale) and left out, because FFCV's writer waits forever for a
worker that raised; should a file still fail in the writer, it is written as a 1x1
placeholder, and the split is written again without it, so no placeholder is ever kept.
A worker that dies in FFCV's own code (a full disk) would also leave the writer waiting:
`_worker_failure_raised` notices its traceback and raises it here instead. Each split's manifest
record holds its .beton's size and sha256 (`bytes`, `sha256`), for a copy to be checked against,
and names the file of its per-sample checksums (`checksums`, `SPLIT.crc32`, with `checksums_bytes`,
`checksums_sha256`, and `layout_crc32` for the rest of the file: pipeline/formats/beton_checksums.py).
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

from pipeline.convert.cli import common_parser, main_guard
from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.images import describe_failure, load_rgb, probe
from pipeline.convert.parallel import parallel_map
from pipeline.convert.splits import SplitResult, run_conversion
from pipeline.convert.upload import sha256_file
from pipeline.formats.beton_checksums import SAMPLE_CHECKSUM, MappedFile, read_layout, sample_checksums
from pipeline.storage.atomic_files import replace_atomically, write_bytes_atomic
from pipeline.formats.imagefolder import Sample, Skipped
from pipeline.progress import Progress

log = logging.getLogger(__name__)

WRITE_MODES = ("raw", "jpg", "smart", "proportion")


class FolderForWriter:
    """The indexable dataset FFCV's writer pulls from: (RGB uint8 array, label) per index.

    Never raises: a failure is appended to `failure_log` (one `index<TAB>reason` line, an
    append of under PIPE_BUF bytes, so lines from several workers do not interleave) and a
    1x1 placeholder takes the sample's place.
    """

    def __init__(self, samples: list[Sample], max_resolution: int | None, failure_log: str):
        self.samples, self.max_resolution, self.failure_log = samples, max_resolution, failure_log

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        sample = self.samples[index]
        try:
            return load_rgb(sample.path, self.max_resolution), sample.label
        except Exception as error:  # noqa: BLE001 - see the class docstring
            with open(self.failure_log, "a", encoding="utf-8") as log:
                log.write(f"{index}\t{describe_failure(error)}\n")
            return np.zeros((1, 1, 3), np.uint8), sample.label


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


def write_beton(args, samples: list[Sample], path: Path, desc: str) -> list[tuple[int, str]]:
    """Write samples to path with FFCV's DatasetWriter, its progress headed `desc`; the (index,
    reason) of failed samples."""
    import pipeline.formats.ffcv_import  # noqa: F401 - first: FFCV without its typed-dict compile
    import ffcv.writer
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    # FFCV's writer draws a plain tqdm bar, which fills a log file with redraws: ours instead
    # (pipeline/progress.py). It calls only tqdm(total=...), update() and close().
    ffcv.writer.tqdm = lambda total: Progress(total, desc, unit="img")

    image_field = RGBImageField(write_mode=args.write_mode, max_resolution=args.max_resolution or None,
                                smart_threshold=args.smart_threshold, jpeg_quality=args.jpeg_quality,
                                compress_probability=args.compress_probability)
    with tempfile.NamedTemporaryFile("r", suffix=".failures", dir=path.parent, delete=True) as log:
        dataset = FolderForWriter(samples, args.max_resolution or None, log.name)
        writer = DatasetWriter(str(path), {"image": image_field, "label": IntField()},
                               num_workers=args.num_workers)
        try:
            with _worker_failure_raised():
                writer.from_indexed_dataset(dataset, chunksize=args.chunk_size)
        except (OSError, ConversionFault):
            shared = getattr(writer, "metadata_sm", None)      # FFCV frees it only when it finishes
            if shared is not None:
                shared.close()
                shared.unlink()
            raise
        return [(int(index), reason) for index, reason in (line.rstrip("\n").split("\t", 1) for line in log)]


def convert_split(args, split: str, samples: list[Sample], out: Path) -> SplitResult:
    reasons = list(parallel_map(probe, [s.path for s in samples], args.num_workers, f"{split}: checking"))
    skipped = [Skipped(s.path, reason) for s, reason in zip(samples, reasons) if reason]
    good = [s for s, reason in zip(samples, reasons) if not reason]
    final = out / f"{split}.beton"
    tmp = out / f".{split}.beton.tmp-{os.getpid()}"
    try:
        for attempt in (1, 2):
            if not good:
                break
            log.info("%s: writing %d samples to %s", split, len(good), final)
            failures = write_beton(args, good, tmp, f"{split}: writing")
            if not failures:
                break
            if attempt == 2:
                raise ConversionError(f"{final}: samples kept failing in FFCV's writer: "
                                      f"{[good[i].path for i, _ in failures][:5]}")
            log.warning("%s: %d files failed only in the writer; writing again without them", split, len(failures))
            failed = {i for i, _ in failures}
            skipped += [Skipped(good[i].path, reason) for i, reason in failures]
            good = [s for i, s in enumerate(good) if i not in failed]
        if not good:
            log.warning("warning: %s: no decodable images; %s not written", split, final.name)
            return SplitResult(0, skipped)
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
    if not 0 <= args.compress_probability <= 1:
        raise ConversionError(f"--compress-probability must be in [0, 1], got {args.compress_probability}")
    if args.chunk_size < 1:
        raise ConversionError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    return run_conversion(args, "ffcv", ("ffcv", "numba"), convert_split)


def command(argv: list[str] | None = None) -> None:
    """The command line (tools/convert_ffcv.py, fastpipe-convert-ffcv): a conversion's error is one
    line on stderr and its exit code."""
    main_guard(lambda: main(argv))


if __name__ == "__main__":
    command()
