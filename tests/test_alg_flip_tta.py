"""FlipTTA: the averaged logits are mirror-invariant, evaluation uses them (on EMA's weights when
both are on), and training and the model a run hands back are untouched."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.ema import EMA
from algorithms.flip_tta import FlipAveraged, FlipTTA, flip_averaged_logits
from conftest import tiny_trainer
from training.models import build_model


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("small_resnet", num_classes=5, width=4, blocks_per_stage=1).eval()


def test_averaged_logits_are_the_same_for_an_image_and_its_mirror():
    model, images = small_model(), torch.randn(6, 3, 16, 16)
    with torch.no_grad():
        averaged, mirrored = flip_averaged_logits(model, images), flip_averaged_logits(model, images.flip(-1))
        plain, plain_mirrored = model(images), model(images.flip(-1))
    torch.testing.assert_close(averaged, mirrored)
    torch.testing.assert_close(averaged, (plain + plain_mirrored) / 2)
    assert not torch.allclose(plain, plain_mirrored, atol=1e-4)     # the model alone is not invariant


def test_wrapper_has_the_models_parameters_in_order():
    model = small_model()
    assert [id(p) for p in FlipAveraged(model).parameters()] == [id(p) for p in model.parameters()]


def evaluated_by_hand(trainer) -> dict:
    """Top-1 and loss over the val split with flip-averaged logits of the model as it is now."""
    state, correct, loss, count = trainer.state, 0, 0.0, 0
    state.model.eval()
    state.val_loader.set_epoch(0)
    with torch.no_grad():
        for images, targets in state.val_loader:
            logits = flip_averaged_logits(state.model, images)
            correct += (logits.argmax(1) == targets).sum().item()
            loss += F.cross_entropy(logits, targets, reduction="sum").item()
            count += targets.shape[0]
    state.model.train()
    return {"val_top1": round(100 * correct / count, 3), "val_loss": round(loss / count, 5)}


def parameters(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.state.model.parameters()])


def test_evaluation_uses_flip_averaged_logits_and_training_is_untouched(tmp_path):
    tta = tiny_trainer(tmp_path / "tta", [FlipTTA()], "optim.lr=1.0")
    tta.fit()
    plain = tiny_trainer(tmp_path / "plain", [], "optim.lr=1.0")
    plain.fit()
    assert type(tta.state.model) is type(plain.state.model)        # unwrapped after every evaluation
    assert torch.equal(parameters(tta), parameters(plain))         # same seed, same training
    by_hand = evaluated_by_hand(tta)
    assert tta.state.metrics["val_top1"] == by_hand["val_top1"]
    assert abs(tta.state.metrics["val_loss"] - by_hand["val_loss"]) < 1e-4
    assert abs(plain.state.metrics["val_loss"] - by_hand["val_loss"]) > 1e-4   # TTA changed what was measured


def test_after_ema_it_evaluates_the_averaged_weights(tmp_path):
    trainer = tiny_trainer(tmp_path, [EMA(half_life="2ba"), FlipTTA()], "optim.lr=1.0")
    trainer.fit()                                                   # FIT_END leaves the EMA weights in
    metrics = dict(trainer.state.metrics)
    by_hand = evaluated_by_hand(trainer)
    assert metrics["val_top1"] == by_hand["val_top1"] and abs(metrics["val_loss"] - by_hand["val_loss"]) < 1e-4
