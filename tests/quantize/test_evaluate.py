"""Perplexity (sliding windows) against transformers' own loss on the same windows."""
import json
import math

import pytest
import torch

from kiln.eval import main
from kiln.quantize.evaluate import perplexity
from kiln.runtime.engine import Engine


def hf_perplexity(model, ids, window, stride):
    """The sliding-window loop of Hugging Face's perplexity guide, weighting each window's loss by
    the tokens it actually predicts (labels after the internal shift)."""
    total, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target_len = end - previous_end
        input_ids = torch.tensor([ids[begin:end]])
        targets = input_ids.clone()
        targets[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=targets).loss
        predicted = (targets[:, 1:] != -100).sum().item()
        total += loss.item() * predicted
        count += predicted
        previous_end = end
        if end == len(ids):
            break
    return math.exp(total / count), count


@pytest.mark.parametrize("window, stride", [(64, 32), (50, 50), (100, 7)])
def test_perplexity_matches_transformers(tiny_models, tiny_engines, window, stride):
    from transformers import AutoModelForCausalLM

    engine = Engine(tiny_engines("llama"))
    ids = [int(t) for t in torch.randint(3, 384, (230,), generator=torch.Generator().manual_seed(stride))]
    got = perplexity(engine.model, ids, window, stride, engine.limits.kv_block_size)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    want, scored = hf_perplexity(model, ids, window, stride)
    assert got.tokens == scored
    if stride < window:  # overlapping windows: every token but the first has context
        assert scored == len(ids) - 1
    assert got.perplexity == pytest.approx(want, rel=1e-4)


def test_bad_stride_is_refused(tiny_engines):
    engine = Engine(tiny_engines("llama"))
    with pytest.raises(ValueError, match="stride must be in"):
        perplexity(engine.model, [1, 2, 3], 8, 9)


def test_kiln_eval_cli_compares_with_the_checkpoint(tiny_models, tiny_engines, tmp_path, capsys):
    from pydoc_data.topics import topics

    text = tmp_path / "held_out.txt"
    text.write_text(topics["with"][:3000])
    code = main(["--engine", str(tiny_engines("llama", "bfloat16")), "--text", str(text),
                 "--reference", str(tiny_models["llama"]), "--window", "128", "--stride", "64", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"]["tokens"] == report["reference"]["tokens"] == report["text_tokens"] - 1
    # bf16 engine vs the float32 checkpoint: close, not equal
    assert 0 < abs(report["relative_increase"]) < 0.05
