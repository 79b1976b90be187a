"""Converted MHLA checkpoints: the on-disk format (save / load), conversion of pretrained
checkpoints, LoRA files, and the importer of the authors' released Wan-MHLA weights."""
