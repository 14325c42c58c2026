"""KVCacheManager: the block pool's accounting (which block holds what, who uses it).

A fixed pool of blocks of `block_size` tokens. Each sequence has a block table; blocks carry
reference counts so full blocks can be shared between sequences with the same prefix. A full
block is identified by a chained hash (its tokens and the hash of the block before it, as in
vLLM and nano-vllm); released hashed blocks stay findable until their space is needed
(least recently released first). The tensors themselves live in model.KVPool."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kiln.runtime.sequence import Sequence


def chain_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
    return hash((previous, tokens))


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] | None = None  # kept to rule out hash collisions


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool = True):
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.blocks = [Block(i) for i in range(num_blocks)]
        # unreferenced, no content worth keeping; taken last-freed first, so a pool whose blocks
        # are not kept for prefix reuse touches (and keeps resident) only the blocks a load needs
        self.free: deque[int] = deque(reversed(range(num_blocks)))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed (LRU order)
        self.by_hash: dict[int, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.reused_blocks = 0
        self.peak_used = 0  # most blocks in use at once since the last reset_peak()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self) -> int:
        if self.free:
            block_id = self.free.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            if self.by_hash.get(block.hash) == block_id:
                del self.by_hash[block.hash]
            block.hash = block.tokens = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the cached blocks of its longest known prefix; returns
        the tokens it need not compute. The last token is always computed (its logits are
        needed), so only blocks before it are reused."""
        assert not seq.block_table
        if not self.enable_prefix_reuse:
            return 0
        tokens = seq.token_ids
        eligible = (len(tokens) - 1) // self.block_size
        self.queried_tokens += eligible * self.block_size
        previous = None
        for i in range(eligible):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = chain_hash(previous, chunk)
            block_id = self.by_hash.get(key)
            if block_id is None or self.blocks[block_id].tokens != chunk:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(key)
            previous = key
        reused = len(seq.block_table)
        self.reused_blocks += reused
        self.hit_tokens += reused * self.block_size
        seq.num_computed = reused * self.block_size
        return seq.num_computed

    def allocate(self, seq: Sequence, total_tokens: int) -> bool:
        """Grow the sequence's table to hold `total_tokens`; False (and nothing taken) if the
        pool cannot."""
        needed = self.blocks_for(total_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take())
        self.peak_used = max(self.peak_used, self.num_blocks - self.num_free_blocks)
        return True

    def reset_peak(self) -> None:
        self.peak_used = self.num_blocks - self.num_free_blocks

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that the last step filled, so later sequences can reuse them."""
        full = seq.num_computed // self.block_size
        tokens = seq.token_ids
        for i in range(len(seq.block_hashes), full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk)
            seq.block_hashes.append(key)
            if self.enable_prefix_reuse and key not in self.by_hash:
                block = self.blocks[seq.block_table[i]]
                block.hash, block.tokens = key, chunk
                self.by_hash[key] = block.id

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free.append(block_id)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; hashed blocks stay findable until evicted. The tail
        goes first so it is evicted before the more shareable head."""
        for block_id in reversed(seq.block_table[seq.released_blocks:]):
            self._drop(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.released_blocks = 0

    def release_behind_window(self, seq: Sequence, window: int) -> None:
        """A model whose every layer attends within a sliding window: release the sequence's
        blocks that no later token can attend to. The next token sits at position num_computed
        and attends from num_computed - window + 1 on, so every block wholly before that goes
        (as blocks of finished sequences go: hashed ones stay findable). Their ids stay in the
        table, which attention never reads again."""
        first_needed = max(0, seq.num_computed - window + 1) // self.block_size
        end = min(first_needed, len(seq.block_table))
        for i in range(seq.released_blocks, end):
            self._drop(seq.block_table[i])
        seq.released_blocks = max(seq.released_blocks, end)

    def stats(self) -> dict:
        return {
            "blocks_total": self.num_blocks,
            "blocks_free": self.num_free_blocks,
            "blocks_used": self.num_blocks - self.num_free_blocks,
            "blocks_used_peak": self.peak_used,
            "blocks_cached": len(self.evictable),
            "blocks_reused": self.reused_blocks,
            "prefix_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
        }
