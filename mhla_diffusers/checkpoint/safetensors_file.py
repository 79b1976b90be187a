"""Reading ``.safetensors`` files that may be damaged: the header checked before any tensor is read.

The one reader of safetensors files the package takes from a user (converted checkpoints, conversion
sources, LoRA folders, training checkpoints and caches): a truncated file, random bytes, a Git LFS
pointer or a header length of 2^63 is one :class:`MHLACheckpointError` naming the file and the fault,
never safetensors' or torch's own exception, and never a read past the file's end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

__all__ = ["MHLACheckpointError", "load_safetensors", "read_safetensors_header"]


class MHLACheckpointError(ValueError):
    """A checkpoint (a converted one, or the source of a conversion) is missing, corrupted or does not match the model."""


# Bytes per element of the safetensors dtype names (the format's own table); names not listed are not size-checked.
_SAFETENSORS_ITEM_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_SAFETENSORS_MAX_HEADER = 100_000_000  # bytes: safetensors itself refuses a larger header


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The checked header of a ``.safetensors`` file, without reading the tensor data (at most ``8 + n`` bytes).

    Returns:
        The header as stored (``"__metadata__"`` included when present).

    Raises:
        FileNotFoundError: no such file.
        MHLACheckpointError: one line naming the file and the fault: too short, a header length past the
            end, not a JSON object of valid tensor entries, offsets not tiling the data, or a byte length
            that is not dtype size times element count.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")

    def bad(what: str) -> MHLACheckpointError:
        return MHLACheckpointError(f"{path} is not a readable safetensors file: {what}")

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise bad(f"it holds {size} bytes, fewer than the 8 of the header length")
        head = f.read(8)
        if head == b"version " and f.read(16) == b"https://git-lfs.":
            raise bad("it is a Git LFS pointer, not the weights (fetch them: git lfs pull)")
        f.seek(8)
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise bad(f"its header length field says {n} bytes, but {size - 8} follow it (a truncated file, or not safetensors)")
        if n > _SAFETENSORS_MAX_HEADER:
            raise bad(f"its header length field says {n} bytes, more than the {_SAFETENSORS_MAX_HEADER} safetensors allows")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise bad(f"its {n}-byte header is not UTF-8 JSON ({err})") from err
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object of tensor entries")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("its __metadata__ is not an object of strings")
    _check_tensor_entries({k: v for k, v in header.items() if k != "__metadata__"}, size - 8 - n, bad)
    return header


def _check_tensor_entries(entries: dict, data_size: int, bad) -> None:
    """Each entry well formed, its byte length that of its dtype and shape, the offsets tiling ``[0, data_size)``."""
    spans = []
    for name, info in entries.items():
        offsets, shape = (info.get("data_offsets"), info.get("shape")) if isinstance(info, dict) else (None, None)
        if (not isinstance(info, dict) or not isinstance(info.get("dtype"), str)
                or not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets)):
            raise bad(f"its entry {name!r} is not {{dtype, shape, data_offsets: [begin, end]}}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise bad(f"tensor {name!r} lies at bytes {begin}..{end} of a data section of {data_size} bytes (a truncated file)")
        item = _SAFETENSORS_ITEM_SIZES.get(info["dtype"])
        count = 1
        for d in shape:
            count *= d
        if item is not None and end - begin != count * item:
            raise bad(f"tensor {name!r} ({info['dtype']}, shape {tuple(shape)}) needs {count * item} bytes, its offsets give {end - begin}")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise bad(f"its tensors do not tile the data: {name!r} begins at byte {begin}, the data before it ends at {position}")
        position = end
    if position != data_size:
        raise bad(f"its tensors cover {position} bytes of a data section of {data_size} (extra bytes at the end)")


def load_safetensors(path: str | os.PathLike, what: str = "") -> dict[str, torch.Tensor]:
    """All tensors of ``path`` on the CPU, after :func:`read_safetensors_header` checked it.

    Raises:
        FileNotFoundError: no such file.
        MHLACheckpointError: a damaged header, or data safetensors cannot read (``what`` names the file's role).
    """
    read_safetensors_header(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise MHLACheckpointError(f"{path} ({what or 'safetensors file'}) cannot be read: {err}") from err


def is_int(value) -> bool:
    """An ``int`` and not a ``bool`` (JSON integers)."""
    return isinstance(value, int) and not isinstance(value, bool)
