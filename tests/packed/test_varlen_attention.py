"""odb_varlen: causal attention per sample of a packed row, exact against each sample alone.

The packed-row proofs with a whole model (logits, losses, the 2-rank DDP gradient) are
in test_packed_isolation.py, parametrized over odb_varlen too. Here: the kernel on its
own (values and gradients, grouped-query heads, bad boundaries), and transformers'
paths that do not come as one packed row (a padding mask, a KV cache in generation,
``cu_seq_lens_*`` kwargs, several rows), which go to sdpa or are read as flash-attention
reads them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers  # pinned under `make test` and test-min: a broken install fails, never skips

import odb
from odb import varlen_causal_attention


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list) -> torch.Tensor:
    reps = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(reps, dim=-3), v.repeat_interleave(reps, dim=-3)
    return torch.cat([F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], is_causal=True)
                      for a, b in zip(bounds, bounds[1:])], dim=-2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_each_sample_attends_only_to_itself_values_and_gradients(kv_heads: int) -> None:
    torch.manual_seed(0)
    bounds = [0, 5, 6, 19, 30]
    q = torch.randn(1, 4, 30, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, 30, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, 30, 8, dtype=torch.float64, requires_grad=True)
    out = varlen_causal_attention(q, k, v, bounds)
    ref = _alone(q, k, v, bounds)
    assert torch.allclose(out, ref, atol=1e-12)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-12)
    # Moving one sample's tokens leaves every other sample's output unchanged.
    k2 = k.detach().clone()
    k2[..., 6:19, :] += 1.0
    out2 = varlen_causal_attention(q, k2, v, bounds)
    assert torch.equal(out2[..., :6, :], out[..., :6, :].detach()) and torch.equal(out2[..., 19:, :],
                                                                                   out[..., 19:, :].detach())


@pytest.mark.parametrize("bounds", [[0, 5], [1, 10], [0, 4, 4, 10], [0, 7, 3, 10], []])
def test_bad_boundaries_are_refused_with_the_rule(bounds: list) -> None:
    q = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match=r"must rise strictly from 0 to the row's length 10.*Fix"):
        varlen_causal_attention(q, q, q, bounds)


# ---- transformers ------------------------------------------------------------------------------


def _llama(attn: str):  # type: ignore[no-untyped-def]
    from packed_workers import tiny_llama  # the isolation tests' 2-layer Llama (grouped-query heads)

    return tiny_llama(attn).eval()


def test_register_is_idempotent_and_returns_the_name() -> None:
    assert odb.register_varlen_attention() == odb.register_varlen_attention() == "odb_varlen"


def test_a_padded_batch_goes_to_sdpa_with_its_mask() -> None:
    name = odb.register_varlen_attention()
    varlen, sdpa = _llama(name), _llama("sdpa")
    ids = torch.randint(1, 50, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[1, 4:] = 0
    with torch.no_grad():
        a = varlen(input_ids=ids, attention_mask=mask).logits
        b = sdpa(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a[mask.bool()], b[mask.bool()], atol=1e-5)


def test_generation_with_a_kv_cache_matches_sdpa() -> None:
    name = odb.register_varlen_attention()
    varlen, sdpa = _llama(name), _llama("sdpa")
    ids = torch.randint(1, 50, (2, 7))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(varlen.generate(ids, **kw), sdpa.generate(ids, **kw))


def test_cu_seq_lens_and_several_rows_give_the_samples_alone() -> None:
    name = odb.register_varlen_attention()
    model = _llama(name)
    gen = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(1, 50, (n,), generator=gen)} for n in (6, 9, 5)]
    with torch.no_grad():
        alone = [model(input_ids=s["input_ids"][None]).logits[0] for s in samples]
        flash_kw = odb.PackedCollate(return_flash_attn_kwargs=True)(samples)
        assert "cu_seq_lens_q" in flash_kw
        row = model(**{k: v for k, v in flash_kw.items() if k != "labels"}).logits[0]
        # Two rows of 20 tokens: (6, 9, 5) and (5, 6, 9), boundaries from each row's position_ids.
        first = odb.PackedCollate()(samples)
        second = odb.PackedCollate()([samples[2], samples[0], samples[1]])
        both = model(input_ids=torch.cat([first["input_ids"], second["input_ids"]]),
                     position_ids=torch.cat([first["position_ids"], second["position_ids"]])).logits
    assert torch.allclose(row, torch.cat(alone), atol=1e-5)
    assert torch.allclose(both[0], torch.cat(alone), atol=1e-5)
    assert torch.allclose(both[1], torch.cat([alone[2], alone[0], alone[1]]), atol=1e-5)


def test_a_sliding_window_is_kept_inside_each_sample() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(attn: str):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        return MistralForCausalLM(MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=4, attn_implementation=attn)).eval()

    varlen, sdpa = mistral(odb.register_varlen_attention()), mistral("sdpa")
    gen = torch.Generator().manual_seed(2)
    samples = [{"input_ids": torch.randint(1, 50, (n,), generator=gen)} for n in (3, 11, 8)]
    with torch.no_grad():
        row = varlen(**{k: v for k, v in odb.PackedCollate()(samples).items() if k != "labels"}).logits[0]
        alone = torch.cat([sdpa(input_ids=s["input_ids"][None]).logits[0] for s in samples])
        no_window = mistral("sdpa")
        no_window.config.sliding_window = None
        wide = no_window(input_ids=samples[1]["input_ids"][None]).logits[0]
    assert torch.allclose(row, alone, atol=1e-5)
    assert not torch.allclose(row[3:14], wide, atol=1e-3)  # the window did cut the 11-token sample's attention


def test_logit_softcapping_is_refused_with_the_fix() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    name = odb.register_varlen_attention()
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           attn_implementation=name))
    with pytest.raises(ValueError, match=r"causal softmax attention only.*softcap=50.*Fix: use 'flash_attention_2'"):
        model(input_ids=torch.randint(1, 50, (1, 10)))


def test_check_packed_model_names_the_faster_attention_once_for_a_dense_mask() -> None:
    model = _llama("sdpa")
    with pytest.warns(UserWarning, match=r"dense block-diagonal mask.*'odb_varlen'.*register_varlen_attention"):
        assert odb.check_packed_model(model) < 1e-4
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        odb.check_packed_model(model)  # once per model
        odb.check_packed_model(_llama(odb.register_varlen_attention()))  # no dense mask: nothing to say


def _kernel_2_10(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None, return_aux=None):
    """A CPU stand-in with torch 2.10's ``varlen_attn`` signature ((T, H, D) tensors, no grouped heads)."""
    assert is_causal and q.shape == k.shape, "torch 2.10's kernel: causal by is_causal, equal heads"
    bounds = cu_q.tolist()
    return _alone(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds).transpose(0, 1)


def _kernel_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
    """A CPU stand-in with the later signature: causal as window_size=(-1, 0), grouped heads by enable_gqa."""
    assert tuple(window_size) == (-1, 0) and enable_gqa == (k.shape[1] != q.shape[1])
    return _alone(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_q.tolist()).transpose(0, 1)


@pytest.mark.parametrize("kernel", [_kernel_2_10, _kernel_2_11], ids=["torch-2.10", "torch-2.11+"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_native_kernel_is_called_as_its_torch_release_takes_it(kernel, kv_heads: int) -> None:
    """torch.nn.attention.varlen.varlen_attn changed its keywords between releases (is_causal in 2.10;
    window_size and enable_gqa later): each is called with its own, grouped heads repeated for 2.10's.
    The CUDA kernel itself runs in tests/cuda (on a GPU machine)."""
    from odb.packed.attention import _native_call

    torch.manual_seed(0)
    bounds = [0, 5, 6, 19, 30]
    q = torch.randn(1, 4, 30, 8, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, 30, 8, dtype=torch.float64) for _ in range(2))
    assert torch.allclose(_native_call(kernel, q, k, v, bounds, None, None), _alone(q, k, v, bounds), atol=1e-12)
