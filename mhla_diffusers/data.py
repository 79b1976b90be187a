"""Image and video datasets (fine-tuning, diagnostics): real photos shipped in wheels, class folders, captioned folders.

The class-labelled datasets return ``{"pixel_values": float32 [3, S, S] in [-1, 1], "class_labels": int64 []}``
(the captioned one ``{"pixel_values", "caption": str}``) from random square crops (with random horizontal flips)
of photos first downscaled so that their short side is ``short_side`` pixels. The randomness of item ``i`` is a pure function of
``(seed, epoch, i)``: the same seed and epoch give the same crops whatever the worker layout, and
:meth:`set_epoch` gives new crops every epoch (call it, as with ``DistributedSampler``).

- :class:`PhotoCrops`: the natural RGB photographs that ship inside the scikit-image and
  scikit-learn wheels (no download): one photo = one class (``PHOTO_NAMES``).
- :class:`ImageFolderCrops`: your own images, ``root/<class name>/<image files>`` (like
  torchvision's ``ImageFolder``; read with PIL).
- :class:`CaptionedImageCrops`: your own images with captions (text-to-image: SANA), captions
  from ``root/metadata.jsonl`` (Hugging Face ``imagefolder`` convention: one JSON object per
  line with ``file_name`` and ``text``) or from a sidecar ``<image stem>.txt``.
- :class:`VideoClips`: captioned videos (text-to-video: Wan): video files (mp4 / webm / mov / mkv /
  avi through imageio-ffmpeg, animated gif / webp through PIL) or folders of frames; random clips
  of ``num_frames`` frames, ``{"pixel_values": float32 [3, F, H, W] in [-1, 1], "caption": str}``.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image, ImageSequence
from torch.utils.data import Dataset

__all__ = [
    "PHOTO_NAMES",
    "load_photo",
    "PhotoCrops",
    "ImageFolderCrops",
    "CaptionedImageCrops",
    "VideoClips",
    "read_captions",
    "read_video_frames",
    "VIDEO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "MAX_CLASSES",
    "build_dataset",
]

# DiT pipelines use class id 1000 as the "null" (unconditional) label: at most 1000 real classes.
MAX_CLASSES = 1000

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif", ".webp")
_FFMPEG_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")


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
    """One of the shipped photos by name (see ``PHOTO_NAMES``): uint8 ``[H, W, 3]``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
        ImportError: scikit-image / scikit-learn missing.
    """
    if name not in _PHOTOS:
        raise KeyError(f"unknown photo {name!r}; choose from {list(PHOTO_NAMES)}")
    img = np.asarray(_PHOTOS[name]())
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise RuntimeError(f"photo {name!r} is not uint8 RGB (shape {img.shape}, dtype {img.dtype})")
    return img


def _resize_short_side(img: Image.Image, short_side: int) -> Image.Image:
    w, h = img.size
    scale = short_side / min(w, h)
    size = (max(short_side, round(w * scale)), max(short_side, round(h * scale)))
    if size == (w, h):
        return img
    return img.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> uint8 ``[3, H, W]``."""
    return torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()


def _check_sizes(resolution: int, short_side: int | None) -> int:
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


def _item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    # Mix (seed, epoch, index) into one 63-bit seed (SplitMix64-style constants).
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 63)
    return torch.Generator().manual_seed(x)


class _RandomCrops(Dataset, abc.ABC):
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
        """Select the crops of ``epoch`` (items are a function of ``(seed, epoch, index)``)."""
        self.epoch = int(epoch)

    def _generator(self, index: int) -> torch.Generator:
        return _item_generator(self.seed, self.epoch, index)

    @abc.abstractmethod
    def _image(self, k: int) -> torch.Tensor:
        """Image ``k`` as uint8 ``[3, H, W]`` (each concrete dataset reads its own source)."""

    @abc.abstractmethod
    def _target(self, k: int) -> dict:
        """What item ``k`` carries beside its pixels (``class_labels`` or ``caption``)."""

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
        """What defines the items (for latent caches): class, sizes, seed, flips, image sources."""
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


