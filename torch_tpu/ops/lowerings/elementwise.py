"""Elementwise lowerings: arithmetic, comparisons, unary math, where/clamp/lerp/addcmul."""

from __future__ import annotations

import numpy as np
import torch

from torch_tpu.ops.lowerings._common import (
    cast,
    float_dtype,
    floated,
    is_one,
    opmath,
    promoted,
    result_dtype,
)
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten
lax = jax.lax


def _check_alpha(x, alpha) -> None:
    if type(alpha) is float and not jnp.issubdtype(x.dtype, jnp.inexact):  # torch refuses, not truncates
        raise ValueError("For integral input tensors, argument alpha must not be a floating point number.")


def _scaled(x, alpha):
    _check_alpha(x, alpha)
    return x if is_one(alpha) else x * cast(alpha, x.dtype)


def _plus_scaled(x, y, alpha, sign: int):
    """``x + sign * alpha * y`` of promoted operands. bfloat16/float16: in float32, rounded once,
    alpha first rounded to their dtype, as CPU's add kernel takes it (rounding the product, then
    the sum, was off by an ulp in a third of the elements)."""
    if is_one(alpha):
        return x + y if sign > 0 else x - y
    dtype = result_dtype(x, y)
    x, y = cast(x, dtype), cast(y, dtype)
    _check_alpha(y, alpha)
    return opmath(lambda a, b, s: a + b * s if sign > 0 else a - b * s, x, y, cast(alpha, dtype))


@register_lowering(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=1):
    return _plus_scaled(*promoted(self, other), alpha, 1)


@register_lowering(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=1):
    return _plus_scaled(*promoted(self, other), alpha, -1)


@register_lowering(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=1):
    a, b = promoted(self, other)
    return _plus_scaled(b, a, alpha, -1)


