"""Paged latent KV cache for Multi-head Latent Attention.

MLA caches, per token, one normalized latent ``c_kv`` (kv_lora_rank, 512 in DeepSeek) and one roped
shared key ``k_pe`` (qk_rope_head_dim, 64), the same for every head. They are stored side by side
in one buffer of pages, (num_pages, page_size, kv_lora_rank + qk_rope_head_dim), exactly as the
decode kernel reads them (``ckv`` and ``kpe`` are views of it with row stride 576).

One :class:`MLACache` serves one attention layer and a batch of ``batch`` sequences. Pages are
handed out from a free list on the host as sequences grow; ``block_table`` (int32, (batch,
max_pages)) maps a sequence's logical page to a physical page, ``seqlens`` (int32, (batch,)) holds
the lengths on the cache's device, and ``lengths`` mirrors them on the host, so appending never
synchronises with the device. A model keeps one cache per layer.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

__all__ = ["MLACache"]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`. A host tensor goes to a GPU without a synchronisation: a blocking copy would wait for
    all queued GPU work (torch synchronises the stream after it); a non-blocking copy from pageable host
    memory is staged by CUDA before it returns, so the host tensor may be freed at once."""
    return t.to(device, non_blocking=t.device.type == "cpu")


class MLACache:
    """Paged cache of MLA latents for one layer.

    Typical use::

        cache = MLACache(kv_lora_rank=512, qk_rope_head_dim=64)
        cache.allocate(num_pages=256, page_size=64, batch=4, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            y = layer(prompt_hidden, cache=cache)     # prefill: fills the cache
            y = layer(next_hidden, cache=cache)       # decode step(s)
        cache.reset()                                 # reuse for new sequences
    """

    def __init__(self, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64):
        self.kv_lora_rank = int(kv_lora_rank)
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.buffer: torch.Tensor | None = None
        self.block_table: torch.Tensor | None = None
        self.seqlens: torch.Tensor | None = None
        self._table_host: torch.Tensor | None = None
        self._lengths: list[int] = []
        self._free: list[int] = []
        self._pages: list[list[int]] = []

    # ------------------------------------------------------------------ setup
    def allocate(self, num_pages: int, page_size: int, batch: int, device=None, dtype=torch.bfloat16,
                 *, max_pages_per_seq: int | None = None) -> "MLACache":
        """Allocate the page pool and an empty block table; returns self."""
        if num_pages <= 0 or page_size <= 0 or batch <= 0:
            raise ValueError(f"num_pages, page_size and batch must be positive, got "
                             f"{num_pages}, {page_size}, {batch}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        width = self.kv_lora_rank + self.qk_rope_head_dim
        self.page_size = int(page_size)
        self.num_pages = int(num_pages)
        self.batch = int(batch)
        self.max_pages_per_seq = int(max_pages_per_seq or num_pages)
        self.buffer = torch.zeros(num_pages, page_size, width, device=device, dtype=dtype)
        self._table_host = torch.zeros(batch, self.max_pages_per_seq, dtype=torch.int32, device="cpu")
        self.block_table = self._table_host.to(device)
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.reset()
        return self

    def reset(self, batch_indices: Sequence[int] | None = None) -> None:
        """Empty the given sequences (all by default) and return their pages to the free list."""
        self._check_allocated()
        if batch_indices is None:
            self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
            self._pages = [[] for _ in range(self.batch)]
            self._lengths = [0] * self.batch
            self._table_host.zero_()
            self.block_table.copy_(self._table_host)
            self.seqlens.zero_()
            return
        for b in batch_indices:
            self._free.extend(reversed(self._pages[b]))
            self._pages[b] = []
            self._lengths[b] = 0
            self._table_host[b].zero_()
        idx = _to_device(torch.as_tensor(list(batch_indices), dtype=torch.long, device="cpu"), self.block_table.device)
        self.block_table[idx] = 0
        self.seqlens[idx.to(self.seqlens.device)] = 0

    # ------------------------------------------------------------------ views
    @property
    def ckv(self) -> torch.Tensor:
        """(num_pages, page_size, kv_lora_rank) view of the buffer."""
        self._check_allocated()
        return self.buffer[..., : self.kv_lora_rank]

    @property
    def kpe(self) -> torch.Tensor:
        """(num_pages, page_size, qk_rope_head_dim) view of the buffer."""
        self._check_allocated()
        return self.buffer[..., self.kv_lora_rank:]

    @property
    def lengths(self) -> list[int]:
        """Host copy of the sequence lengths."""
        return list(self._lengths)

    @property
    def device(self) -> torch.device:
        self._check_allocated()
        return self.buffer.device

    @property
    def dtype(self) -> torch.dtype:
        self._check_allocated()
        return self.buffer.dtype

    def is_empty(self) -> bool:
        return all(n == 0 for n in self.lengths)

    # ------------------------------------------------------------------ growth
    def _check_allocated(self) -> None:
        if self.buffer is None:
            raise RuntimeError("MLACache: call allocate(num_pages, page_size, batch, device, dtype) first")

    def _reserve(self, new_lengths: list[int]) -> None:
        """Make sure every sequence has pages for new_lengths[b] tokens (host bookkeeping only)."""
        changed = []
        for b, n in enumerate(new_lengths):
            need = -(-n // self.page_size)
            if need > self.max_pages_per_seq:
                raise RuntimeError(f"MLACache: sequence {b} needs {need} pages for {n} tokens, more than "
                                   f"max_pages_per_seq={self.max_pages_per_seq}")
            while len(self._pages[b]) < need:
                if not self._free:
                    raise RuntimeError(f"MLACache: out of pages (num_pages={self.num_pages}, "
                                       f"page_size={self.page_size}) growing sequence {b} to {n} tokens")
                pg = self._free.pop()
                self._table_host[b, len(self._pages[b])] = pg
                self._pages[b].append(pg)
                changed.append(b)
        if changed:
            rows = sorted(set(changed))
            idx = torch.as_tensor(rows, dtype=torch.long, device="cpu")  # indexes the host mirror
            dev = self.block_table.device
            self.block_table[_to_device(idx, dev)] = _to_device(self._table_host[idx], dev)

    def append(self, ckv: torch.Tensor, kpe: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
               new_lengths: Sequence[int] | None = None) -> torch.Tensor:
        """Write new tokens' latents at the end of each sequence; returns their positions.

        Dense: ckv (B, S, kv_lora_rank), kpe (B, S, qk_rope_head_dim), S new tokens for every
        sequence. Packed: ckv (T, kv_lora_rank), kpe (T, rope) with cu_seqlens (B+1,). Pages are handed
        out on the host, so the per-sequence counts are needed there: as new_lengths, or from a CPU
        cu_seqlens (both free); a cu_seqlens on the GPU is copied to the host once (a sync).
        kpe must already be rotated. Returns the int64 positions of the new tokens ((B, S) or (T,)),
        i.e. their rotary position ids.
        """
        self._check_allocated()
        if ckv.shape[-1] != self.kv_lora_rank or kpe.shape[-1] != self.qk_rope_head_dim:
            raise ValueError(f"MLACache.append: ckv/kpe last dims {ckv.shape[-1]}/{kpe.shape[-1]} != "
                             f"kv_lora_rank {self.kv_lora_rank} / qk_rope_head_dim {self.qk_rope_head_dim}")
        dev = self.buffer.device
        old = self._lengths
        if cu_seqlens is None:
            if ckv.dim() != 3 or kpe.shape[:2] != ckv.shape[:2]:
                raise ValueError(f"MLACache.append: expected ckv (B, S, r) and kpe (B, S, d_rope), got "
                                 f"{tuple(ckv.shape)} and {tuple(kpe.shape)}")
            B, S = ckv.shape[:2]
            if B != self.batch:
                raise ValueError(f"MLACache.append: batch {B} != allocated batch {self.batch}")
            counts = [S] * B
            start = self.seqlens.to(dev, torch.long)
            pos = start[:, None] + torch.arange(S, device=dev)[None, :]  # (B, S)
            rows = torch.arange(B, device=dev)[:, None].expand(B, S)
        else:
            if ckv.dim() != 2 or kpe.shape[0] != ckv.shape[0]:
                raise ValueError(f"MLACache.append: packed ckv must be (T, r) and kpe (T, d_rope), got "
                                 f"{tuple(ckv.shape)} and {tuple(kpe.shape)}")
            if cu_seqlens.numel() != self.batch + 1:
                raise ValueError(f"MLACache.append: cu_seqlens has {cu_seqlens.numel()} entries, "
                                 f"expected batch + 1 = {self.batch + 1}")
            counts = list(new_lengths) if new_lengths is not None else torch.diff(cu_seqlens.cpu()).tolist()
            T = ckv.shape[0]
            cnt = _to_device(torch.as_tensor(counts, dtype=torch.long, device="cpu"), dev)
            cu = _to_device(cu_seqlens, dev).long()
            rows = torch.repeat_interleave(torch.arange(self.batch, device=dev), cnt, output_size=T)
            start = self.seqlens.to(dev, torch.long)
            pos = torch.arange(T, device=dev) - cu[rows] + start[rows]
        new = [o + c for o, c in zip(old, counts)]
        self._reserve(new)
        table = self.block_table.to(dev, torch.long)
        page = table[rows, torch.div(pos, self.page_size, rounding_mode="floor")]
        flat = page * self.page_size + pos % self.page_size
        buf = self.buffer.view(-1, self.buffer.shape[-1])
        buf[flat.reshape(-1), : self.kv_lora_rank] = ckv.reshape(-1, self.kv_lora_rank).to(buf.dtype)
        buf[flat.reshape(-1), self.kv_lora_rank:] = kpe.reshape(-1, self.qk_rope_head_dim).to(buf.dtype)
        self._lengths = new
        if len(set(counts)) == 1:
            self.seqlens.add_(counts[0])
        else:
            self.seqlens.add_(_to_device(torch.as_tensor(counts, dtype=torch.int32, device="cpu"), self.seqlens.device))
        return pos

    def positions(self, num_new: int) -> torch.Tensor:
        """(batch, num_new) int64 positions the next num_new tokens of each sequence will take."""
        start = self.seqlens.to(torch.long)
        return start[:, None] + torch.arange(num_new, device=start.device)[None, :]

    def gather_all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Every sequence's cached latents packed in order: (ckv (T, r), kpe (T, d_rope),
        cu_seqlens int32 (batch + 1,) on the cache's device, max length). Used to expand the cache
        for chunked prefill; costs one small host-to-device copy of the row indices."""
        self._check_allocated()
        idx = []
        for b, L in enumerate(self._lengths):
            if L:
                pos = torch.arange(L, device="cpu")  # indexes the host mirror of the table
                idx.append(self._table_host[b].long()[pos // self.page_size] * self.page_size + pos % self.page_size)
        flat = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long, device="cpu")
        flat = _to_device(flat, self.buffer.device)
        rows = self.buffer.view(-1, self.buffer.shape[-1])[flat]
        cu = torch.tensor([0] + list(itertools.accumulate(self._lengths)), dtype=torch.int32, device="cpu")
        return (rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank:], _to_device(cu, self.buffer.device),
                max(self._lengths) if self._lengths else 0)

    def gather(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's cached (ckv (L, r), kpe (L, d_rope)) in order (for tests and debugging)."""
        L = self._lengths[b]
        pos = torch.arange(L, device="cpu")
        pages = self._table_host[b].long()[pos // self.page_size].to(self.buffer.device)
        rows = (pos % self.page_size).to(self.buffer.device)
        return self.ckv[pages, rows], self.kpe[pages, rows]

    def __repr__(self) -> str:
        if self.buffer is None:
            return f"MLACache(kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, unallocated)"
        return (f"MLACache(kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"pages={self.num_pages}x{self.page_size}, batch={self.batch}, free={len(self._free)}, "
                f"lengths={self._lengths}, dtype={self.dtype}, device={self.device})")
