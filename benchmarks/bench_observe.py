"""What observing the forward adds to ``param_groups``: a 70B-parameter Llama config
(Llama-3-70B: hidden 8192, 80 layers, 64 heads, 8 key-value heads, MLP 28672), or with
``--model deepseek_v3`` DeepSeek-V3's published config (671B parameters: 61 layers, 256
routed experts, latent attention), built on the meta device, routed with ``observe=False``
and with the default (one meta forward on the model's dummy inputs), interleaved after one
warm-up call; the median of each and their difference. It measures the ``muon_dist``
Python imports (it prints where from): from a git worktree of an editable install, run it
with ``PYTHONPATH=.``.

Run: ``python benchmarks/bench_observe.py [--repeats 3] [--layers 80] [--model llama70b]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import muon_dist


def build(layers: int, model: str = "llama70b") -> torch.nn.Module:
    import transformers as hf

    if model == "deepseek_v3":  # deepseek-ai/DeepSeek-V3's config.json
        config = hf.DeepseekV3Config(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=layers,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_shared_experts=1,
            n_routed_experts=256,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            n_group=8,
            topk_group=4,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            max_position_embeddings=163840,
        )
        with torch.device("meta"):
            return hf.DeepseekV3ForCausalLM(config)
    config = hf.LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        return hf.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="80 (Llama), 61 (DeepSeek)")
    parser.add_argument("--model", choices=("llama70b", "deepseek_v3"), default="llama70b")
    args = parser.parse_args()
    layers = args.layers or (61 if args.model == "deepseek_v3" else 80)
    model = build(layers, args.model)
    count = sum(p.numel() for p in model.parameters())
    times: dict[bool, list[float]] = {False: [], True: []}
    muon_dist.param_groups(model)  # warm-up: meta kernels' first calls
    for _ in range(args.repeats):
        for observe in (False, True):
            start = time.perf_counter()
            muon_dist.param_groups(model, observe=observe)
            times[observe].append(time.perf_counter() - start)
    plain, observed = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}: {count / 1e9:.1f}B parameters, {layers} layers, meta device")
    print(f"muon_dist from {Path(muon_dist.__file__).parent}")  # an editable install's tree
    for observe in (False, True):
        runs = times[observe]
        print(
            f"param_groups observe={observe}: median {statistics.median(runs):.2f} s "
            f"(min {min(runs):.2f}, max {max(runs):.2f}; runs "
            + ", ".join(f"{t:.2f}" for t in runs)
            + ")"
        )
    print(f"observation adds {observed - plain:.2f} s (medians)")


if __name__ == "__main__":
    main()
