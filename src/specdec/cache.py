"""Static KV cache with explicit slots, `commit` and `truncate`.

Layout (one tensor for all layers, so a commit is one gather per k/v):
    k, v: [L, R, n_kv, S, hd]   L layers, R rows (sequences), S slots
    lengths: [R]                committed slots per row

A forward writes its T new rows at slots lengths[r] + t ("scratch"); nothing
past `lengths` is ever trusted. `commit` moves the accepted scratch rows (a
chain's prefix or a tree's accepted path) into place and advances `lengths`;
`truncate` rolls back. Stale rows are masked by slot, never freed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .errors import SpecdecError


class KVCache:
    def __init__(self, n_layers: int, rows: int, n_kv: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (n_layers, rows, n_kv, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = slots
        self.row_offsets: dict[tuple[int, ...], Tensor] = {}   # `ForwardSlots.row_off` per rows, made once

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def check_room(self, rows: Tensor, t: int) -> None:
        """Raise if writing `t` scratch rows would run past the cache."""
        self.check_fits(int(self.lengths[rows].max()) + t)

    def check_fits(self, need: int) -> None:
        """Raise if `need` slots of a row run past the cache."""
        if need > self.slots:
            raise SpecdecError(f"context full: {need} tokens needed, the cache holds {self.slots}")

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor, contiguous_rows: bool = False) -> None:
        """Write k, v [B, n_kv, T, hd] at the scratch slots of `rows` [B]."""
        T = k.shape[2]
        if rows.numel() == 1:                                                  # the common case: plain slices
            r = int(rows.item())                                                # item, not select + item: per layer
            at = int(self.lengths[r])
            self.k[layer, r, :, at:at + T] = k[0]
            self.v[layer, r, :, at:at + T] = v[0]
            return
        slots = self.lengths[rows][:, None] + torch.arange(T, device=k.device)  # [B, T]
        r = rows[:, None].expand_as(slots)                                       # [B, T]
        # advanced indices around a slice: the indexed view is [B, T, n_kv, hd]
        self.k[layer][r, :, slots] = k.transpose(1, 2)
        self.v[layer][r, :, slots] = v.transpose(1, 2)

    def read(self, layer: int, rows: Tensor, kv_len: int, contiguous_rows: bool) -> tuple[Tensor, Tensor]:
        """k, v [B, n_kv, kv_len, hd] for `rows`."""
        if contiguous_rows:
            lo = int(rows[0])
            hi = lo + rows.numel()
            return self.k[layer, lo:hi, :, :kv_len], self.v[layer, lo:hi, :, :kv_len]
        return self.k[layer, rows, :, :kv_len], self.v[layer, rows, :, :kv_len]

    def slots_of(self, rows: Tensor, t: int, kv_len: int) -> "ForwardSlots":
        """Where a forward of `t` tokens per row of `rows` [B] writes and reads, for every layer."""
        lengths = self.lengths[rows]
        return ForwardSlots(self, rows, t, kv_len, lengths, lengths.tolist())

    def commit(self, rows: Tensor, keep: Tensor, num_keep: Tensor) -> None:
        """Keep scratch rows `keep` [B, T] (the first num_keep[b] of them; later entries, PAD among them,
        are ignored) and advance.

        keep[b, i] is an index into the scratch block of the last forward; the
        kept rows land at slots lengths[b] + i, i < num_keep[b].
        """
        B, T = keep.shape
        if T > 0:
            ar = torch.arange(T, device=keep.device).expand(B, T)
            src_rows = torch.where(ar < num_keep[:, None], keep, ar)   # [B, T] past num_keep: stay in place
            if not torch.equal(src_rows, ar):                          # a tree path: move rows into place
                base = self.lengths[rows][:, None]
                src = base + src_rows                                  # [B, T] scratch slots on the path
                dst = base + ar                                        # [B, T] where they belong
                r = rows[:, None].expand(B, T)
                for buf in (self.k, self.v):
                    # advanced indices around a slice: the indexed view is [B, T, L, n_kv, hd]
                    buf.permute(1, 3, 0, 2, 4)[r, dst] = buf.permute(1, 3, 0, 2, 4)[r, src]
        self.lengths[rows] += num_keep

    def advance(self, rows: Tensor, num_keep: Tensor) -> None:
        """Keep the first num_keep [B] scratch rows of `rows` where they are (a chain's accepted prefix):
        `commit` of an identity path, without looking at it (`rows` distinct)."""
        self.lengths.index_add_(0, rows, num_keep)

    def span(self, row: int, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Copies of k, v [L, n_kv, end - start, hd] at committed slots start..end of `row`."""
        if not 0 <= start <= end <= int(self.lengths[row]):
            raise ValueError(f"slots {start}..{end} are not committed in row {row}")
        return self.k[:, row, :, start:end].clone(), self.v[:, row, :, start:end].clone()

    def gather(self, rows: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of every layer at slots [B, T] of rows [B] -> ([L, B, n_kv, T, hd], same)."""
        L, _, n_kv, _, hd = self.k.shape
        B, T = slots.shape
        idx = slots[None, :, None, :, None].expand(L, B, n_kv, T, hd)
        return self.k[:, rows].gather(3, idx), self.v[:, rows].gather(3, idx)

    def append(self, row: int, k: Tensor, v: Tensor) -> None:
        """Commit k, v [L, n_kv, T, hd] after `row`'s committed slots (e.g. a cached prompt piece)."""
        at, T = int(self.lengths[row]), k.shape[2]
        if at + T > self.slots:
            raise SpecdecError(f"context full: {at + T} tokens needed, the cache holds {self.slots}")
        self.k[:, row, :, at:at + T] = k
        self.v[:, row, :, at:at + T] = v
        self.lengths[row] += T

    def truncate(self, rows: Tensor, lengths: Tensor) -> None:
        """Roll `rows` back to `lengths` committed slots."""
        if bool((lengths > self.lengths[rows]).any()) or bool((lengths < 0).any()):
            raise ValueError("truncate can only shorten")
        self.lengths[rows] = lengths


class ForwardSlots:
    """One forward's scratch slots and key window in a KVCache, worked out once and used by every layer.

    Rows that form one block of the cache (a lone sequence, or a dense batch) are read as one strided
    view; if they also share a length, their scratch slots are written as one strided copy. Anything
    else goes through advanced indexing (`KVCache.write` / `read`). Each ATen call costs microseconds
    and a forward makes two writes and two reads per layer, so the fast forms matter when decoding.
    """

    def __init__(self, cache: KVCache, rows: Tensor, t: int, kv_len: int, lengths: Tensor, at: list[int]) -> None:
        """lengths [B] int64: the committed length of each row of `rows` [B] (where its scratch slots start);
        at: the same as Python ints."""
        self.cache, self.rows, self.t, self.kv_len = cache, rows, t, kv_len
        ids = rows.tolist()
        self.contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
        self.even = self.contiguous and len(set(at)) == 1
        _, R, n_kv, S, hd = cache.k.shape
        B = len(ids)
        self._write_size, self._read_size = (B, n_kv, t, hd), (B, n_kv, kv_len, hd)
        self._stride = (n_kv * S * hd, S * hd, hd, 1)
        self._layer = R * n_kv * S * hd                                        # elements per layer
        self._first = ids[0] * n_kv * S * hd                                   # offset of the first row
        self._at = at[0] * hd
        key = tuple(ids)
        if key not in cache.row_offsets:                                      # decoding asks for the same rows
            if len(cache.row_offsets) >= 64:
                cache.row_offsets.clear()
            cache.row_offsets[key] = torch.tensor([r * n_kv * S * hd for r in ids], dtype=torch.int64,
                                                  device=rows.device)
        self.row_off = cache.row_offsets[key]                                 # [B] each row's offset in a layer
        self.at = lengths if lengths.is_contiguous() else lengths.contiguous()   # [B] each row's first scratch slot

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write k, v [B, n_kv, t, hd] at the scratch slots of this forward's rows."""
        if not self.even:
            self.cache.write(layer, self.rows, k, v)
            return
        off = layer * self._layer + self._first + self._at
        self.cache.k.as_strided(self._write_size, self._stride, off).copy_(k)
        self.cache.v.as_strided(self._write_size, self._stride, off).copy_(v)

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        """k, v [B, n_kv, kv_len, hd] of this forward's rows (views where the rows are one block)."""
        if not self.contiguous:
            return self.cache.read(layer, self.rows, self.kv_len, False)
        off = layer * self._layer + self._first
        return (self.cache.k.as_strided(self._read_size, self._stride, off),
                self.cache.v.as_strided(self._read_size, self._stride, off))
