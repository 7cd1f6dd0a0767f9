"""The grouped GEMMs' tile configurations (sonar_kernels/ops/triton_backend/configs.py): every tuning candidate against the
float64 reference under the interpreter, routing tiles for any BLOCK_M, the tuner's choice changing no
result, and a tuning pass of the fused wgrad applying the update once."""

import pytest
import torch
from cases import Case
from numerics import assert_close

import sonar_kernels
from sonar_kernels import ops, reference
from sonar_kernels.kernels.update_bound import COLUMNS, TABLE
from sonar_kernels.ops.common import tile_offsets_for
from sonar_kernels.ops.triton_backend import configs
from sonar_kernels.ops.triton_backend.backward import moe_mlp_bwd_core
from sonar_kernels.specs import mark_expert_tensors

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# An expert without tokens, dropped slots, I and H not multiples of any tile.
CASE = Case(20, 24, 12, 5, 2, "sentinels")


@pytest.fixture(autouse=True)
def fresh_choices():
    configs.pin()
    yield
    configs.pin()


def _every_candidate():
    """(family, config) of every 16-bit candidate but the defaults (which every other test runs)."""
    seen = []
    for family, lists in configs.CANDIDATES.items():
        default = lists[("fp32", None)][0]
        for (kind, major), options in lists.items():
            for config in options:
                if kind == "16bit" and config != default and (family, config) not in seen:
                    seen.append((family, config))
                    yield pytest.param(family, config, id=f"{family}-sm{major}0-{'x'.join(map(str, config))}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "config"), list(_every_candidate()))
def test_every_candidate_matches_the_float64_reference(family, config, device):
    # The family pinned to the candidate (the others at their defaults): output, every gradient, and
    # the fused update of both weights against torch.optim.AdamW on the float64 reference's gradients.
    torch.manual_seed(0)
    x, index, weights, w1, w2 = CASE.make(torch.bfloat16, device=device)
    configs.pin(family, config)
    leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
    out = sonar_kernels.moe_mlp(leaves[0], index, *leaves[1:], backend="triton")
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = reference.moe_mlp(exact[0], index, *exact[1:])
    assert_close(out, expected, torch.bfloat16)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad_out.to(device))
    expected.backward(grad_out.double().to(device))
    for name, leaf, ref in zip(
        ("x", "top_k_weights", "gate_up_proj", "down_proj"), leaves, exact, strict=True
    ):
        assert_close(leaf.grad, ref.grad, torch.bfloat16, what=name)
    if family != "wgrad":
        return
    # The wgrad's fused update with the candidate (fp32 master weights, bf16 compute) against
    # torch.optim.AdamW fed the gradient the same kernels return without an update.
    plain = [torch.nn.Parameter(w.float()) for w in (w1, w2)]
    sonar_kernels.moe_mlp(x, index, weights, *plain, backend="triton").backward(grad_out.to(device))
    torch.optim.AdamW(plain, **HYPER).step()
    params = [torch.nn.Parameter(w.float()) for w in (w1, w2)]
    mark_expert_tensors(*params)
    optimizer = sonar_kernels.ExpertAdamW(params, **HYPER)
    sonar_kernels.moe_mlp(x, index, weights, *params, backend="triton").backward(grad_out.to(device))
    for p, ref in zip(params, plain, strict=True):
        assert float(optimizer.state[p]["step"]) == 1.0 and p.grad is None
        assert_close(p, ref, torch.float32, what="updated weight")


@pytest.mark.parametrize("block_m", [16, 64, 128, 256])
def test_tile_offsets_for_any_block_m_match_the_reference(block_m, device):
    _, index, *_ = CASE.make(torch.float32, device=device)
    meta = ops.routing_metadata(index, CASE.E)
    expected = reference.routing_metadata(index.cpu(), CASE.E, block_m=block_m).tile_offsets
    assert torch.equal(tile_offsets_for(meta, block_m).cpu(), expected)


