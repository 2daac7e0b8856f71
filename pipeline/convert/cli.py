"""The converters' command line: the options both share, turned into typed options
(pipeline/convert/options.py), and `main_guard`, which shows the library's log messages on stderr
and turns a conversion's errors into one line there and its exit code."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.options import RunOptions
from pipeline.convert.sources.base import SourceOptions
from pipeline.convert.worker_pool import children_die_with_this_process
from pipeline.errors import RemoteDataError

log = logging.getLogger(__name__)


def common_parser(description: str) -> argparse.ArgumentParser:
    from pipeline.convert.sources import FORMS
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("src", help="the data as you hold it: an ImageNet-layout folder (SRC/<split>/<class>/<image>), "
                                    "ImageNet's official tars with the devkit, Kaggle's ImageNet folder, Hugging Face "
                                    "parquet, WebDataset tars, or train.csv/val.csv lists; the tar and parquet forms "
                                    "also at an s3://, gs:// or https:// prefix")
    parser.add_argument("out", help="output folder, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX: converted in "
                                    "--staging, then uploaded there, the manifest last")
    parser.add_argument("--source-format", choices=list(FORMS), default=None,
                        help="the form SRC holds (default: found from what SRC holds)")
    parser.add_argument("--split-path", action="append", default=[], metavar="SPLIT=PATTERN",
                        help="webdataset and parquet forms: a split's files, relative to SRC, as a glob or with "
                             "{000..146} numbering (repeat for each split)")
    parser.add_argument("--label-key", default=None,
                        help="webdataset form: a sample's label is this key of its .json (default: its .cls)")
    parser.add_argument("--splits", default="train,val", help="comma-separated splits to convert")
    parser.add_argument("--max-resolution", type=int, default=512,
                        help="shrink so the longest side is at most this (0: keep sizes)")
    parser.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality when (re-)encoding")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if any file was skipped; a damaged tar in SRC stops the run before writing")
    parser.add_argument("--force", action="store_true", help="convert even if OUT is up to date")
    parser.add_argument("--staging", type=Path, default=None,
                        help="with an s3:// or gs:// OUT: the local folder to convert into before uploading; it "
                             "is kept, so a re-run converts nothing already converted and uploads only what is "
                             "missing (default: a folder per destination under the system temp dir, "
                             "fastpipe-staging-UID/FORMAT-HASH; name one on a disk with room for the dataset)")
    parser.add_argument("--upload-workers", type=int, default=4, help="files uploaded at once")
    return parser


def run_options(args: argparse.Namespace) -> RunOptions:
    """The run's options from the command line, checked."""
    split_paths = []
    for item in args.split_path:
        split, sep, pattern = item.partition("=")
        if not sep or not split or not pattern:
            raise ConversionError(f"--split-path {item!r}: give SPLIT=PATTERN, e.g. train='shards/train-*.tar'")
        split_paths.append((split, pattern))
    source = SourceOptions(form=args.source_format, split_paths=tuple(split_paths), label_key=args.label_key,
                           strict=args.strict)
    part = getattr(args, "part", None)
    if part is not None:
        numbers = part.split("/")
        if len(numbers) != 2 or not all(n.isdigit() for n in numbers):
            raise ConversionError(f"--part {part!r}: give I/N, e.g. 0/4 for the first of 4 parts")
        part = (int(numbers[0]), int(numbers[1]))
    return RunOptions(src=str(args.src), out=str(args.out), splits=tuple(s for s in args.splits.split(",") if s),
                      num_workers=args.num_workers, strict=args.strict, force=args.force, staging=args.staging,
                      upload_workers=args.upload_workers, source=source,
                      executor=getattr(args, "executor", "local"),
                      ray_address=getattr(args, "ray_address", None) or os.environ.get("RAY_ADDRESS"),
                      part=part, finish=getattr(args, "finish", None))


def main_guard(run: Callable[[], int]) -> None:
    """Exit with run()'s code; a ConversionError is one line on stderr and exit code 2. The
    library's messages, info and above, are lines on stderr, unless the caller configured logging.
    Every process the conversion forks ends when this one does, killed or not."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    children_die_with_this_process()
    try:
        sys.exit(run())
    except ConversionError as error:
        log.error("error: %s", error)
        sys.exit(2)
    except (ConversionFault, RemoteDataError) as error:     # a fault on the way: run again to go on
        log.error("error: %s", error)
        sys.exit(1)
    except KeyboardInterrupt as interrupt:
        log.warning("interrupted: %s",
                    interrupt or "nothing was renamed into place; outputs from earlier runs are intact")
        sys.exit(130)
