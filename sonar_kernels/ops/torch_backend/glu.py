"""The gated activations of the torch backend, act(gate) * up, and their derivatives in fp32 (the Triton
kernels' formulas): SwiGLU, GeGLU (erf and tanh GELU), the squared ReLU and gpt-oss's clamped SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sonar_kernels.specs import parse_activation


def glu(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(gate) * up: SwiGLU for "silu", GeGLU for "gelu" (exact erf GELU) and "gelu_tanh" (the tanh
    approximation), relu(gate)^2 * up for "relu2"; the clamped SwiGLU of
    :func:`sonar_kernels.specs.clamped_swiglu`. ``up`` None (no gate): act(gate) alone."""
    kind, alpha, limit = parse_activation(activation)
    if kind == "clamped_swiglu":
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + 1.0)
    if activation == "silu":
        act = F.silu(gate)
    elif activation == "relu2":
        act = torch.square(F.relu(gate))
    else:
        act = F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
    return act if up is None else act * up


def glu_bwd(gate: torch.Tensor, up: torch.Tensor | None, grad_a: torch.Tensor, activation: str):
    """(d gate, d up) of act(gate) * up, fp32 in and out (the Triton kernels' formulas); ``up`` None (no
    gate): (d gate, None) of act(gate)."""
    kind, alpha, limit = parse_activation(activation)
    if kind == "clamped_swiglu":
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(alpha * g)
        grad_g = grad_a * (u + 1.0) * (sig + alpha * g * sig * (1.0 - sig))
        # torch's clamp backward: the gradient passes where the input is within the bounds, bounds included.
        return (
            torch.where(gate <= limit, grad_g, 0.0),
            torch.where((up >= -limit) & (up <= limit), grad_a * g * sig, 0.0),
        )
    if activation == "silu":
        sig = torch.sigmoid(gate)
        act = gate * sig
        act_grad = sig * (1.0 + gate * (1.0 - sig))
    elif activation == "relu2":
        r = F.relu(gate)
        act, act_grad = r * r, 2.0 * r
    elif activation == "gelu_tanh":
        # act = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); the derivative as torch's
        # GeluBackward computes it: 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) du/dx.
        tanh = torch.tanh(GELU_TANH_BETA * (gate + GELU_TANH_KAPPA * gate * gate * gate))
        act = 0.5 * gate * (1.0 + tanh)
        act_grad = 0.5 * (1.0 + tanh) + 0.5 * gate * (1.0 - tanh * tanh) * GELU_TANH_BETA * (
            1.0 + 3.0 * GELU_TANH_KAPPA * gate * gate
        )
    else:
        cdf = 0.5 * (1.0 + torch.erf(gate * 0.7071067811865476))
        act = gate * cdf
        act_grad = cdf + gate * torch.exp(-0.5 * gate * gate) * 0.3989422804014327
    if up is None:
        return grad_a * act_grad, None
    return grad_a * up * act_grad, grad_a * act


# The tanh GELU's constants: sqrt(2 / pi) and the cubic coefficient (Hendrycks and Gimpel, 2016).
GELU_TANH_BETA = 0.7978845608028654
GELU_TANH_KAPPA = 0.044715
