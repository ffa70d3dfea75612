"""Device-generic tests of views, indexing, shape ops and embeddings, written as PyTorch writes its
own (``instantiate_device_type_tests``, instantiated for the PrivateUse1 device only: class
``TestViewsIndexingShapesPRIVATEUSE1``), each checked against CPU torch. torch_tpu is imported
first so that ``common_device_type`` sees the renamed backend."""

from __future__ import annotations

import warnings

# isort: off
import torch_tpu  # noqa: F401  (before common_device_type)
import torch
import torch.nn.functional as F
from torch.testing._internal.common_device_type import dtypes, instantiate_device_type_tests
from torch.testing._internal.common_utils import TestCase
# isort: on

def _tensor(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(-5, 10, shape, generator=generator).to(dtype)


class TestViewsIndexingShapes(TestCase):
    exact_dtype = True

    def assert_view_of(self, base, view):
        self.assertTrue(view._is_view() and view._base is base)
        self.assertEqual(view.untyped_storage().data_ptr(), base.untyped_storage().data_ptr())

    def assert_like_cpu(self, fn, *host, strides=True):
        expected = fn(*host)
        got = fn(*(h.to(self.device_type) for h in host))
        self.assertEqual(got.device.type, self.device_type)
        self.assertEqual(got.cpu(), expected)
        if strides:
            self.assertEqual(got.stride(), expected.stride())

    # --- views ------------------------------------------------------------------------------------

    @dtypes(torch.float32, torch.int64, torch.bool)
    def test_views_alias_and_match_cpu_layouts(self, device, dtype):
        host = _tensor((4, 5, 6), dtype)
        views = [lambda t: t.transpose(0, 2), lambda t: t.permute(2, 0, 1), lambda t: t[1:, ::2, 3],
                 lambda t: t.narrow(1, 1, 3), lambda t: t.unsqueeze(1).expand(4, 3, 5, 6), lambda t: t.view(20, 6),
                 lambda t: t.diagonal(0, 1, 2), lambda t: t.unflatten(2, (2, 3)), lambda t: t.select(-1, 2),
                 lambda t: t.as_strided((3, 3), (7, 2), 4), lambda t: t.movedim(0, -1), lambda t: t.unfold(2, 2, 2)]
        for view in views:
            x = host.to(device)
            v = view(x)
            self.assert_view_of(x, v)
            self.assertEqual(v.stride(), view(host).stride())
            self.assertEqual(v.cpu(), view(host))

    def test_expand_strides_of_new_size_one_dims_are_cpus(self, device):
        # CPU gives a new leading dim of size 1 the stride of a dim above the next one, not 0,
        # and a 0-d tensor's expansion strides 0 throughout
        sizes = ((), (1,), (2,), (1, 1), (3, 1), (3, 2), (4, 1, 1), (4, 3, 2))
        for i, source in enumerate(sizes):
            for target in sizes[i + 1:]:
                host = _tensor(source, torch.float32)
                try:
                    expected = torch.broadcast_to(host, target)
                except RuntimeError:
                    continue
                got = torch.broadcast_to(host.to(device), target)
                self.assertEqual((got.shape, got.stride()), (expected.shape, expected.stride()))
                self.assertEqual(got.cpu(), expected)

    def test_writes_through_views_reach_the_base(self, device):
        host = torch.zeros(3, 4)
        x = host.to(device)
        for t in (host, x):
            t.t()[1].fill_(2.0)
            t[:, ::2] += 1
            t.unsqueeze(0).expand(2, 3, 4)[0, 2].mul_(3)
        self.assertEqual(x.cpu(), host)

    def test_conj_self_and_conj_view(self, device):
        t = torch.ones(5, 5, device=device)
        self.assertTrue(t.conj() is t)
        z = torch.randn(3, dtype=torch.complex64, device=device)
        c = z.conj()
        self.assertTrue(c.is_conj() and c._base is z)
        self.assertEqual(c.cpu(), z.cpu().conj())

    def test_view_errors_as_on_cpu(self, device):
        x = torch.randn(2, 3, 4, device=device)
        with self.assertRaises(IndexError):
            x.transpose(0, 3)
        with self.assertRaises(IndexError):
            x.select(3, 0)
        with self.assertRaises(RuntimeError):
            x.permute(0, 0, 1)
        with self.assertRaises(RuntimeError):
            x.t().view(-1)
        with self.assertRaises(RuntimeError):
            x.expand(3, 3, 4)

    # --- indexing ---------------------------------------------------------------------------------

    @dtypes(torch.float32, torch.int32)
    def test_advanced_indexing_matches_cpu(self, device, dtype):
        host = _tensor((5, 4, 3), dtype)
        rows = torch.tensor([4, 0, -1, 2])
        mask = torch.tensor([True, False, True, True, False])
        for fn in (lambda x: x[rows.to(x.device)], lambda x: x[:, [1, -1]], lambda x: x[mask.to(x.device)],
                   lambda x: x[rows.to(x.device)[:, None], torch.tensor([0, 2], device=x.device)],
                   lambda x: x[..., 1], lambda x: x[None, 1:3, ..., None], lambda x: x[x > 0],
                   lambda x: x.index_select(1, torch.tensor([3, 0], device=x.device)),
                   lambda x: x.gather(2, torch.zeros(5, 4, 2, dtype=torch.long, device=x.device)),
                   lambda x: x.take(torch.tensor([0, 59, -60], device=x.device))):
            self.assert_like_cpu(fn, host)

    def test_index_put_and_scatter_match_cpu(self, device):
        host = torch.zeros(4, 3)
        index = torch.tensor([[0, 1, 2], [3, 3, 0]])
        for fn in (lambda x: x.index_put_((torch.tensor([1, 1], device=x.device),), torch.ones(3, device=x.device),
                                          accumulate=True),
                   lambda x: x.scatter_add_(0, index.to(x.device), torch.ones(2, 3, device=x.device)),
                   lambda x: x.scatter_(1, index.to(x.device)[:, :2] % 3, 5.0),
                   lambda x: x.index_fill_(1, torch.tensor([2], device=x.device), -1.0),
                   lambda x: x.masked_fill_(torch.eye(4, 3, dtype=torch.bool, device=x.device), 9.0)):
            self.assert_like_cpu(lambda x: fn(x.clone()), host)

    def test_indexing_with_host_index_tensors(self, device):
        x = torch.arange(20.0).reshape(5, 4)
        index, mask = torch.tensor([3, 1]), torch.tensor([False, True, True, False, True])
        self.assertEqual(x.to(device)[index].cpu(), x[index])
        self.assertEqual(x.to(device)[mask].cpu(), x[mask])

    def test_uint8_masks_are_masks(self, device):
        x = torch.arange(8.0).reshape(4, 2)
        mask = torch.tensor([1, 0, 0, 1], dtype=torch.uint8)
        with self.assertWarnsRegex(UserWarning, "uint8"):
            got = x.to(device)[mask.to(device)]
        self.assertEqual(got.cpu(), x[mask.bool()])

    def test_uint8_masks_warn_once_each_on_every_call(self, device):
        # the lowering runs once per trace: a warning from it came 0..n times per call
        host = torch.randn(5, 7, 3)
        masks = (torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8), torch.tensor([1, 1, 1], dtype=torch.uint8))
        for x, (m1, m2) in ((host, masks), (host.to(device), [m.to(device) for m in masks])) * 2:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertEqual(x[m1, :, m2].shape, (3, 7))
                x.clone()[m1, :, m2] = torch.ones(3, 7, device=x.device)
            self.assertEqual(len(caught), 4)

    def test_index_with_no_indices_raises(self, device):
        self.assert_raises_like_cpu(lambda t: torch.ops.aten.index.Tensor(t, []), torch.tensor([1.0]))

    def test_out_of_range_indices_raise(self, device):
        x = torch.randn(4, 3, device=device)
        bad = torch.tensor([4], device=device)
        for fn, error in ((lambda: x[bad], IndexError), (lambda: x[:, bad], IndexError),
                          (lambda: x.index_select(0, bad), IndexError),
                          (lambda: x.gather(0, bad[None]), RuntimeError),
                          (lambda: x.clone().index_put_((bad,), torch.ones(3, device=device)), IndexError),
                          (lambda: x.take(bad * 3), IndexError), (lambda: F.embedding(bad, x), IndexError)):
            with self.assertRaises(error):
                fn().cpu()

    # --- shape ops --------------------------------------------------------------------------------

    @dtypes(torch.float32, torch.int64)
    def test_shape_ops_match_cpu(self, device, dtype):
        host = _tensor((3, 4, 2), dtype)
        for fn in (lambda x: x.flip(0, 2), lambda x: x.flip(-1), lambda x: x.roll(1, 1),
                   lambda x: x.roll((1, -2), (0, 1)), lambda x: x.rot90(1, (0, 1)), lambda x: torch.cat([x, x], 1),
                   lambda x: torch.stack([x, x], -1), lambda x: x.repeat(2, 1, 1), lambda x: x.tril(),
                   lambda x: x.triu(1), lambda x: x.reshape(4, 6), lambda x: x.flatten(1),
                   lambda x: x.transpose(1, 2).contiguous(), lambda x: x.sort(1).values,
                   lambda x: x.cumsum(2), lambda x: torch.tensor_split(x, 3, 1)[1].contiguous()):
            self.assert_like_cpu(fn, host)
        self.assert_like_cpu(torch.nonzero, host, strides=False)  # CPU's result is column-major

    def test_shape_op_dim_errors(self, device):
        x = torch.randn(2, 3, 4, device=device)
        for fn in (lambda: x.flip(3), lambda: x.roll(1, 3), lambda: x.sum(3), lambda: x.squeeze(5)):
            with self.assertRaises(IndexError):
                fn()
        with self.assertRaises(RuntimeError):
            torch.nonzero(x, out=torch.empty(0, device=device))

    # --- embeddings -------------------------------------------------------------------------------

    def test_embedding_forward_backward_matches_cpu(self, device):
        torch.manual_seed(0)
        host = torch.nn.Embedding(10, 3, padding_idx=1)
        module = torch.nn.Embedding(10, 3, padding_idx=1).to(device)
        module.load_state_dict(host.state_dict())
        ids = torch.tensor([[1, 2, 2], [9, 0, 1]])
        host(ids).pow(2).sum().backward()
        module(ids.to(device)).pow(2).sum().backward()
        self.assertEqual(module.weight.grad.cpu(), host.weight.grad)

    def test_embedding_bag_matches_cpu(self, device):
        weight = torch.randn(10, 3)
        ids, offsets, psw = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2, 2]), torch.rand(6)
        for mode in ("sum", "mean", "max"):
            kwargs = {"per_sample_weights": psw} if mode == "sum" else {}
            expected = F.embedding_bag(ids, weight, offsets, mode=mode, **kwargs)
            got = F.embedding_bag(ids.to(device), weight.to(device), offsets.to(device), mode=mode,
                                  **{k: v.to(device) for k, v in kwargs.items()})
            self.assertEqual(got.cpu(), expected)
        with self.assertRaises(ValueError):
            F.embedding_bag(ids.to(device), weight.to(device), offsets.to(device), mode="sum",
                            per_sample_weights=psw[:3].to(device))

    # --- value checks and layouts PyTorch's own device tests found (issue 30) ---------------------

    def assert_raises_like_cpu(self, fn, *host):
        """``fn`` raises on CPU; the same exception type (and message) on the device."""
        try:
            fn(*host)
        except Exception as error:  # noqa: BLE001
            with self.assertRaisesRegex(type(error), str(error).splitlines()[0][:40].replace("(", r"\(")
                                        .replace(")", r"\)").replace("[", r"\[")):
                got = fn(*(h.to(self.device_type) for h in host))
                got.cpu()
            return
        raise AssertionError("expected CPU to raise")

    def test_index_copy_rejects_negative_and_large_indices(self, device):
        dest, src = torch.zeros(3, 5), torch.ones(3, 8)
        for bad in (-1, 5, -6):
            index = torch.full((8,), bad)
            self.assert_raises_like_cpu(lambda d, i, s: d.index_copy_(1, i, s), dest, index, src)
            self.assert_raises_like_cpu(lambda d, i, s: torch.index_copy(d, 1, i, s), dest, index, src)
        index = torch.tensor([4, 0, 2])
        self.assert_like_cpu(lambda d, i, s: d.index_copy(1, i, s), dest, index, src[:, :3])

    def test_one_hot_checks_class_values(self, device):
        for classes, num in (([0, 3], 3), ([0, -1], 3), ([2, -4], -1)):
            self.assert_raises_like_cpu(lambda c: F.one_hot(c, num), torch.tensor(classes))
        self.assert_like_cpu(lambda c: F.one_hot(c, 4), torch.tensor([[0, 3], [1, 1]]))
        self.assert_like_cpu(lambda c: F.one_hot(c), torch.tensor([2, 0]))

    def test_embedding_bag_offsets_are_checked(self, device):
        weight, ids = torch.randn(10, 3), torch.tensor([1, 2, 3, 4])
        # CPU checks the first and last offset everywhere; whether it catches decreasing offsets
        # depends on which kernel the host CPU gets, the tpu device always refuses them
        for offsets in ([1, 2], [0, 5], [0, 3, 1]):
            if offsets != [0, 3, 1]:
                with self.assertRaises(RuntimeError):
                    F.embedding_bag(ids, weight, torch.tensor(offsets))
            with self.assertRaises(RuntimeError):
                F.embedding_bag(ids.to(device), weight.to(device), torch.tensor(offsets, device=device)).cpu()
        self.assert_raises_like_cpu(lambda i, w, o: F.embedding_bag(i, w, o, include_last_offset=True),
                                    ids, weight, torch.tensor([0, 2, 6]))

    def test_embedding_bag_ranks_are_checked_before_index_values(self, device):
        # index 2 is out of range for a [2, 2, 2] weight: CPU names the weight's rank first
        for bag in (lambda w, i, o: torch.embedding_bag(w, i, o), torch._embedding_bag_forward_only):
            self.assert_raises_like_cpu(bag, torch.zeros(2, 2, 2), torch.tensor([2, 2]), torch.tensor([0, 0]))
            self.assert_raises_like_cpu(bag, torch.zeros(2, 2), torch.tensor([2, 2]), torch.zeros(1, 2).long())
            self.assert_raises_like_cpu(bag, torch.zeros(2, 2), torch.full((1, 1, 2), 2), torch.tensor([0]))

    def test_embedding_bag_include_last_offset_short_of_the_indices(self, device):
        # the last offset ends the last bag's sum; CPU's mean divides by the entries to the end of
        # the indices and its max takes them too: the same values here
        weight, ids, offsets = torch.randn(10, 3), torch.tensor([1, 2, 3, 7]), torch.tensor([0, 1, 2])
        for mode in ("sum", "mean", "max"):
            self.assert_like_cpu(lambda i, w, o: F.embedding_bag(i, w, o, mode=mode, include_last_offset=True),
                                 ids, weight, offsets, strides=False)

    def test_embedding_bag_with_every_bag_empty(self, device):
        # no indices at all: zeros (max mode gathered its argmax from the empty indices and failed)
        weight, ids = torch.randn(5, 3), torch.tensor([], dtype=torch.long)
        for mode, psw, last in (("sum", False, False), ("sum", True, True), ("mean", False, True),
                                ("max", False, False), ("max", False, True)):
            offsets = torch.zeros(4 if last else 3, dtype=torch.long)
            kwargs = {"per_sample_weights": torch.tensor([])} if psw else {}
            for compiled in (False, True):
                def bag(i, w, o, *p, mode=mode, last=last):
                    return F.embedding_bag(i, w, o, mode=mode, include_last_offset=last,
                                           per_sample_weights=p[0] if p else None)
                fn = torch.compile(bag, backend="tpu", fullgraph=True) if compiled else bag
                host = (ids, weight.clone().requires_grad_(), offsets, *kwargs.values())
                dev = (ids.to(device), weight.to(device).requires_grad_(), offsets.to(device),
                       *(v.to(device) for v in kwargs.values()))
                expected, got = bag(*host), fn(*dev)
                self.assertEqual(got.cpu(), expected)
                expected.sum().backward()
                got.sum().backward()
                self.assertEqual(dev[1].grad.cpu(), host[1].grad)

    def test_compiled_functions_creating_empty_and_one_element_tensors(self, device):
        # Dynamo lifts them as constants of stride 0, which the graph's cache key failed to hash
        # (T5's attention creates torch.tensor([]) this way)
        def fn(x):
            empty = torch.tensor([], dtype=x.dtype, device=x.device)
            one = torch.tensor([2.0], dtype=x.dtype, device=x.device)
            return torch.cat([empty, x.reshape(-1)]) * one

        host = torch.randn(3, 2)
        self.assertEqual(torch.compile(fn, backend="tpu")(host.to(device)).cpu(), fn(host))

    def test_nonzero_and_argwhere_strides_are_cpus(self, device):
        host = _tensor((2, 3, 4), torch.float32) > 0
        self.assert_like_cpu(torch.nonzero, host)
        self.assert_like_cpu(torch.argwhere, host.float())
        self.assert_like_cpu(torch.nonzero, torch.zeros(3, 4))  # no hits: strides (1, 0)
        self.assert_like_cpu(torch.nonzero, torch.tensor(2.0))

    def test_out_dtypes_meta_kernels_accept_are_refused_as_on_cpu(self, device):
        x = torch.randn(4, 5)
        calls = [
            lambda x: torch.sort(x, out=(torch.empty_like(x), torch.empty_like(x))),
            lambda x: torch.sort(x, out=(torch.empty_like(x), torch.empty_like(x, dtype=torch.int32))),
            lambda x: torch.kthvalue(x, 2, out=(torch.empty(4, device=x.device), torch.empty(4, device=x.device))),
            lambda x: torch.median(x, 1, out=(torch.empty(4, device=x.device), torch.empty(4, device=x.device))),
            lambda x: torch.cummax(x, 1, out=(torch.empty_like(x), torch.empty_like(x))),
        ]
        for call in calls:
            self.assert_raises_like_cpu(call, x)
        values, indices = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
        torch.sort(x.to(device), out=(values, indices))
        self.assertEqual(indices.cpu(), torch.sort(x).indices)

    def test_randperm_on_the_device(self, device):
        # it recursed (randperm -> randperm.out -> randperm ...) before it had a lowering
        for dtype in (torch.int64, torch.float32):
            perm = torch.randperm(7, dtype=dtype, device=device)
            self.assertEqual(perm.dtype, dtype)
            self.assertEqual(perm.cpu().sort().values, torch.arange(7, dtype=dtype))
        self.assertEqual(torch.randperm(0, device=device).shape, (0,))

    def test_index_fill_refuses_a_complex_value_for_bool(self, device):
        self.assert_raises_like_cpu(lambda x, i: x.index_fill_(0, i, 1 + 1j), torch.zeros(3, dtype=torch.bool),
                                    torch.tensor([0]))


instantiate_device_type_tests(TestViewsIndexingShapes, globals(), only_for="privateuse1")
