"""Batches of a WebDataset split decoded with Pillow in DataLoader worker processes: the
webdataset backend's path for RandAugment (its operations are Pillow's, in Python) and for
`native_decode=False`. Each batch key names its epoch, side and stored sample ids, so
persistent workers need nothing else from the loader; region decode by `pipeline/decode/jpeg_roi.py`.

From a URL the keys also carry the samples' bytes, read in the main process (`KeysWithSamples`):
a forked worker cannot use the object-storage client, whose runtime threads stay in the parent
(a request from a worker hangs).
"""
from __future__ import annotations

from torch.utils.data import Dataset

from pipeline.decode.pillow_sample import collate, load_or_report
from pipeline.errors import CorruptSample
from pipeline.loader.base import not_a_class
from pipeline.shards.index import StoredShards
from pipeline.spec import LoaderSpec


class WorkerBatches(Dataset):
    """Map-style, for DataLoader workers: a batch key (epoch, side, sample ids[, their (JPEG,
    label)s]) -> a collated uint8 batch."""

    def __init__(self, stored: StoredShards, spec: LoaderSpec, num_classes: int):
        self.stored, self.spec, self.num_classes = stored, spec, num_classes

    def __len__(self) -> int:
        return len(self.stored)

    def __getitem__(self, key):
        epoch, side, ids, *carried = key
        samples = carried[0] if carried else [read_or_report(self.stored, sample_id) for sample_id in ids.tolist()]
        images, labels = [], []
        for sample_id, (jpeg, label) in zip(ids.tolist(), samples):
            name = self.stored.name(sample_id)
            if isinstance(jpeg, str):                   # its bytes failed their checksum
                images.append(jpeg)
            elif not 0 <= label < self.num_classes:     # a damaged label: reported like an undecodable image
                images.append(not_a_class(name, label, self.num_classes))
            else:
                images.append(load_or_report(jpeg, self.spec, name=name, sample_id=sample_id, epoch=epoch, side=side,
                                             roi=True))
            labels.append(label)
        return collate(images, labels)


class KeysWithSamples:
    """Batch keys (epoch, side, ids) as a sequence whose items also carry each sample's (JPEG
    bytes, label), read from `stored` when the DataLoader takes the key, in the main process."""

    def __init__(self, stored: StoredShards, keys: list):
        self.stored, self.keys = stored, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return KeysWithSamples(self.stored, self.keys[index])
        epoch, side, ids = self.keys[index]
        return epoch, side, ids, [read_or_report(self.stored, sample_id) for sample_id in ids.tolist()]


def read_or_report(stored: StoredShards, sample_id: int) -> tuple:
    """(JPEG bytes, label), or (the message, 0) for a sample whose bytes fail their checksum."""
    try:
        return stored.read(sample_id)
    except CorruptSample as damaged:
        return str(damaged), 0
