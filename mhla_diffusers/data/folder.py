"""``kind: folder``: random crops of a class-labelled image folder, ``root/<class name>/<images>``.

Like torchvision's ``ImageFolder``: classes are the sorted sub-folders, at most :data:`MAX_CLASSES`
(:class:`ImageFolderCrops`). See ``docs/training.md``, "Datasets".
"""

from __future__ import annotations

import os

import torch

from mhla_diffusers.data.crops import IMAGE_EXTENSIONS, ClassCrops, check_count, check_sizes, file_stats, read_image

__all__ = ["MAX_CLASSES", "ImageFolderCrops"]

# DiT pipelines use class id 1000 as the "null" (unconditional) label: at most 1000 real classes.
MAX_CLASSES = 1000


def _class_folders(root: str) -> list[str]:
    """The sorted class sub-folders of ``root``; ``ValueError`` if none or more than ``MAX_CLASSES``."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(
            f"image folder {root!r} has no class sub-folders; put the images of each class in "
            "root/<class name>/ (a single class is fine: root/all/)"
        )
    if len(classes) > MAX_CLASSES:
        raise ValueError(f"{len(classes)} classes in {root!r}; DiT supports at most {MAX_CLASSES} (id 1000 = unconditional)")
    return classes


def _class_images(folder: str) -> list[str]:
    """The images under ``folder`` (recursively, sorted); ``ValueError`` if none."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS)]
    if not found:
        raise ValueError(
            f"class folder {folder!r} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
            "add some or remove the folder"
        )
    return found


class ImageFolderCrops(ClassCrops):
    """Random crops of ``root/<class name>/<images>``, items as :class:`PhotoCrops` (``short_side`` default: ``resolution``).

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: no class folders, a class without images, more than 1000 classes, bad sizes.
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
        self.short_side = check_sizes(resolution, short_side)
        self.crops_per_image = check_count("crops_per_image", crops_per_image)
        classes = _class_folders(root)
        files: list[str] = []
        labels: list[int] = []
        for c, name in enumerate(classes):
            found = _class_images(os.path.join(root, name))
            files += found
            labels += [c] * len(found)
        self.root = root
        self.classes = classes
        self.files = files
        self.labels = labels
        self.num_images = len(files)
        self.seed = int(seed)
        self.hflip = bool(hflip)

    @property
    def id2label(self) -> dict[int, str]:
        """Class id -> class folder name."""
        return dict(enumerate(self.classes))

    def _image(self, k: int) -> torch.Tensor:
        return read_image(self.files[k], self.short_side)

    def _label(self, k: int) -> int:
        return self.labels[k]

    def _sources(self) -> list:
        return file_stats(self.files) + [self.classes]
