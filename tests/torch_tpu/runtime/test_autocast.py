"""``torch.autocast("tpu")`` with PyTorch's own autocast test lists and checker
(``torch.testing._internal.autocast_test_lists``, the CUDA suite's): each op's output dtype is the
policy's, and its value equals the op run on arguments cast by hand with autocast off."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing._internal.autocast_test_lists import AutocastTestLists, TestAutocast
from torch.utils._pytree import tree_map_only

from torch_tpu.eager import op_jit

DEVICE = "tpu"
AMP_DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def lists() -> AutocastTestLists:
    """PyTorch's lists built on CPU, their tensors then moved to the tpu: built on the tpu, each
    of their random inputs is an eager program of its own (~30 s). The checker compares the tpu
    result with a hand-cast control on the same inputs, so where their values come from is moot."""
    lists = AutocastTestLists(torch.device("cpu"))
    for name, entries in vars(lists).items():
        setattr(lists, name, tree_map_only(torch.Tensor, lambda t: t.to(DEVICE), entries))
    return lists


@pytest.fixture(autouse=True)
def _one_program_per_call():
    """torch's checker compares autocast's output with a hand-cast control bit for bit. The eager
    op cache runs a signature's first call op by op and later calls as one jitted program, whose
    fusions may round 1 ulp differently; with the cache off both sides run the same way."""
    op_jit.set_enabled(False)
    yield
    op_jit.set_enabled(True)


class _Checker(TestAutocast):
    def runTest(self) -> None:  # noqa: N802 -- unittest's name; the checker is used, not collected
        pass


def _cases(entries: list, has_skip_flag: bool = False) -> list[tuple[str, tuple, dict]]:
    cases = []
    for entry in entries:
        op, args = entry[0], entry[1]
        if op.startswith("cudnn_") or (has_skip_flag and len(entry) == 3 and entry[2]):  # as torch: a truthy 3rd skips
            continue
        cases.append((op, args, entry[2] if len(entry) == 3 and isinstance(entry[2], dict) else {}))
    return cases


@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=str)
def test_lower_precision_ops(lists: AutocastTestLists, amp_dtype: torch.dtype) -> None:
    checker = _Checker()
    for op, args, kwargs in _cases(lists.torch_fp16, has_skip_flag=True):
        checker._run_autocast_outofplace(op, args, amp_dtype, DEVICE, add_kwargs=kwargs, amp_dtype=amp_dtype)
    for op, args, kwargs in _cases(lists.nn_fp16):
        checker._run_autocast_outofplace(op, args, amp_dtype, DEVICE, module=torch._C._nn, add_kwargs=kwargs,
                                         amp_dtype=amp_dtype)
    for op, args, kwargs in _cases(lists.linalg_fp16):
        checker._run_autocast_outofplace(op, args, amp_dtype, DEVICE, module=torch._C._linalg, add_kwargs=kwargs,
                                         amp_dtype=amp_dtype)
    for op, args, kwargs in _cases(lists.methods_fp16):
        checker._run_autocast_outofplace(op, args, amp_dtype, DEVICE, module=None, add_kwargs=kwargs,
                                         amp_dtype=amp_dtype)


@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=str)
def test_float32_and_promoting_ops(lists: AutocastTestLists, amp_dtype: torch.dtype) -> None:
    checker = _Checker()
    for entries, module in ((lists.torch_fp32, torch), (lists.torch_need_autocast_promote, torch),
                            (lists.nn_fp32, torch._C._nn), (lists.methods_fp32, None)):
        for op, args, kwargs in _cases(entries):
            checker._run_autocast_outofplace(op, args, torch.float32, DEVICE, module=module, add_kwargs=kwargs,
                                             amp_dtype=amp_dtype)


def test_builtin_promotion_still_applies(lists: AutocastTestLists) -> None:
    checker = _Checker()
    for op, args, out_type in lists.torch_expect_builtin_promote:
        checker._run_autocast_outofplace(op, args, torch.float32, DEVICE, out_type=out_type)
    for op, args, out_type in lists.methods_expect_builtin_promote:
        checker._run_autocast_outofplace(op, args, torch.float32, DEVICE, module=None, out_type=out_type)


def test_banned_ops_raise(lists: AutocastTestLists) -> None:
    with torch.autocast(DEVICE):
        for op, args, module in lists.banned:
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                getattr(module, op)(*args)


def test_default_dtype_is_bfloat16_and_training_matches_cpu_autocast() -> None:
    """A bf16 training step under autocast: the forward's dtypes follow the policy, gradients reach
    the float32 parameters, and values agree with the same model under CPU autocast (which also
    computes its matmuls in bfloat16) to bf16 precision."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    tpu = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(DEVICE)
    tpu.load_state_dict(cpu.state_dict())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    assert torch.get_autocast_dtype(DEVICE) == torch.bfloat16
    with torch.autocast(DEVICE):
        logits = tpu(x.to(DEVICE))
        loss = nn.functional.cross_entropy(logits, y.to(DEVICE))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_logits = cpu(x)
        cpu_loss = nn.functional.cross_entropy(cpu_logits, y)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(logits.float().cpu(), cpu_logits.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss.cpu(), cpu_loss.float(), rtol=2e-2, atol=2e-2)
    loss.backward()
    cpu_loss.backward()
    for p_tpu, p_cpu in zip(tpu.parameters(), cpu.parameters()):
        assert p_tpu.grad.dtype == torch.float32
        torch.testing.assert_close(p_tpu.grad.cpu(), p_cpu.grad, rtol=5e-2, atol=2e-2)


def test_compiled_under_autocast_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)).to(DEVICE)
    x = torch.randn(4, 8).to(DEVICE)

    def step(inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE):
            return model(inputs).softmax(-1)

    eager = step(x)
    compiled = torch.compile(step, backend="tpu")(x)
    assert eager.dtype == compiled.dtype == torch.float32
    torch.testing.assert_close(compiled.cpu(), eager.cpu(), rtol=1e-2, atol=1e-3)
