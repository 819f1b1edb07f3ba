"""Does a model keep the samples of a packed row apart? A probe, and a refusal with the reason.

A packed row is only exact when every sample sees itself alone: the model must turn
the restarting ``position_ids`` (or ``cu_seq_lens_*``) into sample boundaries. Many
do (in transformers 5: Llama, Mistral, Qwen2/3, Gemma, GPT-2, GPT-NeoX, OLMo, Phi,
... with ``sdpa`` and ``eager``), some do not (OPT, Bloom, Mamba), and one setting
breaks those that do: a KV cache in the forward (``config.use_cache=True``, Llama's
default, even in training) makes transformers skip the packed-row detection.
``check_packed_model`` runs the model once on a small packed row and on each of its
samples alone and refuses it, with the reason, when the logits differ.

``prepare_packed_model`` is what odb's trainer integrations run when they train on
packed rows: a model exact only through a dense mask of the whole row (``sdpa``,
``eager``: T^2 attention per row of T tokens, slower than the padded batch of the same
samples) is switched to odb's per-sample attention ``odb_varlen`` (exact: it is probed
like any other), and the switch is logged once; ``attention="model"`` keeps the
model's own attention.
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from odb.packed.collate import PackedCollate
from odb.private_api import read
from odb.packed.image_probe import has_vision, image_refusal
from odb.packed.vision import rope_index_for


_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # models already told that their mask is dense
_DENSE = ("sdpa", "eager")  # transformers' attentions that isolate packed samples through a T x T mask
PACKED_ATTENTION = ("odb_varlen", "model")
logger = logging.getLogger(__name__)


class PackedLayoutError(ValueError):
    """The model mixes the samples of a packed row: use layout="padded" for it, or the fix named."""


def check_packed_model(model: Any, collate: Optional[PackedCollate] = None, *, atol: Optional[float] = None,
                       lengths: Tuple[int, ...] = (13, 7, 20), seed: int = 0,
                       samples: Optional[Sequence[Any]] = None) -> float:
    """Refuse a model whose packed samples see each other; return the largest difference found.

    Packs random samples of ``lengths`` tokens into one row with ``collate`` (default
    ``PackedCollate()``, as the loader builds rows), runs the model on it and on each
    sample alone (``eval()`` and ``no_grad``; the training mode is restored), and
    compares each sample's logits. Costs a forward of ``sum(lengths)`` tokens plus one
    per sample. Call it once before training with ``layout="packed"``. A model that is
    exact only through a dense mask of the whole row (``sdpa``, ``eager``) passes with a
    ``UserWarning`` (once per model) naming the faster implementations.

    A vision-language model (one with a ``vision_config``) is probed with images too
    (``odb.packed.image_probe``): a packed row of up to three of ``samples`` (two with
    images) against each alone; with no sample carrying images, only the models whose
    packed rows with images tests/vlm checks (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) pass.

    Args:
        model: a causal LM taking ``input_ids`` and ``position_ids`` and returning ``logits``.
        collate: the collate that will build the rows (its ``use_cache``, flash-attention
            kwargs and rope index are what the probe passes too). Default:
            ``PackedCollate.for_model(model)``.
        atol: the largest absolute difference accepted, times max(1, the largest logit).
            Default 1e-4 for float32/float64 logits, 3e-2 for 16-bit ones.
        lengths: token counts of the probe's samples.
        seed: seed of the probe's random tokens.
        samples: real samples of the training data (a few; those with images matter), for
            a vision-language model's image probe.

    Raises:
        PackedLayoutError: naming the model, its attention implementation, the difference
            and the reason (a KV cache in the forward, no ``position_ids`` argument, 3-D
            rotary positions the collate does not build, an attention that ignores the
            boundaries, images that do not pack), with the fix.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> model.set_attn_implementation("eager")   # exact, but a dense mask: a UserWarning says so
        >>> check_packed_model(model) < 1e-4
        True
        >>> check_packed_model(model, PackedCollate(use_cache=None))   # Llama's config.use_cache=True
        Traceback (most recent call last):
        ...
        odb.packed.models.PackedLayoutError: ...KV cache...
    """
    collate = collate if collate is not None else PackedCollate.for_model(model)
    name = _describe(model)
    forward = inspect.signature(model.forward).parameters
    if "position_ids" not in forward and not any(p.kind == p.VAR_KEYWORD for p in forward.values()):
        raise PackedLayoutError(f"odb refuses layout='packed' for {name}: its forward takes no position_ids, so it "
                                f"cannot tell where the samples of a packed row begin. Fix: use layout='padded'.")
    _refuse_without_rope(model, collate, name)
    diff, tol = _probe(model, collate, atol, lengths, seed)
    if diff <= tol:
        if has_vision(model):
            images, refusal = image_refusal(model, collate, samples, name, tol)
            if refusal is not None:
                raise PackedLayoutError(refusal)
            diff = max(diff, images)
        _warn_dense_mask(model, name)
        return diff
    reason = ("the model does not turn the restarting position_ids into sample boundaries: its tokens see the "
              "samples before them in the row (through attention, or a recurrent state)")
    fix = ("use layout='padded' for this model, or an attention implementation that isolates packed samples "
           "(docs/packing.md lists the measured ones)")
    if collate.use_cache is not False and getattr(getattr(model, "config", None), "use_cache", False):
        no_cache = PackedCollate(ignore_index=collate.ignore_index, use_cache=False,
                                 return_flash_attn_kwargs=collate.return_flash_attn_kwargs,
                                 return_seq_idx=collate.return_seq_idx, position_ids_start=collate.position_ids_start,
                                 rope_index=collate.rope_index)
        if _probe(model, no_cache, atol, lengths, seed)[0] <= tol:
            reason = ("the forward builds a KV cache (config.use_cache=True) and transformers detects packed rows "
                      "from position_ids only without one")
            fix = "keep PackedCollate(use_cache=False) (the default) or set model.config.use_cache = False"
    raise PackedLayoutError(f"odb refuses layout='packed' for {name}: a packed sample's logits differ from its "
                            f"logits alone by {diff:.3g} (tolerance {tol:.3g}). Reason: {reason}. Fix: {fix}.")


def prepare_packed_model(model: Any, collate: Optional[PackedCollate] = None, *,
                         attention: str = "odb_varlen", samples: Optional[Sequence[Any]] = None) -> str:
    """Ready ``model`` for packed rows; return the attention implementation it will train with.

    ``attention="odb_varlen"`` (default): a model whose attention is ``sdpa`` or ``eager``
    (exact on packed rows only through a dense T x T mask) is switched to odb's
    ``"odb_varlen"`` (``odb.register_varlen_attention``: attention per sample, the cost
    of the samples), with one log line (logger ``odb.packed.models``, level WARNING)
    saying so and how to keep the old one. Padded batches (evaluation, generation with a
    KV cache) still run ``sdpa`` under that name. Where the switch is not possible (a
    model that cannot change its attention, a layer odb_varlen does not compute:
    soft-capping, attention sinks) the model keeps its attention and the log says why.
    ``attention="model"``: keep the model's attention. Then the model is probed
    (``check_packed_model`` with ``samples``, which warns about a dense mask kept).

    Raises:
        PackedLayoutError: the model mixes packed samples (see ``check_packed_model``).
        ValueError: ``attention`` is not one of ``"odb_varlen"``, ``"model"``.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
        >>> prepare_packed_model(model)
        'odb_varlen'
    """
    if attention not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention={attention!r} is not one of {PACKED_ATTENTION}. Rule: 'odb_varlen' "
                         f"switches an sdpa/eager model to per-sample attention on packed rows, 'model' keeps the "
                         f"model's own. Fix: pass packed_attention='odb_varlen' (default) or 'model'.")
    collate = collate if collate is not None else PackedCollate.for_model(model)
    _refuse_without_rope(model, collate, _describe(model))  # before any switch: the attention is not the cause
    impl = _attn_impl(model)
    if attention == "odb_varlen" and impl in _DENSE and _switch_to_varlen(model, impl, collate, samples):
        return _attn_impl(model)
    check_packed_model(model, collate, samples=samples)
    return _attn_impl(model)


def _switch_to_varlen(model: Any, impl: str, collate: Optional[PackedCollate],
                      samples: Optional[Sequence[Any]]) -> bool:
    """Set odb_varlen on the model and probe it; put ``impl`` back (and say why) when that fails."""
    from odb.packed.attention import register_varlen_attention

    name, label = register_varlen_attention(), type(model).__name__
    setter = getattr(model, "set_attn_implementation", None)
    why = "it has no set_attn_implementation"
    if setter is not None:
        try:
            setter(name)
            why = "transformers cannot change its attention implementation after loading"
        except Exception as err:  # transformers refuses a model that cannot use a custom attention
            why = f"set_attn_implementation refused it ({err})"
    if _attn_impl(model) == name:
        try:
            check_packed_model(model, collate, samples=samples)
        except Exception as err:  # a layer odb_varlen cannot compute (soft-capping, sinks), or samples still mixed
            setter(impl)
            why = f"the probe failed with it ({err})"
        else:
            logger.warning(f"odb: {label} trains on packed rows, so its attention is switched from {impl!r} to "
                           f"{name!r}: attention per sample, exact and at the cost of the samples, where {impl!r} "
                           f"attends over a dense mask of the whole row (T^2 per row of T tokens; slower than padded "
                           f"batches). Padded batches (evaluation, generation) still run sdpa. To keep {impl!r}, "
                           f"pass packed_attention='model' to enable_odb.")
            return True
    logger.warning(f"odb: {label} keeps attn_implementation={impl!r} on packed rows: odb could not switch it to "
                   f"{name!r} because {why}.")
    return False


def _refuse_without_rope(model: Any, collate: PackedCollate, name: str) -> None:
    """A model with 3-D (mrope) positions and a collate that builds none: refused, whatever a probe says."""
    if collate.rope_index is None and rope_index_for(model) is not None:
        raise PackedLayoutError(
            f"odb refuses layout='packed' for {name} with a collate that builds no 3-D positions: the model gives "
            f"its tokens 3-D (mrope) rotary positions, which it computes in its forward over the whole sequence (an "
            f"image's tokens by their temporal, height and width place), and finds the samples of a packed row "
            f"only from position_ids of 4 rows ([text; t; h; w]). With 1-D position_ids, the images of every sample "
            f"after a row's first take positions that run on across the row (and, for Qwen2-VL, the row's samples "
            f"attend to each other). Fix: collate with odb.PackedCollate.for_model(model), which builds the 4-row "
            f"position_ids with the model's own rope index per sample.")


def _attn_impl(model: Any) -> Optional[str]:
    """The attention implementation of a transformers model's config (a private name, checked:
    odb.private_api); None for a model without a transformers config."""
    config = getattr(model, "config", None)  # a public attribute, absent from a plain torch module
    transformers = sys.modules.get("transformers")  # a transformers config exists only once it is imported
    if config is None or transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    return read(config, "PretrainedConfig", "_attn_implementation")


def _warn_dense_mask(model: Any, name: str) -> None:
    """Exact but slow: sdpa and eager attend over a dense mask of the whole row (a UserWarning, once per model)."""
    impl = _attn_impl(model)
    if impl in ("sdpa", "eager") and model not in _WARNED:
        warnings.warn(f"odb: {name} keeps packed samples apart, but through a dense block-diagonal mask over the "
                      f"whole row: a row of T tokens costs T^2 in attention, whatever its samples (a padded batch "
                      f"of the same samples is then faster). For packed rows that cost what their samples cost, use "
                      f"attn_implementation='flash_attention_2' (CUDA, flash-attn installed) or odb's "
                      f"'odb_varlen' (torch only, no flash-attn): model.set_attn_implementation(odb.register_varlen_attention()).",
                      UserWarning, stacklevel=3)
        _WARNED.add(model)


def _describe(model: Any) -> str:
    impl = _attn_impl(model)
    return f"{type(model).__name__}" + (f" (attn_implementation={impl!r})" if impl else "")


def _probe(model: Any, collate: PackedCollate, atol: Optional[float], lengths: Tuple[int, ...],
           seed: int) -> Tuple[float, float]:
    """(largest difference of a sample's logits packed vs alone, the tolerance)."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    vocab = _vocab_size(model)
    gen = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(0, vocab, (n,), generator=gen)} for n in lengths]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            row = _logits(model, collate(samples), device)[0]
            alone = [_logits(model, collate([s]), device)[0] for s in samples]
    finally:
        model.train(was_training)
    diff, scale, start = 0.0, 1.0, 0
    for n, ref in zip(lengths, alone):
        diff = max(diff, float((row[start:start + n].float() - ref.float()).abs().max()))
        scale = max(scale, float(ref.float().abs().max()))
        start += n
    if atol is None:
        atol = 1e-4 if row.dtype in (torch.float32, torch.float64) else 3e-2
    return diff, atol * scale


def _logits(model: Any, batch: Dict[str, Any], device: torch.device) -> torch.Tensor:
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out[0]


def _vocab_size(model: Any) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    return int(getattr(model.config, "vocab_size"))
