"""Dense PyTorch reference: F.embedding_bag with per-sample weights, optimizers written by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsecore import optimizers as opt
from sparsecore.stacking import StackingPlan
from sparsecore.validation import FeatureInput


def reference_gains(x: FeatureInput, combiner: str) -> torch.Tensor:
    w = torch.from_numpy(x.weights).double()
    sample = torch.repeat_interleave(torch.arange(x.lengths.size), torch.from_numpy(x.lengths))
    if combiner == "sum":
        return w.float()
    totals = torch.zeros(x.lengths.size, dtype=torch.float64)
    totals.index_add_(0, sample, w if combiner == "mean" else w * w)
    norm = totals if combiner == "mean" else totals.sqrt()
    return (w / norm[sample]).float()


def reference_forward(plan: StackingPlan, weights: dict[str, torch.Tensor], inputs: dict[str, FeatureInput]):
    out = {}
    for f in plan.features:
        x = inputs[f.name]
        offsets = torch.from_numpy(x.lengths).cumsum(0) - torch.from_numpy(x.lengths)
        out[f.name] = F.embedding_bag(torch.from_numpy(x.ids), weights[f.table], offsets, mode="sum",
                                      per_sample_weights=reference_gains(x, plan.tables[f.table].combiner))
    return out


class ReferenceModel:
    """Dense weights + slots; one ``step`` = forward, autograd backward, hand-written update of
    the rows the batch touched."""

    def __init__(self, plan: StackingPlan, weights: dict[str, torch.Tensor]):
        self.plan = plan
        self.weights = {k: v.clone().double() for k, v in weights.items()}
        self.slots = {name: {slot: torch.full((spec.vocab_size,) if slot in spec.optimizer.row_slots
                                              else (spec.vocab_size, spec.dim), value, dtype=torch.float64)
                             for slot, value in spec.optimizer.slot_initial_values().items()}
                      for name, spec in plan.tables.items()}
        self.t = 0

    def step(self, inputs: dict[str, FeatureInput], upstream: dict[str, torch.Tensor]):
        self.t += 1
        leaves = {k: v.clone().float().requires_grad_(True) for k, v in self.weights.items()}
        acts = reference_forward(self.plan, leaves, inputs)
        sum((acts[k] * upstream[k]).sum() for k in acts).backward()
        for name, spec in self.plan.tables.items():
            touched = torch.zeros(spec.vocab_size, dtype=torch.bool)
            for f in self.plan.features:
                if f.table == name:
                    touched[torch.from_numpy(inputs[f.name].ids)] = True
            g = leaves[name].grad.double()[touched]
            w, s = self.weights[name][touched], {k: v[touched] for k, v in self.slots[name].items()}
            w, s = self._update(spec.optimizer, w, s, g, spec.dim)
            self.weights[name][touched] = w
            for k in s:
                self.slots[name][k][touched] = s[k]
        return {k: v.detach() for k, v in acts.items()}

    def _update(self, o, w, s, g, dim):
        lr = o.learning_rate
        if isinstance(o, opt.RowWiseAdagrad):
            acc = s["accumulator"] + (g * g).sum(1) / dim
            return w - lr * g / (acc.sqrt()[:, None] + o.eps), {"accumulator": acc}
        if isinstance(o, opt.Adagrad):
            acc = s["accumulator"] + g * g
            return w - lr * g / (acc.sqrt() + o.eps), {"accumulator": acc}
        if isinstance(o, opt.Adam):
            m = o.beta_1 * s["momentum"] + (1 - o.beta_1) * g
            v = o.beta_2 * s["velocity"] + (1 - o.beta_2) * g * g
            m_hat, v_hat = m / (1 - o.beta_1**self.t), v / (1 - o.beta_2**self.t)
            return w - lr * m_hat / (v_hat.sqrt() + o.epsilon), {"momentum": m, "velocity": v}
        if isinstance(o, opt.FTRL):
            acc = s["accumulator"] + g * g
            k = -o.learning_rate_power
            lin = s["linear"] + g - (acc**k - s["accumulator"] ** k) / lr * w
            l1, l2 = o.l1_regularization_strength, o.l2_regularization_strength
            num = torch.clamp(lin, -l1, l1) - lin
            return num / ((acc**k + o.beta) / lr + 2 * l2), {"accumulator": acc, "linear": lin}
        return w - lr * g, {}
