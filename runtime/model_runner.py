"""ModelRunner: turns a scheduled batch into model inputs, runs the step, samples."""
from __future__ import annotations

import torch

from kiln.runtime.model import KVPool, LlamaModel, StepContext
from kiln.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool):
        self.model = model
        self.pool = pool

    @staticmethod
    def prepare(batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, StepContext, list[Sequence]]:
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        rows: list[int] = []
        sampling: list[Sequence] = []
        for seq, count in batch:
            start = seq.num_computed
            tokens += seq.token_ids[start : start + count]
            positions += range(start, start + count)
            query_start.append(query_start[-1] + count)
            if start + count == len(seq.token_ids):  # prompt done (or a decode step): sample
                rows.append(query_start[-1] - 1)
                sampling.append(seq)
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for i, (seq, _) in enumerate(batch):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        ctx = StepContext(
            positions=torch.tensor(positions),
            query_start=torch.tensor(query_start, dtype=torch.int32),
            context_lens=torch.tensor([seq.num_computed for seq, _ in batch], dtype=torch.int32),
            block_tables=tables,
            logits_rows=torch.tensor(rows, dtype=torch.int64),
        )
        return torch.tensor(tokens), ctx, sampling

    def run(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """One model step; [(sequence, sampled token)] for the sequences that sample now."""
        tokens, ctx, sampling = self.prepare(batch)
        logits = self.model.forward(tokens, ctx, self.pool)
        if not sampling:
            return []
        greedy = [i for i, seq in enumerate(sampling) if seq.params.greedy]
        sampled = [0] * len(sampling)
        if greedy:
            best = torch.argmax(logits[greedy], dim=-1).tolist()
            for i, token in zip(greedy, best):
                sampled[i] = token
        for i, seq in enumerate(sampling):
            if not seq.params.greedy:
                sampled[i] = seq.sampler(logits[i])
        return list(zip(sampling, sampled))
