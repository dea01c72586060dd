"""``SglangPagePool``: the core's page accounting over SGLang's paged allocator.

vToken tracks owners and live counts only of the pages of managed requests; the free list stays the allocator's.
Untracked pages (free, tree-owned, or of unmanaged requests) have owner ``FREE`` here, so this pool does not track
every page (``tracks_every_page`` is False): the integrity check then compares the tracked pages with the
allocator's free list instead of counting owners.

The relocation reserve: up to ``reserve`` pages that vToken frees are held back from the allocator (owner ``FREE``
here, on no free list) for relocation destinations, so that reclaim under memory pressure can compact even when
SGLang has taken every free page. They go back to the allocator before SGLang's idle leak check
(``return_reserve``) and refill from the next pages vToken frees.
"""

from __future__ import annotations

import torch

from vtoken_sglang.core.pages import FREE, OutOfPages, PageAccounting


class SglangPagePool(PageAccounting):
    """``PageAccounting`` over SGLang's ``PagedTokenToKVPoolAllocator``."""

    tracks_every_page = False

    def __init__(self, allocator, device: torch.device, reserve: int = 0):
        super().__init__(allocator.size // allocator.page_size, allocator.page_size, reserve=reserve, device=device)
        self._reserved = torch.empty(0, dtype=torch.int64, device=self.device)  # held back for relocation
        self.allocator = allocator

    def metadata_bytes(self) -> int:
        """Device bytes of the per-page arrays (the free list is SGLang's)."""
        return self._state_bytes()

    def num_free(self, for_relocation: bool = False) -> int:
        pages = self.allocator.available_size() // self.page_size
        return pages + len(self._reserved) if for_relocation else pages

    def reserved_pages(self) -> int:
        return len(self._reserved)

    def alloc(self, n: int, owner, for_relocation: bool = False) -> torch.Tensor:
        """``for_relocation``: the reserve first, then the allocator."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if n > self.num_free(for_relocation):
            raise OutOfPages(f"need {n} pages, {self.num_free(for_relocation)} available")
        taken = self._reserved[:n] if for_relocation else self._reserved[:0]
        self._reserved = self._reserved[len(taken) :]
        pages = taken
        if len(taken) < n:
            slots = self.allocator.alloc((n - len(taken)) * self.page_size)
            if slots is None:
                self._reserved = torch.cat([taken, self._reserved])
                raise OutOfPages(f"SGLang's allocator refused {n - len(taken)} pages")
            pages = torch.cat([taken, (slots[:: self.page_size] // self.page_size).to(self.device, torch.int64)])
        self.owner[pages] = owner.to(self.device, torch.int32) if isinstance(owner, torch.Tensor) else owner
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Untrack ``pages``; the first ones refill the relocation reserve, the rest go to SGLang's allocator."""
        if pages.numel() == 0:
            return
        pages = pages.to(self.device, torch.int64)
        self._check_releasable(pages)
        self.owner[pages] = FREE
        keep = max(0, self.reserve - len(self._reserved))
        if keep:
            self._reserved = torch.cat([self._reserved, pages[:keep]])
            pages = pages[keep:]
        if pages.numel():
            self.allocator.free_page_ids(pages.to(self.allocator.device))

    def return_reserve(self) -> None:
        """Give the reserve back to SGLang's allocator (before its idle leak check, which counts every page)."""
        if self._reserved.numel():
            self.allocator.free_page_ids(self._reserved.to(self.allocator.device))
            self._reserved = self._reserved[:0]

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
