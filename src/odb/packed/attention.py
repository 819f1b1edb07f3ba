"""Attention over a packed row that costs what its samples cost (``"odb_varlen"``; measured on CPU).

A packed row of T tokens holding samples of lengths L1..Ln needs causal attention inside
each sample only. transformers' ``sdpa`` and ``eager`` get this right with a dense
T x T block-diagonal mask, so they do the work of one T-token sample (T^2) where the
samples need sum(Li^2): on a 4096-token row of 200-token samples, 20 times too much,
and more than the padded batch of the same samples pays. The flash-attention kernels
(``flash_attention_2``/``3``) do it right on CUDA, where flash-attn is installed.

``varlen_causal_attention`` runs ``torch.nn.functional.scaled_dot_product_attention``
once per sample with ``is_causal=True``: exact, no mask built, the cost of the samples,
on CPU and on a GPU alike (tested on CPU in CI; tests/cuda ran once on an H200). On CUDA tensors in half precision without dropout it calls
PyTorch's own flash kernel for packed rows, ``torch.nn.attention.varlen.varlen_attn``,
once per row instead, where the installed torch has it (``native_varlen``).
``register_varlen_attention()`` adds it to transformers as the
attention implementation ``"odb_varlen"``: the boundaries come from ``cu_seq_lens_q``
when the batch has them, else from the restarting ``position_ids`` (as flash-attention
reads them). A batch with a padding mask, or a query shorter than its keys (a KV
cache), goes to transformers' own ``sdpa`` unchanged. Causal softmax attention, with
or without a sliding window; a layer that asks for logit soft-capping, attention sinks
or the attention weights is refused with the fix.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

NAME = "odb_varlen"


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens: Sequence[int], *, scale: Optional[float] = None,
                            dropout_p: float = 0.0, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention inside each sample of a packed row; shapes as ``scaled_dot_product_attention``.

    Args:
        query: (H, T, D) or (1, H, T, D), T the row's length.
        key, value: the same, with Hkv heads (H a multiple of Hkv: grouped-query attention).
        cu_seqlens: sample boundaries, 0 = b0 < b1 < ... < bn = T (``cu_seq_lens_q`` of
            ``PackedCollate(return_flash_attn_kwargs=True)``).
        scale: the softmax scale (default 1/sqrt(D)).
        dropout_p: attention dropout (training only; pass 0.0 in eval).
        window: a sliding window: token t sees the tokens t - window + 1 .. t of its sample
            (transformers' ``sliding_window``); None: all of them.

    Returns:
        The output, shaped as ``query``: token t of sample i attends to the tokens of
        sample i up to t, never to another sample.

    Example:
        >>> q = torch.randn(2, 5, 4)
        >>> out = varlen_causal_attention(q, q, q, [0, 3, 5])
        >>> alone = torch.nn.functional.scaled_dot_product_attention(q[:, 3:], q[:, 3:], q[:, 3:], is_causal=True)
        >>> torch.allclose(out[:, 3:], alone)
        True
    """
    bounds = [int(b) for b in cu_seqlens]
    length = query.shape[-2]
    if not bounds or bounds[0] != 0 or bounds[-1] != length or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"varlen_causal_attention: cu_seqlens={bounds[:8]}{'...' if len(bounds) > 8 else ''} must "
                         f"rise strictly from 0 to the row's length {length}. Fix: pass the sample boundaries of "
                         f"the row (cu_seq_lens_q of PackedCollate(return_flash_attn_kwargs=True)).")
    if window is not None and window < 1:
        raise ValueError(f"varlen_causal_attention: window={window} must be at least 1 (or None: no window).")
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        # As autocast casts scaled_dot_product_attention's inputs: under bf16 autocast a Llama's rotary
        # embedding hands over float32 queries, which would miss the half-precision kernel.
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = (x.to(dtype) for x in (query, key, value))
    native = native_varlen(query, dropout_p, window)
    if native is not None:
        return _native_call(native, query, key, value, bounds, scale, window)
    gqa = {"enable_gqa": True} if key.shape[-3] != query.shape[-3] else {}

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[-2]
        if window is None or n <= window:  # the window reaches the sample's start: plain causal
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, **gqa)
        pos = torch.arange(n, device=q.device)
        gap = pos[:, None] - pos[None, :]
        mask = (gap >= 0) & (gap < window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **gqa)

    if len(bounds) == 2:
        return causal(query, key, value)
    # split, not slicing: the backward of a split is one cat, that of n slices n full-size zero tensors.
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    parts = [causal(q, k, v) for q, k, v in zip(query.split(sizes, dim=-2), key.split(sizes, dim=-2),
                                                 value.split(sizes, dim=-2))]
    return torch.cat(parts, dim=-2)


