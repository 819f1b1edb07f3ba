"""Batched generation under a token budget and its OOM fallback.

Planning and ordering are checked with a stub model whose output names its input;
exactness with tiny random Hugging Face models (T5 encoder-decoder, Llama
decoder-only) in float32 with greedy decoding, against one ``generate`` per input.
Out-of-memory errors are simulated: a wrapper raises torch.OutOfMemoryError when a
call has more than ``k`` rows.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
import transformers  # pinned under `make test` and test-min: a broken install fails, never skips
from hypothesis import given, settings
from hypothesis import strategies as st

from odb.train.generation import generate_batched, generate_with_oom_fallback, plan_generation_batches
from odb.train.oom import ODBOOMError

PAD, EOS = 0, 9


class Stub:
    """A decoder-only stand-in: appends [row's first real token, EOS for odd ones] then pads; records calls."""

    config = None

    def __init__(self, max_rows: int = 10**6) -> None:
        self.calls: List[Tuple[int, int]] = []
        self.max_rows = max_rows
        self.generation_config = transformers.GenerationConfig(pad_token_id=PAD, eos_token_id=EOS)

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        self.calls.append(tuple(input_ids.shape))
        if input_ids.shape[0] > self.max_rows:
            raise torch.OutOfMemoryError(f"fake: {input_ids.shape[0]} rows")
        first = input_ids.gather(1, attention_mask.argmax(1, keepdim=True))
        new = first.repeat(1, max_new_tokens)
        odd = first[:, 0] % 2 == 1
        new[odd, 1] = EOS
        new[odd, 2:] = pad_token_id
        if odd.all():  # like generate: stops once every row has ended
            new = new[:, :2]
        return torch.cat([input_ids, new], 1)


class CountRows:
    """Wraps a Hugging Face model: records the rows of every generate call; raises OOM above k rows."""

    def __init__(self, model: Any, k: int) -> None:
        self.model, self.k, self.calls = model, k, []
        self.config, self.generation_config = model.config, model.generation_config

    def generate(self, **kwargs):
        rows, width = kwargs["input_ids"].shape
        self.calls.append((rows, width))
        if rows > self.k:
            raise torch.OutOfMemoryError(f"fake: {rows} rows > {self.k}")
        return self.model.generate(**kwargs)


def prompts(n: int, seed: int, low: int = 1, high: int = 16) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=gen)
    return [torch.randint(10, 60, (int(k),), generator=gen).tolist() for k in lengths]


def stub_expected(prompt: List[int], max_new: int) -> List[int]:
    first = prompt[0]
    new = [first, EOS] if first % 2 else [first] * max_new
    return prompt + new


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=80), budget=st.integers(50, 400),
       max_new=st.integers(0, 10), max_batch=st.one_of(st.none(), st.integers(1, 8)))
@settings(max_examples=200, deadline=None)
def test_plan_takes_every_input_once_within_budget(lengths, budget, max_new, max_batch):
    groups = plan_generation_batches(lengths, token_budget=budget, max_new_tokens=max_new, max_batch_size=max_batch,
                                     oversize="alone")
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        cost = len(g) * (max(lengths[i] for i in g) + max_new)
        assert cost <= budget or len(g) == 1
        assert max_batch is None or len(g) <= max_batch


def test_oversize_inputs_raise_by_default_and_run_alone_on_request():
    with pytest.raises(ValueError, match=r"input 1 has 30 tokens; with max_new_tokens=20 .* token_budget=40"):
        plan_generation_batches([5, 30, 3], token_budget=40, max_new_tokens=20)
    assert plan_generation_batches([5, 30, 3], token_budget=40, max_new_tokens=20, oversize="alone") == [[1], [0],
                                                                                                           [2]]


def test_order_is_kept_and_batches_stay_within_budget():
    inputs = prompts(60, seed=1)
    stub = Stub()
    out = generate_batched(stub, inputs, token_budget=120, max_new_tokens=6)
    assert [o.tolist() for o in out] == [stub_expected(p, 6) for p in inputs]
    assert sum(rows for rows, _ in stub.calls) == len(inputs) and len(stub.calls) > 1
    assert all(rows * (width + 6) <= 120 for rows, width in stub.calls)


def test_inputs_may_be_lists_tensors_or_dicts():
    inputs = [[11, 12, 13], torch.tensor([14, 15]), {"input_ids": [16], "attention_mask": [1]}]
    out = generate_batched(Stub(), inputs, token_budget=100, max_new_tokens=3)
    assert [o.tolist() for o in out] == [[11, 12, 13, 11, 9], [14, 15, 14, 14, 14], [16, 16, 16, 16]]
    with pytest.raises(ValueError, match="input 0 is a dict without input_ids"):
        generate_batched(Stub(), [{"ids": [1]}], token_budget=100, max_new_tokens=3)
    with pytest.raises(ValueError, match="input 1: every field must be 1-D"):
        generate_batched(Stub(), [[1], {"input_ids": [1, 2], "attention_mask": [1]}], token_budget=100,
                         max_new_tokens=3)


def test_only_the_failed_batch_is_split_and_outputs_join_in_order():
    stub = Stub(max_rows=2)
    batch = {"input_ids": torch.tensor([[11, 12], [14, 15], [15, 16], [17, 18], [19, 20]]),
             "attention_mask": torch.ones(5, 2, dtype=torch.long)}
    out = generate_with_oom_fallback(stub, batch, max_new_tokens=4)
    assert stub.calls == [(5, 2), (2, 2), (3, 2), (1, 2), (2, 2)]  # 5 fails -> 2 fits, 3 fails -> 1 + 2
    assert out.shape == (5, 6)  # rows 2-4 (odd first token) ended at EOS: 2 columns short
    for row, got in zip(batch["input_ids"].tolist(), out.tolist()):
        want = stub_expected(row, 4)
        assert got == want + [PAD] * (6 - len(want))  # right-padded with the pad token to a common length
    with pytest.raises(ODBOOMError, match="single input"):
        generate_with_oom_fallback(Stub(max_rows=0), batch, max_new_tokens=4)


def tiny_t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, pad_token_id=0, eos_token_id=46, decoder_start_token_id=0,
                                initializer_factor=10.0)  # larger init: varied tokens, EOS (46) now and then
    return transformers.T5ForConditionalGeneration(cfg).eval()


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=22,
                                   bos_token_id=2)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [tiny_t5, tiny_llama], ids=["t5-encoder-decoder", "llama-decoder-only"])
def test_batched_greedy_generation_with_oom_fallback_equals_one_call_per_input(make):
    model = make()
    inputs = prompts(10, seed=3)
    wrapped = CountRows(model, k=2)
    out = generate_batched(wrapped, inputs, token_budget=160, max_new_tokens=8, do_sample=False)
    single = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False)[0] for p in inputs]
    assert [o.tolist() for o in out] == [s.tolist() for s in single]
    assert any(rows > 2 for rows, _ in wrapped.calls), "the fake limit never triggered a split"
    assert all(rows * (width + 8) <= 160 for rows, width in wrapped.calls)
    full = [(1 if model.config.is_encoder_decoder else len(p)) + 8 for p in inputs]
    ended = sum(len(s) < n for s, n in zip(single, full))
    print(f"\n{make.__name__}: {len(inputs)} inputs, generate calls (rows, width) {wrapped.calls}; "
          f"{ended} outputs stopped at EOS before max_new_tokens")
