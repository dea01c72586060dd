"""The page-level view of the Token Table: who owns each physical KV page, how many live tokens it holds, and
which pages are free.

Page ids run ``1..num_pages``; page 0 is the padding page (never allocated), as in SGLang. Slot ``s`` lies in page
``s // page_size``. Ownership ``owner[p]``:

    FREE  (-1)  on the free list, live == 0
    TREE  (-2)  held by the prefix cache (radix tree): never moved or freed by vToken; live counts not kept
    r >= 0      private to request row r: live == number of row r's live entries in p

``in_flight[p]`` marks pages that are a source or destination of a relocation not yet published; the planner
skips them (I4). A slice of ``reserve`` free pages is kept for relocation destinations: ordinary allocation cannot
take it (headroom-aware admission), relocation can.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

FREE = -1
TREE = -2


def pages_for(tokens: int, page_size: int) -> int:
    """Whole pages that ``tokens`` tokens take."""
    return -(-tokens // page_size)


def tail_room(last_slot: torch.Tensor, page_size: int) -> torch.Tensor:
    """The tail-page rule, the one place it is written: a request's next token goes to ``last_slot + 1`` while that
    slot is in the same page (``tail_room > 0`` slots left there), else to the first slot of a new page. SGLang's
    paged allocator applies it as ``seq_len % page_size``, which holds only for dense rows."""
    return page_size - 1 - last_slot % page_size


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation."""


class PageAccounting(ABC):
    """The page pool's interface, as the core uses it: per page, live counts, owners and in-flight marks (state
    held here, the same in every implementation), and a free list behind ``num_free`` / ``alloc`` / ``free`` /
    ``free_ids`` that each implementation keeps its own way:
    - ``PagePool``: the core's own free list; every page is tracked (owner ``FREE`` <=> on the free list);
    - an engine's bridge (``integration.page_bridge.SglangPagePool``): the engine's allocator keeps the free list,
      and only the pages of requests vToken manages are tracked here (``tracks_every_page`` False).
    Page ids run ``1..num_pages``; a relocation may take pages from the reserve, ordinary allocation may not."""

    tracks_every_page: ClassVar[bool]  # owner FREE <=> free (else: FREE also marks pages not tracked here)

    def __init__(self, num_pages: int, page_size: int, reserve: int = 0, device: str | torch.device = "cpu"):
        assert page_size >= 2, "vToken needs pages of at least 2 tokens"
        assert 0 <= reserve <= num_pages
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserve = reserve
        self.device = torch.device(device)
        self.live = torch.zeros(num_pages + 1, dtype=torch.int32, device=self.device)
        self.owner = torch.full((num_pages + 1,), FREE, dtype=torch.int32, device=self.device)
        self.owner[0] = TREE  # the padding page is never handed out
        self.in_flight = torch.zeros(num_pages + 1, dtype=torch.bool, device=self.device)

    # ------------------------------------------------------------------ the free list (per implementation)

    @abstractmethod
    def num_free(self, for_relocation: bool = False) -> int:
        """Pages an allocation may take now: relocation may dip into the reserve, ordinary allocation may not."""

    @abstractmethod
    def alloc(self, n: int, owner: int | torch.Tensor, for_relocation: bool = False) -> torch.Tensor:
        """Take ``n`` pages (int64 ids) for request row ``owner`` (an int, ``TREE``, or one owner per page).
        Raises ``OutOfPages`` if they are not there; takes nothing then."""

    @abstractmethod
    def free(self, pages: torch.Tensor) -> None:
        """Give back pages that hold no live token and are not in flight."""

    @abstractmethod
    def free_ids(self) -> torch.Tensor:
        """The ids of every free page (the integrity check's view of the free list)."""

    @abstractmethod
    def used_pages(self) -> int:
        """Pages tracked here as taken (owner other than ``FREE``, the padding page not counted)."""

    @abstractmethod
    def metadata_bytes(self) -> int:
        """Device bytes of this pool's own arrays."""

    def _state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.live, self.owner, self.in_flight))

    # ------------------------------------------------------------------ live counts

    def add_live(self, slots: torch.Tensor, delta: int) -> torch.Tensor:
        """Add ``delta`` per slot to the live count of its page (private pages only; tree pages are not counted).
        Returns the private pages whose count dropped to 0 (``delta < 0``), unique and sorted."""
        if slots.numel() == 0:
            return slots.new_empty(0, dtype=torch.int64)
        pages = (slots // self.page_size).to(torch.int64)
        pages = pages[self.owner[pages] >= 0]
        if pages.numel() == 0:
            return pages
        self.live.index_add_(0, pages, torch.full_like(pages, delta, dtype=torch.int32))
        counts = self.live[pages]
        assert bool(((counts >= 0) & (counts <= self.page_size)).all()), "a page's live count left [0, page_size]"
        if delta >= 0:
            return pages.new_empty(0)
        touched = torch.unique(pages)
        return touched[self.live[touched] == 0]

    # ------------------------------------------------------------------ views

    def private_mask(self) -> torch.Tensor:
        return self.owner >= 0

    def private_occupancy(self) -> torch.Tensor:
        """``[allocated private pages, live tokens in them]`` (int64, on the pool's device: nothing read)."""
        mask = self.private_mask()
        # torch.where, not live[mask]: boolean indexing opens a parallel region (slow on shared cores)
        return torch.stack([mask.sum(), torch.where(mask, self.live, 0).sum()])

    def fragmentation(self, occupancy: tuple[int, int] | None = None) -> float:
        """F = 1 - mean page utilization over allocated private pages (0.0 when none); ``occupancy``: the values of
        ``private_occupancy()`` if the caller read them already."""
        n, live = occupancy if occupancy is not None else self.private_occupancy().tolist()
        return 1.0 - live / (n * self.page_size) if n else 0.0


class PagePool(PageAccounting):
    """The core's own free list over ``PageAccounting``. Deterministic: the same call sequence gives the same page
    ids (so every tensor-parallel rank agrees)."""

    tracks_every_page = True

    def __init__(self, num_pages: int, page_size: int, reserve: int = 0, device: str | torch.device = "cpu"):
        super().__init__(num_pages, page_size, reserve, device)
        self._free = torch.arange(1, num_pages + 1, dtype=torch.int64, device=self.device)

    def metadata_bytes(self) -> int:
        """Device bytes of the per-page arrays (live counts, owners, in-flight marks, the free list)."""
        return self._state_bytes() + self._free.numel() * self._free.element_size()

    def num_free(self, for_relocation: bool = False) -> int:
        return len(self._free) if for_relocation else max(0, len(self._free) - self.reserve)

    def alloc(self, n: int, owner: int | torch.Tensor, for_relocation: bool = False) -> torch.Tensor:
        if n > self.num_free(for_relocation):
            raise OutOfPages(f"need {n} pages, {self.num_free(for_relocation)} available")
        pages, self._free = self._free[:n], self._free[n:]
        self.owner[pages] = owner.to(torch.int32) if isinstance(owner, torch.Tensor) else owner
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64)
        assert bool((self.owner[pages] != FREE).all()), "double free"
        assert bool((self.live[pages] == 0).all()), "freeing a page that still holds live tokens"
        assert bool((~self.in_flight[pages]).all()), "freeing a page in flight"
        self.owner[pages] = FREE
        self._free = torch.cat([self._free, pages])

    def free_ids(self) -> torch.Tensor:
        return self._free

    def used_pages(self) -> int:
        return self.num_pages - len(self._free)
