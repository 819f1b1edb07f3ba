"""torch.compile over odb's batches, and shape_buckets (the option that bounds their shapes).

How graphs are counted: ``torch.compile(model, backend=counting)`` with a backend that
records each FX graph dynamo hands it and runs it as is (what ``backend="eager"`` does).
A custom backend is torch.compile's public extension point, and it sees every graph
compiled: the first one, each recompilation for a new shape (or a new set of dynamic
dimensions), and the pieces of a graph break. The eager run keeps the tests fast on CPU:
tracing is what depends on the shapes, and inductor would add seconds of code generation
per graph without changing how many graphs there are (benchmarks/compile_bench.py runs
inductor). The model is a one-layer Llama with random weights (built from a config,
nothing downloaded): a second layer only lengthens each trace.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import odb
from odb.plan.costs.buckets import bucket_length
from odb.config import ODBConfig
from odb.plan.costs.cost import CostModel
from odb.plan.windows.window import flatten, plan_stream

from helpers import IGNORE, LengthDataset, StreamDataset, epoch

BUDGET = 1024
VOCAB = 64
# make test-min's floor (torch 2.6 with transformers 5.18) cannot compile an HF Llama: transformers calls
# torch.compiler.is_exporting, which torch 2.6 lacks, and dynamo there has no fail_on_recompile_limit_hit.
COMPILES = hasattr(torch.compiler, "is_exporting") and hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit")
needs_compile = pytest.mark.skipif(
    not COMPILES, reason=f"TORCH.COMPILE NOT TESTED: torch {torch.__version__} cannot compile transformers "
                         f"{transformers.__version__}'s Llama (no torch.compiler.is_exporting); make test runs it "
                         f"on torch 2.13")


def workload(n: int = 600, seed: int = 1) -> List[int]:
    """Log-normal lengths (mean 60, CV 0.5) clipped to [4, 256]: a short SFT-like spread."""
    sigma2 = np.log1p(0.5 ** 2)
    x = np.random.default_rng(seed).lognormal(np.log(60.0) - sigma2 / 2, np.sqrt(sigma2), size=n)
    return np.clip(np.rint(x), 4, 256).astype(int).tolist()


def tiny_llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config)


class MaskCollate:
    """Pads input_ids (0), labels (-100) and an attention_mask to the longest sample, as HF collators do."""

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        mask = torch.zeros(len(samples), width, dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"] % VOCAB, s["labels"], 1
        labels[labels >= 0] %= VOCAB
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "idx": [s["idx"] for s in samples]}


class GraphCounter:
    """A torch.compile backend that counts the graphs it is given (with their input shapes) and runs them eagerly."""

    def __init__(self) -> None:
        self.graphs: List[List[Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Any:
        self.graphs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs])
        return gm.forward


def loader_for(sample_lengths: List[int], **options: Any) -> odb.ODBDataLoader:
    return odb.ODBDataLoader(LengthDataset(sample_lengths), token_budget=BUDGET, shuffle=True, seed=0,
                             collate_fn=MaskCollate(), shift_labels=True, **options)


def epoch_shapes(loader: odb.ODBDataLoader) -> Tuple[List[Tuple[int, int]], List[int], float]:
    """Shapes (B, L) of one epoch's input_ids, the sample ids, and real / padded tokens."""
    shapes, ids, real, padded = [], [], 0, 0
    for batch in loader:
        info = odb.pop_step_info(batch)
        shapes.append(tuple(batch["input_ids"].shape))
        assert info.padded_tokens == batch["input_ids"].numel()  # odb costs the shape the model gets
        ids += batch["idx"]
        real, padded = real + info.real_tokens, padded + info.padded_tokens
    return shapes, ids, real / padded


def train_compiled(loader: odb.ODBDataLoader, dynamic: Optional[bool]) -> Tuple[GraphCounter, List[Tuple[int, int]]]:
    """One epoch of a compiled tiny Llama; each step's loss is checked against an uncompiled twin's."""
    torch._dynamo.reset()
    model, twin = tiny_llama(), tiny_llama()
    counter = GraphCounter()
    compiled = torch.compile(model, backend=counter, dynamic=dynamic)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    shapes = []
    for batch in loader:
        info = odb.pop_step_info(batch)
        inputs = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}
        shapes.append(tuple(batch["input_ids"].shape))
        for net, optimizer in ((compiled, opt), (twin, twin_opt)):
            loss = odb.scale_loss(net(**inputs).loss, info)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if net is compiled:
                compiled_loss = loss.item()
        torch.testing.assert_close(compiled_loss, loss.item(), rtol=1e-4, atol=1e-6)
    return counter, shapes


@needs_compile
def test_default_compile_trains_an_odb_epoch_in_at_most_3_graphs() -> None:
    # Automatic dynamic shapes: the first shape compiles a static graph, the next one a graph dynamic in B and L
    # that serves every later shape. The epoch has dozens of shapes, so the bound is about recompilation.
    counter, shapes = train_compiled(loader_for(workload(300)), dynamic=None)
    assert len(set(shapes)) > 8, shapes
    assert 1 <= len(counter.graphs) <= 3, counter.graphs