@register_lowering(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    a, b = promoted(self, other)
    return a * b


@register_lowering(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(self, other):
    a, b = floated(self, other)
    return a / b


@register_lowering(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(self, other, *, rounding_mode=None):
    if rounding_mode is None:
        return div(self, other)
    a, b = promoted(self, other)
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b)
    if rounding_mode != "trunc":
        raise ValueError("div expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
                         f"'{rounding_mode}'")
    if jnp.issubdtype(a.dtype, jnp.integer):
        q = jnp.floor_divide(a, b)
        return jnp.where((q < 0) & (q * b != a), q + 1, q)
    return jnp.trunc(a / b)


def _on_promoted(fn):
    """The lowering of a binary op that is ``fn`` of its operands at their promoted dtype."""

    def lowering(self, other):
        return fn(*promoted(self, other))

    lowering.__qualname__ = fn.__name__
    return lowering


register_lowering(aten.floor_divide.default, aten.floor_divide.Scalar)(_on_promoted(jnp.floor_divide))
register_lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)(
    _on_promoted(jnp.remainder))
register_lowering(aten.fmod.Tensor, aten.fmod.Scalar)(_on_promoted(jnp.fmod))


@register_lowering(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow(self, exponent):
    if isinstance(exponent, int) and not isinstance(exponent, bool) and isinstance(self, jax.Array):
        if 0 <= exponent <= 4 or (exponent < 0 and jnp.issubdtype(self.dtype, jnp.inexact)):
            return lax.integer_pow(self, exponent)
    a, b = promoted(self, exponent)
    return jnp.power(a, b)


def _binary(jfn, *, floating: bool = False):
    def lowering(self, other):
        a, b = (floated if floating else promoted)(self, other)
        return jfn(a, b)

    return lowering


for _name, _fn, _floating in [
    ("maximum", jnp.maximum, False),
    ("minimum", jnp.minimum, False),
    ("fmax", jnp.fmax, False),
    ("fmin", jnp.fmin, False),
    ("atan2", jnp.arctan2, True),
    ("hypot", jnp.hypot, True),
    ("logaddexp", jnp.logaddexp, True),
    ("nextafter", jnp.nextafter, False),
]:
    register_lowering(getattr(aten, _name).default)(_binary(_fn, floating=_floating))

register_lowering(aten.copysign.Tensor, aten.copysign.Scalar)(_binary(jnp.copysign, floating=True))
register_lowering(aten.xlogy.Tensor, aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self)(
    _binary(jax.scipy.special.xlogy, floating=True)
)
for _name, _fn in [("bitwise_and", jnp.bitwise_and), ("bitwise_or", jnp.bitwise_or), ("bitwise_xor", jnp.bitwise_xor)]:
    _packet = getattr(aten, _name)
    register_lowering(_packet.Tensor, _packet.Scalar, _packet.Scalar_Tensor)(_binary(_fn))
for _name, _fn in [("logical_and", jnp.logical_and), ("logical_or", jnp.logical_or), ("logical_xor", jnp.logical_xor)]:
    register_lowering(getattr(aten, _name).default)(lambda self, other, _fn=_fn: _fn(self, other))


def _compare(jfn):
    def lowering(self, other):
        a, b = promoted(self, other)
        return jfn(a, b)

    return lowering


for _name, _fn in [("eq", jnp.equal), ("ne", jnp.not_equal), ("lt", jnp.less), ("le", jnp.less_equal),
                   ("gt", jnp.greater), ("ge", jnp.greater_equal)]:
    _packet = getattr(aten, _name)
    register_lowering(_packet.Tensor, _packet.Scalar)(_compare(_fn))


# --- unary -----------------------------------------------------------------------------------


def _float_unary(jfn):
    def lowering(self):
        return jfn(cast(self, float_dtype(self)))

    return lowering


def _same_unary(jfn):
    def lowering(self):
        return jfn(self)

    return lowering


_special = jax.scipy.special
for _name, _fn in [
    ("exp", jnp.exp), ("exp2", jnp.exp2), ("expm1", jnp.expm1), ("log", jnp.log), ("log1p", jnp.log1p),
    ("log2", jnp.log2), ("log10", jnp.log10), ("sqrt", jnp.sqrt), ("rsqrt", lax.rsqrt), ("sin", jnp.sin),
    ("cos", jnp.cos), ("tan", jnp.tan), ("tanh", jnp.tanh), ("sinh", jnp.sinh), ("cosh", jnp.cosh),
    ("asin", jnp.arcsin), ("acos", jnp.arccos), ("atan", jnp.arctan), ("asinh", jnp.arcsinh),
    ("acosh", jnp.arccosh), ("atanh", jnp.arctanh), ("sigmoid", jax.nn.sigmoid), ("erf", _special.erf),
    ("erfc", _special.erfc), ("erfinv", _special.erfinv), ("reciprocal", lambda x: 1 / x),
    ("lgamma", _special.gammaln),
    ("digamma", lambda x: jnp.where(x == 0, jnp.copysign(jnp.inf, -x), _special.digamma(x))), ("sinc", jnp.sinc),
    ("deg2rad", jnp.deg2rad), ("rad2deg", jnp.rad2deg), ("i0", _special.i0), ("special_i1", _special.i1),
]:
    register_lowering(getattr(aten, _name).default)(_float_unary(_fn))


def _trigamma(x):
    """CPU's calc_trigamma (ATen's Math.h): the reflection formula below 0.5, six recurrence steps,
    then the asymptotic series (``jax.scipy.special.polygamma(1, x)`` is wrong for x < 0)."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(np.pi * x)
    result = jnp.where(reflect, -(np.pi * np.pi) / (sin_pi_x * sin_pi_x), 0)
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result)


@register_lowering(aten.polygamma.default, graph_only=True)
def polygamma(n, self):
    """Orders 0 (digamma) and 1 (trigamma, digamma's derivative), for graphs: torch.compile's fx_to_jax
    refuses higher orders (CPU sums a Hurwitz zeta series that JAX's zeta does not follow for x < 0),
    and eager dispatch keeps its CPU-exact path for every order."""
    x = cast(self, float_dtype(self))
    if n == 0:
        return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), _special.digamma(x))
    if n == 1:
        return _trigamma(x)
    raise ValueError(f"polygamma of order {n} has no lowering")


def _integral_identity(jfn):
    def lowering(self):
        return self if not jnp.issubdtype(self.dtype, jnp.inexact) else jfn(self)

    return lowering


for _name, _fn in [("floor", jnp.floor), ("ceil", jnp.ceil), ("trunc", jnp.trunc), ("round", jnp.round)]:
    register_lowering(getattr(aten, _name).default)(_integral_identity(_fn))


@register_lowering(aten.round.decimals)
def round_decimals(self, *, decimals=0):
    return jnp.round(self, decimals)


@register_lowering(aten.frac.default)
def frac(self):
    return self - jnp.trunc(self)


@register_lowering(aten.abs.default)
def abs_(self):
    return self if self.dtype == np.bool_ else jnp.abs(self)


@register_lowering(aten.sign.default, aten.sgn.default)
def sign(self):
    return self if self.dtype == np.bool_ else jnp.sign(self)


for _name, _fn in [("signbit", jnp.signbit), ("isnan", jnp.isnan), ("isinf", jnp.isinf),
                   ("isfinite", jnp.isfinite), ("logical_not", jnp.logical_not), ("neg", jnp.negative)]:
    register_lowering(getattr(aten, _name).default)(_same_unary(_fn))


@register_lowering(aten.bitwise_not.default)
def bitwise_not(self):
    return jnp.logical_not(self) if self.dtype == np.bool_ else jnp.bitwise_not(self)


@register_lowering(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        return self
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# --- ternary and friends ---------------------------------------------------------------------


@register_lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(condition, self, other):
    a, b = promoted(self, other)
    return jnp.where(condition, a, b)


@register_lowering(aten.clamp.default, aten.clamp.Tensor)
def clamp(self, min=None, max=None):
    if min is None and max is None:
        raise ValueError("torch.clamp: At least one of 'min' or 'max' must not be None")
    dt = result_dtype(self, min, max)
    out = cast(self, dt)
    if min is not None:
        out = jnp.maximum(out, cast(min, dt))
    if max is not None:
        out = jnp.minimum(out, cast(max, dt))
    return out


@register_lowering(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):
    return clamp(self, min=min)


@register_lowering(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):
    return clamp(self, max=max)


def _interpolate(a, b, w):
    diff = b - a
    return jnp.where(jnp.abs(w) < 0.5, a + w * diff, b - diff * (1 - w))


@register_lowering(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    """bfloat16/float16 in float32, rounded once; a scalar weight (a Python number, or one the op
    cache traces: weakly typed) in float32 unrounded, as CPU's opmath takes it."""
    if isinstance(weight, (int, float)) or getattr(weight, "weak_type", False):
        return opmath(lambda a, b: _interpolate(a, b, cast(weight, a.dtype)), *promoted(self, end))
    return opmath(_interpolate, *promoted(self, end, weight))


@register_lowering(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, value=1):
    return opmath(lambda a, t1, t2: a + _scaled(t1 * t2, value), *promoted(self, tensor1, tensor2))


@register_lowering(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, value=1):
    operands = promoted(self, tensor1, tensor2)
    if jnp.issubdtype(operands[0].dtype, jnp.integer):
        raise ValueError("Integer division with addcdiv is no longer supported")
    return opmath(lambda a, t1, t2: a + _scaled(t1 / t2, value), *operands)


@register_lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    return jnp.where(mask, cast(value, self.dtype), self)
