"""``kind: photos``: random crops of the photographs shipped in the scikit-image / scikit-learn wheels.

Ten natural RGB photos (no download), one class each (:data:`PHOTO_NAMES`, :func:`load_photo`,
:class:`PhotoCrops`); the demo's and the diagnostics' dataset. See ``docs/training.md``, "Datasets".
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from mhla_diffusers.data.crops import ClassCrops, check_count, check_sizes, resize_short_side, to_tensor

__all__ = ["PHOTO_NAMES", "load_photo", "PhotoCrops"]


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        try:
            import skimage.data  # optional (demo extra): only the photo dataset needs it
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("the photo dataset needs scikit-image: pip install scikit-image") from e
        out = getattr(skimage.data, name)()
        return out[0] if isinstance(out, tuple) else out  # stereo_motorcycle -> (left, right, disparity)

    return load


def _sklearn(index: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        try:
            from sklearn.datasets import load_sample_image  # optional (demo extra): two of the photos
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("the photo dataset needs scikit-learn: pip install scikit-learn") from e
        return load_sample_image(("china.jpg", "flower.jpg")[index])

    return load


# Natural RGB photographs inside the scikit-image 0.2x and scikit-learn wheels (checked: all ship
# in the wheel, all uint8 RGB). Class id = position in this list.
_PHOTOS: dict[str, Callable[[], np.ndarray]] = {
    "astronaut": _skimage("astronaut"),  # 512 x 512
    "cat": _skimage("chelsea"),  # 300 x 451 (skimage.data.cat is the same photo)
    "coffee": _skimage("coffee"),  # 400 x 600
    "rocket": _skimage("rocket"),  # 427 x 640
    "motorcycle": _skimage("stereo_motorcycle"),  # 500 x 741 (left view)
    "hubble deep field": _skimage("hubble_deep_field"),  # 872 x 1000
    "immunohistochemistry": _skimage("immunohistochemistry"),  # 512 x 512
    "retina": _skimage("retina"),  # 1411 x 1411
    "china": _sklearn(0),  # 427 x 640 (temple)
    "flower": _sklearn(1),  # 427 x 640
}
PHOTO_NAMES: tuple[str, ...] = tuple(_PHOTOS)


def load_photo(name: str) -> np.ndarray:
    """One of the shipped photos (``PHOTO_NAMES``) as uint8 ``[H, W, 3]``.

    Raises:
        KeyError: unknown name.
        ImportError: scikit-image / scikit-learn missing.
    """
    if name not in _PHOTOS:
        raise KeyError(f"unknown photo {name!r}; choose from {list(PHOTO_NAMES)}")
    img = np.asarray(_PHOTOS[name]())
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise RuntimeError(f"photo {name!r} is not uint8 RGB (shape {img.shape}, dtype {img.dtype})")
    return img


def _photo_list(photos: Sequence[str] | None) -> list[str]:
    """``photos`` (``None``: all of ``PHOTO_NAMES``) as a list; ``ValueError`` if empty or duplicated."""
    names = list(PHOTO_NAMES if photos is None else photos)
    if not names:
        raise ValueError(f"photos is empty; choose some of {list(PHOTO_NAMES)} or pass None for all")
    if len(set(names)) != len(names):
        raise ValueError(f"photos has duplicates: {names}")
    return names


class PhotoCrops(ClassCrops):
    """Random crops of the photographs shipped in the scikit-image / scikit-learn wheels; one photo, one class.

    ``short_side`` (default ``1.5 * resolution``) is the short side photos are resized to first;
    ``photos`` a subset / order of ``PHOTO_NAMES``. Item: ``{"pixel_values": float32 [3, S, S] in
    [-1, 1], "class_labels": int64}`` with ``S = resolution`` pixels.

    Raises:
        ValueError: bad sizes, an empty or duplicated photo list.
        KeyError: unknown photo name.
        ImportError: scikit-image / scikit-learn not installed.
    """

    def __init__(
        self,
        resolution: int = 64,
        short_side: int | None = None,
        crops_per_photo: int = 64,
        seed: int = 0,
        hflip: bool = True,
        photos: Sequence[str] | None = None,
    ):
        self.resolution = int(resolution)
        self.short_side = check_sizes(resolution, round(1.5 * resolution) if short_side is None else short_side)
        self.crops_per_image = check_count("crops_per_photo", crops_per_photo)
        self.names = _photo_list(photos)
        self.num_images = len(self.names)
        self.seed = int(seed)
        self.hflip = bool(hflip)
        self.images = [to_tensor(resize_short_side(Image.fromarray(load_photo(n)), self.short_side)) for n in self.names]

    @property
    def id2label(self) -> dict[int, str]:
        """Class id -> photo name."""
        return dict(enumerate(self.names))

    def _image(self, k: int) -> torch.Tensor:
        return self.images[k]

    def _label(self, k: int) -> int:
        return k

    def _sources(self) -> list:
        return list(self.names)
