"""KVLayout: which layers keep their keys and values in which blocks.

Layers that attend within the same sliding window (or all over the sequence) form a group, and a
sequence has one block table per group: a sliding-window group releases the blocks that fell out
of its window while a global group keeps them all, so a long sequence on a model that interleaves
the two (Gemma 3) holds only the window on its local layers. Every group draws from one pool of
blocks, as vLLM's hybrid allocator does; a block holds `slots` layers' keys and values for
block_size tokens, so every group has `slots` layers: the fewest layers of one window. A window
with more layers splits into several groups of that size (their tables move alike), the last
leaving slots unused where the count does not divide. A model with one window for every layer
has one group of all its layers."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int  # the layers' sliding window (0: they attend to the whole sequence)
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    slots: int  # layers a block holds

    @classmethod
    def of(cls, windows: list[int], grouped: bool = True) -> KVLayout:
        """The layout for layers with these windows (one a layer). grouped=False: one group of
        every layer (a private pool that releases nothing), its window theirs if they share one."""
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(windows):
            by_window.setdefault(window, []).append(layer)
        if len(by_window) == 1 or not grouped:
            window = windows[0] if len(by_window) == 1 else 0
            return cls((KVGroup(window, tuple(range(len(windows)))),), len(windows))
        slots = min(len(layers) for layers in by_window.values())
        return cls(tuple(KVGroup(window, tuple(layers[k : k + slots]))
                         for window, layers in by_window.items() for k in range(0, len(layers), slots)), slots)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    @property
    def unused_slots(self) -> int:
        """Slots a block leaves empty, summed over the groups (memory the layout wastes)."""
        return self.slots * len(self.groups) - self.num_layers

    def slot_and_group(self) -> list[tuple[int, int]]:
        """(slot, group) of each layer, by layer index."""
        where = {}
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                where[layer] = (slot, g)
        return [where[layer] for layer in range(self.num_layers)]

    def describe(self) -> str:
        if len(self.groups) == 1:
            window = self.groups[0].window
            return f"one block table for all {self.slots} layers" + (f" (window {window})" if window else "")
        counts = Counter(group.window for group in self.groups)
        parts = [f"{n} of window {w}" if w else f"{n} global" for w, n in counts.items()]
        unused = self.unused_slots
        return (f"{len(self.groups)} block tables of {self.slots} layers ({', '.join(parts)}; "
                f"{unused} unused slot{'' if unused == 1 else 's'} a block)")
