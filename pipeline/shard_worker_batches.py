"""Batches of a WebDataset split decoded with Pillow in DataLoader worker processes: the
webdataset backend's path for RandAugment (its operations are Pillow's, in Python) and for
`native_decode=False`. Each batch key names its epoch, side and stored sample ids, so
persistent workers need nothing else from the loader; region decode by `pipeline/jpeg_roi.py`.
"""
from __future__ import annotations

from torch.utils.data import Dataset

from pipeline.sample_decode import collate, load_or_report
from pipeline.shard_index import StoredShards
from pipeline.spec import LoaderSpec


class WorkerBatches(Dataset):
    """Map-style, for DataLoader workers: a batch key (epoch, side, sample ids) -> a collated
    uint8 batch."""

    def __init__(self, stored: StoredShards, spec: LoaderSpec):
        self.stored, self.spec = stored, spec

    def __len__(self) -> int:
        return len(self.stored)

    def __getitem__(self, key):
        epoch, side, ids = key
        images, labels = [], []
        for sample_id in ids.tolist():
            jpeg, label = self.stored.read(sample_id)
            images.append(load_or_report(jpeg, self.spec, name=self.stored.name(sample_id), sample_id=sample_id,
                                         epoch=epoch, side=side, roi=True))
            labels.append(label)
        return collate(images, labels)
