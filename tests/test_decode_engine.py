"""pipeline/decode/engine.py, the webdataset backend's native batch decoder: it crops as
pipeline/transforms/crops.py does, gives Pillow's pixels, does not depend on its thread count (and has no
data race), its SIMD and plain C paths agree, ColOut and flip land where the Python forms put
them, damaged samples are reported, and a loader's memory stays flat over many epochs."""
from __future__ import annotations

import io
import os
import re
import select
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import LoaderSpec, build_loader
from pipeline.decode import engine as decode_engine, jpeg_roi
from pipeline.shards.index import StoredShards
from pipeline.transforms.colout import kept_indices, sample_generator
from pipeline.transforms.crops import UNIFORMS_PER_SAMPLE, center_crop, compiled_sample_uniforms, sample_uniforms, train_crop
from pipeline.datasets import read_converted
from pipeline.decode.pillow_sample import _pil_crop


@pytest.fixture(scope="module")
def stored(converted_sets):
    """Every stored photo of the train split, as the backend hands them to the engine:
    (samples, jpeg bytes)."""
    shards = StoredShards(read_converted(converted_sets["photos"]["webdataset"], "train", "webdataset").shards)
    ids = np.arange(len(shards))
    with shards.located(ids) as samples:
        yield samples, [shards.read(int(i))[0] for i in ids]
    shards.close()


def decode(samples, spec, side, threads=2, **options):
    out = np.zeros((len(samples.sample_ids), *decode_engine.out_shape(spec, side), 3), np.uint8)
    return out, decode_engine.decode_batch(samples, spec, 0, side, out, threads=threads, **options)


def test_crops_are_those_of_pipeline_crops():
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 700, (1500, 2))]
    for split, scale, ratio in (("train", (0.08, 1), (3 / 4, 4 / 3)), ("train", (0.9, 1), (3, 5)), ("val", (0.08, 1), (1, 1))):
        # ratio 3..5 makes most random attempts fail: the fallback crop is checked too
        spec = LoaderSpec("webdataset", path="unused", split=split, scale=scale, ratio=ratio, val_crop_ratio=0.8, seed=3)
        got = decode_engine.crop_boxes(spec, 2, range(len(sizes)), sizes)
        for sample_id, ((height, width), engine) in enumerate(zip(sizes, got)):
            expected = (train_crop(height, width, spec.scale, spec.ratio, sample_uniforms(3, 2, sample_id))
                        if spec.train else (center_crop(height, width, 0.8), False))
            assert engine == expected, (split, height, width)


def test_the_engine_and_ffcvs_decoder_draw_numpys_uniforms():
    """The engine and FFCV's decoder (pipeline/native/sample_uniforms.c) draw each sample's uniforms in
    C (numpy_random.h): numpy's default_rng stream, bit for bit, for any seed, epoch and sample id."""
    rng = np.random.default_rng(1)
    triples = [(0, 0, 0), (2**31, 10**6, 2**40), *rng.integers(0, 10**7, (500, 3)).tolist()]
    for_ffcv, drawn = compiled_sample_uniforms(), np.empty(UNIFORMS_PER_SAMPLE)
    for seed, epoch, sample_id in triples:
        expected = sample_uniforms(seed, epoch, sample_id)
        for_ffcv(seed, epoch, sample_id, drawn.ctypes.data, len(drawn))
        assert np.array_equal(decode_engine.engine_uniforms(seed, epoch, sample_id), expected), (seed, epoch, sample_id)
        assert np.array_equal(drawn, expected), (seed, epoch, sample_id)


@pytest.mark.parametrize("split,side", [("train", 160), ("train", 64), ("val", 224), ("val", 96)])
def test_full_size_decode_gives_pillows_pixels(stored, split, side):
    """At DCT scale 8/8 only, the engine's crop + resize is Pillow's full decode + bilinear resize
    (16-bit weights against Pillow's 22-bit: within 2 of 255)."""
    samples, jpegs = stored
    spec = LoaderSpec("webdataset", path="unused", split=split)
    out, decoded = decode(samples, spec, side, scales=(8,))
    assert not decoded.failed and (decoded.scales == 8).all()
    for i in range(0, len(jpegs), 7):
        image, flip = _pil_crop(jpegs[i], spec, sample_uniforms(0, 0, int(samples.sample_ids[i])), side, draft=False)
        pillow = np.asarray(image)[:, ::-1] if flip else np.asarray(image)
        assert np.abs(out[i].astype(int) - pillow).max() <= 2, i


