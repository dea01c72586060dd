"""``SglangPagePool`` over SGLang's real paged allocator: the relocation reserve is held back from the allocator,
refilled from the pages vToken frees, used first by relocation, and given back whole."""

import pytest
import torch

from vtoken_sglang.core.pages import OutOfPages
from vtoken_sglang.integration.parts.page_bridge import SglangPagePool


def make_pool(pages: int = 8, reserve: int = 2) -> tuple:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    allocator = PagedTokenToKVPoolAllocator(pages * 16, 16, torch.float32, "cpu", None, need_sort=False)
    return SglangPagePool(allocator, torch.device("cpu"), reserve=reserve), allocator


def test_reserve_refills_from_frees_serves_relocation_and_goes_back():
    pool, allocator = make_pool()
    total = allocator.available_size() // 16
    assert pool.reserved_pages() == 0 and pool.num_free() == total
    pages = pool.alloc(5, 0)
    pool.live[pages] = 0
    pool.free(pages[:3])  # the first two refill the reserve, the third goes back to SGLang
    assert pool.reserved_pages() == 2
    assert allocator.available_size() // 16 == total - 5 + 1 == pool.num_free()
    assert pool.num_free(for_relocation=True) == pool.num_free() + 2
    with torch.no_grad():
        rest = pool.alloc(
            pool.num_free(), 1
        )  # SGLang's pages, all of them: ordinary allocation never takes the reserve
    assert allocator.available_size() == 0 and pool.reserved_pages() == 2
    with pytest.raises(OutOfPages):
        pool.alloc(1, 1)
    dst = pool.alloc(2, 1, for_relocation=True)  # relocation: from the reserve
    assert set(dst.tolist()) == set(pages[:2].tolist()) and pool.reserved_pages() == 0
    pool.live[dst] = 0
    pool.free(torch.cat([dst, rest, pages[3:]]))
    assert pool.reserved_pages() == 2
    pool.return_reserve()
    assert pool.reserved_pages() == 0 and allocator.available_size() // 16 == total
    assert pool.used_pages() == 0
