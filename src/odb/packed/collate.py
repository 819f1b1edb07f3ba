"""PackedCollate: a planned group of samples as one padding-free row (``layout="packed"``).

The row holds the samples end to end. ``position_ids`` restart at every sample, which
is how HuggingFace models find the sample boundaries of a packed row (transformers'
``masking_utils.find_packed_sequence_indices`` turns them into a block-diagonal causal
mask for ``sdpa``, ``eager`` and ``flex_attention``; the flash-attention kernels take
the same boundaries from ``position_ids`` or from ``cu_seq_lens_*``). Each sample's
first label is masked: the model shifts labels inside, so the last token of one
sample would otherwise be trained to predict the first token of the next.

Vision-language samples keep their images (``odb.packed.vision``): per-image fields
concatenated in row order and, for models with 3-D rotary positions (the Qwen2-VL
family), the model's own position ids per sample (``PackedCollate.for_model(model)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

import torch

from odb.data.vision_fields import IMAGE_FIELDS, TOKEN_FIELDS

_VISION_KEYS = IMAGE_FIELDS + TOKEN_FIELDS
Backend = Literal["auto", "transformers", "torch"]


class PackedCollate:
    """Collate samples into one padding-free row, in the form HF models and attention kernels accept.

    Each sample is a mapping with 1-D ``input_ids`` (a list, array or tensor) and
    optionally ``labels`` of the same length (default: its input_ids). The batch:

    - ``input_ids`` (1, T) int64: the samples end to end (T: their total length);
    - ``labels`` (1, T) int64: each sample's labels, its first one set to ``ignore_index``;
    - ``position_ids`` (1, T) int64: ``position_ids_start``, +1, ... restarting at each sample;
    - ``use_cache``: False (unless ``use_cache=None``). transformers builds the packed
      mask from position_ids only when the forward has no KV cache, and a model whose
      ``config.use_cache`` is True (Llama's default) makes one even in training: its
      packed samples would attend to each other. Passing ``use_cache=False`` with the
      batch keeps them apart;
    - with ``return_flash_attn_kwargs``: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32
      sample boundaries) and ``max_length_q`` / ``max_length_k`` (ints);
    - with ``return_seq_idx``: ``seq_idx`` (1, T) int32, the sample number of each token;
    - the samples' images: each per-image field (``pixel_values``, ``image_grid_thw``,
      ``image_sizes``, their video equivalents; ``odb.data.vision_fields.IMAGE_FIELDS``)
      concatenated along dim 0 in row order, as a padded batch holds them; token-aligned
      fields (``mm_token_type_ids``, ``token_type_ids``) as (1, T) rows;
    - with ``rope_index`` (``PackedCollate.for_model(model)`` sets the model's own for
      the Qwen2-VL family): ``position_ids`` (4, 1, T), the restarting 1-D positions
      above, then each sample's 3-D (temporal, height, width) positions as it has them
      alone. A collate not made for a model (``model`` None) refuses samples with
      ``image_grid_thw``, ``video_grid_thw`` or ``mm_token_type_ids``: they come from a
      processor whose model may compute 3-D positions that would run on across the row.

    Other sample fields (``attention_mask``, counts such as ``num_image_patches``) are
    dropped. ``backend="auto"`` uses transformers'
    ``DataCollatorWithFlattening`` when transformers is installed, else a torch-only
    implementation that gives the same tensors.

    Example:
        >>> collate = PackedCollate(backend="torch")
        >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}])
        >>> batch["input_ids"].tolist(), batch["labels"].tolist(), batch["position_ids"].tolist()
        ([[5, 6, 7, 8, 9]], [[-100, 6, 7, -100, 9]], [[0, 1, 2, 0, 1]])
    """

    def __init__(self, *, ignore_index: int = -100, use_cache: Optional[bool] = False,
                 return_flash_attn_kwargs: bool = False, return_seq_idx: bool = False, position_ids_start: int = 0,
                 backend: Backend = "auto", rope_index: Optional[Callable[..., torch.Tensor]] = None,
                 model: Optional[str] = None, sample_multiple: int = 1, pad_token_id: int = 0) -> None:
        if backend not in ("auto", "transformers", "torch"):
            raise ValueError(f"PackedCollate(backend={backend!r}): must be 'auto', 'transformers' or 'torch'. "
                             f"Fix: pass backend='auto' (transformers' DataCollatorWithFlattening when installed).")
        self.ignore_index = int(ignore_index)
        self.use_cache = use_cache
        self.return_flash_attn_kwargs = bool(return_flash_attn_kwargs)
        self.return_seq_idx = bool(return_seq_idx)
        self.position_ids_start = int(position_ids_start)
        self.backend = backend
        if rope_index is not None and self.position_ids_start != 0:
            raise ValueError(f"PackedCollate(rope_index={rope_index!r}, position_ids_start={position_ids_start}): "
                             f"a model's 3-D positions start at 0 in every sample, and the row's 1-D positions must "
                             f"match them. Fix: leave position_ids_start at 0.")
        self.rope_index = rope_index
        self.model = model  # the model class the collate was made for (PackedCollate.for_model)
        if isinstance(sample_multiple, bool) or not isinstance(sample_multiple, int) or sample_multiple < 1:
            raise ValueError(f"PackedCollate(sample_multiple={sample_multiple!r}): must be an int >= 1. Fix: pass 1 "
                             f"(no padding), or the multiple context parallelism needs (2 x cp).")
        if sample_multiple > 1 and rope_index is not None:
            raise ValueError(f"PackedCollate(sample_multiple={sample_multiple}) with a model's 3-D rope index: odb "
                             f"cannot pad a vision-language sample inside a packed row. Fix: layout='padded' under "
                             f"context parallelism for this model.")
        # each sample padded to a multiple (pad_token_id, labels ignore_index, positions running on): what a
        # context-parallel sharding of packed rows needs, every sample split evenly (odb.packed.context)
        self.sample_multiple, self.pad_token_id = int(sample_multiple), int(pad_token_id)
        self._flatten = _transformers_collator(self) if backend != "torch" else None
        if backend == "transformers" and self._flatten is None:
            raise ImportError("PackedCollate(backend='transformers') needs a transformers whose "
                              "DataCollatorWithFlattening takes return_seq_idx and position_ids_start (5.23 does; "
                              f"{_transformers_version()} does not). Fix: upgrade transformers, or pass "
                              "backend='auto' (falls back to odb's torch collate, which gives the same rows) or 'torch'.")

    @classmethod
    def for_model(cls, model: Any, **options: Any) -> "PackedCollate":
        """The collate of ``model``'s packed rows: with its 3-D rope index where it has one (Qwen2-VL family).

        ``options`` are ``PackedCollate``'s other arguments.

        Example:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
            >>> PackedCollate.for_model(llama).rope_index is None   # 1-D positions
            True
        """
        from odb.packed.vision import rope_index_for, unwrap

        return cls(rope_index=rope_index_for(model), model=type(unwrap(model)).__name__, **options)

    def __call__(self, samples: Sequence[Any]) -> Dict[str, Any]:
        features = [self._padded(_feature(k, s)) for k, s in enumerate(samples)]
        if not features:
            raise ValueError("PackedCollate got no samples: a packed row needs at least one. Fix: collate a "
                             "non-empty group (odb never emits an empty one).")
        # Empty samples (0 tokens) add nothing to the row; a row of empty samples only holds one unsupervised
        # token, so that the model runs it (a zero-length input fails in most models) and learns nothing.
        row = [f for f in features if len(f["input_ids"])] or [
            {"input_ids": torch.zeros(1, dtype=torch.int64), "labels": torch.full((1,), self.ignore_index)}]
        if self._flatten is not None and (all("labels" in f for f in row) or not any("labels" in f for f in row)):
            batch = dict(self._flatten(row))
        else:
            batch = self._torch(row)
        if self.rope_index is not None or any(isinstance(s, Mapping) and any(
                s.get(k) is not None for k in _VISION_KEYS) for s in samples):
            from odb.packed.vision import carry_images

            carry_images(batch, samples, [len(f["input_ids"]) for f in features], self.rope_index,
                         for_model=self.model is not None)
        if self.use_cache is not None:
            batch["use_cache"] = self.use_cache
        return batch

    def _padded(self, feature: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A sample padded to ``sample_multiple`` tokens (its labels, made from its input_ids where it has none,
        with ``ignore_index``)."""
        extra = -len(feature["input_ids"]) % self.sample_multiple
        if not extra:
            return feature
        ids = feature["input_ids"]
        labels = feature.get("labels", ids)
        return {"input_ids": torch.cat((ids, torch.full((extra,), self.pad_token_id, dtype=ids.dtype))),
                "labels": torch.cat((labels, torch.full((extra,), self.ignore_index, dtype=labels.dtype)))}

    def _torch(self, features: List[Dict[str, torch.Tensor]]) -> Dict[str, Any]:
        ids = torch.cat([f["input_ids"] for f in features])
        labels = torch.cat([f.get("labels", f["input_ids"]) for f in features]).clone()
        sizes = torch.tensor([len(f["input_ids"]) for f in features])
        starts = torch.cumsum(sizes, 0) - sizes
        labels[starts] = self.ignore_index
        positions = torch.arange(len(ids)) - torch.repeat_interleave(starts, sizes) + self.position_ids_start
        batch: Dict[str, Any] = {"input_ids": ids[None], "labels": labels[None], "position_ids": positions[None]}
        if self.return_flash_attn_kwargs:
            cu = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0))).to(torch.int32)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
            batch["max_length_q"] = batch["max_length_k"] = int(sizes.max())
        if self.return_seq_idx:
            batch["seq_idx"] = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), sizes)[None]
        return batch


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "no installed transformers"
    return f"transformers {transformers.__version__}"