def native_varlen(query: torch.Tensor, dropout_p: float = 0.0,
                  window: Optional[int] = None) -> Optional[Callable[..., torch.Tensor]]:
    """PyTorch's ``torch.nn.attention.varlen.varlen_attn`` where it applies to ``query``, else None.

    It runs one flash-attention kernel over the whole row, but only on CUDA tensors in
    float16/bfloat16 and without dropout (and only in a torch that has it, with a sliding
    ``window`` only in one whose kernel takes ``window_size``: torch 2.10's does not);
    everything else takes the per-sample ``scaled_dot_product_attention`` path.

    Example:
        >>> native_varlen(torch.randn(2, 5, 4)) is None  # a CPU tensor: the per-sample path
        True
    """
    if not query.is_cuda or dropout_p > 0.0 or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # an older torch has no varlen_attn
        return None
    if window is not None and "window_size" not in _varlen_params(varlen_attn):
        return None
    return varlen_attn  # type: ignore[no-any-return]


def _native_call(varlen_attn: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, bounds: List[int], scale: Optional[float], window: Optional[int]) -> torch.Tensor:
    """One ``varlen_attn`` call over the row: (H, T, D) in, as (T, H, D) the kernel takes, and back.

    torch 2.10's ``varlen_attn`` takes ``is_causal`` and no window or grouped heads; later ones take
    ``window_size`` (``(-1, 0)`` is causal) and ``enable_gqa``. Grouped key/value heads are repeated for
    a kernel without ``enable_gqa``; a sliding window never reaches a kernel without ``window_size``.
    """
    params = _varlen_params(varlen_attn)
    q, k, v = (x.reshape(x.shape[-3:]).transpose(0, 1).contiguous() for x in (query, key, value))
    kwargs: dict = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    else:  # torch 2.10: causal only (native_varlen sends a window to the per-sample path)
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)
    return out.transpose(0, 1).reshape(query.shape)


@functools.lru_cache(maxsize=4)
def _varlen_params(varlen_attn: Callable[..., torch.Tensor]) -> frozenset:
    """The keyword names the installed ``varlen_attn`` takes (its signature changed between releases)."""
    try:
        return frozenset(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return frozenset()


def register_varlen_attention() -> str:
    """Register ``"odb_varlen"`` with transformers (attention and mask); return the name.

    Idempotent. Pass the name as ``attn_implementation`` when building the model, or set
    it on a built one with ``model.set_attn_implementation(name)``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> name = register_varlen_attention()
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, attn_implementation=name))
        >>> from odb import check_packed_model
        >>> check_packed_model(model) < 1e-4
        True
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _hf_attention)
    AttentionMaskInterface.register(NAME, _hf_mask)
    return NAME


def _hf_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
             attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """No mask where the row's boundaries say it all (as for flash-attention); ``sdpa``'s mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    plain = q_length == kv_length and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
    if plain and (attention_mask is None or bool(attention_mask[:, -kv_length:].all())):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def _hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention interface: (B, H, T, D) in, (B, T, H, D) out."""
    for what in ("softcap", "output_attentions", "s_aux"):
        if kwargs.get(what) is not None and kwargs.get(what) is not False:
            raise ValueError(f"attn_implementation={NAME!r} computes causal softmax attention only; this layer of "
                             f"{type(module).__name__} asks for {what}={kwargs[what]!r}. Fix: use "
                             f"'flash_attention_2' (CUDA) or 'eager' for this model.")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if attention_mask is not None or query.shape[2] != key.shape[2] or not getattr(module, "is_causal", True):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows = _boundaries(query.shape[0], query.shape[2], kwargs)
    # 4-D slices (1, H, T, D): the CPU flash kernel of scaled_dot_product_attention takes 4-D inputs only.
    out = [varlen_causal_attention(query[b:b + 1], key[b:b + 1], value[b:b + 1], bounds, scale=scaling,
                                   dropout_p=dropout, window=window) for b, bounds in enumerate(rows)]
    return torch.cat(out).transpose(1, 2).contiguous(), None


def _boundaries(batch: int, length: int, kwargs: Any) -> List[List[int]]:
    """Each row's sample boundaries: ``cu_seq_lens_q`` (one row), else where ``position_ids`` do not rise by 1."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and batch == 1:
        return [[int(b) for b in cu.tolist()]]
    positions = kwargs.get("position_ids")
    if positions is None:
        return [[0, length]] * batch
    positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
    starts = torch.diff(positions, dim=-1) != 1
    return [[0] + (torch.nonzero(row).flatten() + 1).tolist() + [length] for row in starts]
