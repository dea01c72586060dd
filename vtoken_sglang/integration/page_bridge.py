"""``SglangPagePool``: the core's page accounting over SGLang's paged allocator.

vToken tracks owners and live counts only of the pages of managed requests; the free list stays the allocator's.
Untracked pages (free, tree-owned, or of unmanaged requests) have owner ``FREE`` here, so this pool does not track
every page (``tracks_every_page`` is False): the integrity check then compares the tracked pages with the
allocator's free list instead of counting owners.
"""

from __future__ import annotations

import torch

from vtoken_sglang.core.pages import FREE, OutOfPages, PagePool


class SglangPagePool(PagePool):
    tracks_every_page = False

    def __init__(self, allocator, device: torch.device, reserve: int = 0):
        super().__init__(allocator.size // allocator.page_size, allocator.page_size, reserve=reserve, device=device)
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)
        self.allocator = allocator

    def num_free(self, for_relocation: bool = False) -> int:
        pages = self.allocator.available_size() // self.page_size
        return pages if for_relocation else max(0, pages - self.reserve)

    def alloc(self, n: int, owner, for_relocation: bool = False) -> torch.Tensor:
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if n > self.num_free(for_relocation):
            raise OutOfPages(f"need {n} pages, {self.num_free(for_relocation)} available")
        slots = self.allocator.alloc(n * self.page_size)
        if slots is None:
            raise OutOfPages(f"SGLang's allocator refused {n} pages")
        pages = (slots[:: self.page_size] // self.page_size).to(self.device, torch.int64)
        self.owner[pages] = owner.to(self.device, torch.int32) if isinstance(owner, torch.Tensor) else owner
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(self.device, torch.int64)
        self._check_releasable(pages)
        self.owner[pages] = FREE
        self.allocator.free_page_ids(pages.to(self.allocator.device))

    def disown(self, pages: torch.Tensor) -> None:
        """Stop tracking empty pages that SGLang itself will free."""
        pages = pages.to(self.device, torch.int64)
        self._check_releasable(pages)
        self.owner[pages] = FREE

    def _check_releasable(self, pages: torch.Tensor) -> None:
        assert bool((self.owner[pages] >= 0).all()), "releasing an untracked page"
        assert bool((self.live[pages] == 0).all()) and not bool(self.in_flight[pages].any())

    def free_ids(self) -> torch.Tensor:
        """SGLang's free pages (its free list and the pages staged for it)."""
        return self.allocator.get_all_free_pages().to(self.device, torch.int64)

    def used_pages(self) -> int:
        """Pages tracked here (of managed requests, and relocation sources awaiting release)."""
        return int((self.owner >= 0).sum())
