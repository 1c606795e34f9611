"""The fused MLP's two epilogue products (`fused_mlp quack`, auto's choice where they run) through the
quack-kernels package's CuTe GEMMs, which flash-attn-4 installs (Hopper and Blackwell).

LeakyReLU² with the model's slope joins quack's activations, so its GEMM with an activation
stores the up product and the activation in one epilogue, and its GEMM with an activation's
derivative brings the gradient back through the down projection, multiplied by the
derivative at the stored product: with the forward's activation kept for the down
projection's weight gradient (`leaky_square_grad`, an epilogue of windowgpt's through quack's
epilogue frontend) it stores the gradient alone; without, it stores the activation again on
the way (`leaky_square_back`), so that the forward's copy need not be kept. windowgpt's
own Triton products (`elementwise`) run at about half cuBLAS's rate at the training step's
shapes; quack's are warp-specialized TMA kernels whose epilogue overlaps the next tile's
products (how near cuBLAS they come here, `bench/fused_products.py --training` measures).

Importing this module imports neither quack nor CUTLASS: `quack_loads` and the products do.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import types
from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import ConfigError
from ..runtime import hopper_or_blackwell, imports_cleanly


def quack_available() -> bool:
    return importlib.util.find_spec("quack") is not None


@functools.cache
def quack_loads() -> bool:
    """Whether quack's GEMM interface imports (a package built for another CUDA does not)."""
    return quack_available() and imports_cleanly(
        lambda: [importlib.import_module(module) for module in ("quack.activation", "quack.gemm_interface")])


def quack_targets(device: torch.device) -> bool:
    """Whether quack's products run here: a Hopper or Blackwell GPU with the package loading."""
    return hopper_or_blackwell(device) and quack_loads()


def leaky_square_epilogues(slope: float, larger: Callable[[Any, Any], Any]) -> tuple[Callable, Callable]:
    """(activation, derivative) of LeakyReLU(slope)² for 0 <= slope <= 1, as quack's epilogues
    call them: on float32 values or pairs of them, `larger` their element-wise maximum (the
    same bodies run on tensors in the tests).

    LeakyReLU(slope)(x) = max(x, slope x) for such a slope, and the derivative of its square,
    2 leaky(x) leaky'(x), is 2x above zero and 2 (slope x) slope below it: 2 max(x, slope² x).
    derivative(x, dout) gives (dout times that, the activation at x)."""
    def activation(x):
        if isinstance(x, tuple):
            return tuple(activation(value) for value in x)
        leaky = larger(x, x * slope)
        return leaky * leaky

    def derivative(x, dout):
        if isinstance(x, tuple):
            pairs = [derivative(value, grad) for value, grad in zip(x, dout)]
            return tuple(pair[0] for pair in pairs), tuple(pair[1] for pair in pairs)
        return dout * (2.0 * larger(x, x * (slope * slope))), activation(x)

    return activation, derivative


def code_digest(code: types.CodeType) -> str:
    """A digest of what a function's code computes: its bytecode, names and constants, the
    functions defined inside it included (their source may not be beside them)."""
    parts = [code.co_code, repr(code.co_names).encode()]
    parts += [code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode()
              for const in code.co_consts]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def epilogue_name(slope: float) -> str:
    """The name LeakyReLU(slope)²'s epilogues are registered and known by. quack's compile
    cache keys an epilogue that cutlass's decorator wraps by its qualified name alone (it takes
    the wrapper for installed library code), on disk too: so the name carries the slope and a
    digest of the formulas, and no kernel built for another slope or older formulas is reused."""
    digest = code_digest(leaky_square_epilogues.__code__)[:12]
    return f"windowgpt_leaky_square_{repr(float(slope)).replace('.', 'p').replace('-', 'm')}_{digest}"


def register_epilogues(slope: float, larger: Callable[[Any, Any], Any], user_op: Callable[[Callable], Callable],
                       activations: dict, derivatives: dict) -> str:
    """Registers LeakyReLU(slope)² and its derivative, each wrapped by `user_op` (cutlass's
    `dsl_user_op`) under `epilogue_name(slope)`, in quack's activation and derivative tables;
    returns the name."""
    forward, backward = leaky_square_epilogues(slope, larger)
    name = epilogue_name(slope)

    def leaky_square(x, *, loc=None, ip=None):
        return forward(x)

    def leaky_square_derivative(x, dout, *, loc=None, ip=None):
        return backward(x, dout)

    for function, qualname in ((leaky_square, name), (leaky_square_derivative, f"{name}_derivative")):
        function.__name__ = function.__qualname__ = qualname  # before wrapping: the wrapper copies it
    activations[name] = user_op(leaky_square)
    derivatives[name] = user_op(leaky_square_derivative)
    return name


