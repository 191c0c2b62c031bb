from .paged_kv import BlockAllocator, PagedKVCache

__all__ = ["BlockAllocator", "PagedKVCache"]
