"""The training loop's parts, each alone: engine order, LR schedule, optimizer, losses, checkpoints,
and the loop's events and counters in one in-process run on the synthetic backend."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from algorithms.base import Algorithm, Event
from training import checkpoints
from training.checkpoints import CheckpointStore
from training.config import ConfigError, load_config
from training.distributed import World
from training.engine import Engine
from training.losses import binary_cross_entropy, cross_entropy
from training.optim import DecoupledSGDW, build_optimizer, lr_factor, peak_lr
from training.trainer import Trainer


class Recorder(Algorithm):
    """Records (name, event) for every event, into a log shared between recorders."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.count = name, log, 0

    def match(self, event, state):
        return True

    def apply(self, event, state):
        self.log.append((self.name, event))
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_engine_runs_in_order_and_reverses_on_closing_events():
    log = []
    engine = Engine([Recorder("a", log), Recorder("b", log)])
    engine.fire(Event.BEFORE_FORWARD, None)
    engine.fire(Event.AFTER_BACKWARD, None)
    assert log == [("a", Event.BEFORE_FORWARD), ("b", Event.BEFORE_FORWARD),
                   ("b", Event.AFTER_BACKWARD), ("a", Event.AFTER_BACKWARD)]
    saved = engine.state_dict()
    assert saved == {"0:Recorder": {"count": 2}, "1:Recorder": {"count": 2}}
    with pytest.raises(ValueError, match="checkpoint has algorithms"):
        Engine([Recorder("a", [])]).load_state_dict(saved)


def test_lr_factor_warmup_cosine_linear_step():
    common = dict(total=110, warmup=10, final_fraction=0.0, milestones=(50, 80), gamma=0.1)
    assert lr_factor(0, kind="cosine", **common) == pytest.approx(0.1)
    assert lr_factor(9, kind="cosine", **common) == pytest.approx(1.0)
    assert lr_factor(10, kind="cosine", **common) == pytest.approx(1.0)
    assert lr_factor(60, kind="cosine", **common) == pytest.approx(0.5)
    assert lr_factor(110, kind="cosine", **common) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(60, kind="linear", **common) == pytest.approx(0.5)
    assert lr_factor(60, kind="linear", **{**common, "final_fraction": 0.2}) == pytest.approx(0.6)
    assert [lr_factor(s, kind="step", **common) for s in (49, 50, 80)] == pytest.approx([1, 0.1, 0.01])


def test_the_hardware_decoder_share_reaches_the_loader_spec_and_is_checked():
    config = load_config(None, ["data.backend=dali", "data.path=x", "data.hw_decoder_load=1"])
    assert config.data.loader_spec("train", device="cpu").hw_decoder_load == 1.0
    assert load_config(None, ["data.backend=dali", "data.path=x"]).data.loader_spec("val", device="cpu").hw_decoder_load == 0.65
    with pytest.raises(ConfigError, match=r"^data: hw_decoder_load must be in \[0, 1\], got 1.5$"):
        load_config(None, ["data.backend=dali", "data.path=x", "data.hw_decoder_load=1.5"])


def test_optimizer_scales_lr_and_decays_only_weights():
    config = load_config(None, ["data.backend=synthetic", "optim.lr=0.1", "optim.lr_reference_batch=256",
                                "optim.weight_decay=0.01", "optim.momentum=0"])
    assert peak_lr(config.optim, 1024) == pytest.approx(0.4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = build_optimizer(model, config.optim, 1024)
    weight, bias, bn_weight = (p.detach().clone() for p in (model[0].weight, model[0].bias, model[1].weight))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # decoupled: the weight shrinks by weight_decay (times lr / peak lr = 1), not by lr * weight_decay
    torch.testing.assert_close(model[0].weight, weight * (1 - 0.01))
    torch.testing.assert_close(model[0].bias, bias)
    torch.testing.assert_close(model[1].weight, bn_weight)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] / 2
    optimizer.step()
    torch.testing.assert_close(model[0].weight, weight * (1 - 0.01) * (1 - 0.005))
    assert isinstance(optimizer, DecoupledSGDW)


def test_losses_agree_with_their_definitions():
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 5), torch.randint(5, (6,))
    for smoothing in (0.0, 0.1):
        expected = F.cross_entropy(logits, labels, label_smoothing=smoothing)
        torch.testing.assert_close(cross_entropy(logits, labels, smoothing), expected)
        torch.testing.assert_close(cross_entropy(logits, F.one_hot(labels, 5).float(), smoothing), expected)
    one_hot = F.one_hot(labels, 5).float()
    per_element = F.binary_cross_entropy_with_logits(logits, one_hot, reduction="none")
    torch.testing.assert_close(binary_cross_entropy(logits, labels), per_element.sum(1).mean())
    torch.testing.assert_close(binary_cross_entropy(logits, labels, reduction="mean"), per_element.mean())