@functools.cache
def quack_activation(slope: float) -> str:
    """Registers LeakyReLU(slope)² and its derivative among quack's activations (once per
    slope); the name its GEMMs take."""
    from cutlass import Float32
    from cutlass._mlir.dialects import arith
    from cutlass.cutlass_dsl import dsl_user_op
    from quack import activation as activations

    def larger(a, b):  # max.f32, as quack's own ReLU computes it
        return Float32(arith.maxnumf(Float32(a).ir_value(), Float32(b).ir_value()))

    return register_epilogues(slope, larger, dsl_user_op, activations.act_fn_map, activations.dact_fn_map)


def quack_fits(x: Tensor, up_w: Tensor, down_w: Tensor) -> bool:
    """Whether quack's products take these operands: bf16, x [rows, dim] contiguous, up_w
    [mlp_dim, dim] and down_w [dim, mlp_dim], each row a whole number of 16-byte vectors."""
    return (x.dim() == 2 and x.is_contiguous() and all(t.dtype == torch.bfloat16 for t in (x, up_w, down_w))
            and up_w.size(1) == x.size(1) and down_w.shape == (up_w.size(1), up_w.size(0))
            and x.size(1) % 8 == 0 and up_w.size(0) % 8 == 0)


class QuackUnavailable(ConfigError):
    """quack-kernels could not build or run a product here; `detail` says why in one line."""

    def __init__(self, detail: str):
        super().__init__(f"fused_mlp quack: quack-kernels could not run its product here ({detail}); "
                         "train with --fused-mlp off")
        self.detail = detail


def through_quack(product: Callable[[], Any]) -> Any:
    """product() (a call of quack's, with its activation registered inside it); where quack
    cannot build or run it here (another version's interface, a CUDA it was not built for),
    one clear error instead of the library's trace."""
    try:
        return product()
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        text = str(error).strip()
        raise QuackUnavailable(f"{type(error).__name__}: {text.splitlines()[0] if text else ''}") from error


def leaky_square_up(x: Tensor, up_w: Tensor, slope: float) -> tuple[Tensor, Tensor]:
    """(leaky_square(x @ up_w.T), x @ up_w.T), both bf16 [rows, mlp_dim], in one product."""
    from quack.gemm_interface import gemm_act

    product, hidden = through_quack(
        lambda: gemm_act(x, up_w.t(), activation=quack_activation(slope), store_preact=True))
    return hidden, product


def leaky_square_back(grad: Tensor, down_w: Tensor, product: Tensor, slope: float) -> tuple[Tensor, Tensor]:
    """((grad @ down_w) times leaky_square's derivative at product, leaky_square(product)),
    both [rows, mlp_dim], in one product; grad [rows, dim] contiguous."""
    from quack.gemm_interface import gemm_dact

    grad_product, hidden = through_quack(lambda: gemm_dact(grad, down_w, product, activation=quack_activation(slope)))
    return grad_product, hidden


def gradient_only(derivative: Callable) -> Callable:
    """The epilogue body of a product that brings dout back through the down projection
    (acc) and multiplies it by the derivative at the stored product (c): the gradient alone,
    where `derivative` (x, dout) -> (gradient, activation) also gives the activation."""
    def leaky_square_gradient(acc, c):
        grad, _ = derivative(c, acc)  # the activation is not stored: the compiler drops it
        return {"D": grad}

    return leaky_square_gradient


@functools.cache
def gradient_epilogue(slope: float):
    """quack's GEMM with `gradient_only`'s epilogue for LeakyReLU(slope)² (once per slope)."""
    from quack.activation import dact_fn_map
    from quack.epilogue.frontend import gemm_epilogue

    return gemm_epilogue()(gradient_only(dact_fn_map[quack_activation(slope)]))


def leaky_square_grad(grad: Tensor, down_w: Tensor, product: Tensor, slope: float) -> Tensor:
    """(grad @ down_w) times leaky_square's derivative at product, [rows, mlp_dim], in one
    product that stores nothing else (the activation kept from the forward serves the down
    projection's weight gradient); grad [rows, dim] contiguous."""
    out = torch.empty_like(product)
    through_quack(lambda: gradient_epilogue(slope)(grad, down_w, product, out={"D": out}, dynamic_scheduler=True))
    return out
