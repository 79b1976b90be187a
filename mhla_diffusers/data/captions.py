"""``kind: captions``: captioned images (text-to-image), and the caption files videos share.

Captions (:func:`read_captions`) come from ``root/metadata.jsonl`` (the Hugging Face ``imagefolder``
convention), else a sidecar ``<stem>.txt``; :class:`CaptionedImageCrops` crops the images. See
``docs/training.md``, "Datasets".
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from mhla_diffusers.data.crops import IMAGE_EXTENSIONS, RandomCrops, check_count, check_sizes, file_stats, read_image

__all__ = ["read_captions", "captioned_root", "checked_captions", "CaptionedImageCrops"]


def _metadata_captions(root: str, caption_column: str) -> dict[str, str]:
    """``{normalised path: caption}`` of ``root/metadata.jsonl`` (empty without one)."""
    from_metadata: dict[str, str] = {}
    meta = os.path.join(root, "metadata.jsonl")
    if not os.path.isfile(meta):
        return from_metadata
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
    return from_metadata


def _sidecar_caption(file: str) -> str | None:
    """The text of ``file``'s sidecar ``<stem>.txt``, or ``None``."""
    sidecar = os.path.splitext(file)[0] + ".txt"
    if not os.path.isfile(sidecar):
        return None
    with open(sidecar, encoding="utf-8") as f:
        return f.read().strip()


def read_captions(root: str | os.PathLike, files: Sequence[str], caption_column: str = "text") -> list[str | None]:
    """The caption of each file under ``root`` (``None`` where none): ``metadata.jsonl``, else a sidecar ``.txt``.

    ``ValueError`` for a malformed ``metadata.jsonl`` line, or one naming a missing file.
    """
    from_metadata = _metadata_captions(os.fspath(root), caption_column)
    captions: list[str | None] = []
    for file in files:
        text = from_metadata.get(os.path.normpath(file))
        if text is None:
            text = _sidecar_caption(file)
        captions.append(text)
    return captions


def captioned_root(root, kind: str, missing_caption: str) -> str:
    """``root`` checked to be a directory, and ``missing_caption`` to be ``'error'`` or ``'empty'``."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{kind} folder {root!r} does not exist or is not a directory")
    if missing_caption not in ("error", "empty"):
        raise ValueError(f"missing_caption must be 'error' or 'empty'; got {missing_caption!r}")
    return root


def checked_captions(root: str, files: Sequence[str], caption_column: str, missing_caption: str, what: str) -> list[str]:
    """The captions of ``files`` (``""`` where none); with ``missing_caption="error"``, ``ValueError`` if any lacks one.

    ``what``: the files' plural noun in the message (``"images"``, ``"videos"``).
    """
    captions = read_captions(root, files, caption_column)
    lacking = [f for f, c in zip(files, captions) if c is None]
    if lacking and missing_caption == "error":
        raise ValueError(
            f"{len(lacking)} of {len(files)} {what} have no caption (first: {lacking[0]!r}); add them to "
            f"{os.path.join(root, 'metadata.jsonl')} or a sidecar .txt, or set missing_caption='empty'"
        )
    return [c or "" for c in captions]


def _image_files(root: str) -> list[str]:
    """Every image under ``root`` (hidden folders skipped, sorted); ``ValueError`` if none."""
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS)]
    if not files:
        raise ValueError(f"image folder {root!r} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files


class CaptionedImageCrops(RandomCrops):
    """Random crops of captioned images under ``root`` (text-to-image); captions by :func:`read_captions`.

    Item: ``{"pixel_values": float32 [3, S, S] in [-1, 1], "caption": str}``; ``missing_caption``:
    ``"error"`` or ``"empty"`` (an uncaptioned image gets ``""``).

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: no images, a missing caption (``"error"``), a bad ``metadata.jsonl``, bad sizes.
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
        root = captioned_root(root, "image", missing_caption)
        self.resolution = int(resolution)
        self.short_side = check_sizes(resolution, short_side)
        self.crops_per_image = check_count("crops_per_image", crops_per_image)
        files = _image_files(root)
        self.captions = checked_captions(root, files, caption_column, missing_caption, "images")
        self.root = root
        self.files = files
        self.num_images = len(files)
        self.seed = int(seed)
        self.hflip = bool(hflip)
        self.caption_column = caption_column

    id2label = None  # text-conditioned: no classes

    def _image(self, k: int) -> torch.Tensor:
        return read_image(self.files[k], self.short_side)

    def _target(self, k: int) -> dict:
        return {"caption": self.captions[k]}

    def _sources(self) -> list:
        return file_stats(self.files) + [self.captions]
