"""Photo and image-folder crop datasets: shapes, ranges, labels, determinism, errors."""

import numpy as np
import pytest
import torch
from PIL import Image

from mhla_diffusers.data.folder import ImageFolderCrops
from mhla_diffusers.data.photos import PHOTO_NAMES, PhotoCrops, load_photo


@pytest.fixture(scope="module")
def photos():
    return PhotoCrops(resolution=32, crops_per_photo=3, seed=0)


def test_every_shipped_photo_is_uint8_rgb():
    assert len(PHOTO_NAMES) == 10 and len(set(PHOTO_NAMES)) == 10
    for name in PHOTO_NAMES:
        img = load_photo(name)
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3 and min(img.shape[:2]) >= 256
    with pytest.raises(KeyError, match="choose from"):
        load_photo("lena")


def test_items_shapes_ranges_labels(photos):
    assert len(photos) == 30
    assert photos.id2label == dict(enumerate(PHOTO_NAMES))
    assert photos.short_side == 48  # 1.5 x resolution by default
    labels = []
    for i in range(len(photos)):
        item = photos[i]
        x, y = item["pixel_values"], item["class_labels"]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32
        assert x.min() >= -1.0 and x.max() <= 1.0
        assert y.dtype == torch.long and y.shape == ()
        labels.append(int(y))
    assert labels == [i % 10 for i in range(30)]  # photos interleaved, each equally often
    assert photos[-1]["class_labels"] == photos[29]["class_labels"]
    with pytest.raises(IndexError):
        photos[30]


def test_deterministic_given_seed_and_epoch(photos):
    again = PhotoCrops(resolution=32, crops_per_photo=3, seed=0)
    other = PhotoCrops(resolution=32, crops_per_photo=3, seed=1)
    for i in (0, 7, 29):
        assert torch.equal(photos[i]["pixel_values"], again[i]["pixel_values"])
    assert any(not torch.equal(photos[i]["pixel_values"], other[i]["pixel_values"]) for i in range(10))
    first = [photos[i]["pixel_values"] for i in range(10)]
    photos.set_epoch(1)
    try:
        assert any(not torch.equal(first[i], photos[i]["pixel_values"]) for i in range(10))
        again.set_epoch(1)
        assert torch.equal(photos[3]["pixel_values"], again[3]["pixel_values"])
    finally:
        photos.set_epoch(0)
    assert torch.equal(first[0], photos[0]["pixel_values"])


def test_subset_no_flip_and_full_photo_crop():
    ds = PhotoCrops(resolution=16, short_side=16, crops_per_photo=2, photos=["flower", "cat"], hflip=False)
    assert ds.id2label == {0: "flower", 1: "cat"} and len(ds) == 4
    # short side == resolution: every crop spans the full height; deterministic without flips
    assert all(ds[i]["pixel_values"].shape == (3, 16, 16) for i in range(4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(resolution=64, short_side=32), "short_side"),
        (dict(resolution=0), "resolution"),
        (dict(crops_per_photo=0), "crops_per_photo"),
        (dict(photos=[]), "empty"),
        (dict(photos=["cat", "cat"]), "duplicates"),
    ],
)
def test_photo_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PhotoCrops(**kwargs)


def _write_image(path, size, color):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def test_image_folder(tmp_path):
    _write_image(tmp_path / "reds" / "a.png", (40, 30), (255, 0, 0))
    _write_image(tmp_path / "reds" / "sub" / "b.JPG", (30, 50), (250, 0, 0))
    _write_image(tmp_path / "blues" / "c.png", (20, 20), (0, 0, 255))
    (tmp_path / "blues" / "notes.txt").write_text("not an image")
    ds = ImageFolderCrops(tmp_path, resolution=16, crops_per_image=2, seed=3)
    assert ds.id2label == {0: "blues", 1: "reds"}
    assert len(ds) == 6
    for i in range(len(ds)):
        item = ds[i]
        x, y = item["pixel_values"], int(item["class_labels"])
        assert x.shape == (3, 16, 16) and x.min() >= -1 and x.max() <= 1
        if y == 0:
            assert torch.allclose(x[2], torch.ones(16, 16)) and torch.allclose(x[0], -torch.ones(16, 16))
        else:
            assert x[0].mean() > 0.9 and x[2].mean() < -0.9
    assert torch.equal(ds[1]["pixel_values"], ImageFolderCrops(tmp_path, resolution=16, crops_per_image=2, seed=3)[1]["pixel_values"])


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderCrops(tmp_path / "missing")
    with pytest.raises(ValueError, match="no class sub-folders"):
        ImageFolderCrops(tmp_path)
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(ValueError, match="has no images"):
        ImageFolderCrops(tmp_path)
    (tmp_path / "empty_class" / "broken.png").write_bytes(b"not a png")
    ds = ImageFolderCrops(tmp_path, resolution=8)
    with pytest.raises(ValueError, match="cannot read image"):
        ds[0]


