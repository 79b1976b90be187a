"""Reading and writing the images and videos of generation: first frames, reference images and control videos
in (PIL images, :func:`load_first_frame`, :func:`load_frames`), image grids and mp4 files out (atomic writes,
:func:`save_grid`, :func:`save_video`). Errors are :class:`~mhla_diffusers.families.GenerationError` naming the
command-line flag."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
from diffusers.utils import export_to_video, make_image_grid
from PIL import features

from mhla_diffusers.checkpoint.io import atomic_output
from mhla_diffusers.families import GenerationError

__all__ = ["load_first_frame", "load_frames", "save_video", "IMAGE_FORMATS", "image_format", "save_grid"]


def load_first_frame(image, flag: str = "--image"):
    """An image input (the first frame of an image-to-video request, a reference image) as an RGB ``PIL.Image``:
    ``image`` is a path (any format PIL reads: png, jpg, webp, ...) or a ``PIL.Image``; ``flag`` names it in errors.

    Raises:
        GenerationError: a path that does not exist, is not a file, or that PIL cannot read as an image.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = Path(image)
    if not path.is_file():
        what = "not a file" if path.exists() else "no such file"
        raise GenerationError(f"{flag} {image}: {what}; give an image file")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise GenerationError(f"{flag} {image} is not an image this Pillow can read ({type(err).__name__}); use png or jpg") from None


def load_frames(source, flag: str = "--video") -> list:
    """The frames of a video input as RGB ``PIL.Image`` s: ``source`` is a video file (mp4, webm, gif, ...: diffusers'
    ``load_video``, imageio for mp4), a folder of frame images (read in file-name order) or a list of frames (paths or
    ``PIL.Image``); ``flag`` names it in errors.

    Raises:
        GenerationError: a path that does not exist, an empty folder, a file no reader takes, a frame PIL cannot read,
            frames of different sizes.
    """
    if not isinstance(source, (str, os.PathLike)):
        frames = [load_first_frame(f, flag) for f in source]
    elif Path(source).is_dir():
        names = sorted(p for p in Path(source).iterdir() if p.suffix.lower() in _FRAME_SUFFIXES)
        frames = [load_first_frame(p, flag) for p in names]
    elif Path(source).is_file():
        frames = _read_video(Path(source), flag)
    else:
        raise GenerationError(f"{flag} {source}: no such file or folder; give a video file or a folder of frames")
    if not frames:
        raise GenerationError(f"{flag} {source}: no frames ({', '.join(sorted(_FRAME_SUFFIXES))} files in the folder)")
    odd = next((i for i, f in enumerate(frames) if f.size != frames[0].size), None)
    if odd is not None:  # the pipeline would resize each frame alone, stretching the odd one
        raise GenerationError(
            f"{flag} {source}: frame {odd} is {frames[odd].size[0]} x {frames[odd].size[1]} px and frame 0 "
            f"{frames[0].size[0]} x {frames[0].size[1]}; give frames of one size"
        )
    return frames


_FRAME_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})


def _read_video(path: Path, flag: str) -> list:
    from diffusers.utils import load_video

    try:
        return [frame.convert("RGB") for frame in load_video(str(path))]
    except Exception as err:  # imageio / PIL raise many kinds for a file they cannot decode
        raise GenerationError(
            f"{flag} {path} could not be read as a video ({type(err).__name__}: {err}); give an mp4 (imageio-ffmpeg), a gif, "
            "or a folder of frame images"
        ) from None


def save_video(frames, path: str | os.PathLike, fps: int = 16) -> Path:
    """Write one video (``[F, H, W, 3]`` floats in ``[0, 1]`` or uint8, or a list of frames) as an mp4,
    atomically, through ``diffusers.utils.export_to_video`` (needs ``imageio`` and ``imageio-ffmpeg``).
    Wan 2.1 plays at 16 fps.

    Raises:
        GenerationError: ``path`` does not end in ``.mp4``, or imageio / imageio-ffmpeg are missing.
    """

    path = Path(path)
    if path.suffix.lower() != ".mp4":
        raise GenerationError(f"videos are written as mp4: --out must end in .mp4; got {path.name}")
    missing = [m for m in ("imageio", "imageio_ffmpeg") if importlib.util.find_spec(m) is None]
    if missing:
        raise GenerationError(f"writing mp4 needs {', '.join(missing)}: pip install imageio imageio-ffmpeg")
    frames = [np.asarray(f) for f in frames]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path, suffix=".mp4") as tmp:
        export_to_video(frames, str(tmp), fps=fps)
    return path


# Image file suffixes save_grid writes, and the PIL format of each.
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}


def image_format(path: str | os.PathLike) -> str:
    """The PIL format (``"PNG"``, ``"JPEG"``, ``"WEBP"``) named by the suffix of ``path`` (any case).

    Check an output path with it before generating: no compute is spent on images that cannot be saved.

    Raises:
        GenerationError: no suffix, a video suffix (``.mp4``: images are not videos) or another unknown one.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    known = ", ".join(sorted(IMAGE_FORMATS))
    if suffix == ".mp4":
        raise GenerationError(
            f"{path.name}: mp4 is written for text-to-video checkpoints only; this writes an image grid: "
            f"name it with one of {known}"
        )
    if suffix not in IMAGE_FORMATS:
        what = f"an unknown image suffix {suffix!r}" if suffix else "no suffix"
        raise GenerationError(f"{path.name} has {what}: images are written as {known} (the format follows the suffix)")
    fmt = IMAGE_FORMATS[suffix]
    if fmt == "WEBP" and not features.check("webp"):
        raise GenerationError(f"{path.name}: this Pillow build has no WebP support; use .png or .jpg")
    return fmt


def save_grid(images, path: str | os.PathLike, rows: int | None = None) -> Path:
    """Save images as one grid (``diffusers.utils.make_image_grid``) in the format the suffix of
    ``path`` names (``.png``, ``.jpg`` / ``.jpeg`` at quality 95, ``.webp`` at quality 95), written atomically.

    Raises:
        GenerationError: a suffix :func:`image_format` does not take (checked before anything is written).
    """
    fmt = image_format(path)

    rows = rows or 1
    cols = -(-len(images) // rows)
    blank = images[0].copy()
    blank.paste((255, 255, 255), (0, 0, *blank.size))
    padded = list(images) + [blank] * (rows * cols - len(images))
    grid = make_image_grid(padded, rows=rows, cols=cols)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
    with atomic_output(path) as tmp:
        (grid.convert("RGB") if fmt == "JPEG" and grid.mode != "RGB" else grid).save(tmp, format=fmt, **options)
    return path
