"""odb.train.memory: the meters behind token_budget="auto" measure a step's memory exactly on CPU.

ActivationMeter counts the bytes autograd saves in the model's forward: exact figures for
known small models, views and parameters not counted, less under checkpointing, nothing under
no_grad, the largest of several micro-batches, outputs and gradients unchanged, hooks gone after
close(), and a tiny HF Llama whose eager attention saves the L x L probabilities.
CudaPeakMeter/default_meter on a machine without CUDA: None, and CUDA left uninitialised.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from odb.train.memory import ActivationMeter, CudaPeakMeter, default_meter

F32 = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("batch", [3, 6])
def test_linear_relu_linear_exact_bytes(batch):
    """Linear saves its input (B x 4), ReLU its output (B x 8) = the 2nd Linear's input: once."""
    model = mlp()
    with ActivationMeter(model) as meter:
        step(model, torch.randn(batch, 4))
        assert meter() == batch * (4 + 8) * F32


def test_bytes_double_with_the_batch():
    model = mlp()
    with ActivationMeter(model) as meter:
        step(model, torch.randn(3, 4))
        small = meter()
        step(model, torch.randn(6, 4))
        assert meter() == 2 * small == 2 * 144


def test_single_linear_saves_its_input_only():
    torch.manual_seed(0)
    model = nn.Linear(5, 7)
    with ActivationMeter(model) as meter:
        step(model, torch.randn(3, 5))
        assert meter() == 3 * 5 * F32           # the weight (saved as weight.t()) is a parameter


def test_input_requiring_grad_saves_the_weight_but_it_is_not_counted():
    torch.manual_seed(0)
    model = nn.Linear(5, 7)
    x = torch.randn(3, 5, requires_grad=True)
    with ActivationMeter(model) as meter:
        step(model, x)
        assert meter() == 3 * 5 * F32


