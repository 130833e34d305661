"""A real text corpus that is on every machine already: the Python standard library's own source.

The files are read in sorted order and split by file, one in ten held out for validation, so the
validation text is code the model never trained on. Text is read as bytes (vocabulary 256), and
cut into fixed windows of block_size + 1 bytes: the inputs and, shifted by one, the targets.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte string: item i is
    (bytes[i*B : i*B+B], bytes[i*B+1 : i*B+B+1])."""

    def __init__(self, data: bytes, block_size: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def stdlib_source(max_bytes: int, val_every: int = 10) -> tuple[bytes, bytes]:
    """(train, validation) text: up to `max_bytes` of the standard library's top-level modules,
    every `val_every`-th file held out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python source files in {stdlib}")
    train, val = bytearray(), bytearray()
    val_budget = max_bytes // val_every
    for index, path in enumerate(files):
        held_out = index % val_every == val_every - 1
        part, budget = (val, val_budget) if held_out else (train, max_bytes - val_budget)
        if len(part) < budget:
            part += path.read_bytes()[: budget - len(part)]
        if len(train) >= max_bytes - val_budget and len(val) >= val_budget:
            break
    return bytes(train), bytes(val)


def load(max_bytes: int, block_size: int) -> tuple[ByteWindows, ByteWindows]:
    train, val = stdlib_source(max_bytes)
    return ByteWindows(train, block_size), ByteWindows(val, block_size)
