"""The dataset of a training config's ``data`` section, by its ``kind`` (:func:`build_dataset`)."""

from __future__ import annotations

from typing import Any, Mapping

from mhla_diffusers.data.captions import CaptionedImageCrops
from mhla_diffusers.data.folder import ImageFolderCrops
from mhla_diffusers.data.photos import PhotoCrops
from mhla_diffusers.data.video import VideoClips

__all__ = ["build_dataset"]


def build_dataset(data: Mapping[str, Any]):
    """The dataset of ``config["data"]`` by ``kind`` (photos, folder, captions, video); raises as its constructor."""
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
