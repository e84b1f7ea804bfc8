"""Pretrained weights from a local folder's safetensors files (model.hf.path), read slice by slice: a rank reads
only the rows of each tensor that its shard or partition holds, never the whole model."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtk.errors import DtkError


def safetensors_files(folder: str) -> list[Path] | None:
    """The folder's safetensors files (one, or the shards its index names); None when it has none."""
    root = Path(folder)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    single = root / "model.safetensors"
    return [single] if single.is_file() else None


def _rows(full_shape, target: torch.Tensor) -> tuple[int, int, slice | None]:
    """(first row, row count, flat cut within those rows) of the whole tensor that `target` holds."""
    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full_shape, target.device_mesh, target.placements)
        if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(full_shape[1:]):
            raise DtkError("strategy: a tensor sharded along a dimension other than the first cannot be read by "
                           "slices; accepted: fsdp's or zero3's default sharding")
        return offset[0], shape[0], None
    if hasattr(target, "ds_tensor"):  # ZeRO-3: a flat range of the tensor, padded at the end
        n = target.ds_tensor.numel()
        start = n * target.ds_process_group.rank() if hasattr(target, "ds_process_group") else 0
        row = max(1, int(torch.Size(full_shape[1:]).numel())) if len(full_shape) > 1 else 1
        first, last = start // row, min(-(-(start + n) // row), full_shape[0] if full_shape else 1)
        return first, max(0, last - first), slice(start - first * row, start - first * row + n)
    return 0, full_shape[0] if full_shape else 1, None


@dataclass(kw_only=True)
class SliceReader:
    """Reads into a materialised model the tensors the files hold, each rank only its part."""

    files: list[Path]
    prefix: str = ""
    """The model's base prefix (transformers' base_model_prefix): checkpoints of a base model lack it."""
    bytes_read: int = field(default=0)

    def load_into(self, target: nn.Module) -> list[str]:
        """Fill `target`'s parameters and persistent buffers from the files; returns the names not found there
        (tied parameters, or ones the caller's init gave)."""
        from safetensors import safe_open

        wanted: dict[str, torch.Tensor] = dict(target.named_parameters(remove_duplicate=False))
        wanted.update(target.named_buffers())
        found: set[str] = set()
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                for name, tensor in wanted.items():
                    key = name if name in keys else name.removeprefix(self.prefix + ".") if self.prefix else name
                    if key not in keys or name in found:
                        continue
                    self._place(f.get_slice(key), tensor)
                    found.add(name)
        return sorted(set(wanted) - found)

    def _place(self, piece, target: torch.Tensor) -> None:
        shape = piece.get_shape()
        first, count, cut = _rows(shape, target)
        values = piece[first:first + count] if shape else piece[:]
        self.bytes_read += values.numel() * values.element_size()
        with torch.no_grad():
            if isinstance(target, DTensor):
                if target.to_local().numel():
                    target.to_local().copy_(values)
            elif hasattr(target, "ds_tensor"):
                part = target.ds_tensor.reshape(-1)
                flat = values.reshape(-1)[cut]
                part.zero_()
                part[:flat.numel()].copy_(flat)
            else:
                target.copy_(values.reshape(target.shape))