# -- captioned folders -----------------------------------------------------------------------------
def test_captioned_folder_metadata_and_sidecars(tmp_path):
    import json

    from mhla_diffusers.data.captions import CaptionedImageCrops, read_captions

    _write_image(tmp_path / "a.png", (20, 20), (255, 0, 0))
    _write_image(tmp_path / "sub" / "b.jpg", (24, 20), (0, 255, 0))
    _write_image(tmp_path / "c.png", (20, 30), (0, 0, 255))
    (tmp_path / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.png", "text": "a red square"}) + "\n\n" + json.dumps({"file_name": "sub/b.jpg", "text": "green"}) + "\n"
    )
    (tmp_path / "c.txt").write_text("  a blue square\n")
    (tmp_path / "a.txt").write_text("ignored: metadata.jsonl wins")
    ds = CaptionedImageCrops(tmp_path, resolution=16, crops_per_image=2, seed=1)
    assert len(ds) == 6 and ds.id2label is None
    caption = {f.rsplit("/", 1)[-1]: c for f, c in zip(ds.files, ds.captions)}
    assert caption == {"a.png": "a red square", "c.png": "a blue square", "b.jpg": "green"}
    item = ds[0]
    assert set(item) == {"pixel_values", "caption"} and item["pixel_values"].shape == (3, 16, 16)
    assert item["caption"] == ds.captions[0]
    assert ds.fingerprint() == CaptionedImageCrops(tmp_path, resolution=16, crops_per_image=2, seed=1).fingerprint()
    assert ds.fingerprint() != CaptionedImageCrops(tmp_path, resolution=16, crops_per_image=2, seed=2).fingerprint()
    assert read_captions(tmp_path, [str(tmp_path / "d.png")]) == [None]


def test_captioned_folder_errors(tmp_path):
    from mhla_diffusers.data.captions import CaptionedImageCrops

    with pytest.raises(FileNotFoundError):
        CaptionedImageCrops(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no images"):
        CaptionedImageCrops(tmp_path)
    _write_image(tmp_path / "a.png", (20, 20), (255, 0, 0))
    with pytest.raises(ValueError, match="have no caption"):
        CaptionedImageCrops(tmp_path, resolution=16)
    assert CaptionedImageCrops(tmp_path, resolution=16, missing_caption="empty")[0]["caption"] == ""
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png"}\n')
    with pytest.raises(ValueError, match="metadata.jsonl:1"):
        CaptionedImageCrops(tmp_path, resolution=16)
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "missing.png", "text": "x"}\n')
    with pytest.raises(ValueError, match="does not exist"):
        CaptionedImageCrops(tmp_path, resolution=16)


def test_cache_roundtrip_and_key(tmp_path):
    from mhla_diffusers.training.cache import CachedDataset, build_cache, cache_key, is_complete, module_fingerprint

    ds = PhotoCrops(resolution=16, crops_per_photo=2, photos=["cat", "coffee"], seed=0)
    calls = []

    def encode(batch):
        calls.append(len(batch["pixel_values"]))
        return {"latents": batch["pixel_values"] * 2, "class_labels": batch["class_labels"]}

    key = cache_key(ds.fingerprint(), module_fingerprint(torch.nn.Linear(2, 2)))
    folder = build_cache(ds, encode, tmp_path / key, batch_size=3)
    assert is_complete(folder) and sum(calls) == 4
    cached = CachedDataset(folder)
    assert len(cached) == 4
    for i in range(4):
        assert torch.equal(cached[i]["latents"], ds[i]["pixel_values"] * 2)
        assert int(cached[i]["class_labels"]) == int(ds[i]["class_labels"])
    build_cache(ds, encode, folder)
    assert sum(calls) == 4  # complete: not encoded again
    other = PhotoCrops(resolution=16, crops_per_photo=2, photos=["cat", "coffee"], seed=1)
    assert cache_key(other.fingerprint(), module_fingerprint(torch.nn.Linear(2, 2))) != key
    torch.manual_seed(1)
    assert module_fingerprint(torch.nn.Linear(2, 2)) != module_fingerprint(torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match="no complete latent cache"):
        CachedDataset(tmp_path / "nothing")