@pytest.mark.parametrize("side", [96, 48])
def test_reduced_dct_scales_stay_close_to_a_full_decode(stored, side):
    """At the smallest scale that keeps the crop at least the target size, val crops stay within
    the cross-backend tolerance of a full decode (tests/test_loaders.py: mean 2.5, image 8)."""
    samples, _ = stored
    spec = LoaderSpec("webdataset", path="unused", split="val")
    full, _ = decode(samples, spec, side, scales=(8,))
    reduced, decoded = decode(samples, spec, side)
    assert (decoded.scales < 8).mean() > 0.5          # the point: most crops decode at a reduced scale
    difference = np.abs(full.astype(float) - reduced)
    assert difference.mean() <= 2.5 and difference.reshape(len(full), -1).mean(1).max() <= 8


def test_same_batch_at_any_thread_count(stored):
    """One thread against many, several times over: the same bytes (a race would show as a
    difference in some run)."""
    samples, _ = stored
    spec = LoaderSpec("webdataset", path="unused", split="train", colout=(0.2, 0.1))
    one, _ = decode(samples, spec, 96, threads=1)
    for threads in (3, 8, 8, 16):
        many, decoded = decode(samples, spec, 96, threads=threads)
        assert np.array_equal(one, many), threads
        assert decoded.stage_seconds.min() > 0