@needs_compile
@pytest.mark.parametrize("shape_buckets", [8, odb.fit_buckets(workload(), 5, multiple=8, budget=BUDGET)],
                         ids=["halving-8", "fitted-5"])
def test_shape_buckets_bound_static_compile_to_8_graphs(shape_buckets: Any) -> None:
    lengths = workload(300)
    plain_shapes, _, plain_eff = epoch_shapes(loader_for(lengths))
    assert len(set(plain_shapes)) > 8  # without the option, dynamic=False would recompile at every new shape
    # dynamo's recompile limit (8 per function) would quietly fall back to eager beyond 8 shapes: make it fail
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        counter, shapes = train_compiled(loader_for(lengths, shape_buckets=shape_buckets), dynamic=False)
    assert len(set(shapes)) <= 8, sorted(set(shapes))
    assert len(counter.graphs) == len(set(shapes))  # one static graph per shape, each compiled once
    cfg = ODBConfig(token_budget=BUDGET, shape_buckets=shape_buckets)
    assert {length for _, length in shapes} <= set(cfg.shape_buckets)


def test_shape_buckets_epoch_is_exact_and_reports_its_padding() -> None:
    lengths = workload()
    plain, plain_ids, plain_eff = epoch_shapes(loader_for(lengths))
    bucketed, ids, eff = epoch_shapes(loader_for(lengths, shape_buckets=(64, 128, 256)))
    assert sorted(ids) == sorted(plain_ids) == list(range(len(lengths)))
    assert all(b * length <= BUDGET for b, length in bucketed)
    # every batch but the epoch's first and last is a full batch of its bucket
    full = [(b, length) for b, length in bucketed if b == BUDGET // length]
    assert len(full) >= len(bucketed) - 2, bucketed
    # the padding the option costs shows in the step infos (here most samples are far below their bucket)
    assert eff < plain_eff - 0.1 and 0.5 < eff


def test_shape_buckets_with_known_lengths_and_workers() -> None:
    # lengths= plans in the batch sampler and the workers collate (and pad to the bucket) whole batches
    lengths = workload(200)
    online = [(tuple(b["input_ids"].shape), list(b["idx"]))
              for b in epoch(loader_for(lengths, shape_buckets=(32, 64, 128, 256)))]
    known = [(tuple(b["input_ids"].shape), list(b["idx"]))
             for b in epoch(loader_for(lengths, shape_buckets=(32, 64, 128, 256), lengths=lengths, num_workers=2))]
    assert known == online
    assert {shape[1] for shape, _ in known} <= {32, 64, 128, 256}


def test_pad_to_bucket_leaves_a_causal_lm_loss_unchanged() -> None:
    model = tiny_llama().eval()
    samples = [{"input_ids": torch.arange(n) + 1, "labels": torch.arange(n) + 1, "idx": i}
               for i, n in enumerate((5, 9, 3))]
    plain = MaskCollate()(copy.deepcopy(samples))
    padded = odb.PadToBucket(MaskCollate(), (8, 16, 32))(copy.deepcopy(samples))
    assert padded["input_ids"].shape == padded["labels"].shape == padded["attention_mask"].shape == (3, 16)
    assert (padded["labels"][:, 9:] == IGNORE).all() and (padded["attention_mask"][:, 9:] == 0).all()
    with torch.no_grad():
        keys = ("input_ids", "labels", "attention_mask")
        torch.testing.assert_close(model(**{k: padded[k] for k in keys}).loss,
                                   model(**{k: plain[k] for k in keys}).loss)


def test_pad_to_bucket_warns_once_where_it_cannot_pad() -> None:
    def tuple_collate(samples: List[Dict[str, Any]]) -> Tuple[torch.Tensor, torch.Tensor]:
        ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
        return ids, ids.clone()

    loader = odb.ODBDataLoader(LengthDataset([5, 9, 3, 7] * 8), token_budget=64, collate_fn=tuple_collate,
                               shape_buckets=(8, 16), shift_labels=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    notes = [w for w in caught if "shape_buckets" in str(w.message)]
    assert len(notes) == 1 and "odb.bucket_length" in str(notes[0].message)
    assert {tuple(b[0].shape)[1] for b in batches} - {8, 16}  # the widths are the collate's own: warned about


@pytest.mark.parametrize("dataset", [LengthDataset, StreamDataset], ids=["len-probe", "stream"])
def test_oversize_names_the_buckets(dataset: Any) -> None:
    # 200 tokens fit the budget but no bucket: the error names the buckets, not the budget
    loader = odb.ODBDataLoader(dataset([10, 200, 12]), token_budget=BUDGET, collate_fn=MaskCollate(),
                               shape_buckets=(16, 64), shift_labels=True)
    with pytest.raises(ValueError, match=r"length 200, and shape_buckets=\(16, 64\) has no bucket that holds it"):
        list(loader)


@st.composite
def bucket_setups(draw: Any) -> Tuple[np.ndarray, ODBConfig]:
    multiple = draw(st.sampled_from([1, 8]))
    budget = draw(st.integers(64, 4096)) // multiple * multiple or multiple
    if draw(st.booleans()):
        buckets: Any = draw(st.integers(2, 10))
    else:
        grid = draw(st.lists(st.integers(1, max(1, budget // multiple)), min_size=1, max_size=8, unique=True))
        buckets = tuple(sorted(v * multiple for v in grid))
    cfg = ODBConfig(token_budget=budget, shape_buckets=buckets, pad_to_multiple_of=multiple,
                    max_batch_size=draw(st.none() | st.integers(8, 64)),
                    batch_size_multiple=draw(st.sampled_from([1, 1, 4])),
                    buffer_size=draw(st.integers(8, 300)), first_window_size=draw(st.integers(1, 64)),
                    window_budgets=draw(st.none() | st.integers(1, 8)), max_carry=draw(st.none() | st.integers(0, 50)),
                    pack_efficiency=draw(st.none() | st.floats(0.5, 1.0)))
    n = draw(st.integers(0, 400))
    top = min(budget, cfg.shape_buckets[-1])
    lengths = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(1, top + 1, size=n)
    return lengths, cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bucket_setups())
def test_shape_buckets_keep_the_budget_and_every_sample_once(setup: Tuple[np.ndarray, ODBConfig]) -> None:
    lengths, cfg = setup
    groups, oversize = flatten(plan_stream(lengths, cfg))
    cost = CostModel.from_config(cfg)
    emitted = np.concatenate(groups + [oversize]) if groups else oversize
    assert sorted(emitted.tolist()) == list(range(len(lengths)))  # every sample exactly once
    for g in groups:
        longest = -(-int(lengths[g].max()) // cfg.pad_to_multiple_of) * cfg.pad_to_multiple_of
        width = bucket_length(longest, cfg.shape_buckets)
        assert width in cfg.shape_buckets  # the batch has a bucket's length
        assert len(g) * width <= cfg.token_budget  # and fits the budget at that length
        assert cost.batch_cost(cost.pad(lengths[g][:, None])) == len(g) * width
        assert cfg.max_batch_size is None or len(g) <= cfg.max_batch_size
    for sid in oversize.tolist():  # only samples whose bucket cannot hold one copy within the budget
        assert bucket_length(int(lengths[sid]), cfg.shape_buckets) > cfg.token_budget


class TrainerCollate:
    """MaskCollate without the sample ids (the Trainer hands every batch key to the model)."""

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        batch = MaskCollate()([{**s, "idx": None} for s in samples])  # the Trainer drops the ids
        batch.pop("idx")
        return batch


class RecordingPad(odb.PadToBucket):
    """odb's bucket padding (odb does not wrap a PadToBucket again) that records the shapes it hands out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes: List[Tuple[int, ...]] = []

    def __call__(self, samples: List[Any]) -> Any:
        batch = super().__call__(samples)
        self.shapes.append(tuple(batch["input_ids"].shape))
        return batch


@needs_compile
@pytest.mark.parametrize("static", [False, True], ids=["torch_compile", "torch_compile+shape_buckets+static"])
def test_hf_trainer_torch_compile_with_odb(static: bool, tmp_path: Any, monkeypatch: Any) -> None:
    # Trainer(torch_compile=True) compiles through Accelerate with dynamic unset (automatic dynamic shapes);
    # Accelerate's own ACCELERATE_DYNAMO_USE_DYNAMIC=false makes the graphs static. Graphs are counted with dynamo's
    # counters here: the Trainer takes a backend name, not a callable.
    from torch._dynamo.utils import counters
    from odb.integrations.hf import enable_odb

    buckets = (32, 64, 128, 256)
    collate = RecordingPad(TrainerCollate(), buckets) if static else TrainerCollate()
    if static:
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "false")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                                          torch_compile=True, torch_compile_backend="eager", num_train_epochs=1,
                                          save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                                          learning_rate=1e-3)
    data = LengthDataset(workload(300))
    samples = [{k: data[i][k] for k in ("input_ids", "labels", "idx")} for i in range(len(data))]
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=samples, data_collator=collate)
    # static graphs: budget-filled steps, whose batches are full per bucket (one B per bucket); with
    # global_batch_size (the default) B follows each step's cut, so shapes are buckets x several B
    static_options = {"shape_buckets": buckets, "global_batch_size": None}
    enable_odb(trainer, token_budget=BUDGET, shift_labels=True, **(static_options if static else {}))
    torch._dynamo.reset()
    counters.clear()
    trainer.train()
    graphs = counters["stats"]["unique_graphs"]
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)  # compiled, not eager
    assert graphs >= 1
    if static:
        # one static graph per shape (automatic dynamic shapes would have stopped at 2 for these 3 or more)
        assert 3 <= graphs == len(set(collate.shapes)) <= 8, sorted(set(collate.shapes))
        assert {w for _, w in collate.shapes} <= set(buckets)
    else:
        # the first shape, the second (its differing dimensions turn dynamic), B = 1 (specialised), and with
        # global_batch_size (the default) one more: a step's first micro-batches often share B, so B turns
        # dynamic only at the next shape (measured: 4 graphs; 2 with budget-filled steps)
        assert graphs <= 4
