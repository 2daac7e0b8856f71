"""How well an epoch's order of samples is shuffled, for the webdataset backend's plan: one epoch
of a converted split, the global order (global step after global step, each step's samples as
its ranks hold them, rank 0's first), measured two ways:

- displacement: how far a sample moves from its stored place, as a share of the split (a
  uniformly random order averages 1/3);
- neighbours: how often two consecutive samples of the global order share a class (a random
  order gives the sum over classes of their squared shares: 0.1 for ten balanced classes), and
  how often they come from one shard: the same-class share of a dataset whose shards each hold
  one class (our converters shuffle before writing, so classes are mixed within shards).

    .venv/bin/python benchmarks/shuffle_quality.py data/wds/fashion --global-batch 12 1024 --world-size 1 8

It reads only the shards' index and labels (no image is decoded) and prints a table; `--out FILE`
appends the figures as JSON lines (benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from pipeline.datasets import read_converted
from pipeline.shards.index import StoredShards
from pipeline.spec import LoaderSpec


def global_order(stored: StoredShards, path: str, global_batch: int, world_size: int, epoch: int, seed: int):
    """The epoch's stored sample ids in global order."""
    plans = [stored.epoch_batches(LoaderSpec(backend="webdataset", path=path, batch_size=global_batch // world_size,
                                             rank=rank, world_size=world_size, seed=seed), epoch)
             for rank in range(world_size)]
    return np.concatenate([np.concatenate([plan[step] for plan in plans]) for step in range(len(plans[0]))])


def quality(order: np.ndarray, labels: np.ndarray, shards: np.ndarray) -> dict:
    displacement = np.abs(np.arange(len(order)) - order).mean() / len(labels)
    shares = np.bincount(labels) / len(labels)
    shard_shares = np.bincount(shards) / len(shards)
    return {"displacement": round(float(displacement), 4),
            "same_class_neighbours": round(float(np.mean(labels[order[1:]] == labels[order[:-1]])), 4),
            "same_class_if_random": round(float((shares ** 2).sum()), 4),
            "same_shard_neighbours": round(float(np.mean(shards[order[1:]] == shards[order[:-1]])), 4),
            "same_shard_if_random": round(float((shard_shares ** 2).sum()), 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a convert_wds.py output folder")
    parser.add_argument("--global-batch", type=int, nargs="+", default=[1024])
    parser.add_argument("--world-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="a name for this order in the output (e.g. a commit)")
    parser.add_argument("--out", help="append the figures as JSON lines here")
    args = parser.parse_args(argv)
    split = read_converted(args.path, "train", "webdataset")
    stored = StoredShards(split.shards)
    labels = np.array([stored.read(sample)[1] for sample in range(len(stored))])
    rows = []
    for global_batch in args.global_batch:
        for world_size in args.world_size:
            if global_batch % world_size:
                continue
            order = global_order(stored, args.path, global_batch, world_size, args.epoch, args.seed)
            rows.append({"order": args.label, "dataset": Path(args.path).name, "samples": len(stored),
                         "global_batch": global_batch, "world_size": world_size, "epoch": args.epoch,
                         **quality(order, labels, stored.shard_of)})
    print(f"{'order':>10} {'global batch':>12} {'world size':>10} {'displacement':>12} {'same class':>20} "
          f"{'same shard':>20}  (neighbours; a random order's share in brackets)")
    for row in rows:
        print(f"{row['order']:>10} {row['global_batch']:>12} {row['world_size']:>10} {row['displacement']:>12.3f} "
              f"{row['same_class_neighbours']:>11.3f} ({row['same_class_if_random']:.3f}) "
              f"{row['same_shard_neighbours']:>11.3f} ({row['same_shard_if_random']:.3f})")
    if args.out:
        with open(args.out, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