def test_batches_started_together_or_from_threads_are_those_made_one_by_one(stored):
    """The engine's threads are kept from batch to batch and serve batches in the order started:
    two batches in their hands at once (the loader's overlap), and batches started from several
    Python threads with different thread counts, give the bytes of batches made one at a time."""
    samples, _ = stored
    half = len(samples.sample_ids) // 2
    parts = [decode_engine.StoredSamples(*(None if a is None else a[part] for a in (
        samples.sample_ids, samples.fds, samples.image_at, samples.image_size, samples.label_at, samples.bases,
        samples.checksums))) for part in (slice(0, half), slice(half, None))]
    specs = [LoaderSpec("webdataset", path="unused", split=split) for split in ("train", "val")]
    expected = [decode(part, spec, 72)[0] for spec in specs for part in parts]
    outs = [np.zeros_like(e) for e in expected]
    started = [decode_engine.StartedBatch(part, spec, 0, 72, out, threads=2)
               for (spec, part), out in zip([(spec, part) for spec in specs for part in parts], outs)]
    assert not any(batch.result().failed for batch in started)
    for made, want in zip(outs, expected):
        assert np.array_equal(made, want)
    results = {}

    def make(k, threads):
        out = np.zeros_like(expected[k])
        spec, part = specs[k // 2], parts[k % 2]
        decode_engine.StartedBatch(part, spec, 0, 72, out, threads=threads).result()
        results[k] = out
    callers = [threading.Thread(target=make, args=(k, threads)) for k, threads in enumerate((1, 2, 3, 5))]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    for k, want in enumerate(expected):
        assert np.array_equal(results[k], want), k


def test_a_forked_child_makes_batches_with_threads_of_its_own(stored):
    """A child forked after the engine's threads started (a DataLoader worker, a multiprocessing
    pool) has none of them: its batches are made by threads it starts, the same bytes."""
    samples, _ = stored
    spec = LoaderSpec("webdataset", path="unused", split="val")
    expected, _ = decode(samples, spec, 64)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:                                  # pragma: no cover - the child's exit code is the check
        try:
            out, _ = decode(samples, spec, 64)
            os.write(writer, b"1" if np.array_equal(out, expected) else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    try:
        answered, _, _ = select.select([reader], [], [], 60)
        assert answered and os.read(reader, 1) == b"1", "the child's batch never came"
    finally:
        os.close(reader)
        os.kill(child, 9)
        os.waitpid(child, 0)


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        return set(next(line for line in info if line.startswith("flags")).split(":", 1)[1].split())


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v2", "x86-64-v3"])
def test_plain_c_and_simd_paths_agree(stored, tmp_path, march):
    """Each instruction set's loops (none; SSE4.1; AVX2 without AVX-512) compute the integers
    this CPU's build does, so the same bytes, flipped, ColOut'ed and at sides whose rows end
    mid-register; the float32 batch is the same pixels normalized (the build for this CPU may
    fuse the multiply and add, which moves the last bit)."""
    if march == "x86-64-v3" and "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    samples, _ = stored
    other = decode_engine.load(flags=(f"-march={march}",), library=tmp_path / f"_decode_engine_{march}.so")
    for split, side, colout in (("train", 112, None), ("train", 81, (0.2, 0.1)), ("val", 81, None), ("val", 224, None)):
        spec = LoaderSpec("webdataset", path="unused", split=split, colout=colout)
        native, _ = decode(samples, spec, side)
        built, _ = decode(samples, spec, side, library=other)
        assert np.array_equal(native, built), (split, side)
    spec = LoaderSpec("webdataset", path="unused", split="train")
    floats = [np.zeros((len(samples.sample_ids), 81, 81, 3), np.float32) for _ in range(2)]
    for out, library in zip(floats, (None, other)):
        decode_engine.decode_batch(samples, spec, 0, 81, out, threads=2, library=library)
    assert np.allclose(*floats, rtol=0, atol=1e-5) and floats[0].std() > 0.5


def test_the_engines_crc32_is_zlibs():
    """The checksum the engine checks samples against (crc32_fold.h, by carry-less multiplication
    where the CPU has it) is zlib's, at every length round its 64- and 16-byte steps, at any
    alignment and from any starting value."""
    import zlib
    data = np.random.default_rng(0).integers(0, 256, 200_000, np.uint8).tobytes()
    engine_crc32 = decode_engine._library.engine_crc32
    for size in [*range(0, 300), 4095, 85_001, 199_997]:
        for offset, start in ((0, 0), (3, 0), (5, 0x9E3779B9)):
            piece = data[offset:offset + size]
            assert engine_crc32(start, piece, len(piece)) == zlib.crc32(piece, start), (size, offset, start)


def test_entropy_only_decodes_the_crops_mcus_and_writes_nothing(stored):
    """The floor's pass: every sample read, checked and Huffman-decoded (so a damaged one still
    fails), its label given, and not a byte of the batch written."""
    samples, jpegs = stored
    spec = LoaderSpec("webdataset", path="unused", split="train")
    out = np.full((len(samples.sample_ids), 64, 64, 3), 77, np.uint8)
    decoded = decode_engine.decode_batch(samples, spec, 0, 64, out, threads=2, entropy_only=True)
    assert not decoded.failed and not decoded.damaged and (out == 77).all()
    _, full = decode(samples, spec, 64)
    assert np.array_equal(decoded.labels, full.labels)
    read, entry, entropy, *rest = decoded.stage_seconds
    assert read > 0 and entry > 0 and entropy > 0 and not any(rest)
    # Less CPU than a full decode's stage: the least of 3 runs each, at a side that takes most crops at
    # full DCT scale (at 64 px the inverse DCT is a small share), so that another process's load on one
    # run of a few milliseconds does not turn them round
    wide = np.empty((len(samples.sample_ids), 224, 224, 3), np.uint8)
    least = {only: min(decode_engine.decode_batch(samples, spec, 0, 224, wide, threads=2, entropy_only=only)
                       .stage_seconds[decode_engine.STAGES.index("decode")] for _ in range(3)) for only in (True, False)}
    assert least[True] < least[False]


def test_colout_and_flip_land_where_the_python_forms_put_them(stored):
    samples, _ = stored
    side, shares = 48, (0.25, 0.5)
    whole, _ = decode(samples, LoaderSpec("webdataset", path="unused", split="train"), side)
    cut, _ = decode(samples, LoaderSpec("webdataset", path="unused", split="train", colout=shares), side)
    assert cut.shape[1:] == (36, 24, 3)
    for i, sample_id in enumerate(samples.sample_ids[:50]):
        uniforms = sample_uniforms(0, 0, int(sample_id))
        rows, cols = kept_indices(side, side, *shares, sample_generator(uniforms))
        assert np.array_equal(cut[i], whole[i][rows][:, cols])     # whole[i] is already flipped where drawn


def decode_pieces(pieces: list[bytes], path, spec, side, **options):
    """The engine run on `pieces` (JPEG bytes, or anything), stored one after another in `path`
    as a shard stores them, each followed by the label 7."""
    label = (7).to_bytes(4, "little")
    offsets, blob = [], b""
    for piece in pieces:
        offsets.append(len(blob))
        blob += piece + label
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        at, size = np.array(offsets), np.array([len(p) for p in pieces])
        return decode(decode_engine.StoredSamples(np.arange(len(pieces)), np.full(len(pieces), fd), at, size, at + size),
                      spec, side, **options)
    finally:
        os.close(fd)


def test_damaged_and_cmyk_samples_are_reported_not_decoded(stored, tmp_path):
    samples, jpegs = stored
    good = jpegs[0]
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(good)).convert("CMYK").save(cmyk, "JPEG")
    pieces = [good, good[:len(good) // 2], b"not a jpeg", cmyk.getvalue()]
    out, decoded = decode_pieces(pieces, tmp_path / "mixed.bin", LoaderSpec("webdataset", path="unused", split="val"), 32)
    assert list(decoded.labels) == [7, 7, 7, 7]
    messages = dict(decoded.failed)
    assert sorted(messages) == [1, 2, 3] and "CMYK" in messages[3] and messages[1] and messages[2]
    assert out[0].std() > 0


def restart_layouts(jpegs: list[bytes]) -> list[bytes]:
    """Stored photos re-encoded in other layouts (4:4:4, 4:2:2, grey, odd sizes), each with a
    restart marker after every MCU, and one progressive JPEG without (decoded whole). Half the
    grey ones are sampled 2x2, which the engine's segment decoder leaves to libjpeg."""
    layouts = []
    for k, data in enumerate(jpegs):
        image = Image.open(io.BytesIO(data))
        if k % 4 == 1:
            image = image.convert("L")
        if k % 4 == 2:
            image = image.crop((3, 5, image.width - 7, image.height - 2))
        out = io.BytesIO()
        subsampling = (0, 1 if k % 8 == 1 else 2, 2, 2)[k % 4]
        image.save(out, "JPEG", quality=85, subsampling=subsampling, progressive=k == 3)
        layouts.append(out.getvalue() if k == 3 else jpeg_roi.transcode(out.getvalue()))
    return layouts


@pytest.mark.parametrize("split,side", [("train", 32), ("train", 96), ("train", 160), ("val", 128)])
def test_restart_markers_change_no_pixel(stored, split, side, tmp_path):
    """JPEGs with a restart marker after every MCU (what convert_wds.py stores) are cut down to
    the MCUs under the crop before the decode (jpeg_restarts.h): the very same pixels as the
    decode that enters at the top, at every DCT scale, and as the photos' own bytes give."""
    samples, jpegs = stored
    assert all(data.count(b"\xff\xd0") for data in jpegs[:48])       # stored with the markers
    spec = LoaderSpec("webdataset", path="unused", split=split, seed=side)
    pieces = jpegs[:48] + restart_layouts(jpegs[48:64])
    plain = [jpeg_roi.transcode(data, restart_markers=False) for data in jpegs[:48]]
    for scales in ((1, 2, 4, 8), (8,), tuple(range(1, 9))):
        cut, decoded = decode_pieces(pieces, tmp_path / "marked.bin", spec, side, scales=scales)
        whole, _ = decode_pieces(pieces, tmp_path / "marked.bin", spec, side, scales=scales, restarts=False)
        unmarked, _ = decode_pieces(plain, tmp_path / "plain.bin", spec, side, scales=scales)
        assert not decoded.failed
        assert np.array_equal(cut, whole), scales
        assert np.array_equal(cut[:48], unmarked), scales


def test_damaged_segments_are_reported_not_decoded(stored, tmp_path):
    """An MCU whose segment holds a code no table has, or ends before the MCU does, fails its
    sample with libjpeg's words, whether the engine's segment decoder (jpeg_huffman.h) or
    libjpeg's own reads it; the samples beside it decode."""
    _, jpegs = stored
    marked = jpegs[0]
    markers = [found.start() for found in re.finditer(rb"\xff[\xd0-\xd7]", marked)]
    width, height = Image.open(io.BytesIO(marked)).size
    across = -(-width // 16)                                                      # the photos are 4:2:0
    middle = (-(-height // 16) // 2) * across + across // 2                       # an MCU under the val crop
    start, end = markers[middle - 1] + 2, markers[middle]
    bad_code = marked[:start] + b"\xff\x00" * 8 + marked[end:]                   # all ones: no table's code
    cut_short = marked[:start + 1] + marked[end:]
    spec = LoaderSpec("webdataset", path="unused", split="val")
    for restarts in (True, False):
        out, decoded = decode_pieces([bad_code, cut_short, marked], tmp_path / "damaged.bin", spec, 64,
                                     restarts=restarts)
        messages = dict(decoded.failed)
        assert sorted(messages) == [0, 1], restarts
        assert "bad Huffman code" in messages[0], messages
        assert "Corrupt JPEG data" in messages[1], messages
        assert out[2].std() > 0


def test_random_damage_in_the_segments_is_survived(stored, tmp_path):
    """Bytes of the entropy-coded segments changed at random (never into a marker, so that the
    restart index still holds): each sample is made or reported, and nothing is read or written
    out of bounds, which would end this process. Each sample's own pixels are those libjpeg
    makes of the same bytes, where both decode it."""
    _, jpegs = stored
    rng = np.random.default_rng(11)
    pieces = []
    for data in jpegs[:40]:
        sos = data.index(b"\xff\xda")
        scan = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")      # the first entropy-coded byte
        damaged = bytearray(data)
        for at in rng.integers(scan, len(data) - 2, int(rng.integers(1, 4))):
            if damaged[at] != 0xFF and damaged[at - 1] != 0xFF:            # no marker, no stuffed zero
                damaged[at] = int(rng.integers(0, 255))                    # and never 0xFF written
        pieces.append(bytes(damaged))
    spec = LoaderSpec("webdataset", path="unused", split="train")
    ours, decoded = decode_pieces(pieces, tmp_path / "fuzzed.bin", spec, 96)
    theirs, libjpeg = decode_pieces(pieces, tmp_path / "fuzzed.bin", spec, 96, restarts=False)
    assert list(decoded.labels) == [7] * len(pieces)
    failed = {position for position, _ in decoded.failed} | {position for position, _ in libjpeg.failed}
    assert len(failed) < len(pieces) / 2, (len(decoded.failed), len(libjpeg.failed))
    for position in set(range(len(pieces))) - failed:
        assert np.array_equal(ours[position], theirs[position]), position


def test_restart_markers_are_lossless_and_one_per_mcu(stored):
    _, jpegs = stored
    for data in jpegs[:10]:
        marked = jpeg_roi.transcode(data)
        width, height = Image.open(io.BytesIO(data)).size
        mcus = -(-width // 16) * -(-height // 16)                    # the photos are 4:2:0
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(marked))), np.asarray(Image.open(io.BytesIO(data))))
        assert sum(marked.count(bytes([0xFF, 0xD0 + k])) for k in range(8)) == mcus - 1
    with pytest.raises(jpeg_roi.JPEGError):
        jpeg_roi.transcode(jpegs[0][:len(jpegs[0]) // 2])


@pytest.mark.timeout(240)
def test_memory_stays_flat_over_twenty_epochs(converted_sets):
    loader = build_loader(LoaderSpec("webdataset", path=str(converted_sets["photos"]["webdataset"]), split="train",
                                     batch_size=16, resolution=64, num_workers=2))
    assert loader.uses_engine
    resident = []
    for epoch in range(20):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        resident.append(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20)
    assert resident[-1] - resident[4] < 16, resident    # MiB: no growth after the first epochs


def test_batches_kept_by_the_caller_are_never_overwritten(converted_sets):
    """The engine writes into reused buffers: a batch the caller still holds must be left alone
    (the ring takes fresh memory instead), so holding every batch equals copying each at once."""
    def loader():
        made = build_loader(LoaderSpec("webdataset", path=str(converted_sets["photos"]["webdataset"]),
                                       split="train", batch_size=8, resolution=32, num_workers=2))
        made.set_epoch(1)
        return made
    copied = [images.clone() for images, _ in loader()]
    held = [images for images, _ in loader()]
    assert len(held) == len(copied) == 11
    assert all(torch.equal(a, b) for a, b in zip(held, copied))