def _train_step(device, seed=0):
    """One fused in-backward update of both weights (bf16 compute, fp32 master weights); the weights, their
    states and the output."""
    torch.manual_seed(seed)
    x, index, weights, w1, w2 = CASE.make(torch.bfloat16, device=device)
    params = [torch.nn.Parameter(w.float()) for w in (w1, w2)]
    mark_expert_tensors(*params)
    optimizer = sonar_kernels.ExpertAdamW(params, **HYPER)
    out = sonar_kernels.moe_mlp(x, index, weights, *params, backend="triton")
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    return out.detach(), [
        (p.detach().clone(), *(optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step")))
        for p in params
    ]


def test_a_tuning_pass_applies_the_fused_update_once(device):
    # The first step with tuning on times every candidate of every family (the wgrad through its check
    # pass); the second, identical step finds every choice made and tunes nothing. A tuning pass that
    # applied the update once per candidate would leave other weights, moments and steps than the second.
    with configs.tuning(True):
        tuned_out, tuned = _train_step(device)
        chosen = configs.chosen()
        assert {key.split()[0] for key in chosen} == {"up", "grouped_mm", "dhpre", "wgrad"}
        again_out, again = _train_step(device)
        assert configs.chosen() == chosen
    assert torch.equal(tuned_out, again_out)
    for first, second in zip(tuned, again, strict=True):
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)
        assert float(first[3]) == 1.0  # one AdamW step


def test_the_tuner_keeps_its_public_name():
    """``from sonar_kernels.ops import configs`` (configs.pin, configs.timings) names the Triton room's module."""
    from sonar_kernels.ops import configs as public

    assert public is configs and public.pin is configs.pin


def test_pinning_is_checked():
    with pytest.raises(ValueError, match="family must be one of"):
        configs.pin("attention", configs.Config(64, 64, 32, 8, 3))
    with pytest.raises(
        ValueError, match=r"config must be a sonar_kernels\.ops\.triton_backend\.configs\.Config"
    ):
        configs.pin("up", (64, 64, 32, 8, 3))
    # fp32 keeps its one no-spill configuration; 16-bit dtypes have candidates, the default first.
    for family in configs.FAMILIES:
        fp32 = configs.candidates(family, torch.float32, torch.device("cpu"))
        bf16 = configs.candidates(family, torch.bfloat16, torch.device("cpu"))
        assert len(fp32) == 1 and bf16[0] == fp32[0] and len(bf16) > 1


def test_tuning_is_off_under_the_interpreter_and_by_environment(monkeypatch):
    assert not configs.tuning_enabled(torch.device("cpu"))
    monkeypatch.setenv("SONAR_KERNELS_TUNING", "0")
    assert not configs.tuning_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("SONAR_KERNELS_TUNING", "1")
    assert configs.tuning_enabled(torch.device("cuda", 0))


# dHpre's epilogue in column slices (EPILOGUE_SPLIT 2 and 4) against today's whole-tile epilogue
# (EPILOGUE_SPLIT 1) at the same row tile and BLOCK_K (G's sums in the same order) and the slices' width (its
# routing-weight partial sums over the same columns): every output the same bits; dHpre, A and the magnitudes
# also those of today's default tile. I 100: several slices and column tiles, the last partly or wholly past I;
# one routing weight inf and one NaN, so that the magnitudes meet both (a NaN counts as inf).
SLICED_DHPRE = [
    pytest.param(configs.Config(64, 64, 32, 8, 3, 2), configs.Config(64, 32, 32, 8, 3), id="64x64x32-split2"),
    pytest.param(
        configs.Config(64, 128, 64, 8, 3, 4), configs.Config(64, 32, 64, 8, 3), id="64x128x64-split4"
    ),
    pytest.param(
        configs.Config(128, 64, 64, 8, 4, 4), configs.Config(128, 16, 64, 8, 4), id="128x64x64-split4"
    ),
]
SLICED_CASE = Case(40, 24, 100, 3, 2, "sentinels")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def _dhpre_core(config, poison, device):
    """ops.moe_mlp_bwd_core with dHpre pinned to ``config``: {name: bits} of dX, d top_k_weights, dHpre and A
    (their kept rows) and the magnitudes."""
    torch.manual_seed(3)
    x, index, weights, w1, w2 = SLICED_CASE.make(torch.bfloat16, device=device)
    if poison:
        weights[2, 0], weights[5, 1] = float("inf"), float("nan")
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(x)
    _, hpre, meta = ops.moe_mlp_fwd(x, index, weights, w1, w2, "silu")
    configs.pin("dhpre", config)
    outputs = moe_mlp_bwd_core(grad_out, x, weights, w1, w2, hpre, meta, "silu", (True,) * 5)
    kept = int(meta.expert_offsets[-1])
    names = ("dX", "d top_k_weights", "dHpre", "A", "magnitudes")
    # The magnitudes: the flags' table, then the rows of a pass over the dHpre kernel's per-program maxima
    # (whose number depends on its tiles): the table and each column's largest are what bound the gradients.
    table, rows = outputs[4][:TABLE], outputs[4][TABLE:].view(-1, COLUMNS)
    outputs = (*outputs[:4], torch.cat([rows.amax(0), table]))
    return {
        name: _bits(t[:kept] if name in ("dHpre", "A") else t) for name, t in zip(names, outputs, strict=True)
    }


@pytest.mark.parametrize(("sliced", "today"), SLICED_DHPRE)
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "inf-nan-weights"])
def test_dhpre_in_column_slices_gives_todays_bits(sliced, today, poison, device):
    new = _dhpre_core(sliced, poison, device)
    old = _dhpre_core(today, poison, device)
    default = _dhpre_core(
        configs.candidates("dhpre", torch.bfloat16, torch.device(device))[0], poison, device
    )
    for name, bits in new.items():
        assert torch.equal(bits, old[name]), name
        if name in ("dHpre", "A", "magnitudes"):  # elementwise, or a largest magnitude: any tile's bits
            assert torch.equal(bits, default[name]), name
    magnitudes = new["magnitudes"].view(torch.float32)
    assert bool(torch.isinf(magnitudes[1])) == poison and bool(torch.isfinite(magnitudes[0]))
