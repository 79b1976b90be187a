"""``kind: video``: random clips of captioned videos or frame folders (text-to-video, e.g. Wan).

Video files (mp4 / webm / mov / mkv / avi through imageio with imageio-ffmpeg; animated gif / webp
through PIL) and folders of frame images (:func:`read_video_frames`), captions as for images
(:mod:`mhla_diffusers.data.captions`); :class:`VideoClips`. See ``docs/training.md``, "Datasets".
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np
import torch
from PIL import Image, ImageSequence
from torch.utils.data import Dataset

from mhla_diffusers.data.captions import captioned_root, checked_captions
from mhla_diffusers.data.crops import IMAGE_EXTENSIONS, check_count, file_stats, item_generator, to_tensor

__all__ = ["VIDEO_EXTENSIONS", "read_video_frames", "VideoClips"]

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif", ".webp")
_FFMPEG_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")


def _is_frame_folder(path: str) -> bool:
    with os.scandir(path) as it:
        entries = list(it)
    return bool(entries) and any(e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in entries) and not any(
        e.is_dir() for e in entries
    )


def _pick_frames(frames: Iterable, start: int, stride: int, wanted: list[int] | None, last: int | None, to_array):
    """Frames ``start, start + stride, ...`` (those in ``wanted``, if given) of a stream read up to frame ``last``,
    and the number of frames read."""
    picked: list[np.ndarray] = []
    total = 0
    for i, frame in enumerate(frames):
        total = i + 1
        if i >= start and (i - start) % stride == 0 and (wanted is None or i in wanted):
            picked.append(to_array(frame))
        if last is not None and i >= last:
            break
    return picked, total


def _folder_frames(path: str, start: int, stride: int, wanted: list[int] | None, last: int | None) -> tuple[list, int]:
    """``_pick_frames`` for a folder of frame images (sorted by name; only the wanted ones are opened)."""
    names = sorted(f for f in os.listdir(path) if f.lower().endswith(IMAGE_EXTENSIONS))
    picks = range(start, len(names), stride) if wanted is None else [i for i in wanted if i < len(names)]
    frames = []
    for i in picks:
        with Image.open(os.path.join(path, names[i])) as im:
            frames.append(np.asarray(im.convert("RGB")))
    return frames, len(names)


def _ffmpeg_frames(path: str, start: int, stride: int, wanted: list[int] | None, last: int | None) -> tuple[list, int]:
    """``_pick_frames`` for an ffmpeg format (mp4, webm, mov, mkv, avi) through imageio."""
    try:
        import imageio.v2 as imageio  # optional (video extra): mp4 / webm / ... need ffmpeg
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"reading {path} needs imageio and imageio-ffmpeg: pip install imageio imageio-ffmpeg") from e
    reader = imageio.get_reader(path, "ffmpeg")
    try:
        return _pick_frames(reader, start, stride, wanted, last, lambda frame: np.asarray(frame)[..., :3])
    finally:
        reader.close()


def _animation_frames(path: str, start: int, stride: int, wanted: list[int] | None, last: int | None) -> tuple[list, int]:
    """``_pick_frames`` for an animation PIL reads (gif, webp)."""
    with Image.open(path) as im:
        return _pick_frames(ImageSequence.Iterator(im), start, stride, wanted, last, lambda frame: np.asarray(frame.convert("RGB")))


def read_video_frames(path: str | os.PathLike, start: int = 0, count: int | None = None, stride: int = 1) -> torch.Tensor:
    """Frames ``start, start + stride, ...`` (``count``, or to the end) of a video file or frame folder, uint8 ``[F, 3, H, W]``.

    Raises:
        ValueError: an unreadable file, or fewer frames than asked for.
        ImportError: imageio / imageio-ffmpeg missing for an ffmpeg format.
    """
    path = os.fspath(path)
    wanted = None if count is None else [start + i * stride for i in range(count)]
    last = None if wanted is None else wanted[-1]
    if os.path.isdir(path):
        read = _folder_frames
    elif path.lower().endswith(_FFMPEG_EXTENSIONS):
        read = _ffmpeg_frames
    else:
        read = _animation_frames
    try:
        frames, total = read(path, start, stride, wanted, last)
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


def _find_videos(root: str) -> list[str]:
    """Every video file and frame folder under ``root`` (hidden folders skipped), sorted; ``ValueError`` if none."""
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
    return videos


def _frame_size(resolution: int | Sequence[int]) -> tuple[int, int]:
    """``resolution`` (``S`` or ``(height, width)``) as ``(height, width)``; ``ValueError`` if bad."""
    size = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    if len(size) != 2 or any(int(v) != v or v < 1 for v in size):
        raise ValueError(f"resolution must be a positive integer or (height, width); got {resolution!r}")
    return int(size[0]), int(size[1])


def _cover(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[F, 3, h, w]`` frames resized (Lanczos) to cover ``size = (H, W)``."""
    h, w = frames.shape[-2:]
    H, W = size
    scale = max(H / h, W / w)
    new = (max(W, round(w * scale)), max(H, round(h * scale)))
    if new == (w, h):
        return frames
    return torch.stack([
        to_tensor(Image.fromarray(f.permute(1, 2, 0).numpy()).resize(new, Image.Resampling.LANCZOS, reducing_gap=3.0))
        for f in frames
    ])


