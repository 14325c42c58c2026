"""What a quantized build cost in accuracy, measured against the unquantized model on held-out
text: perplexity (and its relative increase), next-token agreement (the share of positions
where both models' argmax is the same token) and the mean KL divergence
KL(unquantized || quantized) of the next-token distributions. Checked against
`quantization.accuracy_gate`."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kiln.quantize.evaluate import window_logits
from kiln.runtime.model import LlamaModel


@dataclass
class AccuracyReport:
    tokens: int
    ppl_reference: float
    ppl_quantized: float
    ppl_increase: float  # relative
    token_agreement: float
    kl: float  # nats, mean per position
    gate: dict | None = None
    passed: bool = True
    failures: list[str] | None = None

    def to_json(self) -> dict:
        return asdict(self)


def measure(reference: LlamaModel, quantized: LlamaModel, ids: list[int], window: int, block_size: int = 32,
            progress: Callable[[], None] = lambda: None) -> AccuracyReport:
    """Consecutive windows of `window` tokens; each token after a window's first is scored once."""
    nll_ref = nll_q = kl = 0.0
    agree = scored = 0
    for begin in range(0, len(ids) - 1, window):
        chunk = ids[begin : begin + window]
        if len(chunk) < 2:
            break
        targets = torch.tensor(chunk[1:])
        ref = torch.log_softmax(window_logits(reference, chunk, block_size)[:-1], dim=-1)
        q = torch.log_softmax(window_logits(quantized, chunk, block_size)[:-1], dim=-1)
        nll_ref -= ref.gather(1, targets[:, None]).sum().item()
        nll_q -= q.gather(1, targets[:, None]).sum().item()
        kl += (ref.exp() * (ref - q)).sum().item()
        agree += int((ref.argmax(dim=-1) == q.argmax(dim=-1)).sum())
        scored += len(chunk) - 1
        progress()
    ppl_ref, ppl_q = math.exp(nll_ref / scored), math.exp(nll_q / scored)
    return AccuracyReport(scored, ppl_ref, ppl_q, ppl_q / ppl_ref - 1, agree / scored, kl / scored)


def apply_gate(report: AccuracyReport, gate) -> AccuracyReport:
    """gate: config AccuracyGate (or None: report only)."""
    if gate is None:
        return report
    report.gate = gate.model_dump()
    failures = []
    if report.ppl_increase > gate.max_ppl_increase:
        failures.append(f"perplexity +{report.ppl_increase:.2%} is over max_ppl_increase "
                        f"+{gate.max_ppl_increase:.2%}")
    if report.token_agreement < gate.min_token_agreement:
        failures.append(f"token agreement {report.token_agreement:.2%} is under min_token_agreement "
                        f"{gate.min_token_agreement:.2%}")
    if report.kl > gate.max_kl:
        failures.append(f"KL divergence {report.kl:.4f} is over max_kl {gate.max_kl}")
    report.failures = failures
    report.passed = not failures
    return report


def report_table(report: AccuracyReport, algo: str):
    from rich.table import Table

    table = Table(title=f"accuracy of {algo} vs the unquantized model ({report.tokens} held-out tokens)")
    for column in ("metric", "unquantized", algo, "change", "gate"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    gate = report.gate or {}
    table.add_row("perplexity", f"{report.ppl_reference:.4f}", f"{report.ppl_quantized:.4f}",
                  f"{report.ppl_increase:+.2%}", f"≤ +{gate['max_ppl_increase']:.2%}" if gate else "-")
    table.add_row("next-token agreement", "100%", f"{report.token_agreement:.2%}", "",
                  f"≥ {gate['min_token_agreement']:.2%}" if gate else "-")
    table.add_row("KL divergence (nats)", "0", f"{report.kl:.4f}", "", f"≤ {gate['max_kl']}" if gate else "-")
    return table
