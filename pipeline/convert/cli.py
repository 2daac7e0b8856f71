"""The converters' command line: the options both share and their checks, and `main_guard`,
which shows the library's log messages on stderr and turns a conversion's errors into one line
there and its exit code."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from pipeline.convert.errors import ConversionError, ConversionFault

log = logging.getLogger(__name__)


def common_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("src", type=Path, help="ImageNet-layout folder: SRC/<split>/<class>/<image>")
    parser.add_argument("out", help="output folder, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX: converted in "
                                    "--staging, then uploaded there, the manifest last")
    parser.add_argument("--splits", default="train,val", help="comma-separated split folders to convert")
    parser.add_argument("--max-resolution", type=int, default=512,
                        help="shrink so the longest side is at most this (0: keep sizes)")
    parser.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality when (re-)encoding")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any file was skipped")
    parser.add_argument("--force", action="store_true", help="convert even if OUT is up to date")
    parser.add_argument("--staging", type=Path, default=argparse.SUPPRESS,
                        help="with an s3:// or gs:// OUT: the local folder to convert into before uploading; it "
                             "is kept, so a re-run converts nothing already converted and uploads only what is "
                             "missing (default: a folder per destination under the system temp dir, "
                             "fastpipe-staging-UID/FORMAT-HASH; name one on a disk with room for the dataset)")
    parser.add_argument("--upload-workers", type=int, default=4, help="files uploaded at once")
    return parser


def check_common_args(args: argparse.Namespace) -> None:
    if args.max_resolution < 0:
        raise ConversionError(f"--max-resolution must be >= 0, got {args.max_resolution}")
    if not 1 <= args.jpeg_quality <= 100:
        raise ConversionError(f"--jpeg-quality must be in 1..100, got {args.jpeg_quality}")
    if args.num_workers < 1:
        raise ConversionError(f"--num-workers must be >= 1, got {args.num_workers}")
    if args.upload_workers < 1:
        raise ConversionError(f"--upload-workers must be >= 1, got {args.upload_workers}")
    args.splits = [s for s in args.splits.split(",") if s]
    if not args.splits:
        raise ConversionError("--splits is empty")


def main_guard(run: Callable[[], int]) -> None:
    """Exit with run()'s code; a ConversionError is one line on stderr and exit code 2. The
    library's messages, info and above, are lines on stderr, unless the caller configured logging."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        sys.exit(run())
    except ConversionError as error:
        log.error("error: %s", error)
        sys.exit(2)
    except ConversionFault as error:
        log.error("error: %s", error)
        sys.exit(1)
    except KeyboardInterrupt as interrupt:
        log.warning("interrupted: %s",
                    interrupt or "nothing was renamed into place; outputs from earlier runs are intact")
        sys.exit(130)