def _transformers_collator(c: PackedCollate) -> Any:
    """transformers' DataCollatorWithFlattening with these options, or None where it is missing or older."""
    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:
        return None
    try:
        return DataCollatorWithFlattening(return_tensors="pt", separator_id=c.ignore_index,
                                          return_flash_attn_kwargs=c.return_flash_attn_kwargs,
                                          return_seq_idx=c.return_seq_idx, position_ids_start=c.position_ids_start)
    except TypeError:  # an older transformers without some of these options
        return None


def _feature(k: int, sample: Any) -> Dict[str, torch.Tensor]:
    """input_ids (and labels, when the sample has them) of sample k as 1-D int64 tensors, checked."""
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        what = f"fields {list(sample)}" if isinstance(sample, Mapping) else f"type {type(sample).__name__}"
        raise TypeError(f"PackedCollate: sample {k} has {what}; a packed row needs a mapping with input_ids "
                        f"(and optionally labels). Fix: return dicts with 1-D input_ids from the dataset.")
    out = {key: torch.as_tensor(sample[key], dtype=torch.int64) for key in ("input_ids", "labels")
           if key in sample and sample[key] is not None}
    ids = out["input_ids"]
    if ids.dim() != 1:
        raise ValueError(f"PackedCollate: sample {k} has input_ids of shape {tuple(ids.shape)}; a packed row joins "
                         f"1-D samples. Fix: tokenize without return_tensors (or squeeze(0)).")
    if "labels" in out and out["labels"].shape != ids.shape:
        raise ValueError(f"PackedCollate: sample {k} has labels of shape {tuple(out['labels'].shape)} but input_ids "
                         f"of shape {tuple(ids.shape)}; in a packed row each label sits under its token. Fix: give "
                         f"every sample one label per input id (ignore_index where unsupervised).")
    return out


def check_context_collate(cfg: Any, collate: Any) -> None:
    """Refuse a packed layout under context parallelism whose collate does not pad each sample of a row to the
    multiple the sharding needs (``cfg.length_multiple``): the shards of a sample would not be even."""
    if cfg.layout != "packed" or cfg.context_parallel == 1:
        return
    multiple = getattr(collate, "sample_multiple", None) if isinstance(collate, PackedCollate) else None
    if multiple is None or multiple % cfg.length_multiple:
        raise ValueError(f"odb got layout='packed' with context_parallel={cfg.context_parallel} and collate_fn="
                         f"{collate!r}: a packed row is cut sample by sample over the CP ranks, so each sample's "
                         f"length must be a multiple of {cfg.length_multiple}. Fix: leave collate_fn out (odb's "
                         f"PackedCollate pads each sample), or pass odb.PackedCollate(sample_multiple="
                         f"{cfg.length_multiple}, ...).")
