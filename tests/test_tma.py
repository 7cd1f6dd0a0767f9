"""The grouped GEMMs through TMA descriptors (sonar_kernels/ops/triton_backend/tma.py, kernels/expert_mlp_tma.py): the same
bits as the pointer kernel at the same tile, and the float64 reference, for the down projection, dX and the
up-projection in every layout each is offered for, at shapes with K and N tails and experts without rows;
and not offered where the strides or the device do not allow it."""

import pytest
import torch
from cases import Case
from numerics import assert_close

from sonar_kernels import reference
from sonar_kernels.ops.common import gate_up_operand, triton_interpreting
from sonar_kernels.ops.triton_backend import configs, tma
from sonar_kernels.ops.triton_backend.backward import _dx
from sonar_kernels.ops.triton_backend.forward import moe_mlp_fwd, routing_metadata
from sonar_kernels.specs import down_view

# H 72 and I 40: N and K tails at every tile (multiples of 8, so bf16 rows stay 16-byte aligned); experts
# 0, 2 and 4 of 5 without rows; _routed() drops slots (sentinel ids).
CASE = Case(20, 72, 40, 5, 2, "skip-experts")
# Each TMA candidate and the pointer kernel at its tile.
PAIRS = [
    pytest.param(c, c._replace(TMA=False, PERSISTENT=False), id="x".join(map(str, c.blocks().values())) + ("-persistent" if c.PERSISTENT else ""))
    for c in configs.TMA_CANDIDATES
]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_choices():
    configs.pin()
    yield
    configs.pin()


