"""`model/weight_grad.py`: every linear's autograd function, whose weight gradient a store defers.

Without a store it is torch's linear bit for bit (input, weight and bias gradients); inside one the
weight gradient waits, and the weight pass adds exactly it, in backward order, to the parameter's
`.grad`, also when a saved-tensor hook (the memory meter's) unpacks the weight as another tensor.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ds.model import weight_grad


def pair(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Linear, weight_grad.Linear]:
    torch.manual_seed(0)
    ref = torch.nn.Linear(32, 48).to(dtype)
    ours = weight_grad.Linear(32, 48).to(dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torchs_linear_bit_for_bit(dtype: torch.dtype) -> None:
    ref, ours = pair(dtype)
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 16, 48, dtype=dtype)
    assert torch.equal(ref(x), ours(x))
    ref(x).backward(g)
    gx, x.grad = x.grad, None
    ours(x).backward(g)
    assert torch.equal(gx, x.grad)
    assert torch.equal(ref.weight.grad, ours.weight.grad) and torch.equal(ref.bias.grad, ours.bias.grad)


def test_deferred_weight_gradients_add_up_in_backward_order() -> None:
    ref, ours = pair()
    store = weight_grad.WeightGradStore()
    batches = [(torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 16, 48)) for _ in range(3)]
    for x, g in batches:
        ref(x).backward(g)
        with store.deferring():
            ours(x).backward(g)
    assert ours.weight.grad is None and ours.bias.grad is not None  # biases are not deferred
    assert store.pending == 3 and store.deferred == 3
    for _ in range(3):
        store.run_oldest()
    assert torch.equal(ref.weight.grad, ours.weight.grad) and torch.equal(ref.bias.grad, ours.bias.grad)
    with pytest.raises(AssertionError, match="without a backward"):
        store.run_oldest()


def test_a_weight_pass_frees_each_added_gradient_before_making_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once `.grad` exists, each weight gradient is made, added and freed before the next is made: one
    temporary at a time, as the memory model counts (the allocation trace of benchmarks/schedules.py
    target saw two at once, the head's and the next layer's, before this)."""
    import weakref

    torch.manual_seed(0)
    layers = [weight_grad.Linear(32, 32) for _ in range(3)]
    made, alive_at_each = [], []
    real = weight_grad.weight_gradient

    def tracked(grad_output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        alive_at_each.append(sum(r() is not None and not any(r() is m.weight.grad for m in layers) for r in made))
        out = real(grad_output, inputs)
        made.append(weakref.ref(out))
        return out

    store = weight_grad.WeightGradStore()
    for _ in range(2):
        x = torch.randn(4, 32, requires_grad=True)
        with store.deferring():
            y = x
            for m in layers:
                y = m(y)
            y.sum().backward()
    monkeypatch.setattr(weight_grad, "weight_gradient", tracked)
    store.run_oldest()  # the first pass: each gradient becomes the `.grad`
    store.run_oldest()  # the second: each is added, then freed
    assert alive_at_each == [0] * 6


def test_the_weight_pass_reaches_the_parameter_through_saved_tensor_hooks() -> None:
    """A hook that unpacks saved tensors as other objects (as the memory meter's may) must not send
    the weight gradient to a stranger: it lands on the parameter."""
    _, ours = pair()
    x, g = torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 16, 48)
    store = weight_grad.WeightGradStore()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.detach().clone()):
        y = ours(x)
    with store.deferring():
        y.backward(g)
    store.run_oldest()
    assert ours.weight.grad is not None
    assert torch.allclose(ours.weight.grad, weight_grad.weight_gradient(g, x))


def test_megatron_core_forms_that_cannot_defer_keep_their_own_function() -> None:
    calls = []

    def fallback(x, w, **kw):
        calls.append(kw)
        return x

    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(6, 8))
    plain = {"bias": None, "allreduce_dgrad": False, "sequence_parallel": False, "grad_output_buffer": None}
    assert weight_grad.megatron_linear(x, w, fallback, **plain).shape == (4, 6) and not calls
    for change in ({"gradient_accumulation_fusion": True}, {"grad_output_buffer": []}):
        weight_grad.megatron_linear(x, w, fallback, **{**plain, **change})
    assert len(calls) == 2


class _OneRank:
    """A tensor group of one rank: megatron-core's first-dimension gather and reduce-scatter pass through."""

    @staticmethod
    def size() -> int:
        return 1


def test_the_sequence_parallel_form_defers_its_weight_gradient_on_the_gathered_input() -> None:
    """megatron-core's column-parallel linear under sequence parallelism goes through `linear` with the
    tensor group as its sequence group: the weight pass gets the (gathered) input, the fallback is not called."""
    calls = []
    x = torch.randn(4, 2, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8))
    kwargs = {"bias": None, "allreduce_dgrad": False, "sequence_parallel": True, "grad_output_buffer": None}
    y = weight_grad.megatron_linear(x, w, lambda *a, **k: calls.append(k), tp_group=_OneRank(), **kwargs)
    g = torch.randn_like(y)
    store = weight_grad.WeightGradStore()
    with store.deferring():
        y.backward(g)
    assert not calls and w.grad is None and store.deferred == 1
    assert torch.allclose(x.grad, g.matmul(w.detach()))
    store.run_oldest()
    assert torch.allclose(w.grad, weight_grad.weight_gradient(g, x.detach()))