class _ClassCrops(_RandomCrops):
    """Crops of class-labelled images: items carry ``class_labels``; subclasses provide ``_label(k)``."""

    @abc.abstractmethod
    def _label(self, k: int) -> int:
        """Class id of image ``k``."""

    def _target(self, k: int) -> dict:
        return {"class_labels": torch.tensor(self._label(k), dtype=torch.long)}


class PhotoCrops(_ClassCrops):
    """Random crops of the real photographs shipped in the scikit-image / scikit-learn wheels.

    Each photo is one class (``class_labels`` = its index in ``photos``); ``id2label`` maps ids to
    photo names. An epoch is ``len(photos) * crops_per_photo`` crops, interleaved over the photos.

    Args:
        resolution: crop side ``S`` in pixels (e.g. 64).
        short_side: each photo is first resized (Lanczos) so its short side is this many pixels
            (>= ``resolution``; default ``1.5 * resolution``, e.g. 96 for 64-px crops): a crop then shows
            a recognisable part of the photo.
        crops_per_photo: crops of each photo per epoch (defines ``len``).
        seed: base seed of the crop positions / flips.
        hflip: random horizontal flips (p = 0.5).
        photos: subset / order of ``PHOTO_NAMES`` (default: all 10).

    Item: ``{"pixel_values": float32 [3, S, S] in [-1, 1], "class_labels": int64 scalar}``.

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
        self.short_side = _check_sizes(resolution, round(1.5 * resolution) if short_side is None else short_side)
        if int(crops_per_photo) != crops_per_photo or crops_per_photo < 1:
            raise ValueError(f"crops_per_photo must be a positive integer; got {crops_per_photo!r}")
        names = list(PHOTO_NAMES if photos is None else photos)
        if not names:
            raise ValueError(f"photos is empty; choose some of {list(PHOTO_NAMES)} or pass None for all")
        if len(set(names)) != len(names):
            raise ValueError(f"photos has duplicates: {names}")
        self.names = names
        self.crops_per_image = int(crops_per_photo)
        self.num_images = len(names)
        self.seed = int(seed)
        self.hflip = bool(hflip)
        self.images = [_to_tensor(_resize_short_side(Image.fromarray(load_photo(n)), self.short_side)) for n in names]

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


class ImageFolderCrops(_ClassCrops):
    """Random crops of your own images laid out as ``root/<class name>/<image>``.

    Classes are the sub-folders of ``root`` in sorted order (class id = position); images are the
    files with an extension in ``IMAGE_EXTENSIONS`` (case-insensitive), searched recursively inside
    each class folder, read with PIL and converted to RGB. An epoch is
    ``num_images * crops_per_image`` crops. Images are decoded on access (cache-free).

    Args:
        root: the folder.
        resolution: crop side ``S`` in pixels.
        short_side: resize each image so its short side is this many pixels before cropping
            (>= ``resolution``; default ``resolution``: crops span the short side).
        crops_per_image: crops of each image per epoch.
        seed, hflip: as in :class:`PhotoCrops`.

    Raises:
        FileNotFoundError: ``root`` does not exist or is not a folder.
        ValueError: no class sub-folders, a class folder without images, more than 1000 classes
            (DiT reserves id 1000 for the unconditional label), bad sizes.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        resolution: int = 64,
        short_side: int | None = None,
        crops_per_image: int = 1,
        seed: int = 0,
        hflip: bool = True,
    ):
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(
                f"image folder {root!r} does not exist or is not a directory; expected root/<class name>/<images>"
            )
        self.resolution = int(resolution)
        self.short_side = _check_sizes(resolution, short_side)
        if int(crops_per_image) != crops_per_image or crops_per_image < 1:
            raise ValueError(f"crops_per_image must be a positive integer; got {crops_per_image!r}")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise ValueError(
                f"image folder {root!r} has no class sub-folders; put the images of each class in "
                "root/<class name>/ (a single class is fine: root/all/)"
            )
        if len(classes) > MAX_CLASSES:
            raise ValueError(f"{len(classes)} classes in {root!r}; DiT supports at most {MAX_CLASSES} (id 1000 = unconditional)")
        files: list[str] = []
        labels: list[int] = []
        for c, name in enumerate(classes):
            found = []
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, name)):
                dirnames.sort()
                found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS)]
            if not found:
                raise ValueError(
                    f"class folder {os.path.join(root, name)!r} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                    "add some or remove the folder"
                )
            files += found
            labels += [c] * len(found)
        self.root = root
        self.classes = classes
        self.files = files
        self.labels = labels
        self.num_images = len(files)
        self.crops_per_image = int(crops_per_image)
        self.seed = int(seed)
        self.hflip = bool(hflip)

    @property
    def id2label(self) -> dict[int, str]:
        """Class id -> class folder name."""
        return dict(enumerate(self.classes))

    def _image(self, k: int) -> torch.Tensor:
        return _read_image(self.files[k], self.short_side)

    def _label(self, k: int) -> int:
        return self.labels[k]

    def _sources(self) -> list:
        return _file_stats(self.files) + [self.classes]


