"""The paged KV cache's bookkeeping on the host: which block holds what, and prefix reuse.

The cache is a pool of fixed-size blocks of `block_size` token positions (the arrays live on
the device, in `eqllm.generation.paged`); a sequence holds a list of blocks, its page table, and
position p of the sequence lives in block `pages[p // block_size]` at offset `p % block_size`.
So a sequence takes the memory of its actual length, never the context's.

Prefix reuse (vLLM's automatic prefix caching, by block hashes): a block that is full is
registered under a hash of its tokens chained with the hash of the block before it (and the
adapter the sequence runs with), so equal hashes mean equal prefixes. A new sequence looks its
prompt's full blocks up in order and takes every block found instead of computing it again.
Blocks are counted by reference; a registered block that no sequence holds any more stays
cached until memory runs short, and the least recently released one is then reused first
(LRU eviction). Blocks never registered go straight back to the free list.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, salt: str = "", *, start: bytes = b""
) -> list[bytes]:
    """The chained hash of each full block of `tokens` (a trailing partial block has none).

    `salt` separates sequences whose blocks must never be shared (different adapters);
    `start` is the hash before the first block (to continue a chain)."""
    tokens = np.asarray(tokens, np.int64)
    out, parent = [], start or hashlib.sha256(salt.encode()).digest()
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + chunk.tobytes()).digest()
        out.append(parent)
    return out


class BlockPool:
    """`blocks` cache blocks: reference counts, the prefix table and the eviction order.

    Arguments:
        blocks: how many blocks the device pool holds.
        block_size: token positions per block.
        prefix_cache: register full blocks for reuse (False: every block is private).
    """

    def __init__(self, blocks: int, block_size: int, *, prefix_cache: bool = True):
        if blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {blocks}")
        self.blocks, self.block_size, self.prefix_cache = blocks, block_size, prefix_cache
        self.refs = np.zeros(blocks, np.int64)
        self._free = collections.deque(range(blocks))  # never registered, or evicted
        self._hash: dict[int, bytes] = {}  # block -> its hash, for registered blocks
        self._block: dict[bytes, int] = {}  # hash -> block
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.hit_tokens = 0  # prompt tokens found in the cache, over all lookups
        self.looked_up_tokens = 0  # prompt tokens looked up
        self.evicted = 0

    # Allocation ----------------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks that `allocate` can hand out now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._cached)

    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.blocks - self.available()

    def allocate(self) -> int | None:
        """A block for new content (reference count 1), or None when every block is held.

        A free block first; else the least recently released cached block, whose hash is
        forgotten (evicted)."""
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._block[self._hash.pop(block)]
            self.evicted += 1
        else:
            return None
        self.refs[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds is cached (registered) or
        freed. Released in reverse, so a sequence's last blocks are evicted before its first
        (the shared start of a prompt stays longest)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._hash:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # Prefix reuse --------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], tokens: int) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each now referenced once more.
        `tokens` (the prompt's length) only feeds the hit-rate counters."""
        found = []
        if self.prefix_cache:
            for h in hashes:
                block = self._block.get(h)
                if block is None:
                    break
                if self.refs[block] == 0:
                    del self._cached[block]
                self.refs[block] += 1
                found.append(block)
        self.hit_tokens += len(found) * self.block_size
        self.looked_up_tokens += tokens
        return found

    def register(self, block: int, h: bytes) -> None:
        """Record that full `block` holds the prefix hashed `h` (a no-op when that prefix is
        already cached in another block, or prefix caching is off)."""
        if self.prefix_cache and h not in self._block and block not in self._hash:
            self._block[h] = block
            self._hash[block] = h

    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens found in the cache."""
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0
