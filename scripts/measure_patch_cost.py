"""What one image patch weighs against one token, in activation bytes (odb.train.memory.ActivationMeter, CPU,
fp32), for Qwen2-VL-2B's shapes: its vision tower (32 blocks, 1280 wide, 2x2 merger) and its language model
(28 layers, 1536 wide, vocabulary 151,936), each built from a config with one and two layers (random weights,
nothing downloaded); the per-layer slope is scaled to the real depth. Prints ``image_patch_cost`` (tokens-
equivalent per patch) with a chunked or fused loss and with a plain cross-entropy. Run:

    PYTHONPATH=src python scripts/measure_patch_cost.py
"""
import torch
from transformers import Qwen2Config
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model
from odb.train.memory import ActivationMeter
torch.set_num_threads(1)
torch.manual_seed(0)

def slope(model, make, sizes):
    out = []
    with ActivationMeter(model) as meter:
        for n in sizes:
            y = model(**make(n))
            y = y if torch.is_tensor(y) else (y.pooler_output if getattr(y, "pooler_output", None) is not None else y.last_hidden_state)
            y.float().sum().backward()
            out.append(meter())
    return (out[1] - out[0]) / (sizes[1] - sizes[0]), out

def vision(depth):
    cfg = Qwen2VLVisionConfig(depth=depth, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                              temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    cfg._attn_implementation = "sdpa"
    m = Qwen2VisionTransformerPretrainedModel(cfg)
    def make(n):  # n patches as one image of grid (1, 2, n/2)
        return {"hidden_states": torch.randn(n, 3 * 2 * 14 * 14), "grid_thw": torch.tensor([[1, 2, n // 2]])}
    return slope(m, make, (256, 512))

def lm(layers):
    cfg = Qwen2Config(vocab_size=32, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, attn_implementation="sdpa")
    m = Qwen2Model(cfg)
    def make(n):
        return {"inputs_embeds": torch.randn(1, n, 1536)}
    return slope(m, make, (256, 512))

v1, v1r = vision(1); v2, v2r = vision(2)
l1, l1r = lm(1); l2, l2r = lm(2)
per_v_layer, v_rest = v2 - v1, v1 - (v2 - v1)
per_l_layer, l_rest = l2 - l1, l1 - (l2 - l1)
print("vision bytes/patch: per block %.0f, outside blocks %.0f" % (per_v_layer, v_rest))
print("LM bytes/token: per layer %.0f, outside layers %.0f" % (per_l_layer, l_rest))
patch = 32 * per_v_layer + v_rest
token = 28 * per_l_layer + l_rest
V = 151936
for name, logits in (("chunked/fused loss", 0.0), ("plain CE (fp32 logits + log-softmax)", 2 * 4 * V)):
    print("%s: bytes/token %.0f, bytes/patch %.0f, image_patch_cost = %.3f tokens/patch" % (name, token + logits, patch, patch / (token + logits)))
