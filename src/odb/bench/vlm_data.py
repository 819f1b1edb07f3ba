"""Tiny vision-language models and image-bearing chat samples, built offline (tests and the benchmark).

Two real transformers model classes, built from configs with random weights, each with
its real processor:

- ``"qwen2_vl"``: ``Qwen2VLForConditionalGeneration`` and ``Qwen2VLProcessor`` with the
  PIL image processor (``Qwen2VLImageProcessorPil``). Images keep their aspect ratio:
  ``pixel_values`` is (patches, 3 * 2 * p * p) and ``image_grid_thw`` (images, 3), and
  an image of ``t x h x w`` patches becomes ``t*h*w / 4`` ``<|image_pad|>`` tokens.
- ``"llava"``: ``LlavaForConditionalGeneration`` (CLIP vision tower, Llama text model)
  and ``LlavaProcessor`` with ``LlavaImageProcessorPil``: every image is resized and
  cropped to one size, ``pixel_values`` is (images, 3, S, S), each image is
  ``(S / p)^2`` ``<image>`` tokens.

The pinned torch has no torchvision, and transformers' video processors (and its
"fast" image processors) need it, so the Qwen2-VL processor is built without a video
processor (``ImageOnlyQwen2VLProcessor``: the same class, images and text only).

The tokenizer is word level (``WORDS``), with the models' special tokens and a chat
template; ``vlm_samples`` builds chat samples, about half with 1-2 random-noise images
of random sizes, each processed alone: chat template, image-token expansion, the prompt
masked with -100 in ``labels``. ``pad_collate`` is the collator a user writes: pad the
text, concatenate ``pixel_values`` and ``image_grid_thw``.

Example:
    >>> samples = vlm_samples("qwen2_vl", 4, seed=0)
    >>> sorted(samples[1])
    ['attention_mask', 'image_grid_thw', 'image_patches', 'input_ids', 'labels', 'mm_token_type_ids', 'pixel_values']
    >>> batch = pad_collate(samples)
    >>> model = build_model("qwen2_vl", seed=0)
    >>> model(**batch).loss.dim()
    0
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from odb.data.vision_fields import image_patches

MODELS = ("qwen2_vl", "llava")
# Qwen2.5-VL and Qwen3-VL take the samples of Qwen2-VL's processor (same image patches, tokens and template
# here); build_model builds them too.
QWEN_FAMILY = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PATCHES_KEY = "image_patches"  # the samples' image-patch count (an int): pass it as image_patches_key
IGNORE = -100
PAD = "<pad>"

_QWEN_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>")
_LLAVA_SPECIAL = ("<image>", "</s>")
# Plain words: the text of the samples and the chat templates' role names.
WORDS = ("user", "assistant", "USER", "ASSISTANT", ":", "describe", "the", "image", "a", "picture", "of",
         "noise", "what", "is", "in", "it", "colour", "red", "green", "blue", "many", "few", "dots", "and",
         "some", "lines", "answer", "yes", "no", "this", "that", "shows", "random", "pixels", "bright", "dark",
         "left", "right", "top", "bottom", "small", "large", "square", "wide", "tall", "one", "two", "three")

QWEN_PATCH = 4    # vision patch side (pixels); Qwen2-VL merges 2 x 2 patches into one token
LLAVA_PATCH = 4
LLAVA_IMAGE = 16  # LLaVA's images are resized and cropped to 16 x 16: (16 / 4)^2 = 16 tokens each

_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] != 'user' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _check(name: str) -> str:
    """The processor's model of ``name``: 'qwen2_vl' for the Qwen family, else 'llava'."""
    if name not in QWEN_FAMILY + ("llava",):
        raise ValueError(f"vlm_data: model {name!r} is not one of {QWEN_FAMILY + ('llava',)}. Fix: pass one of them.")
    return "qwen2_vl" if name in QWEN_FAMILY else "llava"


