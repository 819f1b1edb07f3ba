"""Worker functions for tests/integrations/test_fsdp.py: odb batches under FSDP2 (``fully_shard``) on gloo CPU ranks.

Run on every rank by dist_harness.run_ranks ("fsdp_workers:<function>"). ``own_loop``
trains a float64 model sharded with ``torch.distributed.fsdp.fully_shard`` in a plain
loop; ``hf_trainer_suite`` trains HF Trainers whose Llama was sharded with FSDP2 at load
time (``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=world))``).
The single-process references live here too, so the parent test rebuilds the same
model from the same seed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

import odb
from dist_workers import VOCAB, grad_lengths, grad_shards, lm_loss, record
from helpers import IGNORE, LengthDataset, make_sample, pad_collate


# ---- a plain loop over a fully_shard model ----------------------------------------------------


def plain_model(seed: int) -> torch.nn.Sequential:
    """Embedding, two Linear layers of odd widths (7 and 9 rows shard unevenly over 2 or 3 ranks), float64."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 9), torch.nn.Linear(9, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, VOCAB)).double()


def sharded_model(seed: int) -> torch.nn.Module:
    """``plain_model`` with every layer and the root sharded by FSDP2 over the default group."""
    from torch.distributed.fsdp import fully_shard

    model = plain_model(seed)
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer)
    return fully_shard(model)


def own_loop(rank: int, world: int, p: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """Per accumulation K: every optimizer step's full gradient (gathered from the shards), the
    micro-batches that made it, the final full parameters and this rank's shard sizes.

    Gradient sync is off on all but the last micro-batch of a step, as FSDP2 accumulation is
    done; a ghost micro-batch still runs forward and backward, so every rank issues the same
    all-gathers and reduce-scatters.
    """
    lengths = grad_lengths(world, p)
    dataset = LengthDataset(lengths)
    out = {}
    for k in p["accumulation"]:
        loader = odb.ODBDataLoader(dataset, token_budget=p["budget"], sampler=grad_shards(world, p)[rank],
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0,
                                   gradient_accumulation_steps=k, lengths=lengths if p.get("known") else None,
                                   num_workers=p.get("num_workers", 0))
        model = sharded_model(p["seed"])
        optimizer = torch.optim.SGD(model.parameters(), lr=p["lr"])
        steps: List[Dict[str, Any]] = []
        micro: List[Dict[str, Any]] = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            micro.append(record(batch, info))
            model.set_requires_gradient_sync(info.is_last_micro_step)
            (lm_loss(model, batch) * info.loss_scale).backward()
            if info.is_last_micro_step:
                steps.append({"grads": [w.grad.full_tensor() for w in model.parameters()], "micro": micro})
                micro = []
                optimizer.step()
                optimizer.zero_grad()
        out[k] = {"steps": steps, "params": [w.detach().full_tensor() for w in model.parameters()],
                  "rows": [w.to_local().shape[0] for w in model.parameters()]}
    return out


def step_samples(micro: Sequence[Dict[str, Any]]) -> List[int]:
    """Dataset indices trained in a step's micro-batches (a ghost's sample only keeps collectives aligned)."""
    return [i for m in micro if not m["ghost"] for i in m["idx"]]


def reference_steps(world: int, p: Dict[str, Any], steps: Sequence[Sequence[int]]) -> Dict[str, Any]:
    """One process, unsharded: per step the gradient of (sum of token losses) / (their count) over the
    step's samples, then an SGD step; the gradients and the final parameters."""
    lengths = grad_lengths(world, p)
    model = plain_model(p["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=p["lr"])
    grads = []
    for ids in steps:
        batch = pad_collate([make_sample(i, lengths[i]) for i in ids])
        optimizer.zero_grad()
        (lm_loss(model, batch, reduction="sum") / int((batch["labels"] != IGNORE).sum())).backward()
        grads.append([w.grad.detach().clone() for w in model.parameters()])
        optimizer.step()
    return {"grads": grads, "params": [w.detach().clone() for w in model.parameters()]}


# ---- the HF Trainer over a model sharded at load time ---------------------------------------


def hf_trainer_suite(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """For each run of ``p["runs"]``: an ODBTrainer over the Llama saved at ``p["path"]``, loaded sharded by
    FSDP2 over all ranks; the full parameter change, the last step's infos and the trained sample ids. Then
    whether a Trainer given ``TrainingArguments(fsdp=True)`` on these CPU ranks has FSDP enabled."""
    import hf_workers as W
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from odb.integrations.hf import ODBTrainer

    W._join_torch_distributed(rank, world)
    results: List[Dict[str, Any]] = []
    for run in p["runs"]:
        model = LlamaForCausalLM.from_pretrained(p["path"], distributed_config=DistributedConfig(fsdp_size=world),
                                                 dtype=torch.float64)
        before = {n: w.detach().full_tensor() for n, w in model.named_parameters()}
        odb_options = dict(token_budget=run["budget"], buffer_size=run.get("buffer", 16), **run.get("odb", {}))
        trainer = ODBTrainer(model=model, args=W.make_args(run, run["out"]), train_dataset=W.dataset_for(run),
                             data_collator=W.pad_collate, **odb_options)
        trainer.train()
        infos = trainer.odb_step_infos
        results.append({
            "delta": {n: w.detach().full_tensor() - before[n] for n, w in trainer.model.named_parameters()},
            "sharded": all(type(w).__name__ == "DTensor" for w in trainer.model.parameters()),
            "infos": [i.as_dict() for i in infos], "ids": sorted(i for info in infos for i in info.sample_ids),
            "log": trainer.state.log_history})
    # Last (Accelerate sets ACCELERATE_USE_FSDP in the environment): what TrainingArguments(fsdp=...) does here.
    plugin = W.build_trainer(dict(p["runs"][0], args=dict(fsdp=True, fsdp_config={"version": 2})), p["runs"][0]["out"])
    results.append({"fsdp_enabled": plugin.is_fsdp_enabled,
                    "distributed_type": str(plugin.accelerator.state.distributed_type)})
    return results