class VideoClips(Dataset):
    """Random clips of captioned videos or frame folders under ``root`` (text-to-video, e.g. Wan).

    A clip is ``num_frames`` frames (Wan: ``4 k + 1``) ``frame_stride`` apart, at ``resolution`` (``S`` or
    ``(height, width)`` pixels). Item: ``{"pixel_values": float32 [3, F, H, W] in [-1, 1], "caption": str}``.

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: no videos, missing captions, bad sizes; at access, a video shorter than a clip.
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
        root = captioned_root(root, "video", missing_caption)
        self.size = _frame_size(resolution)
        self.num_frames = check_count("num_frames", num_frames)
        self.frame_stride = check_count("frame_stride", frame_stride)
        self.clips_per_video = check_count("clips_per_video", clips_per_video)
        self.root, self.videos = root, _find_videos(root)
        self.captions = checked_captions(root, self.videos, caption_column, missing_caption, "videos")
        self.seed, self.hflip, self.epoch = int(seed), bool(hflip), 0
        self._lengths: dict[int, int] = {}

    id2label = None

    def __len__(self) -> int:
        return len(self.videos) * self.clips_per_video

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def fingerprint(self) -> dict:
        return {
            "class": type(self).__name__, "size": list(self.size), "num_frames": self.num_frames, "stride": self.frame_stride,
            "clips_per_video": self.clips_per_video, "seed": self.seed, "hflip": self.hflip,
            "sources": [[v, *(file_stats([v])[0][1:] if os.path.isfile(v) else [_video_length(v)])] for v in self.videos]
            + [self.captions],
        }

    def _clip_start(self, k: int, g: torch.Generator) -> int:
        """A random first frame of a clip of video ``k``; ``ValueError`` if the video is shorter than a clip."""
        path = self.videos[k]
        if k not in self._lengths:
            self._lengths[k] = _video_length(path)
        span = (self.num_frames - 1) * self.frame_stride + 1
        if self._lengths[k] < span:
            raise ValueError(
                f"video {path!r} has {self._lengths[k]} frames; a clip needs {span} (num_frames {self.num_frames}, "
                f"frame_stride {self.frame_stride}): lower them or drop the video"
            )
        return int(torch.randint(0, self._lengths[k] - span + 1, (1,), generator=g))

    def _crop(self, frames: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """A random (flipped) ``size`` crop of uint8 ``[F, 3, h, w]`` frames as float32 ``[3, F, H, W]`` in ``[-1, 1]``."""
        h, w = frames.shape[-2:]
        H, W = self.size
        top = int(torch.randint(0, h - H + 1, (1,), generator=g))
        left = int(torch.randint(0, w - W + 1, (1,), generator=g))
        flip = bool(torch.rand((), generator=g) < 0.5)
        clip = frames[:, :, top : top + H, left : left + W]
        if self.hflip and flip:
            clip = clip.flip(-1)
        return (clip.to(torch.float32).permute(1, 0, 2, 3) / 127.5 - 1.0).contiguous()  # [3, F, H, W]

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} clips")
        index %= len(self)
        k = index % len(self.videos)
        g = item_generator(self.seed, self.epoch, index)
        start = self._clip_start(k, g)
        frames = read_video_frames(self.videos[k], start, self.num_frames, self.frame_stride)  # uint8 [F, 3, h, w]
        return {"pixel_values": self._crop(_cover(frames, self.size), g), "caption": self.captions[k]}
