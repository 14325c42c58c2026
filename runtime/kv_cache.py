"""KVCacheManager: the block pool's accounting (which block holds what, who uses it).

A fixed pool of blocks of `block_size` tokens. Each sequence has a block table per group of
layers (kv_layout: layers of one sliding window share a table; most models have one group);
every table covers the same positions and draws from the one pool. Blocks carry reference counts
so full blocks can be shared between sequences with the same prefix. A full block is identified
by its group and a chained hash (its tokens and the hash of the block before it, as in vLLM and
nano-vllm); released hashed blocks stay findable until their space is needed (least recently
released first). A sliding-window group releases the blocks that fell out of its window as the
sequence moves on. The tensors themselves live in model.KVPool."""
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool = True,
                 windows: tuple[int, ...] = (0,)):
        """windows: each group's sliding window (0: its layers attend to the whole sequence)."""
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.windows = tuple(windows)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # unreferenced, no content worth keeping; taken last-freed first, so a pool whose blocks
        # are not kept for prefix reuse touches (and keeps resident) only the blocks a load needs
        self.free: deque[int] = deque(reversed(range(num_blocks)))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed (LRU order)
        self.by_hash: dict[tuple[int, int], int] = {}  # (group, chain hash) -> block
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

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def releases_behind_window(self) -> bool:
        return any(self.windows)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_blocks(self, tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence of `tokens` tokens holds at once, over every group, when a
        step computes at most `step_tokens` of them: a sliding-window group holds the blocks its
        window reaches back from a step's first token, and the step's."""
        full = self.blocks_for(tokens)
        return sum(min(full, self.blocks_for(window - 1 + step_tokens) + 1) if window else full
                   for window in self.windows)

    @staticmethod
    def held_blocks(seq: Sequence) -> int:
        return sum(len(table) - released for table, released in zip(seq.block_tables, seq.released_blocks))

    def _start(self, seq: Sequence) -> None:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
            seq.released_blocks = [0] * len(self.windows)

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

    def _cached(self, group: int, key: int, chunk: tuple[int, ...]) -> int | None:
        block_id = self.by_hash.get((group, key))
        return block_id if block_id is not None and self.blocks[block_id].tokens == chunk else None

    def _first_needed(self, group: int, tokens: int) -> int:
        """The first block of `group` that the token after `tokens` cached ones attends to."""
        window = self.windows[group]
        return max(0, tokens - window + 1) // self.block_size if window else 0

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the cached blocks of its longest known prefix; returns
        the tokens it need not compute. The last token is always computed (its logits are
        needed), so only blocks before it are reused. A global group needs every block of the
        prefix; a sliding-window group only those its window still reaches (the others' table
        entries are placeholders, never read)."""
        assert not seq.block_tables
        if not self.enable_prefix_reuse:
            return 0
        tokens = seq.token_ids
        eligible = (len(tokens) - 1) // self.block_size
        self.queried_tokens += eligible * self.block_size
        keys: list[int] = []
        found: list[list[int | None]] = [[] for _ in self.windows]
        previous = None
        for i in range(eligible):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            previous = chain_hash(previous, chunk)
            ids = [self._cached(g, previous, chunk) for g in range(len(self.windows))]
            if any(block_id is None for block_id, window in zip(ids, self.windows) if not window):
                break
            keys.append(previous)
            for g, block_id in enumerate(ids):
                found[g].append(block_id)
        matched = len(keys)
        while matched and any(None in found[g][self._first_needed(g, matched * self.block_size) : matched]
                              for g, window in enumerate(self.windows) if window):
            matched -= 1
        if matched == 0:
            return 0
        self._start(seq)
        for g, table in enumerate(seq.block_tables):
            first = self._first_needed(g, matched * self.block_size)
            table.extend([0] * first)  # placeholders: behind the window, never read
            for block_id in found[g][first:matched]:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.evictable[block_id]
                block.ref_count += 1
                table.append(block_id)
            self.reused_blocks += matched - first
            seq.released_blocks[g] = first
        seq.block_hashes = keys[:matched]
        self.hit_tokens += matched * self.block_size
        seq.num_computed = matched * self.block_size
        return seq.num_computed

    def allocate(self, seq: Sequence, total_tokens: int) -> bool:
        """Grow the sequence's tables to hold `total_tokens`; False (and nothing taken) if the
        pool cannot."""
        self._start(seq)
        per_table = self.blocks_for(total_tokens) - len(seq.block_tables[0])
        if per_table * len(self.windows) > self.num_free_blocks:
            return False
        for table in seq.block_tables:
            for _ in range(per_table):
                table.append(self._take())
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return True

    def reset_peak(self) -> None:
        self.peak_used = self.num_used_blocks

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that the last step filled, so later sequences can reuse them."""
        full = seq.num_computed // self.block_size
        tokens = seq.token_ids
        for i in range(len(seq.block_hashes), full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk)
            seq.block_hashes.append(key)
            if not self.enable_prefix_reuse:
                continue
            for g, table in enumerate(seq.block_tables):
                if (g, key) not in self.by_hash:
                    block = self.blocks[table[i]]
                    block.hash, block.tokens = (g, key), chunk
                    self.by_hash[(g, key)] = block.id

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
        for table, released in zip(seq.block_tables, seq.released_blocks):
            for block_id in reversed(table[released:]):
                self._drop(block_id)
        seq.block_tables = []
        seq.released_blocks = []
        seq.block_hashes.clear()
        seq.num_computed = 0

    def release_behind_window(self, seq: Sequence) -> None:
        """Release the blocks of the sequence's sliding-window groups that no later token can
        attend to. The next token sits at position num_computed and attends from
        num_computed - window + 1 on, so every block wholly before that goes (as blocks of
        finished sequences go: hashed ones stay findable). Their ids stay in the table, which
        attention never reads again."""
        for g, window in enumerate(self.windows):
            if window:
                table = seq.block_tables[g]
                end = min(self._first_needed(g, seq.num_computed), len(table))
                for i in range(seq.released_blocks[g], end):
                    self._drop(table[i])
                seq.released_blocks[g] = max(seq.released_blocks[g], end)

    def stats(self) -> dict:
        return {
            "blocks_total": self.num_blocks,
            "blocks_free": self.num_free_blocks,
            "blocks_used": self.num_used_blocks,
            "blocks_used_peak": self.peak_used,
            "blocks_cached": len(self.evictable),
            "blocks_reused": self.reused_blocks,
            "prefix_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
        }
