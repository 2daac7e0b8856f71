"""What a WebDataset conversion has finished so far, kept in OUT so that a run killed at any moment
(SIGKILL, preemption, a full disk) goes on where it stopped, and so that many processes or machines
can write one split's shards side by side (`--part I/N`, Ray):

    OUT/.converting/<split>.plan.json           what the shards are (source, options, plan)
    OUT/.converting/<split>/shard-NNNNNN.*      finished shards' tar, .idx and .crc32
    OUT/.converting/<split>.done/shard-NNNNNN.json   each finished shard's record, written last
    OUT/.converting/<split>/.staging-HOST-PID/  a writer's shard in progress

A shard is finished when its record exists: its files are renamed into place before it, and the
record is written atomically. Once every shard of every split is finished, the driver moves the
shards into OUT/<split> and writes the manifest; until then nothing in OUT looks complete.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.convert.errors import ConversionError
from pipeline.formats.imagefolder import Skipped
from pipeline.formats.wds_shards import SHARD_NAME, ShardRecord
from pipeline.storage.atomic_files import fsync_path, replace_atomically, write_bytes_atomic

log = logging.getLogger(__name__)

WORK = ".converting"


@dataclass
class ShardDone:
    """A written shard: its manifest record (None where every sample it was to hold was skipped),
    the samples it skipped, and how many of its samples carry restart markers."""
    record: dict | None
    skipped: list[Skipped] = field(default_factory=list)
    restart_markers: int = 0

    def as_dict(self) -> dict:
        return {"record": self.record, "skipped": [skip.as_dict() for skip in self.skipped],
                "restart_markers": self.restart_markers}

    @classmethod
    def from_dict(cls, done: dict) -> ShardDone:
        return cls(done["record"], [Skipped(**skip) for skip in done["skipped"]], done["restart_markers"])


class InProgress:
    """One split's finished shards in OUT/.converting, for the plan `identity` (a dict that names
    the source, the options and the plan: what makes two runs write the same shards)."""

    def __init__(self, out: Path, split: str, identity: dict):
        self.out, self.split, self.identity = Path(out), split, json.loads(json.dumps(identity))
        work = self.out / WORK
        self.folder, self.records, self.plan_file = work / split, work / f"{split}.done", work / f"{split}.plan.json"

    def begin(self, refuse_other: bool, alone: bool) -> None:
        """Take up the work an earlier run left for this plan. Work for another plan (other options,
        another seed, a changed source) is discarded, or with `refuse_other` (a part of a run across
        machines, whose other parts wrote it) refused. The staging folders of writers that were
        killed go: all of them where this run is `alone` in OUT, else this host's."""
        self._remove_dead_staging(alone)
        earlier = self._earlier_identity()
        if earlier is not None and earlier != self.identity:
            if refuse_other:
                changed = sorted(key for key in set(earlier) | set(self.identity)
                                 if earlier.get(key) != self.identity.get(key))
                raise ConversionError(f"{self.plan_file}: the other parts of this conversion were run with another "
                                      f"plan (it differs in: {', '.join(changed)}): give every part the same SRC, "
                                      f"options and seed, or remove {self.out / WORK} to start again")
            log.info("%s: discarding an interrupted conversion of %s made with other options or source",
                     self.out / WORK, self.split)
            self.discard()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.records.mkdir(parents=True, exist_ok=True)
        if earlier != self.identity:
            # The first part to start writes the plan, whole (a link fails where one exists); the others compare
            written = self.plan_file.with_name(f".{self.plan_file.name}.tmp-{socket.gethostname()}-{os.getpid()}")
            write_bytes_atomic(written, json.dumps(self.identity, indent=1, sort_keys=True).encode())
            try:
                os.link(written, self.plan_file)
            except FileExistsError:
                return self.begin(refuse_other, alone)
            finally:
                written.unlink()

    def _remove_dead_staging(self, alone: bool) -> None:
        host = socket.gethostname()
        for staging in self.folder.glob(".staging-*"):
            writer_host, _, pid = staging.name[len(".staging-"):].rpartition("-")
            if alone or (writer_host == host and pid.isdigit() and not _alive(int(pid))):
                shutil.rmtree(staging, ignore_errors=True)

    def _earlier_identity(self) -> dict | None:
        try:
            return json.loads(self.plan_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):      # damaged: nothing can be taken up
            return {}

    def done(self) -> dict[int, ShardDone]:
        """The finished shards, by number: those with a record whose files are there at their size."""
        finished = {}
        for path in sorted(self.records.glob("shard-*.json")):
            try:
                done = ShardDone.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if done.record is None or all(self._whole(file.name, file.bytes)
                                          for file in ShardRecord.from_dict(done.record).files().values()):
                finished[int(path.stem.split("-")[1])] = done
        return finished

    def _whole(self, name: str, size: int | None) -> bool:
        try:
            return (self.folder / name).stat().st_size == size
        except OSError:
            return False

    def staging(self) -> Path:
        """A folder of this process's own for the shard it writes (hosts may share OUT)."""
        return self.folder / f".staging-{socket.gethostname()}-{os.getpid()}"

    def finished(self, number: int, done: ShardDone, staging: Path) -> None:
        """Move a shard written in `staging` into place, then record it."""
        if done.record is not None:
            for file in ShardRecord.from_dict(done.record).files().values():
                os.replace(staging / file.name, self.folder / file.name)
            fsync_path(self.folder)
        name = SHARD_NAME.format(number)
        write_bytes_atomic(self.records / f"{name}.json", json.dumps(done.as_dict()).encode())

    def place(self, final: Path) -> None:
        """Put the finished shards in OUT/<split> (the earlier files there are replaced) and forget
        the work."""
        for leftover in self.folder.glob(".staging-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        replace_atomically(self.folder, final)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self.records, ignore_errors=True)
        self.plan_file.unlink(missing_ok=True)
        for written in self.plan_file.parent.glob(f".{self.plan_file.name}.tmp-*"):     # a plan being written when killed
            written.unlink(missing_ok=True)
        try:
            (self.out / WORK).rmdir()
        except OSError:
            pass


def forget_work(out: Path, split: str) -> None:
    """Remove what an interrupted conversion of `split` left in OUT (once the split is complete
    there, written this time or found up to date)."""
    InProgress(out, split, {}).discard()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
