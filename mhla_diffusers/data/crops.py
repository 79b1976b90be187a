"""What the datasets share: per-item randomness, image reading and resizing, the random-crop base classes.

Item ``i``'s randomness is a pure function of ``(seed, epoch, i)`` (:func:`item_generator`);
:class:`RandomCrops` crops, flips and normalises, its subclasses say which image and what target.
"""

from __future__ import annotations

import abc
import os
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

__all__ = [
    "IMAGE_EXTENSIONS",
    "item_generator",
    "check_sizes",
    "check_count",
    "resize_short_side",
    "to_tensor",
    "read_image",
    "file_stats",
    "RandomCrops",
    "ClassCrops",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator of item ``index`` in ``epoch``: a pure function of ``(seed, epoch, index)``."""
    # Mix (seed, epoch, index) into one 63-bit seed (SplitMix64-style constants).
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 63)
    return torch.Generator().manual_seed(x)


def check_sizes(resolution: int, short_side: int | None) -> int:
    """``short_side`` (``resolution`` when ``None``) checked against ``resolution``; ``ValueError`` if bad."""
    if int(resolution) != resolution or resolution < 1:
        raise ValueError(f"resolution must be a positive integer (pixels); got {resolution!r}")
    if short_side is None:
        short_side = int(resolution)
    if int(short_side) != short_side or short_side < resolution:
        raise ValueError(
            f"short_side must be an integer >= resolution ({resolution}); got {short_side!r}. "
            "It is the length in pixels each image's short side is resized to before cropping."
        )
    return int(short_side)


def check_count(name: str, value) -> int:
    """``value`` as an int, or ``ValueError`` unless it is a positive integer (``name`` in the message)."""
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def resize_short_side(img: Image.Image, short_side: int) -> Image.Image:
    """``img`` resized (Lanczos) so its short side is ``short_side`` pixels."""
    w, h = img.size
    scale = short_side / min(w, h)
    size = (max(short_side, round(w * scale)), max(short_side, round(h * scale)))
    if size == (w, h):
        return img
    return img.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


def to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> uint8 ``[3, H, W]``."""
    return torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()


def read_image(path: str, short_side: int) -> torch.Tensor:
    """The image at ``path`` as uint8 ``[3, H, W]``, short side resized; ``ValueError`` if unreadable."""
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
    except Exception as e:
        raise ValueError(f"cannot read image {path!r}: {e}") from e
    return to_tensor(resize_short_side(im, short_side))


def file_stats(files: Sequence[str]) -> list:
    """``[path, size, mtime_ns]`` of each file (a dataset's fingerprint)."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


class RandomCrops(Dataset, abc.ABC):
    """Shared crop / flip / normalise logic; subclasses provide ``_image(k)`` and ``_target(k)``."""

    resolution: int
    seed: int
    hflip: bool
    epoch: int = 0
    num_images: int
    crops_per_image: int

    def __len__(self) -> int:
        return self.num_images * self.crops_per_image

    def set_epoch(self, epoch: int) -> None:
        """Select the crops of ``epoch``."""
        self.epoch = int(epoch)

    def _generator(self, index: int) -> torch.Generator:
        return item_generator(self.seed, self.epoch, index)

    @abc.abstractmethod
    def _image(self, k: int) -> torch.Tensor:
        """Image ``k`` as uint8 ``[3, H, W]``."""

    @abc.abstractmethod
    def _target(self, k: int) -> dict:
        """What item ``k`` carries beside its pixels."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} crops")
        index = index % len(self)
        k = index % self.num_images  # crops interleave images: every image equally often
        img = self._image(k)
        g = self._generator(index)
        s = self.resolution
        h, w = img.shape[-2:]
        top = int(torch.randint(0, h - s + 1, (1,), generator=g))
        left = int(torch.randint(0, w - s + 1, (1,), generator=g))
        flip = bool(torch.rand((), generator=g) < 0.5)
        crop = img[:, top : top + s, left : left + s]
        if self.hflip and flip:
            crop = crop.flip(-1)
        pixels = crop.to(torch.float32) / 127.5 - 1.0
        return {"pixel_values": pixels.contiguous(), **self._target(k)}

    def fingerprint(self) -> dict:
        return {
            "class": type(self).__name__,
            "resolution": self.resolution,
            "short_side": getattr(self, "short_side", None),
            "crops_per_image": self.crops_per_image,
            "seed": self.seed,
            "hflip": self.hflip,
            "sources": self._sources(),
        }

    def _sources(self) -> list:
        return []


class ClassCrops(RandomCrops):
    """Crops of class-labelled images; subclasses provide ``_label(k)``."""

    @abc.abstractmethod
    def _label(self, k: int) -> int:
        """Class id of image ``k``."""

    def _target(self, k: int) -> dict:
        return {"class_labels": torch.tensor(self._label(k), dtype=torch.long)}
