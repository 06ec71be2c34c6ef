"""Which KV block of the pool holds what: a free list, reference counts and the prefix cache (ids only; the
tensors live in runner.KVPool).

Blocks hold block_size consecutive positions of one sequence. A block that is full gets a chain hash that covers
its tokens and the previous block's hash, so equal hashes mean equal whole prefixes, and a new request whose
prompt starts with the same full blocks reuses them (reference-counted) instead of computing them again. A
released block keeps its contents while nothing else needs the space: unreferenced hashed blocks wait in an LRU
list and are evicted, oldest first, only when the free list is empty. Every operation is O(1) per block.

Each running sequence also has a slot (seq.slot) in Slots: per-slot arrays of what a decode step reads (its block
table, the token it computes next and that token's position), kept current here as blocks are allocated, grown
and released and as the step's tokens are accounted for, so the runner copies a batch's rows in one op each.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import numpy as np

from astrai_core.inference.engine.sequence import Sequence


def chain_hash(prev: bytes, tokens: list[int]) -> bytes:
    """The hash of a full block: its tokens and its predecessor's hash (b"" for the first block)."""
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=16).digest()


class Slots:
    """Per running sequence, at row seq.slot: its block table (0 past its end), the token it computes next and
    that token's position (runner.DecodeBuffers reads the rows of a batch; a decode row computes 1 token, `count`).
    The last row, `pad`, is never handed out: its count is 0, so a batch padded with it writes only the pool's
    scratch slot. numpy, not torch: a Python int is written in about 0.1 us, a torch element in a few us."""

    def __init__(self, max_seqs: int, width: int) -> None:
        self.pad = max_seqs
        self.tables = np.zeros((max_seqs + 1, width), dtype=np.int64)
        self.next_token = np.zeros(max_seqs + 1, dtype=np.int64)
        self.start = np.zeros(max_seqs + 1, dtype=np.int64)
        self.count = np.ones(max_seqs + 1, dtype=np.int64)
        self.count[self.pad] = 0
        self.free = list(range(max_seqs - 1, -1, -1))  # popped from the end: slot 0 first


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True, max_seqs: int | None = None,
                 width: int | None = None) -> None:
        """max_seqs: sequences holding blocks at once (the engine's max_batch_size); width: blocks per sequence at
        most (a full context's). Each defaults to num_blocks, a bound either way: every sequence holds a block of
        its own (its last token's)."""
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self.slots = Slots(max_seqs or num_blocks, width or num_blocks)
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks  # set while the block is in hash_to_block
        self.hash_to_block: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))  # unreferenced, nothing worth keeping
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced but cached, least recently used first
        self.hits = 0  # full blocks found in the prefix cache
        self.queries = 0  # full blocks looked up

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:  # evict the least recently used cached block
            block, _ = self.lru.popitem(last=False)
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def reuses_prefix(self, seq: Sequence) -> bool:
        return self.prefix_cache and seq.params.prompt_logprobs is None

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Blocks of the prefix cache that hold seq's leading full blocks (at least its last token is left to
        compute: its logits are what the next step needs), with their chain hashes. None for a request that asked
        for its prompt's logprobs: a cached block's positions would never be computed, so neither their logits."""
        if not self.reuses_prefix(seq):
            return [], []
        tokens, bs = seq.tokens, self.block_size
        blocks, hashes, prev = [], [], b""
        for i in range((len(tokens) - 1) // bs):
            prev = chain_hash(prev, tokens[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(prev)
            if block is None:
                break
            blocks.append(block)
            hashes.append(prev)
        return blocks, hashes

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks; False (and nothing
        changed) when the pool cannot hold it now."""
        assert not seq.block_table
        cached, hashes = self._cached_prefix(seq)
        revived = sum(1 for b in cached if self.ref_count[b] == 0)  # cached blocks leaving the LRU list
        if self.blocks_for(len(seq)) - len(cached) > self.num_free - revived:
            return False
        if self.reuses_prefix(seq):
            self.queries += (len(seq) - 1) // self.block_size
            self.hits += len(cached)
        for block in cached:
            if self.ref_count[block] == 0:
                del self.lru[block]
            self.ref_count[block] += 1
        seq.block_table = cached + [self._take() for _ in range(self.blocks_for(len(seq)) - len(cached))]
        seq.block_hashes = hashes
        seq.num_cached = len(cached) * self.block_size
        seq.slot = self.slots.free.pop()
        self.slots.tables[seq.slot, :len(seq.block_table)] = seq.block_table
        self.track(seq)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for seq's first num_tokens positions; False (and nothing changed) when too few are free."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > self.num_free:
            return False
        if missing > 0:
            have = len(seq.block_table)
            seq.block_table += [self._take() for _ in range(missing)]
            self.slots.tables[seq.slot, have:have + missing] = seq.block_table[have:]
        return True

    def track(self, seq: Sequence) -> None:
        """Write the token seq computes next (it has one: num_cached < len(seq)), and its position, into its slot;
        called once its num_cached or its tokens changed (at most once a step: about 0.4 us)."""
        n = seq.num_cached
        self.slots.start[seq.slot] = n
        self.slots.next_token[seq.slot] = seq.tokens_between(n, n + 1)[0]

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks that the last step filled, so later requests can share them."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_cached // bs):  # none in most decode steps
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", seq.tokens_between(i * bs, (i + 1) * bs))
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.hash_to_block:  # else an equal block is cached already: keep that one
                self.hash_to_block[h] = block
                self.block_hash[block] = h

    def release(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody references go to the LRU list (hashed) or the free list. Last
        block first, so a prefix's tail is evicted before its head (the head is what other prompts share)."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self.lru[block] = None
                else:
                    self.free.append(block)
        if seq.slot is not None:  # a waiting sequence holds neither blocks nor a slot
            self.slots.tables[seq.slot] = 0
            self.slots.free.append(seq.slot)
        seq.block_table, seq.block_hashes, seq.num_cached, seq.slot = [], [], 0, None
