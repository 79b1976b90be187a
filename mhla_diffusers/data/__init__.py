"""Image and video datasets for fine-tuning and diagnostics, one module per ``data.kind`` of a training config.

Items are random crops (``pixel_values`` float32 in ``[-1, 1]``) with ``class_labels`` or a
``caption``; item ``i``'s randomness is a pure function of ``(seed, epoch, i)`` (call ``set_epoch``
each epoch). :mod:`.photos` (``kind: photos``, :class:`~.photos.PhotoCrops`: photos shipped in the
scikit-image / scikit-learn wheels), :mod:`.folder` (``kind: folder``, :class:`~.folder.ImageFolderCrops`),
:mod:`.captions` (``kind: captions``, :class:`~.captions.CaptionedImageCrops`, :func:`~.captions.read_captions`),
:mod:`.video` (``kind: video``, :class:`~.video.VideoClips`), :mod:`.crops` (what they share: the crop
base classes, per-item randomness, image reading) and :mod:`.build` (:func:`~.build.build_dataset`,
the dataset of a config). Nothing is imported here: import the module that defines a name.
See ``docs/training.md``, "Datasets".
"""
