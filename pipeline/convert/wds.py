"""Convert a dataset, in the form you hold it, to WebDataset shards: OUT/<split>/shard-NNNNNN.tar + .idx.
(The forms it reads: pipeline/convert/sources/.)

    python pipeline/convert/wds.py SRC OUT [--max-resolution 512] [--shard-size-mb 256] ...

What a shard holds (each sample's `.jpg`, `.cls` and `.lbl`, the `.idx` index, the per-sample
checksums) is pipeline/formats/wds_shards.py's, which writes and reads it. The manifest's
`members` names the members for the loaders.

Resize semantics are the FFCV converter's (longest side at most --max-resolution, OpenCV's
INTER_AREA, FFCV's size rounding). An RGB JPEG that needs no resize and no EXIF rotation
is stored as it is, without a lossy re-encode; anything else is re-encoded at
--jpeg-quality. Either way it is then rewritten losslessly with a restart marker after every
MCU (the same pixels, a few % more bytes; --no-restart-markers stores it without): the
decode engine then decodes only the MCUs under a crop (pipeline/native/jpeg_restarts.h).

Which samples each shard holds, in which order and under which keys is planned before anything is
written (pipeline/convert/plan.py), and shards are written by tasks of that plan
(pipeline/convert/shard_tasks.py): on this machine's process pool, a group of shards at a time; on
a Ray cluster (--executor ray), a shard a task; or as part I of N (--part, then --finish). Each
finished shard is recorded in OUT (pipeline/convert/in_progress.py), so a killed run, run again with
the same command, writes only the shards not yet finished. Tars are deterministic: the same input
and options give the same bytes, however and wherever they were written.
"""
from __future__ import annotations

import argparse
import logging
import math
from functools import partial
from pathlib import Path

from pipeline.convert.cli import common_parser, main_guard, run_options
from pipeline.convert.errors import ConversionError, ConversionFault
from pipeline.convert.in_progress import InProgress
from pipeline.convert.options import RunOptions, WdsOptions
from pipeline.convert.plan import ShardPlan
from pipeline.convert.ray_executor import disconnect, write_shards_on_ray
from pipeline.convert.shard_tasks import ShardDone, write_shards
from pipeline.convert.sources import Source
from pipeline.convert.splits import SplitResult, run_conversion
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.wds_shards import MEMBERS, SAMPLE_CHECKSUM
from pipeline.progress import Progress

log = logging.getLogger(__name__)

GROUP_BYTES = (256 << 20, 2 << 30)   # source bytes read for a group of shards, at least and at most: what a kill costs


def convert_split(options: WdsOptions, run: RunOptions, source: Source, split: str, out: Path,
                  identity: dict) -> SplitResult | None:
    """Write the split's shards not yet finished in OUT/.converting (all of them, this part's, or,
    for --finish, none); once all are, the split's result, whose `place` moves them into OUT/<split>.
    None for a part, which leaves the rest to --finish."""
    plan = ShardPlan.of(source, split, options)
    progress = InProgress(out, split, {**identity, "plan": plan.as_dict()})
    progress.begin(refuse_other=bool(run.part or run.finish), alone=not run.part)
    done = progress.done()
    todo = [number for number in range(plan.shards) if number not in done]
    if done and todo and not run.finish:
        log.info("%s: %d of %d %s shards were finished already; writing the other %d",
                 out, len(done), plan.shards, split, len(todo))
    if run.part:
        part, parts = run.part
        todo = [number for number in todo if number % parts == part]
    if run.finish and todo:
        missing = sorted({number % run.finish for number in todo})
        raise ConversionError(f"{out}: {len(todo)} of the {plan.shards} {split} shards are not written yet, by part"
                              f"{'s' * (len(missing) > 1)} {', '.join(f'{p}/{run.finish}' for p in missing)}; "
                              "run them, then --finish")
    if todo:
        executor = write_shards_on_ray if run.executor == "ray" else write_here
        executor(source, plan, todo, options, run, progress)
    if run.part:
        return None
    done = progress.done()
    lost = [number for number in range(plan.shards) if number not in done]
    if lost:
        raise ConversionFault(f"{out}: {split} shards {lost[:10]} were written but are not there now; run again")
    result = merged(source, plan, done)
    result.place = partial(progress.place, out / split) if result.count else progress.discard
    return result


