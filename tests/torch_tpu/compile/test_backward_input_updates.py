"""torch.compile(backend="tpu") graphs that update their inputs in place: a backward writing a
forward input (a fused optimizer's update, which AOTAutograd keeps as ``copy_`` into the saved
input) reaches the caller's tensor, as in eager."""

import torch

import torch_tpu  # noqa: F401


class _FusedScale(torch.autograd.Function):
    """y = x * w; backward updates w in place (w -= 0.5 * sum(grad * x), per column) and gives
    no gradient for it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        with torch.no_grad():
            w.copy_(w - 0.5 * (grad * x).sum(0))
        return grad * w, None


def _run(compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4).to("tpu"))
    fn = lambda x: (_FusedScale.apply(x, w) ** 2).sum()  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="tpu", fullgraph=True)
    grads = []
    for step in range(2):
        x = (torch.arange(12.0).reshape(3, 4) / (step + 3)).to("tpu").requires_grad_(True)
        fn(x).backward()
        grads.append(x.grad.cpu())
    return w.detach().cpu(), grads


def test_backward_that_updates_an_input_in_place_matches_eager() -> None:
    eager_w, eager_grads = _run(compiled=False)
    compiled_w, compiled_grads = _run(compiled=True)
    assert not torch.equal(eager_w, torch.linspace(-1.0, 1.0, 4))  # the update ran
    torch.testing.assert_close(compiled_w, eager_w)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)
