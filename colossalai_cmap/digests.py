"""Digests that are the same in every process: of a structure (its ``repr``) and of tensors' bytes.

``hash`` of a str is salted per process, so ranks compare these instead.
"""

import zlib
from typing import Any, Iterable

import torch


def digest(obj: object) -> int:
    """A digest of ``repr(obj)``, never 0 (0 means "none" in a round's header)."""
    return zlib.crc32(repr(obj).encode()) or 1


def tensor_crc(tensors: Iterable[Any], start: int = 0) -> int:
    """crc32 of the bytes of the tensors among ``tensors``, in order, continuing from ``start`` (other values are
    skipped). A lazy conjugate or negative bit is resolved first, so the digest is of the values."""
    crc = start
    for t in tensors:
        if isinstance(t, torch.Tensor):
            flat = t.detach().resolve_conj().resolve_neg().contiguous().cpu().reshape(-1)
            if flat.numel():
                crc = zlib.crc32(flat.view(torch.uint8).numpy().tobytes(), crc)
    return crc