@functools.lru_cache(maxsize=4)
def build_tokenizer(name: str) -> Any:
    """The word-level tokenizer of model ``name``: its special tokens, ``WORDS``, pad id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    name = _check(name)
    special = _QWEN_SPECIAL if name == "qwen2_vl" else _LLAVA_SPECIAL
    vocab = {w: i for i, w in enumerate((PAD, "<unk>") + special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    eos = "<|im_end|>" if name == "qwen2_vl" else "</s>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, unk_token="<unk>", eos_token=eos,
                                   extra_special_tokens=[s for s in special if s != eos], padding_side="right")


def _qwen_processor_class() -> type:
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without its video processor (which needs torchvision): images and text."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Optional[str] = None,
                     **kwargs: Any) -> None:
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor


@functools.lru_cache(maxsize=4)
def build_processor(name: str, max_side: int = 64) -> Any:
    """The real processor of model ``name`` (PIL image processor, no torchvision), with a chat template.

    ``max_side``: Qwen2-VL resizes an image to at most ``max_side^2`` pixels (patch 4,
    merge 2: at most ``(max_side / 8)^2`` image tokens); LLaVA's images are always
    ``LLAVA_IMAGE`` pixels square.
    """
    name = _check(name)
    tok = build_tokenizer(name)
    if name == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        images = Qwen2VLImageProcessorPil(patch_size=QWEN_PATCH, merge_size=2, temporal_patch_size=2,
                                          min_pixels=(2 * QWEN_PATCH) ** 2, max_pixels=max_side * max_side)
        return _qwen_processor_class()(image_processor=images, tokenizer=tok, chat_template=_QWEN_TEMPLATE)
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    images = LlavaImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                    crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=LLAVA_PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=_LLAVA_TEMPLATE)


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    """A tiny ``name`` model with random weights (seeded), its vocabulary that of ``build_tokenizer(name)``.

    ``name``: one of ``QWEN_FAMILY`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or ``"llava"``. Text
    decoder: ``layers`` layers of width ``hidden``, 2 heads (1 key/value head); vision
    tower of width 16: one block (Qwen2-VL), two (Qwen2.5-VL: a windowed one and a full
    one; Qwen3-VL: with a deepstack layer) or two CLIP layers (LLaVA; it reads the last
    one, so only CLIP's ``post_layernorm``, which feeds the unused pooled output, gets no
    gradient). ``use_cache`` is off, as in training.
    """
    tok = build_tokenizer(name)
    ids = tok.get_vocab()
    text: Dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, pad_token_id=0,
        bos_token_id=None, eos_token_id=tok.eos_token_id, use_cache=False)
    torch.manual_seed(seed)
    if name == "llava":
        from transformers import LlavaConfig, LlavaForConditionalGeneration

        cfg = LlavaConfig(text_config=dict(text, model_type="llama"), vision_config=dict(
            model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, image_size=LLAVA_IMAGE, patch_size=LLAVA_PATCH, projection_dim=16),
            image_token_id=ids["<image>"], vision_feature_select_strategy="default", vision_feature_layer=-1,
            projector_hidden_act="gelu", attn_implementation=attn_implementation)
        return LlavaForConditionalGeneration(cfg).to(dtype)
    import transformers

    half = hidden // 4  # head_dim / 2 rotary frequencies, split over (t, h, w)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    vision: Dict[str, Any] = dict(hidden_size=16, num_heads=2, patch_size=QWEN_PATCH, spatial_merge_size=2,
                                  temporal_patch_size=2)
    if name == "qwen2_vl":
        vision.update(depth=1, embed_dim=16, hidden_size=hidden, mlp_ratio=2)
    elif name == "qwen2_5_vl":
        vision.update(depth=2, intermediate_size=32, out_hidden_size=hidden, window_size=16, fullatt_block_indexes=[1])
    else:
        text.update(head_dim=hidden // 2)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(depth=2, intermediate_size=32, out_hidden_size=hidden, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[name]
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], attn_implementation=attn_implementation)
    model: torch.nn.Module = getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg)
    return model.to(dtype)


def noise_image(rng: np.random.RandomState, height: int, width: int) -> Any:
    """A PIL RGB image of uniform random pixels."""
    from PIL import Image

    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def vlm_samples(name: str, n: int, seed: int = 0, image_share: float = 0.5, max_images: int = 2,
                sides: Tuple[int, int] = (12, 64), words: Tuple[int, int] = (2, 24)) -> List[Dict[str, Any]]:
    """``n`` chat samples for model ``name``, each processed alone; deterministic in ``seed``.

    A sample is a user turn (``image_share`` of them with 1 to ``max_images`` noise images
    whose sides are drawn from ``sides`` pixels, then a question) and an assistant answer,
    each of ``words`` words. Fields: 1-D ``input_ids`` (image tokens expanded),
    ``labels`` (the prompt -100, the answer and its end token supervised; unshifted, as
    HF causal LMs shift inside), ``attention_mask``; for Qwen2-VL ``mm_token_type_ids``;
    for samples with images ``pixel_values`` and, for Qwen2-VL, ``image_grid_thw``; and
    ``image_patches`` (int: vision-tower patches, 0 without images). Qwen2.5-VL and
    Qwen3-VL get Qwen2-VL's samples.
    """
    name = _check(name)
    proc = build_processor(name, max(sides))
    tok = proc.tokenizer
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        count = int(rng.randint(1, max_images + 1)) if rng.rand() < image_share else 0
        images = [noise_image(rng, int(rng.randint(sides[0], sides[1] + 1)), int(rng.randint(sides[0], sides[1] + 1)))
                  for _ in range(count)]
        question = " ".join(rng.choice(WORDS[5:], int(rng.randint(words[0], words[1] + 1))))
        answer = " ".join(rng.choice(WORDS[5:], int(rng.randint(words[0], words[1] + 1))))
        user = {"role": "user", "content": [{"type": "image"}] * count + [{"type": "text", "text": question}]}
        messages = [user, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        full = proc.apply_chat_template(messages, tokenize=False)
        prompt = proc.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        if not full.startswith(prompt):
            raise AssertionError(f"vlm_data: the chat template's prompt {prompt!r} does not start {full!r}")
        enc = proc(text=[full], images=images or None, return_tensors="pt")
        sample: Dict[str, Any] = {k: v[0] for k, v in enc.items() if k in ("input_ids", "attention_mask",
                                                                        "mm_token_type_ids")}
        answer_len = len(tok(full[len(prompt):], add_special_tokens=False)["input_ids"])
        labels = sample["input_ids"].clone()
        labels[:len(labels) - answer_len] = IGNORE
        sample["labels"] = labels
        if images:
            sample["pixel_values"] = enc["pixel_values"]
            if "image_grid_thw" in enc:
                sample["image_grid_thw"] = enc["image_grid_thw"]
        sample[PATCHES_KEY] = image_patches(sample, patches_per_image=(LLAVA_IMAGE // LLAVA_PATCH) ** 2)
        out.append(sample)
    return out


_TEXT_FIELDS = {"input_ids": 0, "labels": IGNORE, "attention_mask": 0, "mm_token_type_ids": 0}
_IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


def pad_collate(samples: Sequence[Dict[str, Any]], pad_id: int = 0) -> Dict[str, torch.Tensor]:
    """The collator a user writes: right-pad the text fields, concatenate the image fields in sample order.

    ``input_ids`` pad with ``pad_id``, ``labels`` with -100, ``attention_mask`` and
    ``mm_token_type_ids`` with 0; ``pixel_values`` and ``image_grid_thw`` of the samples
    that have them are concatenated (absent when no sample has images). Other fields
    (``image_patches``) are dropped.
    """
    width = max(len(s["input_ids"]) for s in samples)
    batch: Dict[str, torch.Tensor] = {}
    for key, fill in _TEXT_FIELDS.items():
        if key not in samples[0]:
            continue
        fill = pad_id if key == "input_ids" else fill
        rows = torch.full((len(samples), width), fill, dtype=torch.long)
        for i, s in enumerate(samples):
            rows[i, :len(s[key])] = torch.as_tensor(s[key])
        batch[key] = rows
    for key in _IMAGE_FIELDS:
        parts = [s[key] for s in samples if key in s]
        if parts:
            batch[key] = torch.cat(parts)
    return batch
