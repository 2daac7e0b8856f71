"""The global batch a run keeps for life, and what a resume compares (training/data_order.py)."""
from __future__ import annotations

import pytest

from training import data_order
from training.config import ConfigError, load_config


def config(*overrides):
    return load_config(None, ["data.backend=synthetic", "data.batch_size=128", *overrides])


def checkpoint(global_batch: int, requested: int, **order) -> dict:
    return {"data_order": {"global_batch_size": global_batch, "requested_batch_size": requested, "backend": "webdataset",
                           "train_samples": 1000, "classes": 10, **order}}


def test_a_new_run_takes_batch_size_times_world_size():
    given = config()
    run, record = data_order.settle_global_batch(given, 8, None)
    assert record == {"global_batch_size": 1024, "requested_batch_size": 128}
    assert (run.data.batch_size, run.data.global_batch_size) == (128, 1024)
    assert given == config()                                # settled in a copy


def test_a_resume_on_fewer_processes_keeps_the_global_batch():
    run, record = data_order.settle_global_batch(config(), 4, checkpoint(1024, 128))
    assert record["global_batch_size"] == 1024 and run.data.batch_size == 256


def test_an_explicit_global_batch_or_another_batch_size_asks_for_another():
    explicit, record = data_order.settle_global_batch(config("data.global_batch_size=512"), 4, checkpoint(1024, 128))
    assert record["global_batch_size"] == 512 and explicit.data.batch_size == 128
    _, record = data_order.settle_global_batch(config("data.batch_size=64"), 8, checkpoint(1024, 128))
    assert record["global_batch_size"] == 512


@pytest.mark.parametrize("overrides, world_size, message", [
    ((), 3, "the global batch of 1024 samples does not divide among 3 processes: run on a number of processes"),
    (("grad_accum=128",), 16, "does not divide among 16 processes into 128 micro-batches each"),
])
def test_a_world_size_that_does_not_divide_the_global_batch_is_refused(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        data_order.settle_global_batch(config(*overrides), world_size, checkpoint(1024, 128))


def test_changes_name_each_thing_that_differs():
    saved = checkpoint(1024, 128)["data_order"]
    assert data_order.changes(saved, dict(saved)) == []
    now = {**saved, "global_batch_size": 512, "backend": "ffcv", "train_samples": 900}
    assert data_order.changes(saved, now) == ["global batch 1024 -> 512", "backend webdataset -> ffcv",
                                              "dataset of 1000 train samples in 10 classes -> 900 in 10"]


def test_a_checkpoint_from_before_the_record_is_read_from_its_config():
    old = {"world_size": 2, "config": {"data": {"batch_size": 64, "backend": "folder"}}}
    saved = data_order.saved_order(old)
    assert (saved["global_batch_size"], saved["requested_batch_size"], saved["backend"]) == (128, 64, "folder")
    assert data_order.changes(saved, {**saved, "train_samples": 5, "classes": 2}) == []   # its dataset unknown
