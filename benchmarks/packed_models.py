"""Which transformers causal LMs keep the samples of a packed row apart (CPU, random weights).

For each architecture a tiny model is built from its config (nothing is downloaded)
with each attention implementation, and ``odb.check_packed_model`` packs three random
samples into one row (``odb.PackedCollate()``, which passes ``use_cache=False``) and
compares each sample's logits with those of the sample alone. The table in
docs/packing.md comes from this script.

    PYTHONPATH=src python benchmarks/packed_models.py
    PYTHONPATH=src python benchmarks/packed_models.py llama opt --attn sdpa
"""

from __future__ import annotations

import argparse
import logging
import warnings

import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from odb import PackedLayoutError, check_packed_model, register_varlen_attention

ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2", "gemma3_text",
                 "granite", "olmo", "phi", "stablelm", "starcoder2", "cohere", "gpt2", "gpt_neox", "opt", "bloom",
                 "mamba")
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, n_embd=32, n_layer=2, n_head=4, n_positions=256,
            ffn_dim=64, word_embed_proj_dim=32)


def verdict(model_type: str, attn: str) -> str:
    """'isolated (max diff ...)', 'refused: <reason>' or 'not available: <why>'."""
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY), attn_implementation=attn)
    except Exception as err:  # an implementation the architecture does not offer
        return f"not available ({type(err).__name__})"
    try:
        return f"isolated (max diff {check_packed_model(model):.1e})"
    except PackedLayoutError as err:
        diff = str(err).split("alone by ")[1].split(" ")[0]
        return f"refused: {'a KV cache' if 'KV cache' in str(err) else 'samples mix'} (max diff {diff})"
    except ValueError as err:  # odb_varlen refuses a layer it cannot compute (soft-capping, attention sinks)
        return f"refused: {str(err).split(' asks for ')[1].split('=')[0]}" if " asks for " in str(err) else repr(err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="*", default=list(ARCHITECTURES))
    ap.add_argument("--attn", nargs="*", default=["sdpa", "eager", "odb_varlen"])
    args = ap.parse_args()
    register_varlen_attention()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    print(f"transformers {transformers.__version__}")
    print("| model_type | " + " | ".join(args.attn) + " |")
    print("|---|" + "---|" * len(args.attn))
    for model_type in args.types:
        print(f"| {model_type} | " + " | ".join(verdict(model_type, a) for a in args.attn) + " |", flush=True)


if __name__ == "__main__":
    main()
