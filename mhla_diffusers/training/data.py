"""Moved to :mod:`mhla_diffusers.data` (the diagnostics use the photos too); this path keeps working (a re-export)."""

from mhla_diffusers.data import (
    IMAGE_EXTENSIONS,
    MAX_CLASSES,
    PHOTO_NAMES,
    VIDEO_EXTENSIONS,
    CaptionedImageCrops,
    ImageFolderCrops,
    PhotoCrops,
    VideoClips,
    build_dataset,
    load_photo,
    read_captions,
    read_video_frames,
)

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
