"""Print what the data folder holds: every converted dataset's format, classes, counts and size.

    python tools/summarize_data.py [DATA]     (default: data; `make demo` ends with this)

Reads the converters' manifests (OUT/manifest.json) under DATA and the sample sets under
DATA/sample; prints one line per dataset, and nothing else is touched.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.formats.manifest import MANIFEST, ManifestError, read_manifest


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def rows(data: Path) -> list[tuple]:
    found = []
    for split_root in sorted(data.glob("sample/*/train")):
        root = split_root.parent
        counts = {split: sum(1 for p in (root / split).glob("*/*") if p.is_file()) for split in ("train", "val")}
        classes = sum(1 for p in split_root.iterdir() if p.is_dir())
        found.append((root.name, "jpeg folder", classes, counts, folder_bytes(root), root))
    for manifest_path in sorted(data.glob(f"*/*/{MANIFEST}")):
        root = manifest_path.parent
        manifest = read_manifest(root)
        size = sum((root / f).stat().st_size for record in manifest["splits"].values()
                   for f in record["files"] if (root / f).exists())
        found.append((root.name, manifest["format"], len(manifest["classes"]), manifest["counts"], size, root))
    return found


def main(argv: list[str]) -> int:
    data = Path(argv[0] if argv else "data")
    try:
        table = rows(data)
    except ManifestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not table:
        print(f"error: {data}: no sample sets or converted datasets found", file=sys.stderr)
        return 2
    print(f"{'dataset':<10} {'format':<12} {'classes':>7} {'train':>8} {'val':>8} {'MiB':>8}  path")
    for name, fmt, classes, counts, size, root in table:
        print(f"{name:<10} {fmt:<12} {classes:>7} {counts.get('train', 0):>8} {counts.get('val', 0):>8} "
              f"{size / 2**20:>8.1f}  {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
