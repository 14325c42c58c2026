"""ModelRunner: turns a scheduled batch into model inputs, runs the step, samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.model import KVPool, LlamaModel, StepContext
from kiln.runtime.sampling import greedy_tokens, process_logits
from kiln.runtime.sequence import Sequence


@dataclass
class Sample:
    seq: Sequence
    token: int
    log_prob: float | None = None  # when the request returns log probs
    logits: torch.Tensor | None = None  # the raw row, when it returns generation logits
    error: str | None = None  # sampling this sequence failed (its request fails, not the step)


@dataclass
class StepInputs:
    tokens: torch.Tensor
    ctx: StepContext
    sampling: list[tuple[Sequence, int]]  # (sequence, its logits row)
    context: list[tuple[Sequence, int, int, int]]  # (sequence, first position, first row, rows)


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool):
        self.model = model
        self.pool = pool

    @staticmethod
    def prepare(batch: list[tuple[Sequence, int]]) -> StepInputs:
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        rows: list[int] = []
        sampling: list[tuple[Sequence, int]] = []
        context: list[tuple[Sequence, int, int, int]] = []
        for seq, count in batch:
            start = seq.num_computed
            tokens += seq.token_ids[start : start + count]
            positions += range(start, start + count)
            query_start.append(query_start[-1] + count)
            prompt_rows = min(start + count, len(seq.prompt_ids)) - start
            if seq.params.return_context_logits and prompt_rows > 0:  # every prompt row's logits
                context.append((seq, start, len(rows), prompt_rows))
                rows += range(query_start[-2], query_start[-2] + prompt_rows)
            if start + count == len(seq.token_ids):  # prompt done (or a decode step): sample
                last = query_start[-1] - 1
                if not rows or rows[-1] != last:
                    rows.append(last)
                sampling.append((seq, len(rows) - 1))
        width = max(len(seq.block_tables[0]) for seq, _ in batch)
        tables = torch.zeros(len(batch[0][0].block_tables), len(batch), width, dtype=torch.int32)
        for i, (seq, _) in enumerate(batch):
            tables[:, i, : len(seq.block_tables[0])] = torch.tensor(seq.block_tables, dtype=torch.int32)
        ctx = StepContext(
            positions=torch.tensor(positions),
            query_start=torch.tensor(query_start, dtype=torch.int32),
            context_lens=torch.tensor([seq.num_computed for seq, _ in batch], dtype=torch.int32),
            block_tables=tables,
            logits_rows=torch.tensor(rows, dtype=torch.int64),
        )
        return StepInputs(torch.tensor(tokens), ctx, sampling, context)

    def run(self, batch: list[tuple[Sequence, int]]) -> list[Sample]:
        """One model step; a Sample for each sequence that samples now."""
        step = self.prepare(batch)
        logits = self.model.forward(step.tokens, step.ctx, self.pool)
        for seq, position, row, count in step.context:
            if seq.context_logits is None:
                seq.context_logits = torch.empty(len(seq.prompt_ids), logits.shape[-1])
            seq.context_logits[position : position + count] = logits[row : row + count]
        if not step.sampling:
            return []
        samples: list[Sample] = []
        plain = [(seq, row) for seq, row in step.sampling if seq.params.plain_greedy]
        if plain:
            best = greedy_tokens(logits[[row for _, row in plain]])
            samples += [Sample(seq, token) for (seq, _), token in zip(plain, best)]
        for seq, row in step.sampling:
            if not seq.params.plain_greedy:
                try:
                    samples.append(self._sample_one(seq, logits[row]))
                except Exception as exc:  # this request's values: fail it alone
                    samples.append(Sample(seq, -1, error=f"sampling failed: {type(exc).__name__}: {exc}"))
        return samples

    @staticmethod
    def _sample_one(seq: Sequence, raw: torch.Tensor) -> Sample:
        params = seq.params
        logits = raw
        if params.processes_logits:
            logits = process_logits(raw, params, seq.token_ids, seq.num_generated, seq.stop_ids, seq.sampler.bias)
        token = seq.sampler(logits)
        sample = Sample(seq, token)
        if params.return_log_probs:  # of the distribution drawn from (TensorRT-LLM's convention)
            sample.log_prob = float(torch.log_softmax(seq.sampler.distribution_logits(logits), -1)[token])
        if params.return_generation_logits:
            sample.logits = raw.clone()
        return sample
