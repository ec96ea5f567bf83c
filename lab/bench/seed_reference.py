"""The seed document's page allocator, written as it was meant to work, in plain Python: pages in
a free list, each sequence a linked chain of pages walked from its head on every access. It is the
baseline the Rust block manager is compared with (``python -m lab bench blocks``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Page:
    """A fixed-size page: the token ids written to it and the next page of its chain."""

    capacity: int
    tokens: list[int] = field(default_factory=list)
    next_page: Page | None = None


class SeedPageAllocator:
    """Free list of pages and a chain per sequence; O(chain length) to reach the tail."""

    def __init__(self, num_pages: int, page_capacity: int) -> None:
        self.page_capacity = page_capacity
        self.free_pages = [Page(page_capacity) for _ in range(num_pages)]
        self.heads: dict[int, Page] = {}

    def _tail(self, seq_id: int) -> Page:
        page = self.heads[seq_id]
        while page.next_page is not None:
            page = page.next_page
        return page

    def _new_page(self) -> Page:
        if not self.free_pages:
            raise MemoryError("no free pages")
        return self.free_pages.pop()

    def append(self, seq_id: int, token: int) -> None:
        """Writes one token at the end of ``seq_id``, starting the chain or a new page as needed."""
        if seq_id not in self.heads:
            self.heads[seq_id] = self._new_page()
        tail = self._tail(seq_id)
        if len(tail.tokens) == tail.capacity:
            tail.next_page = self._new_page()
            tail = tail.next_page
        tail.tokens.append(token)

    def allocate(self, seq_id: int, tokens: list[int]) -> None:
        """Creates ``seq_id`` holding ``tokens``."""
        for token in tokens:
            self.append(seq_id, token)

    def free(self, seq_id: int) -> None:
        """Returns every page of ``seq_id`` to the free list."""
        page = self.heads.pop(seq_id)
        while page is not None:
            following, page.next_page = page.next_page, None
            page.tokens.clear()
            self.free_pages.append(page)
            page = following