def _file_stats(files: Sequence[str]) -> list:
    out = []
    for f in files:
        st = os.stat(f)
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


def _read_image(path: str, short_side: int) -> torch.Tensor:
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
    except Exception as e:
        raise ValueError(f"cannot read image {path!r}: {e}") from e
    return _to_tensor(_resize_short_side(im, short_side))


def read_captions(root: str | os.PathLike, files: Sequence[str], caption_column: str = "text") -> list[str | None]:
    """The caption of each image file under ``root``, ``None`` where it has none.

    Sources, in order of precedence: ``root/metadata.jsonl`` (one JSON object per line with
    ``file_name``, relative to ``root``, and ``caption_column``); a sidecar text file beside the
    image with the same stem (``cat.png`` -> ``cat.txt``, stripped).

    Raises:
        ValueError: a malformed ``metadata.jsonl`` line, or one naming a file that is not there.
    """
    root = os.fspath(root)
    from_metadata: dict[str, str] = {}
    meta = os.path.join(root, "metadata.jsonl")
    if os.path.isfile(meta):
        with open(meta, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    name, text = row["file_name"], row[caption_column]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"{meta}:{n}: expected a JSON object with 'file_name' and {caption_column!r}; got {line.strip()[:80]!r} ({e})"
                    ) from None
                path = os.path.normpath(os.path.join(root, name))
                if not os.path.exists(path):  # a file, or a folder of frames (videos)
                    raise ValueError(f"{meta}:{n}: file_name {name!r} does not exist under {root}")
                from_metadata[path] = str(text)
    captions: list[str | None] = []
    for file in files:
        text = from_metadata.get(os.path.normpath(file))
        if text is None:
            sidecar = os.path.splitext(file)[0] + ".txt"
            if os.path.isfile(sidecar):
                with open(sidecar, encoding="utf-8") as f:
                    text = f.read().strip()
        captions.append(text)
    return captions


