"""LLaMA-Factory SFT with odb: LLaMA-Factory's own workflow, batches planned under a token budget.

    python examples/llamafactory_sft.py                     # offline demo: tiny random Llama on CPU
    python examples/llamafactory_sft.py my_sft.yaml 16384   # your LLaMA-Factory config (stage: sft), budget

The config is what ``llamafactory-cli train my_sft.yaml`` reads; odb replaces its
``per_device_train_batch_size`` by ``token_budget`` (padded tokens per micro-batch). The
demo writes a word-level tokenizer, a 2-layer random Llama and multi-turn ShareGPT-style
chats to a temporary folder, so it needs no download. See
docs/integration-guides/llamafactory.md.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import random
import sys
import tempfile
import types
from typing import Any, Dict, List

WORDS = ("the a cat dog sat on mat ran far quick brown fox jumps over lazy hello world how are you fine thanks "
         "what is your name my odb batches tokens budget Human Assistant").split()


def import_llamafactory() -> None:
    """Import LLaMA-Factory's SFT code in environments outside its declared requirements.

    Both steps are no-ops in an environment that ``pip install llamafactory`` resolved:
    - transformers newer than LLaMA-Factory's range (0.9.5: <=5.6) fails its import-time
      version check; its documented switch DISABLE_VERSION_CHECK=1 is set, with a notice;
    - its multimodal plugin imports torchaudio at module level; where none is installed
      (no build matches a CPU-only torch 2.13, for example) a stand-in that fails on use
      is registered during the import: text-only SFT never calls it.
    """
    import transformers
    import transformers.processing_utils  # noqa: F401  (checks for torchaudio before any stand-in exists)
    from packaging.version import Version

    if Version(transformers.__version__) > Version("5.6") and not os.environ.get("DISABLE_VERSION_CHECK"):
        print(f"note: transformers {transformers.__version__} is newer than LLaMA-Factory 0.9.5 declares; "
              f"setting DISABLE_VERSION_CHECK=1")
        os.environ["DISABLE_VERSION_CHECK"] = "1"
    try:
        import torchaudio  # noqa: F401
        stand_in = None
    except ImportError:
        stand_in = types.ModuleType("torchaudio")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

        def missing(name: str) -> Any:
            raise ImportError(f"torchaudio.{name}: torchaudio is not installed (audio inputs need it)")

        stand_in.__getattr__ = missing  # type: ignore[attr-defined]
        sys.modules["torchaudio"] = stand_in
    try:
        import llamafactory.train.sft.workflow  # noqa: F401
    finally:
        if stand_in is not None and sys.modules.get("torchaudio") is stand_in:
            del sys.modules["torchaudio"]


def write_demo(root: str, conversations: int = 48, seed: int = 0) -> Dict[str, Any]:
    """A tiny random Llama, its tokenizer and ShareGPT-style chats under ``root``; LLaMA-Factory args."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS) + " : ?"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    model_dir = os.path.join(root, "tiny-llama")
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(model_dir)

    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    chats: List[Dict[str, Any]] = []
    for _ in range(conversations):  # one to three turns of very different lengths, as in real SFT data
        turns = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            turns += [{"from": "human", "value": text(rng.choice([2, 4, 8, 16, 30]))},
                      {"from": "gpt", "value": text(rng.choice([1, 3, 10, 25]))}]
        chats.append({"conversations": turns})
    data_dir = os.path.join(root, "data")
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "chats.json"), "w") as f:
        json.dump(chats, f)
    with open(os.path.join(data_dir, "dataset_info.json"), "w") as f:
        json.dump({"chats": {"file_name": "chats.json", "formatting": "sharegpt"}}, f)
    return dict(stage="sft", do_train=True, finetuning_type="full", model_name_or_path=model_dir,
                dataset="chats", dataset_dir=data_dir, template="default", cutoff_len=128,
                cache_dir=os.path.join(root, "cache"), overwrite_cache=True, output_dir=os.path.join(root, "out"),
                num_train_epochs=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True, seed=seed,
                # no use for a tiny model; LLaMA-Factory 0.9.5's checkpointing wrapper also fails on transformers
                # 5.23 (it works on 5.6)
                disable_gradient_checkpointing=True)


def main(argv: List[str]) -> None:
    import_llamafactory()
    from odb.integrations.llamafactory import run_exp

    if argv:
        import yaml

        with open(argv[0], encoding="utf-8") as f:
            args = yaml.safe_load(f)
        budget = int(argv[1]) if len(argv) > 1 else 16384
    else:
        args, budget = write_demo(tempfile.mkdtemp(prefix="odb-llamafactory-")), 512
    run_exp(args, token_budget=budget, buffer_size=256)  # every other odb option works here too

    with open(os.path.join(args["output_dir"], "trainer_state.json"), encoding="utf-8") as f:
        logs = [h for h in json.load(f)["log_history"] if "odb_mean_batch_size" in h]
    batch = sum(h["odb_mean_batch_size"] for h in logs) / max(len(logs), 1)
    padding = sum(h["odb_padding_ratio"] for h in logs) / max(len(logs), 1)
    print(f"odb: {len(logs)} logged steps, mean batch {batch:.1f} samples, padding {padding:.1%}, "
          f"token budget {budget}; model and logs in {args['output_dir']}")


if __name__ == "__main__":
    main(sys.argv[1:])
