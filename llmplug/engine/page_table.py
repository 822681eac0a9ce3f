"""The Engine's page tables on the device, updated by what changed instead of rebuilt every step.

A step's ``block_tables (B, M)`` used to be built on the host from every row's page list and copied over: ~1.5 ms of
Python a step for 256 rows of ~50 pages on the H100 host, while the 1B Engine was host-bound (BENCHMARKS.md, "Fifth
session of 2026-11-27"). Here each sequence's page list (:class:`PageList`) remembers the first entry changed since
the table last copied it, the table keeps a row per list, and a step sends only its rows' indices and the changed
entries.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch

from .step import to_device


class PageList(list):
    """A sequence's page ids (a ``list``) that remembers ``changed``: the first index any edit touched since
    :class:`PageTable` last copied it (None: nothing changed). ``row`` is its row in that table, if any."""

    __slots__ = ("changed", "row")

    def __init__(self, pages=()) -> None:
        super().__init__(pages)
        self.changed: int | None = 0
        self.row: int | None = None

    def _touch(self, index: int) -> None:
        if self.changed is None or index < self.changed:
            self.changed = max(index, 0)

    def _touch_key(self, key) -> None:
        if isinstance(key, slice):
            self._touch(key.indices(len(self))[0] if key.step in (None, 1) else 0)
        else:
            self._touch(key % max(len(self), 1))

    def __setitem__(self, key, value) -> None:
        self._touch_key(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._touch_key(key)
        super().__delitem__(key)

    def __iadd__(self, pages):
        self._touch(len(self))
        return super().__iadd__(pages)

    def __imul__(self, times):
        self._touch(0)
        return super().__imul__(times)

    def append(self, page) -> None:
        self._touch(len(self))
        super().append(page)

    def extend(self, pages) -> None:
        self._touch(len(self))
        super().extend(pages)

    def insert(self, index, page) -> None:
        self._touch(min(index, len(self)) if index >= 0 else 0)
        super().insert(index, page)

    def pop(self, index=-1):
        self._touch(index % max(len(self), 1))
        return super().pop(index)

    def remove(self, page) -> None:
        self._touch(0)
        super().remove(page)

    def clear(self) -> None:
        self._touch(0)
        super().clear()

    def sort(self, *args, **kwargs) -> None:
        self._touch(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._touch(0)
        super().reverse()


class PageTable:
    """Device page tables of up to ``capacity`` sequences, widened as longer lists come.

    A list gets a row the first time a step includes it. When none is free, every row no list of the current step
    holds is taken back (those lists are copied whole again when they return), so ``capacity`` must exceed the rows of
    one step.
    """

    def __init__(self, capacity: int, device: torch.device, width: int = 64) -> None:
        self.table = torch.zeros(capacity, width, dtype=torch.int32, device=device)
        self.owner: list[PageList | None] = [None] * capacity  # the list each row holds
        self.free = list(range(capacity - 1, -1, -1))
        self._last: tuple[list[PageList], torch.Tensor, torch.Tensor] | None = None  # lists, their rows, the result

    def rows(self, pages: list[PageList]) -> torch.Tensor:
        """``(B, longest)`` int32 page ids of the lists ``pages`` (one step's sequences' ``blocks``), on the device;
        one host-to-device copy (their rows, then the changed entries) and at most two kernels; the same lists as the
        last call (decode steps of one batch) send their changed entries alone, or nothing. Past a list's end a row
        holds page ids it had before (or 0): valid pages that no step reads."""
        last = self._last
        same = last is not None and len(pages) == len(last[0]) and all(map(operator.is_, pages, last[0]))
        rows, at, cols, vals = [], [], [], []
        for i, p in enumerate(pages):
            start = p.changed
            if not same:  # the same lists as last time hold their rows still
                if p.row is None or self.owner[p.row] is not p:
                    self._take(pages, i)
                    start = 0  # a new row: the whole list
                rows.append(p.row)
            if start is not None:
                n = len(p)
                if start < n:
                    at.extend(repeat(p.row, n - start))
                    cols.extend(range(start, n))
                    vals.extend(p[start:])
                p.changed = None
        longest = max(map(len, pages), default=1)
        if same and not vals and longest <= last[2].shape[1]:
            return last[2]
        uploaded = self._upload(rows, at, cols, vals, longest)  # (no rows when they are the last call's)
        lists, index = (last[0], last[1]) if same else (list(pages), uploaded)
        out = self.table[:, :longest].index_select(0, index)
        self._last = (lists, index, out)
        return out

    def _upload(self, rows: list[int], at: list[int], cols: list[int], vals: list[int], longest: int) -> torch.Tensor:
        """Widen the table to ``longest`` pages if needed, send ``rows`` and the entries ``table[at, cols] = vals`` in
        one copy and write the entries -> ``rows`` on the device."""
        if longest > self.table.shape[1]:  # a longer list than any before: a wider table, the rows kept
            wider = self.table.new_zeros(self.table.shape[0], max(longest, 2 * self.table.shape[1]))
            wider[:, :self.table.shape[1]] = self.table
            self.table = wider
        b, u = len(rows), len(vals)
        host = to_device(torch.tensor(rows + at + cols + vals, dtype=torch.int32), self.table.device)
        if u:
            self.table.index_put_((host[b:b + u], host[b + u:b + 2 * u]), host[b + 2 * u:])
        return host[:b]

    def _take(self, pages: list[PageList], index: int) -> None:
        """A row for ``pages[index]`` (its ``row``); when none is free, the rows of lists outside ``pages`` come back
        first."""
        if not self.free:
            keep = {id(p) for p in pages}
            for row, owner in enumerate(self.owner):
                if owner is not None and id(owner) not in keep:
                    owner.row = None
                    self.owner[row] = None
                    self.free.append(row)
            if not self.free:
                raise RuntimeError(f"a step of {len(pages)} sequences needs more than the page table's "
                                   f"{len(self.owner)} rows")
        row = self.free.pop()
        self.owner[row] = pages[index]
        pages[index].row = row
