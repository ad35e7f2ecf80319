"""DecodeSchedule: the split-KV schedule of one decode step (made by mla_autograd.decode_schedule).

Its own module so that validation (_validate) and the functional API can both import it without
importing each other.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DecodeSchedule"]


class DecodeSchedule:
    """The split-KV schedule of one decode step, from `decode_schedule`; pass it to every `decode` call of
    the step (all layers) as ``schedule=``.

    Attributes:
        tensor: int32 1-D tensor on `device` (the kernel's work items then per-request split counts;
            empty where decode runs the reference path, which needs none).
        batch, seqlen_q, num_heads: the (B, Sq, H) it was computed for.
        device: the device of cache_seqlens.
        seqlens_version, seqlens_ptr: cache_seqlens._version and data_ptr() when it was computed (None
            where unreadable: under torch.compile; the version of an inference tensor), to detect a stale
            schedule.
        seqlens_copy: for an inference-mode cache_seqlens (no version counter), an int32 (B,) copy of the
            lengths on `device` taken when the schedule was computed (a device-to-device copy, no sync);
            decode compares it with cache_seqlens while it checks values, in the same single host copy.
            None otherwise (the version counter does that job), and under torch.compile or CUDA-graph
            capture.
    """

    __slots__ = ("tensor", "batch", "seqlen_q", "num_heads", "device", "seqlens_version", "seqlens_ptr",
                 "seqlens_copy")

    def __init__(self, tensor: Tensor, batch: int, seqlen_q: int, num_heads: int, device: torch.device,
                 seqlens_version: int | None, seqlens_ptr: int | None, seqlens_copy: Tensor | None = None):
        self.tensor = tensor
        self.batch, self.seqlen_q, self.num_heads, self.device = batch, seqlen_q, num_heads, device
        self.seqlens_version, self.seqlens_ptr = seqlens_version, seqlens_ptr
        self.seqlens_copy = seqlens_copy

    def __repr__(self) -> str:
        return (f"DecodeSchedule(batch={self.batch}, seqlen_q={self.seqlen_q}, num_heads={self.num_heads}, "
                f"device={self.device}, numel={self.tensor.numel()})")