def test_checkpoint_store_keeps_newest_and_skips_damaged(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (5, 10, 15):
        store.save({"step": step, "weights": torch.full((3,), float(step))}, epoch=step // 10, step=step)
    assert [p.name for p in store.checkpoints()] == ["ep1-ba10.pt", "ep1-ba15.pt"]
    assert not list(tmp_path.glob(".*tmp*"))
    newest = store.checkpoints()[-1]
    newest.write_bytes(newest.read_bytes()[:100])             # a crash mid-copy, say
    with caplog.at_level(logging.WARNING, logger="training"):
        path, state = store.load_newest()
    assert path.name == "ep1-ba10.pt" and state["step"] == 10
    assert "ep1-ba15.pt does not load" in caplog.text


def test_a_checkpoint_whose_tensor_bytes_changed_is_named_and_the_one_before_it_used(tmp_path, caplog):
    from runs import flip_a_tensor_byte
    store = CheckpointStore(tmp_path, keep=3)
    for step in (5, 10):
        store.save({"step": step, "weights": torch.arange(4096, dtype=torch.float32) * step}, epoch=0, step=step)
    newest = store.checkpoints()[-1]
    flip_a_tensor_byte(newest)
    damaged = torch.load(newest, weights_only=True)             # it still loads: only the checksum tells
    assert not torch.equal(damaged["weights"], torch.arange(4096, dtype=torch.float32) * 10)
    with caplog.at_level(logging.WARNING, logger="training"):
        path, state = store.load_newest()
    assert path.name == "ep0-ba5.pt" and state["step"] == 5 and "sha256" not in state
    [line] = [r.getMessage() for r in caplog.records if "ep0-ba10.pt" in r.getMessage()]
    assert "fail the sha256 it records" in line and "trying the one before it" in line
    with pytest.raises(ConfigError, match=r"resume=.*ep0-ba10.pt: cannot load it \(its contents fail the sha256"):
        checkpoints.find(store, str(newest))
    torch.save({"step": 1, "weights": torch.ones(3)}, tmp_path / "ep0-ba1.pt")   # written before checksums: taken
    assert checkpoints.load(tmp_path / "ep0-ba1.pt")["step"] == 1


def test_checkpoints_refuse_pickled_code(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    store.save({"step": 1}, epoch=0, step=1)
    torch.save({"step": 2, "payload": Recorder("x", [])}, tmp_path / "ep0-ba2.pt")  # not weights_only-safe
    with caplog.at_level(logging.WARNING, logger="training"):
        path, state = store.load_newest()
    assert state == {"step": 1} and "ep0-ba2.pt does not load" in caplog.text


def test_resume_finds_the_named_checkpoint_or_says_in_one_line_why_not(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=2)
    assert checkpoints.find(store, "auto") is None                  # a new run
    store.save({"step": 3}, epoch=0, step=3)
    assert checkpoints.find(store, "auto") == (store.checkpoints()[-1], {"step": 3})
    named = tmp_path / "elsewhere.pt"
    torch.save({"step": 7}, named)
    assert checkpoints.find(store, str(named)) == (named, {"step": 7})
    torch.save({"step": 8, "payload": Recorder("x", [])}, named)    # not weights_only-safe: a long message
    reasons = [rf"it holds a {Recorder.__module__}.Recorder object, and checkpoints load weights-only",
               r"\w+Error: "]                                          # then truncated: torch's first line
    for damage, reason in zip((lambda: None, lambda: named.write_bytes(named.read_bytes()[:50])), reasons):
        damage()
        with pytest.raises(ConfigError, match=rf"^resume={named}: cannot load it \({reason}") as raised:
            checkpoints.find(store, str(named))
        assert "\n" not in str(raised.value) and "weights_only=False" not in str(raised.value)


def test_changed_config_keys_are_dotted_and_leave_out_where_the_run_is():
    old = {"optim": {"lr": 0.1, "momentum": 0.9}, "run_dir": "a", "resume": "never", "seed": 1}
    new = {"optim": {"lr": 0.2, "momentum": 0.9}, "run_dir": "b", "resume": "auto", "seed": 1, "compile": True}
    assert checkpoints.changed_keys(old, new) == ["compile", "optim.lr"]


def test_loop_fires_events_in_order_and_counts(tmp_path):
    config = load_config(None, ["data.backend=synthetic", "data.num_classes=4", "data.synthetic_size=48",
                                "data.batch_size=8", "data.resolution=16", "data.val_resolution=16",
                                "model.name=small_resnet", "model.width=4", "model.blocks_per_stage=1",
                                "max_duration=2ep", "grad_accum=2", "precision=fp32", "log.progress=false",
                                f"run_dir={tmp_path}", "checkpoint.interval=1ep", "log.interval=2"])
    log = []
    trainer = Trainer(config, World(0, 0, 1, torch.device("cpu")), [Recorder("a", log)])
    summary = trainer.fit()
    events = [event for _, event in log]
    step = [Event.AFTER_DATALOADER] + [Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS,
                                       Event.AFTER_BACKWARD] * 2 + [Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END]
    epoch = [Event.EPOCH_START] + step * 6 + [Event.EPOCH_END, Event.EVAL_START, Event.EVAL_END]
    assert events == [Event.INIT, Event.FIT_START] + epoch * 2 + [Event.FIT_END]
    assert summary["steps"] == 12 and summary["epochs"] == 2 and summary["world_size"] == 1
    assert trainer.state.lr == pytest.approx(0.0, abs=1e-9)        # cosine ran to its end, step-wise
    assert math.isfinite(summary["last_val_top1"])
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["ep2-ba12.pt"] or \
        sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ep1-ba6.pt", "ep2-ba12.pt"]
