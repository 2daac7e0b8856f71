"""The CUDA path, on a machine with a GPU (`make gpu-check` runs `pytest -m cuda`); skipped
with the reason elsewhere. DALI `mixed` against DALI's CPU graph and `folder`; every backend
onto the device from pinned memory; train steps in bf16 and fp16 (GradScaler) with
channels-last under a real torchrun (NCCL); checkpoints moving between CUDA and the CPU."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, made_once, run_tool
from pipeline import LoaderSpec, build_loader

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (make gpu-check runs these)")]
UNIT = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))   # "normalized" pixels stay in 0..255
HAS = {name: importlib.util.find_spec(module) is not None for name, module in (("ffcv", "ffcv"), ("dali", "nvidia.dali"))}


def needs(name):
    return pytest.mark.skipif(not HAS[name], reason=f"{name} is not installed here")


@pytest.fixture(scope="module")
def photos(tmp_path_factory, debian_cache) -> dict:
    """The photos sample, 4 images per class and split, in every form this machine can read."""
    from make_sample_data import make_photos

    def make(root):
        make_photos(root, limit=4, progress=False, cache_dir=debian_cache)
        run_tool("convert_wds.py", root / "photos", root / "photos_wds", check=True)
        if HAS["ffcv"]:
            run_tool("convert_ffcv.py", root / "photos", root / "photos_ffcv", check=True)
    root = made_once(tmp_path_factory, "cuda-photos", make)
    return {"folder": root / "photos", "webdataset": root / "photos_wds", "ffcv": root / "photos_ffcv"}


def first_val_batch(photos, backend, form, device, **spec):
    loader = build_loader(LoaderSpec(backend, path=str(photos[form]), split="val", batch_size=64, num_workers=2,
                                     val_resolution=160, val_crop_ratio=224 / 256, device=device, **UNIT, **spec))
    images, labels = next(iter(loader))
    assert images.device.type == device.split(":")[0], (backend, form, images.device)
    return images.float().cpu(), labels.cpu()


@needs("dali")
@pytest.mark.parametrize("form", ["folder", "webdataset"])
def test_dali_mixed_gives_the_pixels_of_dali_on_the_cpu_and_of_folder(photos, form):
    """The cross-backend tolerance of test_loaders (mean |difference| <= 2.5 in 0..255, no image
    worse than 8), for nvJPEG alone (hw_decoder_load 0) and with the hardware decoder (1)."""
    reference, reference_labels = first_val_batch(photos, "folder", "folder", "cpu")
    dali_cpu, _ = first_val_batch(photos, "dali", form, "cpu")
    for load in (0.0, 1.0):
        images, labels = first_val_batch(photos, "dali", form, "cuda", hw_decoder_load=load)
        assert torch.equal(labels, reference_labels)
        for other, name in ((reference, "folder"), (dali_cpu, "dali cpu")):
            difference = (images - other).abs()
            print(f"dali mixed hw {load} vs {name}: mean |difference| {difference.mean():.3f}, "
                  f"worst image {difference.flatten(1).mean(1).max():.3f}")
            assert difference.mean() <= 2.5, (load, name, float(difference.mean()))
            assert difference.flatten(1).mean(1).max() <= 8, (load, name)


def test_webdataset_engine_on_cuda_gives_the_pixels_of_its_cpu_path(photos):
    """uint8 in pinned memory, normalized on the device: the same floats as the CPU path."""
    on_cpu, labels = first_val_batch(photos, "webdataset", "webdataset", "cpu")
    on_gpu, gpu_labels = first_val_batch(photos, "webdataset", "webdataset", "cuda")
    assert torch.equal(labels, gpu_labels)
    assert torch.allclose(on_cpu, on_gpu, atol=1e-3), float((on_cpu - on_gpu).abs().max())


DEVICE_CASES = [("webdataset", "webdataset", {}), ("webdataset", "webdataset", {"native_decode": False}),
                ("folder", "folder", {}), pytest.param("ffcv", "ffcv", {}, marks=needs("ffcv")),
                pytest.param("dali", "webdataset", {}, marks=needs("dali"))]


@pytest.mark.parametrize("backend,form,spec", DEVICE_CASES,
                         ids=["webdataset", "webdataset-pillow", "folder", "ffcv", "dali"])
def test_batches_reach_the_device_and_host_copies_come_from_pinned_memory(photos, backend, form, spec):
    """Two train epochs under the CUDA profiler: every host-to-device copy the loader makes is
    'Pinned -> Device' (a pageable copy would stage through a bounce buffer and block)."""
    loader = build_loader(LoaderSpec(backend, path=str(photos[form]), batch_size=16, num_workers=2, resolution=96,
                                     device="cuda", **spec))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for images, labels in loader:
                assert images.is_cuda and labels.is_cuda and images.shape[-1] == 96
        torch.cuda.synchronize()
    copies = [event.name for event in profile.events() if "Memcpy HtoD" in event.name]
    print(f"{backend} {spec}: {len(copies)} host-to-device copies: {sorted(set(copies))}")
    if backend == "dali":             # DALI decodes on the device; its own small copies are its business
        return
    assert copies, "no host-to-device copy was seen"
    assert not any("Pageable" in name for name in copies), copies


def torchrun(run_dir, *overrides, nproc=1, device="cuda", timeout=300):
    """training/main.py under torchrun on synthetic data, as a user launches it; returns stdout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "training" / "main.py"), "data.backend=synthetic", "data.num_classes=10",
               "data.synthetic_size=512", "data.batch_size=64", "data.resolution=64", "data.val_resolution=64",
               "model.name=resnet18", "log.progress=false", "log.tensorboard=false", "checkpoint.interval=1ep",
               f"device={device}", f"run_dir={run_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_steps_in_bf16_and_fp16_channels_last_under_torchrun_nccl(tmp_path, precision):
    torchrun(tmp_path, "max_duration=2ep", f"precision={precision}", "channels_last=true", "log.interval=2")
    losses = [m["train_loss"] for m in metrics(tmp_path) if "train_loss" in m]
    assert losses and all(loss == loss and loss < 1e4 for loss in losses), losses   # finite, not diverged
    checkpoint = torch.load(sorted((tmp_path / "checkpoints").glob("ep2-*.pt"))[0], map_location="cpu",
                            weights_only=True)
    if precision == "fp16":             # the GradScaler ran and its scale is saved to resume with
        assert checkpoint["scaler"].get("scale") is not None, checkpoint["scaler"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["train_img_per_s"] > 0, summary


@pytest.mark.timeout(300)
def test_precision_auto_on_cuda_is_bf16_where_the_gpu_has_it_without_measuring(tmp_path):
    log = torchrun(tmp_path, "max_duration=1ep", "precision=auto")
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert f"precision auto: {expected} (this GPU " in log and "train step here" not in log, log[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["precision"] == expected


def test_a_batch_crosses_to_the_high_priority_step_stream_in_order():
    """The races of training/step_stream.py, each made certain by a GPU sleep on the stream that would
    lose it: the step reading the batch before the loader's stream wrote it; the loader's next batch
    taking the memory the step still reads; the default stream reading the step's result early."""
    from training.step_stream import StepStream
    device, cycles = torch.device("cuda"), 200_000_000            # about 0.1 s on an H100's clock
    steps = StepStream(device, "high_priority")
    assert steps.stream.priority == torch.cuda.Stream.priority_range()[1] < 0
    batch = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)                  # the loader's stream is slow to write the batch
    batch.fill_(1.0)
    with steps.around(batch):
        assert torch.cuda.current_stream() == steps.stream
        torch.cuda._sleep(cycles)              # the step is slow to read it
        total = batch.sum()
    del batch
    reused = torch.full((1 << 20,), 5.0, device=device)   # the next batch, on the loader's stream
    assert torch.cuda.current_stream() != steps.stream
    assert total.item() == 1 << 20, total.item()           # read on the default stream
    assert reused[0].item() == 5.0


@pytest.mark.timeout(400)
def test_deterministic_training_on_cuda_and_the_same_on_a_high_priority_stream(tmp_path):
    """deterministic=true trains on CUDA (cuBLAS's workspace set, no pooling without a deterministic
    backward) and reruns bit for bit; with the step on its own stream too, or a batch crossed unordered."""
    common = ("max_duration=2ep", "deterministic=true", "precision=bf16", "log.interval=2")
    torchrun(tmp_path / "default", *common)
    log = torchrun(tmp_path / "high", *common, "step_stream=high_priority")
    assert "train step on a CUDA stream of priority" in log, log[-2000:]
    default, high = ([(m["step"], m["train_loss"]) for m in metrics(tmp_path / run) if "train_loss" in m]
                     for run in ("default", "high"))
    assert default and high == default, (default, high)
    tops = [json.loads((tmp_path / run / "summary.json").read_text())["last_val_top1"] for run in ("default", "high")]
    assert tops[0] == tops[1], tops


@pytest.mark.timeout(400)
def test_a_checkpoint_written_on_cuda_resumes_on_the_cpu_and_back(tmp_path):
    common = ("precision=bf16", "channels_last=true", "data.synthetic_size=128", "model.name=small_resnet")
    torchrun(tmp_path, "max_duration=1ep", *common, device="cuda")
    log = torchrun(tmp_path, "max_duration=2ep", *common, device="cpu")
    assert "resumed from" in log and "ep1-" in log, log[-2000:]
    log = torchrun(tmp_path, "max_duration=3ep", *common, device="cuda")
    assert "resumed from" in log and "ep2-" in log, log[-2000:]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints").glob("*.pt"))[-1] == "ep3"


NCCL_SCRIPT = """
import os, torch, torch.distributed as dist
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
value = torch.full((1000,), float(rank + 1), device="cuda")
dist.all_reduce(value)
assert value[0].item() == size * (size + 1) / 2, value[0].item()
print(f"rank {rank}: nccl all_reduce of {size} ranks ok, nccl {torch.cuda.nccl.version()}")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("nproc", [1, 2])
def test_nccl_all_reduce(tmp_path, nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, this machine has {torch.cuda.device_count()}")
    script = tmp_path / "nccl.py"
    script.write_text(NCCL_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("all_reduce") == nproc, result.stdout