class ViewsAndBuffer(nn.Module):
    """Saves two views of one tensor, a buffer and a parameter: only the tensor counts."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.register_buffer("shift", torch.full((6,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale                       # saves x (B x 6) and scale (a parameter)
        a, b = h[:, :3], h[:, 3:]                # two views of one storage
        return (a * b).sum() + (h * self.shift).sum()   # saves a and b; h * buffer saves the buffer


def test_views_parameters_and_buffers_are_not_counted():
    model = ViewsAndBuffer()
    x = torch.randn(4, 6)
    with ActivationMeter(model) as meter:
        model(x).backward()
        assert meter() == 2 * 4 * 6 * F32        # x, and h's storage once (not a, b separately)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x)))


def test_nested_modules_count_every_saved_activation_once():
    model = Nested()
    with ActivationMeter(model) as meter:
        step(model, torch.randn(3, 4))
        # x (3x4); ReLU's output (3x8, also the 2nd Linear's input); tanh's output (3x8, also the
        # head's input). tanh saves its output, not its input, so the 2nd Linear's output is not saved.
        assert meter() == 3 * (4 + 8 + 8) * F32


class Blocks(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ckpt = ckpt
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
                                    for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return x


def test_checkpointing_reports_less_and_the_same_gradients():
    x = torch.randn(5, 16)
    results = {}
    for ckpt in (False, True):
        model = Blocks(ckpt)
        with ActivationMeter(model) as meter:
            step(model, x)
            results[ckpt] = (meter(), [p.grad.clone() for p in model.parameters()])
    plain, ckpt = results[False][0], results[True][0]
    # Each block saves its input (5x16), the GELU input (5x64) and the GELU output (5x64).
    assert plain == 3 * 5 * (16 + 64 + 64) * F32
    # Non-reentrant checkpointing keeps only each block's input for the recomputation.
    assert ckpt == 3 * 5 * 16 * F32 < plain / 4
    for a, b in zip(results[False][1], results[True][1]):
        torch.testing.assert_close(a, b)


def test_no_grad_forward_counts_zero():
    model = mlp()
    with ActivationMeter(model) as meter:
        with torch.no_grad():
            model(torch.randn(3, 4))
        assert meter() == 0                     # a forward ran, nothing was saved
        assert meter() is None                  # no forward since the previous call


def test_outputs_and_gradients_are_unchanged():
    x = torch.randn(6, 4)
    ref_model = mlp()
    ref_loss = step(ref_model, x)
    model = mlp()
    with ActivationMeter(model) as meter:
        loss = step(model, x)
        assert meter() > 0
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_reset_semantics():
    model = mlp()
    with ActivationMeter(model) as meter:
        assert meter() is None                  # nothing measured yet
        step(model, torch.randn(3, 4))
        assert meter() == 144
        assert meter() is None                  # no step since the previous call: None, not 0


def test_micro_batches_give_the_largest_not_the_sum():
    model = mlp()
    with ActivationMeter(model) as meter:
        step(model, torch.randn(3, 4))
        step(model, torch.randn(6, 4))
        step(model, torch.randn(2, 4))
        assert meter() == 6 * 12 * F32


def test_close_removes_the_hooks():
    model = mlp()
    meter = ActivationMeter(model)
    step(model, torch.randn(3, 4))
    meter.close()
    meter.close()                               # idempotent
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert meter() == 144                       # what was measured before close() is still returned
    step(model, torch.randn(6, 4))
    assert meter() is None                      # a forward after close() changes nothing


def test_a_failing_forward_leaves_no_hooks_behind():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    model = Boom()
    with ActivationMeter(model) as meter:
        with pytest.raises(ValueError):
            model(torch.randn(2))
        # The saved-tensor hooks were left (always_call): a graph built outside counts nothing.
        w = torch.randn(3, requires_grad=True)
        (w * w).sum().backward()
        assert meter() == 0


def test_autocast_counts_the_saved_low_precision_copies():
    model = mlp()
    with ActivationMeter(model) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(3, 4))
        out.float().sum().backward()
        # bf16: the input cast (3x4), ReLU's output (3x8) and the 2nd Linear's weight cast (8x2),
        # 2 bytes each; the 1st Linear's weight is not saved (its input needs no gradient).
        assert meter() == (3 * 4 + 3 * 8 + 8 * 2) * 2


def test_compiled_model_is_measured():
    model = mlp()
    with ActivationMeter(model) as meter:
        compiled = torch.compile(model, backend="aot_eager")   # no C compiler needed
        for batch in (3, 6):
            step(compiled, torch.randn(batch, 4))
            assert meter() == batch * 12 * F32


def test_rejects_a_non_module():
    with pytest.raises(TypeError):
        ActivationMeter(lambda x: x)


def llama(impl: str):
    import transformers  # pinned in both test environments: a broken install fails, never skips
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, attn_implementation=impl)
    return transformers.LlamaForCausalLM(config)


def llama_bytes(model, shapes, ckpt=False):
    if ckpt:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):          # transformers >= 5.23
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    model.train()
    out = []
    with ActivationMeter(model) as meter:
        for batch, length in shapes:
            ids = torch.randint(0, 64, (batch, length))
            model(input_ids=ids, labels=ids).loss.backward()
            out.append(meter())
    return out


def test_tiny_llama_eager_attention_saves_the_probabilities():
    """Same tokens, twice the length: eager's bytes grow by the L x L attention probabilities.

    Measured (torch 2.13 + transformers 5.23): eager 1,881,092 bytes at 4 x 64 and 2,409,476 at
    2 x 128; growth 528,384 = 2 layers x 4 heads x 4 bytes x (2 x 128^2 - 4 x 64^2) (= 524,288)
    + 4,096 (the rotary cos/sin, one row per position). sdpa: 1,299,460 and 1,303,556, growth
    4,096 only: CPU sdpa runs a fused kernel that saves q, k, v, the output and a logsumexp per
    row, no L x L tensor. With torch 2.6 + transformers 5.18 (.venv-min) sdpa saves a
    (B, heads, L, L) tensor and measures exactly as eager: the test asserts what holds on both.
    """
    eager = llama_bytes(llama("eager"), [(4, 64), (2, 128), (8, 64)])
    sdpa = llama_bytes(llama("sdpa"), [(4, 64), (2, 128), (8, 64)])
    probs_growth = 2 * 4 * F32 * (2 * 128 ** 2 - 4 * 64 ** 2)
    eager_growth, sdpa_growth = eager[1] - eager[0], sdpa[1] - sdpa[0]
    assert eager_growth >= probs_growth
    assert eager_growth - probs_growth <= 2 * 128 * 8 * F32        # the rotary cos/sin at most
    assert sdpa_growth <= eager_growth
    if sdpa[0] < eager[0]:                       # a fused sdpa kernel: no L x L tensor saved
        assert sdpa_growth < probs_growth / 10
    # Twice the sequences of one length: about twice the bytes (everything but rotary scales).
    for measured in (eager, sdpa):
        assert 1.9 < measured[2] / measured[0] <= 2.0


def test_tiny_llama_checkpointing_reports_less():
    plain = llama_bytes(llama("eager"), [(4, 64)])[0]
    ckpt = llama_bytes(llama("eager"), [(4, 64)], ckpt=True)[0]
    assert ckpt < plain / 4                       # measured: 234,500 vs 1,881,092 bytes


def test_cuda_peak_meter_without_cuda_is_none_and_leaves_cuda_alone():
    """In a fresh interpreter, so that nothing else in this process initialised CUDA."""
    code = (
        "import torch\n"
        "from odb.train.memory import ActivationMeter, CudaPeakMeter, default_meter\n"
        "meter = CudaPeakMeter()\n"
        "first, second = meter(), meter()\n"
        "if torch.cuda.is_available():\n"
        "    torch.ones(1024, device='cuda')\n"
        "    assert meter() >= 4096 and isinstance(default_meter(), CudaPeakMeter)\n"
        "    print('cuda')\n"
        "else:\n"
        "    assert first is None and second is None\n"
        "    assert default_meter() is None\n"
        "    assert isinstance(default_meter(torch.nn.Linear(2, 2)), ActivationMeter)\n"
        "    assert not torch.cuda.is_initialized()\n"
        "    print('cpu')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("backward", [False, True])
def test_the_meter_keeps_no_activation_alive(backward):
    """A forward's outputs and saved activations are freed once the caller lets go, as without the
    meter. Returning the saved tensor itself from the pack hook made every saved *output* (ReLU's,
    softmax's) hold its own grad_fn: a cycle through autograd's graph that gc cannot collect, so each
    forward leaked its activations (the auto-budget benchmark's shape search grew to 23 GB)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Softmax(dim=-1))
    refs = []
    with ActivationMeter(model) as meter:
        for _ in range(3):
            out = model(torch.randn(3, 4))
            refs.append(weakref.ref(out))
            if backward:
                out.square().sum().backward()
            del out
        assert meter() == 3 * (4 + 8 + 8) * F32   # input, ReLU's output (the softmax's input), softmax's output
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
