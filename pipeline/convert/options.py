"""The converters' options as typed values: how a run goes (`RunOptions`: where from and to, with
how many workers; none of it changes what is written) and what each format writes (`WdsOptions`,
`FfcvOptions`, both `ImageOptions`). Only the format's options go into the manifest's `params`,
and --repair reads them back from there (`from_params`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import SourceOptions

WRITE_MODES = ("raw", "jpg", "smart", "proportion")


@dataclass(frozen=True)
class RunOptions:
    src: str                      # a folder, or an s3://, gs:// or http(s):// prefix (the forms read from URLs)
    out: str                      # a folder, or an s3:// or gs:// prefix to upload to
    splits: tuple[str, ...] = ("train", "val")
    num_workers: int = 1
    strict: bool = False          # exit 1 if anything was skipped; a damaged source tar stops the run
    force: bool = False           # convert even where OUT is up to date
    staging: Path | None = None   # where an upload is converted first
    upload_workers: int = 4
    source: SourceOptions = field(default_factory=SourceOptions)
    executor: str = "local"       # "local" (the process pool) or "ray"
    ray_address: str | None = None
    part: tuple[int, int] | None = None   # (I, N): write only part I of N of the shards
    finish: int | None = None     # N: the parts are done; check and write the manifest

    def __post_init__(self):
        if self.part is not None and not 0 <= self.part[0] < self.part[1]:
            raise ConversionError(f"--part {self.part[0]}/{self.part[1]}: give I/N with 0 <= I < N")
        if sum((self.part is not None, self.finish is not None, self.executor != "local")) > 1:
            raise ConversionError("--part, --finish and --executor ray are three ways to run; choose one")
        if self.finish is not None and self.finish < 1:
            raise ConversionError(f"--finish {self.finish}: give the number of parts, N >= 1")
        spread = self.part is not None or self.finish is not None or self.executor != "local"
        if spread and self.out.startswith(("s3://", "gs://")) and self.staging is None:
            raise ConversionError(f"{self.out}: converting on many machines into a bucket needs --staging, a folder "
                                  "every machine sees, where the shards are written before the upload")
        if self.num_workers < 1:
            raise ConversionError(f"--num-workers must be >= 1, got {self.num_workers}")
        if self.upload_workers < 1:
            raise ConversionError(f"--upload-workers must be >= 1, got {self.upload_workers}")
        if not self.splits:
            raise ConversionError("--splits is empty")


@dataclass(frozen=True)
class ImageOptions:
    max_resolution: int = 512     # longest side; 0 keeps sizes
    jpeg_quality: int = 90

    def __post_init__(self):
        if self.max_resolution < 0:
            raise ConversionError(f"--max-resolution must be >= 0, got {self.max_resolution}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConversionError(f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}")

    def params(self) -> dict:
        """The manifest's record of these options."""
        return asdict(self)

    @classmethod
    def from_params(cls, params: dict):
        """The options a manifest records (one written before options were typed holds more keys)."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in params.items() if key in names})


@dataclass(frozen=True)
class WdsOptions(ImageOptions):
    shard_size_mb: float = 256
    shard_samples: int | None = None     # samples a shard; None: from shard_size_mb and the source's sizes
    seed: int = 0                 # of the train split's write order
    restart_markers: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.shard_size_mb <= 0:
            raise ConversionError(f"--shard-size-mb must be > 0, got {self.shard_size_mb}")
        if self.shard_samples is not None and self.shard_samples < 1:
            raise ConversionError(f"--shard-samples must be >= 1, got {self.shard_samples}")


@dataclass(frozen=True)
class FfcvOptions(ImageOptions):
    write_mode: str = "jpg"
    smart_threshold: int | None = None
    compress_probability: float = 0.5
    chunk_size: int = 100

    def __post_init__(self):
        super().__post_init__()
        if self.write_mode not in WRITE_MODES:
            raise ConversionError(f"--write-mode must be one of {', '.join(WRITE_MODES)}, got {self.write_mode}")
        if not 0 <= self.compress_probability <= 1:
            raise ConversionError(f"--compress-probability must be in [0, 1], got {self.compress_probability}")
        if self.chunk_size < 1:
            raise ConversionError(f"--chunk-size must be >= 1, got {self.chunk_size}")