def _captioned_root(root, kind: str, missing_caption: str) -> str:
    """``root`` as a string, checked to be a directory; ``missing_caption`` checked ('error' / 'empty')."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{kind} folder {root!r} does not exist or is not a directory")
    if missing_caption not in ("error", "empty"):
        raise ValueError(f"missing_caption must be 'error' or 'empty'; got {missing_caption!r}")
    return root


class CaptionedImageCrops(_RandomCrops):
    """Random crops of captioned images (text-to-image fine-tuning, e.g. SANA).

    Images: every file with an extension in ``IMAGE_EXTENSIONS`` under ``root`` (recursive, sorted).
    Captions: see :func:`read_captions` (``metadata.jsonl`` or sidecar ``.txt``). Item:
    ``{"pixel_values": float32 [3, S, S] in [-1, 1], "caption": str}``.

    Args:
        root: the folder.
        resolution, short_side, crops_per_image, seed, hflip: as in :class:`ImageFolderCrops`.
        caption_column: the ``metadata.jsonl`` key holding the caption.
        missing_caption: ``"error"`` (default) or ``"empty"`` (an image without a caption gets ``""``,
            i.e. it trains the unconditional model).

    Raises:
        FileNotFoundError: ``root`` is not a folder. ValueError: no images, an image without a
        caption (with ``missing_caption="error"``), a bad ``metadata.jsonl``, bad sizes.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        resolution: int = 64,
        short_side: int | None = None,
        crops_per_image: int = 1,
        seed: int = 0,
        hflip: bool = True,
        caption_column: str = "text",
        missing_caption: str = "error",
    ):
        root = _captioned_root(root, "image", missing_caption)
        self.resolution = int(resolution)
        self.short_side = _check_sizes(resolution, short_side)
        if int(crops_per_image) != crops_per_image or crops_per_image < 1:
            raise ValueError(f"crops_per_image must be a positive integer; got {crops_per_image!r}")
        files: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS)]
        if not files:
            raise ValueError(f"image folder {root!r} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        captions = read_captions(root, files, caption_column)
        lacking = [f for f, c in zip(files, captions) if c is None]
        if lacking and missing_caption == "error":
            raise ValueError(
                f"{len(lacking)} of {len(files)} images have no caption (first: {lacking[0]!r}); add them to "
                f"{os.path.join(root, 'metadata.jsonl')} or a sidecar .txt, or set missing_caption='empty'"
            )
        self.root = root
        self.files = files
        self.captions = [c or "" for c in captions]
        self.num_images = len(files)
        self.crops_per_image = int(crops_per_image)
        self.seed = int(seed)
        self.hflip = bool(hflip)
        self.caption_column = caption_column

    id2label = None  # text-conditioned: no classes

    def _image(self, k: int) -> torch.Tensor:
        return _read_image(self.files[k], self.short_side)

    def _target(self, k: int) -> dict:
        return {"caption": self.captions[k]}

    def _sources(self) -> list:
        return _file_stats(self.files) + [self.captions]


# -- videos ----------------------------------------------------------------------------------------
def _is_frame_folder(path: str) -> bool:
    with os.scandir(path) as it:
        entries = list(it)
    return bool(entries) and any(e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in entries) and not any(
        e.is_dir() for e in entries
    )


def read_video_frames(path: str | os.PathLike, start: int = 0, count: int | None = None, stride: int = 1) -> torch.Tensor:
    """Frames ``start, start + stride, ...`` (``count`` of them; ``None``: to the end) of a video as
    uint8 ``[F, 3, H, W]``.

    ``path``: a video file (mp4 / webm / mov / mkv / avi through imageio with imageio-ffmpeg; animated
    gif / webp through PIL) or a folder of frame images (sorted by name).

    Raises:
        ValueError: unreadable file, or fewer frames than asked for.
        ImportError: imageio / imageio-ffmpeg missing for an ffmpeg format.
    """
    path = os.fspath(path)
    wanted = None if count is None else [start + i * stride for i in range(count)]
    last = None if wanted is None else wanted[-1]
    frames: list[np.ndarray] = []
    total = 0
    try:
        if os.path.isdir(path):
            names = sorted(f for f in os.listdir(path) if f.lower().endswith(IMAGE_EXTENSIONS))
            total = len(names)
            picks = range(start, total, stride) if wanted is None else [i for i in wanted if i < total]
            for i in picks:
                with Image.open(os.path.join(path, names[i])) as im:
                    frames.append(np.asarray(im.convert("RGB")))
        elif path.lower().endswith(_FFMPEG_EXTENSIONS):
            try:
                import imageio.v2 as imageio  # optional (video extra): mp4 / webm / ... need ffmpeg
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError(f"reading {path} needs imageio and imageio-ffmpeg: pip install imageio imageio-ffmpeg") from e
            reader = imageio.get_reader(path, "ffmpeg")
            try:
                for i, frame in enumerate(reader):
                    total = i + 1
                    if i >= start and (i - start) % stride == 0 and (wanted is None or i in wanted):
                        frames.append(np.asarray(frame)[..., :3])
                    if last is not None and i >= last:
                        break
            finally:
                reader.close()
        else:
            with Image.open(path) as im:
                for i, frame in enumerate(ImageSequence.Iterator(im)):
                    total = i + 1
                    if i >= start and (i - start) % stride == 0 and (wanted is None or i in wanted):
                        frames.append(np.asarray(frame.convert("RGB")))
                    if last is not None and i >= last:
                        break
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot read video {path!r}: {e}") from e
    if count is not None and len(frames) < count:
        raise ValueError(
            f"video {path!r} has {total} frames; a clip of {count} frames with stride {stride} from frame {start} needs "
            f"{start + (count - 1) * stride + 1}: lower data.num_frames / data.frame_stride or drop the video"
        )
    if not frames:
        raise ValueError(f"video {path!r} has no frames")
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()


def _video_length(path: str) -> int:
    if os.path.isdir(path):
        return sum(1 for f in os.listdir(path) if f.lower().endswith(IMAGE_EXTENSIONS))
    if path.lower().endswith(_FFMPEG_EXTENSIONS):
        import imageio.v2 as imageio  # optional (video extra); read_video_frames says what to install

        reader = imageio.get_reader(path, "ffmpeg")
        try:
            n = reader.count_frames()
        finally:
            reader.close()
        return int(n)
    with Image.open(path) as im:
        return int(getattr(im, "n_frames", 1))


class VideoClips(Dataset):
    """Random clips of captioned videos (text-to-video fine-tuning, e.g. Wan).

    Videos: every file under ``root`` with an extension in ``VIDEO_EXTENSIONS`` and every folder of
    frame images (a folder holding images and no sub-folders); recursive, sorted. Captions: as for
    :class:`CaptionedImageCrops` (``metadata.jsonl`` with ``file_name`` naming the file or folder, or
    a sidecar ``<name>.txt`` beside it). A clip is ``num_frames`` frames ``frame_stride`` apart from a
    random start, scaled (Lanczos) so it covers ``(height, width)``, randomly cropped and flipped;
    the randomness of item ``i`` is a function of ``(seed, epoch, i)`` (:meth:`set_epoch`).

    Args:
        root: the folder.
        resolution: ``S`` (square) or ``(height, width)`` of the clips, pixels.
        num_frames: frames per clip (Wan: ``4 k + 1``: 1, 5, ..., 81).
        frame_stride: take every ``frame_stride``-th frame.
        clips_per_video: items per video per epoch.
        seed, hflip, caption_column, missing_caption: as in :class:`CaptionedImageCrops`.

    Item: ``{"pixel_values": float32 [3, F, H, W] in [-1, 1], "caption": str}``.

    Raises:
        FileNotFoundError: ``root`` is not a folder. ValueError: no videos, missing captions (with
        ``missing_caption="error"``), bad sizes; at access, a video shorter than a clip.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        resolution: int | Sequence[int] = 64,
        num_frames: int = 17,
        frame_stride: int = 1,
        clips_per_video: int = 1,
        seed: int = 0,
        hflip: bool = True,
        caption_column: str = "text",
        missing_caption: str = "error",
    ):
        root = _captioned_root(root, "video", missing_caption)
        size = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
        if len(size) != 2 or any(int(v) != v or v < 1 for v in size):
            raise ValueError(f"resolution must be a positive integer or (height, width); got {resolution!r}")
        for name, v in (("num_frames", num_frames), ("frame_stride", frame_stride), ("clips_per_video", clips_per_video)):
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        videos: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for d in list(dirnames):
                full = os.path.join(dirpath, d)
                if _is_frame_folder(full):
                    videos.append(full)
                    dirnames.remove(d)
            videos += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(VIDEO_EXTENSIONS)]
        videos.sort()
        if not videos:
            raise ValueError(f"video folder {root!r} has no videos ({', '.join(VIDEO_EXTENSIONS)}) or frame folders")
        captions = read_captions(root, videos, caption_column)
        lacking = [v for v, c in zip(videos, captions) if c is None]
        if lacking and missing_caption == "error":
            raise ValueError(
                f"{len(lacking)} of {len(videos)} videos have no caption (first: {lacking[0]!r}); add them to "
                f"{os.path.join(root, 'metadata.jsonl')} or a sidecar .txt, or set missing_caption='empty'"
            )
        self.root, self.videos, self.captions = root, videos, [c or "" for c in captions]
        self.size = (int(size[0]), int(size[1]))
        self.num_frames, self.frame_stride, self.clips_per_video = int(num_frames), int(frame_stride), int(clips_per_video)
        self.seed, self.hflip, self.epoch = int(seed), bool(hflip), 0
        self._lengths: dict[int, int] = {}

    id2label = None

    def __len__(self) -> int:
        return len(self.videos) * self.clips_per_video

    def set_epoch(self, epoch: int) -> None:
        """Select the clips of ``epoch``."""
        self.epoch = int(epoch)

    def fingerprint(self) -> dict:
        """What defines the items (for latent caches)."""
        return {
            "class": type(self).__name__, "size": list(self.size), "num_frames": self.num_frames, "stride": self.frame_stride,
            "clips_per_video": self.clips_per_video, "seed": self.seed, "hflip": self.hflip,
            "sources": [[v, *(_file_stats([v])[0][1:] if os.path.isfile(v) else [_video_length(v)])] for v in self.videos]
            + [self.captions],
        }

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} clips")
        index %= len(self)
        k = index % len(self.videos)
        path = self.videos[k]
        if k not in self._lengths:
            self._lengths[k] = _video_length(path)
        span = (self.num_frames - 1) * self.frame_stride + 1
        if self._lengths[k] < span:
            raise ValueError(
                f"video {path!r} has {self._lengths[k]} frames; a clip needs {span} (num_frames {self.num_frames}, "
                f"frame_stride {self.frame_stride}): lower them or drop the video"
            )
        g = _item_generator(self.seed, self.epoch, index)
        start = int(torch.randint(0, self._lengths[k] - span + 1, (1,), generator=g))
        frames = read_video_frames(path, start, self.num_frames, self.frame_stride)  # uint8 [F, 3, h, w]
        h, w = frames.shape[-2:]
        H, W = self.size
        scale = max(H / h, W / w)
        new = (max(W, round(w * scale)), max(H, round(h * scale)))
        if new != (w, h):
            frames = torch.stack([
                _to_tensor(Image.fromarray(f.permute(1, 2, 0).numpy()).resize(new, Image.Resampling.LANCZOS, reducing_gap=3.0))
                for f in frames
            ])
        h, w = frames.shape[-2:]
        top = int(torch.randint(0, h - H + 1, (1,), generator=g))
        left = int(torch.randint(0, w - W + 1, (1,), generator=g))
        flip = bool(torch.rand((), generator=g) < 0.5)
        clip = frames[:, :, top : top + H, left : left + W]
        if self.hflip and flip:
            clip = clip.flip(-1)
        pixels = clip.to(torch.float32).permute(1, 0, 2, 3) / 127.5 - 1.0  # [3, F, H, W]
        return {"pixel_values": pixels.contiguous(), "caption": self.captions[k]}


def build_dataset(data: Mapping[str, Any]):
    """The dataset of ``config["data"]``: :class:`PhotoCrops` (``kind: photos``),
    :class:`ImageFolderCrops` (``folder``), :class:`CaptionedImageCrops` (``captions``) or
    :class:`VideoClips` (``video``).

    Raises:
        ValueError / FileNotFoundError: from the dataset constructors (bad sizes, empty folder, ...).
    """
    if data["kind"] == "video":
        return VideoClips(
            data["root"], resolution=data["resolution"], num_frames=data.get("num_frames", 17), frame_stride=data.get("frame_stride", 1),
            clips_per_video=data["crops_per_image"], seed=data["seed"], hflip=data["hflip"],
            caption_column=data.get("caption_column", "text"), missing_caption=data.get("missing_caption", "error"),
        )
    common = dict(resolution=data["resolution"], short_side=data["short_side"], seed=data["seed"], hflip=data["hflip"])
    if data["kind"] == "photos":
        return PhotoCrops(crops_per_photo=data["crops_per_image"], photos=data["photos"], **common)
    if data["kind"] == "captions":
        return CaptionedImageCrops(
            data["root"], crops_per_image=data["crops_per_image"], caption_column=data.get("caption_column", "text"),
            missing_caption=data.get("missing_caption", "error"), **common,
        )
    return ImageFolderCrops(data["root"], crops_per_image=data["crops_per_image"], **common)