def write_here(source: Source, plan: ShardPlan, numbers: list[int], options: WdsOptions, run: RunOptions,
               progress: InProgress) -> None:
    """The local process pool: the shards a group at a time, so that a kill loses one group at most."""
    places = plan.order_and_places(source.scratch / f"{plan.split}-order")[1]
    staging = progress.staging()
    bar = Progress(plan.samples_in(numbers), f"{plan.split}: encoding", unit="img")
    for group in shard_groups(source, plan, numbers):
        write_shards(source, plan, group, places, options, run.num_workers, staging,
                     partial(progress.finished, staging=staging), bar)
    bar.close()


def shard_groups(source: Source, plan: ShardPlan, numbers: list[int]) -> list[list[int]]:
    """`numbers` in groups of an eighth of the split's shards, within GROUP_BYTES of source; one
    group where a sample cannot be read without its neighbours (parquet), since each group reads
    every row group it touches."""
    if not source.sample_reads:
        return [numbers]
    shard_bytes = max(1, plan.per_shard * source.entries(plan.split).mean_size())
    least, most = (-(-limit // shard_bytes) for limit in GROUP_BYTES)
    size = max(1, least, min(most, math.ceil(plan.shards / 8)))
    return [numbers[at:at + size] for at in range(0, len(numbers), size)]


def merged(source: Source, plan: ShardPlan, done: dict[int, ShardDone]) -> SplitResult:
    """The split's result from its finished shards' records."""
    shards = [done[number].record for number in sorted(done) if done[number].record is not None]
    skipped = sorted((skip for finished in done.values() for skip in finished.skipped), key=lambda skip: skip.entry)
    skipped = [Skipped(source.name(plan.split, skip.entry), skip.reason, skip.entry) for skip in skipped]
    count = sum(shard["count"] for shard in shards)
    if not count:
        log.warning("warning: %s: no decodable images; not written", plan.split)
        return SplitResult(0, skipped)
    files = [f"{plan.split}/{shard[kind]}" for shard in shards for kind in ("tar", "index", "checksums")]
    return SplitResult(count, skipped, files, {
        "shards": shards, "members": MEMBERS, "shard_samples": plan.per_shard,
        "restart_markers": sum(finished.restart_markers for finished in done.values()),
        "sample_checksum": SAMPLE_CHECKSUM,
        "bytes": sum(shard[size] for shard in shards for size in ("bytes", "index_bytes", "checksums_bytes"))})


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--shard-size-mb", type=float, default=256,
                        help="shard size in MiB, about: shards are cut by count, this over the source's mean "
                             "sample size")
    parser.add_argument("--shard-samples", type=int, default=None, help="samples a shard (instead of --shard-size-mb)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train split's write order")
    parser.add_argument("--restart-markers", action=argparse.BooleanOptionalAction, default=True,
                        help="store each JPEG with a restart marker after every MCU (lossless), so the decode "
                             "engine decodes only the MCUs a crop needs")
    parser.add_argument("--executor", choices=("local", "ray"), default="local",
                        help="where shards are written: this machine's process pool, or a Ray cluster (one task a "
                             "shard; OUT must be a folder every node sees)")
    parser.add_argument("--ray-address", default=None,
                        help="the Ray cluster (default: RAY_ADDRESS, else a Ray started on this machine)")
    parser.add_argument("--part", default=None, metavar="I/N",
                        help="write only part I of N (0 <= I < N) of the shards, for a launcher of N tasks (a Slurm "
                             "array, a Kubernetes indexed job) into one shared OUT; then --finish")
    parser.add_argument("--finish", type=int, default=None, metavar="N",
                        help="after the N parts: check every shard is written and write the manifest")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = run_options(args)
    options = WdsOptions(max_resolution=args.max_resolution, jpeg_quality=args.jpeg_quality,
                         shard_size_mb=args.shard_size_mb, shard_samples=args.shard_samples, seed=args.seed,
                         restart_markers=args.restart_markers)
    try:
        return run_conversion(run, options, "webdataset", ("webdataset",), convert_split)
    finally:
        disconnect()


def command(argv: list[str] | None = None) -> None:
    """The command line (tools/convert_wds.py, fastpipe-convert-wds): a conversion's error is one
    line on stderr and its exit code."""
    main_guard(lambda: main(argv))


if __name__ == "__main__":
    command()
