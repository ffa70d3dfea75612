"""The in-place, method and out= variants of every lowered op: tpu vs the same variant on CPU torch.

For each OpInfo of a lowered op (``test_opinfo.OPINFOS``) and its first samples, the variant runs on
CPU first; where CPU raises (an in-place op whose result cannot be cast or broadcast into the
input), the tpu must raise too. Otherwise the tpu result, the mutated input (in-place) or the
written ``out`` tensors must equal CPU's, with the same shapes and dtypes, and in-place / out=
variants must return the very tensor they wrote. The full sample sets are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from tests.torch_tpu.opinfo_cases import OPINFOS, compare, first_samples, opinfo_id

_VARIANTS = ("inplace", "method", "out")


def _tpu(x):
    return x.detach().to("tpu") if isinstance(x, torch.Tensor) else x


def _cpu_copy(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _out_like(result, device):
    return pytree.tree_map(
        lambda r: torch.empty(0, dtype=r.dtype, device=device) if isinstance(r, torch.Tensor) else r, result)


def _call(opinfo, variant, sample, device):
    convert = _tpu if device == "tpu" else _cpu_copy
    args = pytree.tree_map(convert, (sample.input, *sample.args))
    kwargs = pytree.tree_map(convert, dict(sample.kwargs))
    if "device" in kwargs:
        kwargs["device"] = device
    if variant == "inplace":
        returned = opinfo.inplace_variant(*args, **kwargs)
        return returned, args[0], args[0]
    if variant == "method":
        result = opinfo.method_variant(*args, **kwargs)
        return result, result, None
    expected = opinfo.op(*pytree.tree_map(_cpu_copy, (sample.input, *sample.args)), **sample.kwargs)
    out = _out_like(expected, device)
    returned = opinfo.op(*args, **kwargs, out=out if isinstance(expected, torch.Tensor) else tuple(out))
    return returned, out, out


def _variant_available(opinfo, variant):
    if variant == "inplace":
        return opinfo.inplace_variant is not None
    if variant == "method":
        return opinfo.method_variant is not None
    return opinfo.supports_out


def _run(opinfo, variant, max_samples):
    if not _variant_available(opinfo, variant):
        pytest.skip(f"{opinfo.name} has no {variant} variant")
    if torch.float32 not in opinfo.supported_dtypes("cpu"):
        pytest.skip(f"{opinfo.name} does not support float32")
    torch.manual_seed(0)
    for sample in first_samples(opinfo, torch.float32, False, max_samples, tensor_input=True):
        try:
            _, cpu_written, cpu_identity = _call(opinfo, variant, sample, "cpu")
        except (RuntimeError, TypeError, ValueError, IndexError) as error:
            with pytest.raises(type(error)):
                _call(opinfo, variant, sample, "tpu")
            continue
        returned, written, identity = _call(opinfo, variant, sample, "tpu")
        what = f"{opinfo.name} {variant} {sample}"
        compare(written, cpu_written, torch.float32, what)
        for a, e in zip(pytree.tree_leaves(written), pytree.tree_leaves(cpu_written)):
            if isinstance(e, torch.Tensor):
                assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        if identity is not None and cpu_identity is not None:
            for r, w in zip(pytree.tree_leaves(returned), pytree.tree_leaves(identity)):
                if isinstance(w, torch.Tensor):
                    assert r is w, f"{what}: the {variant} variant must return the tensor it wrote"


@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("opinfo", OPINFOS, ids=opinfo_id)
def test_variant_equals_cpu(opinfo, variant):
    _run(opinfo, variant, max_samples=1)


@pytest.mark.slow
@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("opinfo", OPINFOS, ids=opinfo_id)
def test_variant_full_sweep(opinfo, variant):
    _run(opinfo, variant, max_samples=None)
