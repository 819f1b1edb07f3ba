"""Peak memory of one training step, measured between steps (for ``token_budget="auto"``).

A *meter* is a callable the loader calls on the training thread between steps:
``meter() -> Optional[float]`` returns the peak bytes since the previous call and starts a
new measurement; ``None`` means nothing was measured. Three ways to get one:

* ``ActivationMeter(model)``: on any device, the bytes autograd saves for backward during the
  model's forward: the activation memory, the part of a step's peak that grows with the
  batch's tokens. Exact on CPU, where there is no allocator peak to read.
* ``CudaPeakMeter(device)``: the CUDA caching allocator's peak
  (``torch.cuda.max_memory_allocated``, then ``torch.cuda.reset_peak_memory_stats``), which
  also holds the parameters, gradients and optimizer state.
* ``default_meter(model)``: ``CudaPeakMeter`` when CUDA is available, else an
  ``ActivationMeter`` of the model when one is given, else ``None``.

Example (Linear, ReLU, Linear on CPU; the input does not require grad, so the first Linear
saves its input (3 x 4 floats) but not its weight; ReLU saves its output (3 x 8 floats),
which the second Linear saves again as its input: one storage, counted once; the second
Linear's weight is a parameter, not an activation):

    >>> import torch
    >>> from odb.train.memory import ActivationMeter
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> with ActivationMeter(model) as meter:
    ...     model(torch.randn(3, 4)).sum().backward()
    ...     meter(), meter()
    (144, None)

``144 == 3 * (4 + 8) * 4`` bytes; the second call saw no forward, so it gives ``None``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Optional, Set, Tuple, Type, Union

import torch

__all__ = ["ActivationMeter", "CudaPeakMeter", "Meter", "default_meter"]

Meter = Callable[[], Optional[float]]
"""What the loader calls between steps: the peak bytes since the previous call, or None."""

_StorageKey = Tuple[str, int, int]


def _storage_key(tensor: torch.Tensor) -> Optional[Tuple[_StorageKey, int]]:
    """(device, data_ptr, nbytes) of the tensor's storage and its nbytes; None when it has none."""
    try:
        storage = tensor.untyped_storage()
        return (str(storage.device), storage.data_ptr(), storage.nbytes()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        # Sparse, nested or some wrapper subclasses have no single storage: count their elements.
        try:
            nbytes = tensor.numel() * tensor.element_size()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            return None
        return None if nbytes == 0 else (("", id(tensor), nbytes), nbytes)


class ActivationMeter:
    """Bytes autograd saves for backward during ``model``'s forward: the step's activation memory.

    A forward pre-hook and an always-called forward hook on the root module enter and leave
    ``torch.autograd.graph.saved_tensors_hooks`` around each outermost forward. The pack hook
    returns the tensor unchanged (outputs and gradients stay identical) and adds the bytes of
    its storage to the forward's total, once per storage: views of one tensor share a storage,
    and the same tensor saved by two operations (ReLU's output, then the next Linear's input)
    is counted once. Storages of the model's parameters and buffers are not activations and are
    not counted (nor are views of them, like ``weight.t()`` saved by a Linear). A view keeps its
    whole storage alive, so the whole storage is counted.

    Peak: backward frees the saved tensors as it goes, so the most that is held at once is what
    the forward saved; the total saved over one forward is taken as the step's activation peak.
    Under gradient accumulation each micro-batch's backward frees its own activations before the
    next forward, so a call returns the *largest* forward since the previous call, not the sum.

    Under ``torch.autocast`` the low-precision copies of the weights that an operation saves are
    new tensors and are counted (they are held until backward like the activations, but do not
    grow with the batch). Works through ``torch.compile`` (the hooks sit on the module, outside
    the compiled graph; what the compiled graph saves is counted).

    Not counted: parameters, buffers, gradients and optimizer state (not activations); anything
    computed outside the root module's forward (a loss computed by the training loop from the
    logits); the temporary buffers of one operation (workspace, the autograd engine's gradient
    buffers during backward); tensors recomputed in backward by gradient checkpointing (the meter
    then reports less, which is what checkpointing saves). Under ``torch.no_grad`` nothing is
    saved and a forward counts 0. Storages are told apart by address while they are alive, which
    every saved tensor is until backward; a saved tensor whose graph is dropped before the forward
    ends may let a later one reuse its address and go uncounted.

    Call semantics: ``meter()`` returns the bytes (an ``int``) of the largest completed forward
    since the previous call, or ``None`` when no forward completed since then (0 when forwards ran
    but saved nothing), and starts over. Hooks run on the thread that runs the forward and the
    saved-tensor hooks are per thread: run the forward and call the meter on the training thread.
    ``close()`` (or leaving the ``with`` block) removes the hooks; the model is as before.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ActivationMeter needs a torch.nn.Module, got {type(model).__name__}")
        self._model = model
        self._depth = 0
        self._hooks: Optional[Any] = None
        self._skip: Set[Tuple[str, int]] = set()
        self._seen: Set[_StorageKey] = set()
        self._total = 0
        self._peak: Optional[int] = None
        self._closed = False
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    # -- hooks -------------------------------------------------------------------------------

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth > 1:              # the root module called again inside its own forward
            return
        self._skip = set()
        for tensor in list(module.parameters()) + list(module.buffers()):
            try:
                storage = tensor.untyped_storage()
                self._skip.add((str(storage.device), storage.data_ptr()))
            except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                pass
        self._seen = set()
        self._total = 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        try:
            hooks.__enter__()
        except RuntimeError:
            # Saved-tensor hooks are disabled here (torch.autograd.graph.disable_saved_tensors_hooks,
            # some wrappers): measure nothing rather than break the forward.
            return
        self._hooks = hooks

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth > 0 or self._hooks is None:
            return
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        self._peak = self._total if self._peak is None else max(self._peak, self._total)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        found = _storage_key(tensor)
        if found is not None:
            key, nbytes = found
            if key not in self._seen and (key[0], key[1]) not in self._skip:
                self._seen.add(key)
                self._total += nbytes
        # Not the tensor itself: a saved output that holds its own grad_fn is a reference cycle through
        # autograd's C++ graph, which Python's gc cannot collect (every forward's activations leaked).
        # The detached view shares the storage (and the version counter) without the grad_fn.
        return tensor.detach()

    # -- the meter ---------------------------------------------------------------------------

    def __call__(self) -> Optional[int]:
        """Bytes saved by the largest forward since the previous call (None if none ran); resets."""
        peak, self._peak = self._peak, None
        return peak

    def close(self) -> None:
        """Remove the hooks (idempotent); the meter then measures nothing."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        if self._hooks is not None:      # closed inside a forward: leave the saved-tensor hooks now
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        self._depth = 0

    def __enter__(self) -> "ActivationMeter":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"ActivationMeter({type(self._model).__name__}, {state})"


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class CudaPeakMeter:
    """The CUDA allocator's peak bytes since the previous call (``max_memory_allocated``), then reset.

    ``device`` is anything ``torch.cuda`` accepts (None: the current device). The peak holds all
    the memory allocated through the caching allocator: parameters, gradients, optimizer state,
    activations and the temporary buffers of each operation. Returns ``None`` when CUDA is not
    available, or not initialised yet (nothing can have been allocated; the meter does not
    initialise CUDA itself). With no step since the previous call it returns what is allocated
    now, since that is the peak of an idle interval.

        >>> import torch
        >>> from odb.train.memory import CudaPeakMeter
        >>> meter = CudaPeakMeter()
        >>> torch.cuda.is_available() or meter() is None
        True
    """

    def __init__(self, device: Union[None, int, str, torch.device] = None) -> None:
        self.device = device
        if self._ready():
            torch.cuda.reset_peak_memory_stats(device)

    @staticmethod
    def _ready() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def __call__(self) -> Optional[int]:
        """Peak allocated bytes since the previous call (None without CUDA); resets the peak."""
        if not self._ready():
            return None
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def __repr__(self) -> str:
        return f"CudaPeakMeter(device={self.device!r})"


def default_meter(model: Optional[torch.nn.Module] = None) -> Optional[Meter]:
    """``CudaPeakMeter`` when CUDA is available, else ``ActivationMeter(model)``, else ``None``.

    With CUDA the meter reads the device of the model's first CUDA parameter (the current device
    when there is none, e.g. a model moved to the GPU later).

        >>> import torch
        >>> from odb.train.memory import default_meter
        >>> torch.cuda.is_available() or default_meter() is None
        True
    """
    if torch.cuda.is_available():
        device = None
        if model is not None:
            device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
        return CudaPeakMeter(device)
    if model is not None:
        return ActivationMeter(model)
    return None
