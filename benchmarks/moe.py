"""Mixture-of-Experts decode at batch 1: a random Mixtral of a realistic shape (8 experts, top-2,
hidden 1024) against two dense Llamas with the same attention, embeddings and head: one whose MLP
is as wide as the two active experts together (what the MoE should cost: the same bytes a token)
and one as wide as all eight (the same parameters run densely). Also the bytes of weights one
decode step of the MoE reads: every linear it calls (each wrapped to add up its tensors' bytes)
and its routers, against the active parameters' bytes (attention, routers, head, and
experts_per_token experts a layer). Counted, not measured with hardware counters.

    cd benchmarks && PYTHONPATH=.. python moe.py --algo none int4_wo --json ../out/moe.json
    cd benchmarks && PYTHONPATH=.. python moe.py --moe-only --algo int4_wo int4_awq --json ../out/moe-awq.json

Prints a table of medians and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import yaml
from decode_latency import time_kiln
from host import host_info
from rich.console import Console
from rich.table import Table

SHAPE = dict(vocab_size=16384, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
             max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 2816


def write_model(folder: Path, moe: bool, mlp_width: int, seed: int) -> Path:
    """A random Hugging Face folder: Mixtral (moe) or Llama with an MLP of mlp_width."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = hidden // heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(SHAPE["vocab_size"], hidden), "lm_head.weight": w(SHAPE["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                        p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(kv * head_dim, hidden),
                        p + "self_attn.v_proj.weight": w(kv * head_dim, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden)})
        if moe:
            tensors[p + "block_sparse_moe.gate.weight"] = w(EXPERTS, hidden)
            for e in range(EXPERTS):
                q = f"{p}block_sparse_moe.experts.{e}."
                tensors.update({q + "w1.weight": w(mlp_width, hidden), q + "w3.weight": w(mlp_width, hidden),
                                q + "w2.weight": w(hidden, mlp_width)})
        else:
            tensors.update({p + "mlp.gate_proj.weight": w(mlp_width, hidden), p + "mlp.up_proj.weight": w(mlp_width, hidden),
                            p + "mlp.down_proj.weight": w(hidden, mlp_width)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    config = {**SHAPE, "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
              "intermediate_size": mlp_width, "hidden_act": "silu"}
    if moe:
        config.update(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder)
    return folder


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE of the model's vocabulary size, trained on Python's own docs."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(topics.values()), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))


def build(folder: Path, out: Path, algo: str) -> Path:
    from kiln.builder.cli import build as run_build

    quantization = {"algo": algo, "accuracy_gate": None, "accuracy": {"tokens": 512, "window": 128}}
    if algo in ("int4_wo", "int4_awq", "w4a8_awq"):
        quantization["group_size"] = 128
    if algo in ("int4_awq", "w4a8_awq", "int8_sq", "fp8"):  # random weights: the text only has to route tokens
        quantization["calibration"] = {"samples": 16, "seq_len": 128}
    config = {"model": {"checkpoint": str(folder), "dtype": "bfloat16"},
              "build": {"max_batch_size": 1, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 256},
              "quantization": quantization}
    out.mkdir(parents=True, exist_ok=True)
    (out / "build.yaml").write_text(yaml.safe_dump(config))
    engine_dir, _ = run_build(out / "build.yaml", out)
    return engine_dir


def tensor_bytes(linear) -> int:
    return sum(t.nbytes for t in vars(linear).values() if isinstance(t, torch.Tensor))


def step_bytes(engine_dir: Path) -> dict:
    """Bytes of weights one decode step calls on (linears wrapped and counted), and the active
    parameters' bytes, for a MoE engine."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.model import KVPool, StepContext

    engine = Engine(engine_dir)
    model, spec = engine.model, engine.spec
    # the Python loop, whose linears can be wrapped (decode_layers and moe_mlp run the same experts)
    model.fused_decode = model.fused_experts = False
    read = [0]

    def counted(linear):
        size = tensor_bytes(linear)

        def call(x):
            read[0] += size
            return linear(x)
        return call

    routers = sum(layer.router.nbytes for layer in model.layers)  # read with F.linear, not wrapped
    active = tensor_bytes(model.lm_head) + routers
    for layer in model.layers:
        active += tensor_bytes(layer.qkv) + tensor_bytes(layer.out)
        expert_sizes = [tensor_bytes(e.gate_up) + tensor_bytes(e.down) for e in layer.experts]
        active += spec.experts_per_token * statistics.mean(expert_sizes)
        layer.qkv, layer.out = counted(layer.qkv), counted(layer.out)
        for expert in layer.experts:
            expert.gate_up, expert.down = counted(expert.gate_up), counted(expert.down)
    model.lm_head = counted(model.lm_head)
    pool = KVPool(spec, 4, engine.limits.kv_block_size, model.kv_dtype)
    prompt = list(range(5, 25))
    model.forward(torch.tensor(prompt), StepContext.single(0, len(prompt), [0, 1, 2, 3]), pool)
    read[0] = 0
    model.forward(torch.tensor([7]), StepContext.single(len(prompt), 1, [0, 1, 2, 3]), pool)
    return {"step_bytes": read[0] + routers, "active_bytes": active, "ratio": (read[0] + routers) / active}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", nargs="+", default=["none", "int4_wo"],
                        help="none (bf16), int8_wo, int4_wo, or a calibrated one (int4_awq: experts' pre-scales)")
    parser.add_argument("--moe-only", action="store_true", help="only the MoE (to compare algorithms on it)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the models and engines")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kiln-moe-"))
    models = {"MoE 8x2816, top-2": write_model(work / "moe", True, EXPERT_WIDTH, 1),
              f"dense {TOP_K}x2816 (active size)": write_model(work / "dense-active", False, TOP_K * EXPERT_WIDTH, 2),
              f"dense {EXPERTS}x2816 (all experts)": write_model(work / "dense-all", False, EXPERTS * EXPERT_WIDTH, 3)}
    if args.moe_only:
        models = dict(list(models.items())[:1])
    engines = {(name, algo): build(folder, work / f"{folder.name}-{algo}", algo)
               for algo in args.algo for name, folder in models.items()}
    bytes_read = {algo: step_bytes(engines["MoE 8x2816, top-2", algo]) for algo in args.algo}
    prompt = [(i * 7919) % 16000 + 100 for i in range(64)]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for algo in args.algo:
            for name in models:  # side by side: each engine in turn, at the same threads
                timed = time_kiln(str(engines[name, algo]), prompt, args.decode_tokens, args.repeats)[0]
                rows.append({"threads": threads, "algo": algo, "model": name, "decode_tok_s": timed["decode_tok_s"],
                             "prefill_ms": timed["prefill_ms"]})
            moe = next(r for r in rows if r["threads"] == threads and r["algo"] == algo and r["model"].startswith("MoE"))
            for row in rows:
                if row["threads"] == threads and row["algo"] == algo:
                    row["moe_vs_this"] = moe["decode_tok_s"] / row["decode_tok_s"]
    table = Table(title=f"MoE decode, batch 1: prompt 64 tokens, {args.decode_tokens} decoded, median of {args.repeats}")
    for column in ("threads", "weights", "model", "decode tok/s", "MoE / this", "prefill ms"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["threads"]), row["algo"], row["model"], f"{row['decode_tok_s']:.1f}",
                      f"{row['moe_vs_this']:.2f}x", f"{row['prefill_ms']:.0f}")
    console = Console()
    console.print(table)
    for algo, counted in bytes_read.items():
        console.print(f"{algo}: a decode step reads {counted['step_bytes'] / 1e6:.1f} MB of weights; the active "
                      f"parameters are {counted['active_bytes'] / 1e6:.1f} MB ({counted['ratio']:.3f}x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "bytes": bytes_read}, indent=2))


if __name__ == "__main__":
    main()
