"""Images in a packed row: the per-image tensors in row order, and 3-D (mrope) position ids per sample.

A packed row of vision-language samples keeps each sample's images: every per-image field
(``odb.data.vision_fields.IMAGE_FIELDS``: ``pixel_values``, ``image_grid_thw``, ...) is
concatenated along its first dimension in row order, as a padded batch does, so the model
scatters the image features into the row's placeholder tokens in the samples' order; the
vision tower encodes each image alone (Qwen2-VL's attention is split per image by
``image_grid_thw``, LLaVA's CLIP takes one image per batch entry).

Models of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...) give image
tokens 3-D rotary positions (temporal, height, width) and compute them inside their
forward with ``get_rope_index``, over the whole sequence: on a packed row, the samples
after the first would continue the first's positions. Their text model reads a packed
row from ``position_ids`` of 4 rows, ``[text; t; h; w]``: row 0 the 1-D positions that
restart per sample (the sample boundaries, for the attention mask or ``odb_varlen``),
rows 1-3 the 3-D positions. ``RopeIndex`` runs the model's own ``get_rope_index`` on each
sample alone, so each sample's positions are those it has alone.

Example:
    >>> import torch
    >>> from odb.bench.vlm_data import build_model
    >>> rope = rope_index_for(build_model("qwen2_vl"))
    >>> rope(torch.tensor([5, 6, 7])).tolist()   # text alone: 0, 1, 2 on all three axes
    [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    >>> rope_index_for(build_model("llava")) is None   # 1-D positions: the plain packed row
    True
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from odb.data.vision_fields import TOKEN_FIELDS, image_fields


class _ConfigHost:
    """Stands in for the module that owns ``get_rope_index``: its config, and its class's methods bound to this.

    ``get_rope_index`` reads only the config (merge sizes, token ids) and calls sibling
    methods (``get_vision_position_ids``), never weights; a method that reaches for
    anything else fails here with an ``AttributeError`` naming it.
    """

    def __init__(self, owner: type, config: Any) -> None:
        self.config = config
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        owner = self.__dict__.get("_owner")
        if owner is None or name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(owner, name)
        return types.MethodType(attr, self) if inspect.isfunction(attr) else attr


class RopeIndex:
    """A model's own 3-D rope index (``get_rope_index``) for one sample; picklable (class and config only).

    Call it with a sample's 1-D ``input_ids`` and its fields (``mm_token_type_ids``,
    ``image_grid_thw``, ``video_grid_thw``, ``second_per_grid_ts``, where the sample has
    them); it returns the (3, L) int64 positions the model computes for that sample
    alone. ``mm_token_type_ids`` missing: derived from the config's image and video token
    ids, for the grids given.
    """

    def __init__(self, owner: type, config: Any, model_name: str) -> None:
        self.owner, self.config, self.model_name = owner, config, model_name
        self.params = frozenset(inspect.signature(owner.get_rope_index).parameters)

    def __call__(self, input_ids: torch.Tensor, **fields: Optional[torch.Tensor]) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1)
        kinds = fields.get("mm_token_type_ids")
        if kinds is None:  # as the processor marks them: the placeholder tokens of the images and videos given
            kinds = torch.zeros_like(ids)
            for kind, key, grid in ((1, "image_token_id", "image_grid_thw"), (2, "video_token_id", "video_grid_thw")):
                token = getattr(self.config, key, None)
                if token is not None and fields.get(grid) is not None:
                    kinds[ids == token] = kind
        kwargs = {k: torch.as_tensor(v) for k, v in fields.items()
                  if k in self.params and k != "mm_token_type_ids" and v is not None}
        host = _ConfigHost(self.owner, self.config)
        positions, _ = self.owner.get_rope_index(host, ids, mm_token_type_ids=torch.as_tensor(kinds).reshape(1, -1),
                                                 attention_mask=None, **kwargs)
        return positions[:, 0].to(torch.int64)

    def __repr__(self) -> str:
        return f"RopeIndex({self.model_name})"


def unwrap(model: Any) -> Any:
    """The model inside DDP/FSDP-style wrappers (``.module``)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def rope_index_for(model: Any) -> Optional[RopeIndex]:
    """``model``'s 3-D rope index (a ``RopeIndex``) where it computes one (``get_rope_index``); else None.

    Looks through wrappers (``.module``) and at the model and its inner ``.model``.
    """
    model = unwrap(model)
    for part in (model, getattr(model, "model", None)):
        if part is not None and callable(getattr(type(part), "get_rope_index", None)):
            return RopeIndex(type(part), part.config, type(model).__name__)
    return None


_GRIDS = ("image_grid_thw", "video_grid_thw")  # what the processors of 3-D rope models return with images


def carry_images(batch: Dict[str, Any], samples: Sequence[Mapping], sizes: Sequence[int],
                 rope: Optional[Callable[..., torch.Tensor]], for_model: bool = False) -> None:
    """Add the samples' image and token-aligned fields to the packed ``batch``; with ``rope``, 4-row position_ids.

    ``sizes``: each sample's token count. Per-image fields are concatenated along dim 0
    in row order (samples without the field add nothing); token-aligned fields
    (``mm_token_type_ids``) along the row, 0 for samples without them. With ``rope``
    (a ``RopeIndex``), ``position_ids`` become (4, 1, T): the batch's restarting 1-D
    positions, then each sample's 3-D positions alone.

    Raises:
        ValueError: a token-aligned field of another length than its sample's input_ids,
            or, from a collate not made for its model (``for_model`` False), samples as a 3-D
            rope model's processor makes them (``image_grid_thw``, ``video_grid_thw``,
            ``mm_token_type_ids``) without ``rope``.
    """
    for key in image_fields(samples):
        batch[key] = torch.cat([torch.as_tensor(s[key]) for s in samples if s.get(key) is not None])
    for key in TOKEN_FIELDS:
        if all(s.get(key) is None for s in samples):
            continue
        parts = []
        for k, (s, n) in enumerate(zip(samples, sizes)):
            part = torch.as_tensor(s[key]).reshape(-1) if s.get(key) is not None else torch.zeros(n, dtype=torch.int64)
            if len(part) != n:
                raise ValueError(f"PackedCollate: sample {k} has {key} of {len(part)} entries but {n} input_ids; a "
                                 f"packed row places one {key} under each token. Fix: keep {key} as the processor "
                                 f"returns it for the sample (1-D, one per input id).")
            parts.append(part)
        batch[key] = torch.cat(parts)[None]
    if rope is None:
        signs = [k for k in _GRIDS + ("mm_token_type_ids",) if k in batch]
        if signs and not for_model:
            raise ValueError(f"PackedCollate: the samples carry {', '.join(signs)}, as the processors of models with "
                             f"3-D (mrope) rotary positions make them (the Qwen2-VL family), and this collate was not "
                             f"made for the model: such a model computes its position ids over the whole sequence, "
                             f"so in a packed row every sample after the first would continue the first's positions "
                             f"(and Qwen2-VL's samples would attend to each other). Fix: collate with "
                             f"odb.PackedCollate.for_model(model), which runs the model's own rope index per sample "
                             f"(and is the plain row for a model without 3-D positions).")
        return
    rows = []
    for s in samples:
        grid = {k: s.get(k) for k in ("mm_token_type_ids",) + _GRIDS + ("second_per_grid_ts",)}
        rows.append(rope(s["input_ids"], **grid))
    batch["position_ids"] = torch.cat((batch["position_ids"].reshape(1, 1, -1), torch.cat(rows, dim=1)[:, None]))
