"""The host's book of a paged KV cache (kv_cache.KVCache with a page table): which pool pages each slot
holds. A request is admitted with every page its prompt, answer and a step's scratch rows can reach,
so it never waits for memory mid-answer; its pages return when it ends. The engine sends the whole
table with each admission (slots.admit), so the device's table changes only between chunks."""

from __future__ import annotations

import numpy as np

from jetspec_jax.kv_cache import SCRATCH_PAGE, pages_for


class PageBook:
    def __init__(self, num_pages: int, num_slots: int, pages_per_slot: int, page_size: int):
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"kv_pages must be an integer >= 2 (page {SCRATCH_PAGE} is scratch), got {num_pages!r}")
        self.num_pages, self.page_size = num_pages, page_size
        self.table = np.full((num_slots, pages_per_slot), SCRATCH_PAGE, np.int32)
        self.held = [0] * num_slots
        self.free = [p for p in range(num_pages - 1, -1, -1) if p != SCRATCH_PAGE]  # pop() takes the lowest

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def used(self) -> int:
        return self.usable - len(self.free)

    def pages_for(self, rows: int) -> int:
        return pages_for(rows, self.page_size)

    def can_take(self, rows: int) -> bool:
        return self.pages_for(rows) <= len(self.free)

    def take(self, slot: int, rows: int) -> None:
        """Hands slot `slot` (holding none) the pages of its first `rows` rows."""
        count = self.pages_for(rows)
        if self.held[slot]:
            raise RuntimeError(f"slot {slot} still holds {self.held[slot]} pages")
        if count > len(self.free):
            raise RuntimeError(f"{count} pages asked for, {len(self.free)} free")
        self.table[slot, :count] = [self.free.pop() for _ in range(count)]
        self.held[slot] = count

    def give_back(self, slot: int) -> None:
        count = self.held[slot]
        self.free.extend(self.table[slot, :count].tolist())
        self.table[slot] = SCRATCH_PAGE
        self.held[slot] = 0