@pytest.fixture
def launches(monkeypatch):
    """The results of ops.triton_backend.tma.launch_grouped_mm (True: the TMA kernel ran) in call order."""
    seen = []
    launch = tma.launch_grouped_mm

    def spy(*args, **kwargs):
        seen.append(launch(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(tma, "launch_grouped_mm", spy)
    return seen


def _routed():
    """CASE's tensors, a third of the tokens' first slot dropped (id -1)."""
    torch.manual_seed(0)
    x, index, weights, w1, w2 = CASE.make(torch.bfloat16)
    index[::3, 0] = -1
    return x, index, weights, w1, w2


def _gate_up(w1, layout):
    """Concatenated W1 [E, 2I, H] as ``layout``'s tensors (new memory): (gate_up_proj, up_proj or None).
    A separate layout's two tensors are the halves of one buffer, the up tensor after the gate
    ("separate") or before it ("separate-reversed": a negative half stride, which TMA cannot take)."""
    I = w1.shape[1] // 2
    if layout == "ungated":
        return w1[:, :I].clone(), None
    if layout.startswith("separate"):
        buffer = torch.stack((w1[:, :I], w1[:, I:]))  # [2, E, I, H]
        return (
            (buffer[0], buffer[1])
            if layout == "separate"
            else (buffer[1].copy_(w1[:, :I]), buffer[0].copy_(w1[:, I:]))
        )
    w = torch.stack((w1[:, :I], w1[:, I:]), dim=2).flatten(1, 2) if "interleaved" in layout else w1.clone()
    return (w.transpose(1, 2).contiguous(), None) if layout.endswith("_transposed") else (w, None)  # fmt: skip


def _dx_expected(grad_hpre, w1, meta, T, top_k, gated):
    """dX in float64 from concatenated W1, per kept slot (independent of the kernels' views)."""
    I = w1.shape[1] // 2
    bounds = meta.expert_offsets.tolist()
    dx = torch.zeros(T, w1.shape[2], dtype=torch.float64)
    for slot, row in enumerate(meta.row_of_slot.tolist()):
        if row < 0:
            continue
        e = max(e for e in range(len(bounds) - 1) if bounds[e] <= row)
        w = w1[e].double() if gated else w1[e, :I].double()
        dx[slot // top_k] += grad_hpre[row].double() @ w
    return dx


@pytest.mark.parametrize(
    "layout", ["concatenated", "interleaved", "ungated", "separate", "concatenated_transposed"]
)
@pytest.mark.parametrize(("config", "pointer"), PAIRS)
def test_dx_through_tma_equals_the_pointer_kernel_bitwise(layout, config, pointer, launches):
    _, index, _, w1, _ = _routed()
    T, H, I, E, top_k = CASE.T, CASE.H, CASE.I, CASE.E, CASE.top_k
    meta = routing_metadata(index, E)
    assert (
        meta.expert_offsets[1] == 0 and meta.expert_offsets[E - 1] == meta.expert_offsets[E]
    )  # empty experts
    gate_up_proj, up_proj = _gate_up(w1, layout)
    w = gate_up_operand(gate_up_proj, layout if layout != "ungated" else "ungated", up_proj)
    gated = layout != "ungated"
    grad_hpre = torch.randn(T * top_k, (2 if gated else 1) * I).to(torch.bfloat16)
    results = []
    for cfg in (config, pointer):
        configs.pin("grouped_mm", cfg)
        grad_x = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        results.append(_dx(grad_hpre, w, meta, grad_x, top_k, torch.bfloat16, triton_interpreting(), ("k",)))
    assert launches == [True]  # the TMA kernel ran (the pointer config never asks for it)
    assert torch.equal(results[0], results[1])
    assert_close(results[0], _dx_expected(grad_hpre, w1, meta, T, top_k, gated), torch.bfloat16, what="dX")


@pytest.mark.parametrize("transposed", [False, True], ids=["down", "down-transposed"])
@pytest.mark.parametrize(("config", "pointer"), PAIRS)
def test_down_projection_through_tma_equals_the_pointer_kernel_bitwise(transposed, config, pointer, launches):
    x, index, weights, w1, w2 = _routed()
    down_proj = w2.transpose(1, 2).contiguous() if transposed else w2
    layout = "concatenated_transposed" if transposed else "concatenated"
    gate_up_proj = w1.transpose(1, 2).contiguous() if transposed else w1
    assert down_view(down_proj, layout).stride(1 if transposed else 2) == 1
    outs = []
    for cfg in (config, pointer):
        configs.pin("grouped_mm", cfg)
        outs.append(moe_mlp_fwd(x, index, weights, gate_up_proj, down_proj, "silu", layout)[0])
    assert launches == [True]
    assert torch.equal(outs[0], outs[1])
    expected = reference.moe_mlp(x.double(), index, weights.double(), w1.double(), w2.double())
    assert_close(outs[0], expected, torch.bfloat16)


def _operands(layout):
    torch.manual_seed(0)
    _, _, _, w1, _ = CASE.make(torch.bfloat16)
    gate_up_proj, up_proj = _gate_up(w1, layout)
    w = gate_up_operand(gate_up_proj, layout, up_proj)
    return w.base, w.strides


@pytest.mark.parametrize("layout", ["interleaved_transposed", "separate-reversed"])
def test_not_offered_where_the_weight_strides_do_not_allow_it(layout):
    # Interleaved transposed W1: its unit stride is between the gate and the up half (neither K nor N);
    # separate tensors with the up tensor first: a negative half stride.
    base, strides = _operands(layout.replace("-reversed", ""))
    if layout == "separate-reversed":
        gate, up = _gate_up(CASE.make(torch.bfloat16)[3], layout)
        base, strides = gate_up_operand(gate, "separate", up)[:2]
        assert strides[1] < 0
    grad_hpre = torch.randn(CASE.T * CASE.top_k, 2 * CASE.I).to(torch.bfloat16)
    assert not tma.usable(grad_hpre, base, strides, 2, CASE.H)
    offered = configs.candidates("grouped_mm", torch.bfloat16, torch.device("cpu"), tma=False)
    assert (
        not any(c.TMA for c in offered)
        and offered[0] == configs.candidates("grouped_mm", torch.float32, torch.device("cpu"))[0]
    )


def test_not_offered_at_unaligned_rows_or_addresses():
    base, strides = _operands("concatenated")
    grad_hpre = torch.randn(CASE.T * CASE.top_k, 2 * CASE.I).to(torch.bfloat16)
    assert tma.usable(grad_hpre, base, strides, 2, CASE.H)
    # I 12: dHpre's half (24 bytes) and the rows of W1 (bf16, H 12 below) are not 16-byte aligned.
    assert not tma.usable(torch.randn(8, 24).to(torch.bfloat16), base, strides, 2, CASE.H)
    odd = torch.randn(2, 24, 12).to(torch.bfloat16)
    assert not tma.usable(grad_hpre, odd, (odd.stride(0), 12 * 12, 12, 1), 2, 12)
    # A base 2 bytes past an aligned address.
    shifted = torch.randn(grad_hpre.numel() + 1).to(torch.bfloat16)[1:].view_as(grad_hpre)
    assert not tma.usable(shifted, base, strides, 2, CASE.H)


def test_offered_only_on_devices_that_run_tma(monkeypatch):
    # sm_90 and later on CUDA; the CPU (the interpreter emulates it); never sm_80 (Ampere has no TMA).
    assert tma.tma_supported(torch.device("cpu"))
    for major, expected in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, major=major: (major, 0))
        assert tma.tma_supported(torch.device("cuda", 0)) is expected
    bf16 = torch.bfloat16
    assert set(configs.TMA_CANDIDATES) <= set(
        configs.candidates("grouped_mm", bf16, torch.device("cpu"), tma=True)
    )
    assert not any(
        c.TMA for c in configs.candidates("grouped_mm", torch.float32, torch.device("cpu"), tma=True)
    )
    # Only the up-projection and the grouped GEMM have TMA candidates, and only in the sm_90 lists.
    for family in configs.FAMILIES:
        listed = configs.candidates(family, bf16, torch.device("cpu"), tma=True)
        assert any(c.TMA for c in listed) == (family in ("up", "grouped_mm")), family
        assert not any(c.TMA for c in configs.CANDIDATES[family][("16bit", 8)]), family


def test_the_tuner_times_the_tma_candidates_where_offered_and_keeps_a_correct_one(launches):
    # Tuning on (the interpreter's times mean nothing): every TMA candidate is launched once, and whichever
    # option wins, dX matches the float64 reference; the key is tuned once.
    _, index, _, w1, _ = _routed()
    T, H, I, E, top_k = CASE.T, CASE.H, CASE.I, CASE.E, CASE.top_k
    meta = routing_metadata(index, E)
    w = gate_up_operand(w1, "concatenated")
    grad_hpre = torch.randn(T * top_k, 2 * I).to(torch.bfloat16)
    with configs.tuning():
        for _ in range(2):
            grad_x = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
            dx = _dx(grad_hpre, w, meta, grad_x, top_k, torch.bfloat16, triton_interpreting(), ("tuned",))
            assert_close(dx, _dx_expected(grad_hpre, w1, meta, T, top_k, True), torch.bfloat16, what="dX")
    chosen = configs.chosen()
    assert len(chosen) == 1 and next(iter(chosen.values())) in configs.candidates(
        "grouped_mm", torch.bfloat16, torch.device("cpu"), tma=True
    )
    assert launches[: len(configs.TMA_CANDIDATES)] == [True] * len(configs.TMA_CANDIDATES)


@pytest.fixture
def up_descriptors(monkeypatch):
    """Whether each ops.triton_backend.tma.up_descriptor call gave a descriptor (True: the TMA up-projection ran)."""
    seen = []
    describe = tma.up_descriptor

    def spy(*args, **kwargs):
        seen.append(describe(*args, **kwargs) is not None)
        return None if not seen[-1] else describe(*args, **kwargs)

    monkeypatch.setattr(tma, "up_descriptor", spy)
    return seen


@pytest.mark.parametrize(
    ("layout", "activation", "bias"),
    [("concatenated", "silu", False), ("interleaved", "clamped_swiglu", True), ("separate", "gelu", False),
     ("ungated", "relu2", False)],
)  # fmt: skip
@pytest.mark.parametrize(
    "config", configs.UP_TMA_CANDIDATES, ids=lambda c: "x".join(map(str, c.blocks().values()))
)
def test_up_projection_through_tma_equals_the_pointer_kernel_bitwise(
    layout, activation, bias, config, up_descriptors
):
    # W1 through a descriptor (gate and up rows in one copy), X gathered by pointers: Hpre (its kept rows)
    # and the output equal the pointer kernel's at the same tile, and the output the float64 reference's.
    x, index, weights, w1, w2 = _routed()
    gated = layout != "ungated"
    gate_up_proj, up_proj = _gate_up(w1, layout)
    b1 = (torch.randn(CASE.E, 2 * CASE.I) / 4).to(torch.bfloat16) if bias else None
    b1_layout = torch.stack((b1[:, : CASE.I], b1[:, CASE.I :]), dim=2).flatten(1) if bias else None
    results = []
    for cfg in (config, config._replace(TMA=False)):
        configs.pin("up", cfg)
        out, hpre, meta = moe_mlp_fwd(
            x,
            index,
            weights,
            gate_up_proj,
            w2,
            activation,
            layout,
            gate_up_proj_bias=b1_layout,
            up_proj=up_proj,
        )
        results.append((out, hpre[: int(meta.expert_offsets[-1])]))
    assert up_descriptors == [True]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    w1_ref = w1 if gated else w1[:, : CASE.I]
    expected = reference.moe_mlp(
        x.double(), index, weights.double(), w1_ref.double(), w2.double(), activation=activation,
        gate_up_proj_bias=None if b1 is None else b1.double(), gated=gated,
    )  # fmt: skip
    assert_close(results[0][0], expected, torch.bfloat16)


@pytest.mark.parametrize("layout", ["concatenated_transposed", "interleaved_transposed", "separate-reversed"])
def test_up_projection_not_offered_where_w1_has_no_unit_stride_along_h(layout):
    _, _, _, w1, _ = _routed()
    gate, up = _gate_up(w1, layout)
    operand = gate_up_operand(gate, layout.replace("-reversed", ""), up)
    assert tma.up_descriptor(operand, CASE.H, 64, 32) is None and not tma.up_usable(operand, CASE.H)
    assert tma.up_usable(gate_up_operand(w1, "concatenated"), CASE.H)
    offered = configs.candidates("up", torch.bfloat16, torch.device("cpu"), tma=False)
    assert not any(c.TMA for c in offered)
    assert set(configs.UP_TMA_CANDIDATES) <= set(
        configs.candidates("up", torch.bfloat16, torch.device("cpu"), tma=True)
    )
