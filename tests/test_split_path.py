"""The Triton backend's split path with a bounded scratch (sonar_kernels/ops/triton_backend/wgrad_update.py): the wgrad of a
chunk of experts into scratch, then the standalone AdamW kernel, chunk after chunk. With chunks forced down
to one or two experts it must give the fused epilogue's bits for every state kind (exact moments, fp32
master weights, 8-bit moments, a bf16 weight with its remainder or stochastic rounding, the spike rule,
gradient accumulation) and the same telemetry; a non-finite gradient in the last chunk must leave every
chunk untouched; the chunk follows the documented bound; the tuner's choice between the paths applies
the update once."""

import pytest
import torch
from cases import Case

import sonar_kernels
from sonar_kernels.ops.triton_backend import configs, wgrad_update

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# 5 experts (chunks of 2: 2, 2, 1), one without tokens; W1 [5, 64, 32] and W2 [5, 32, 32] (whole 8-bit blocks).
SHAPE = Case(12, 32, 32, 5, 2, "skip-experts")
STEPS = 2

KINDS = {
    "bf16": ({}, torch.bfloat16),
    "fp32-master": ({}, torch.float32),  # fp32 weights, bf16 GEMMs (HF Trainer's bf16 mode)
    "8bit": ({"moments_dtype": "8bit"}, torch.bfloat16),
    "remainder": ({"master_weights": "remainder"}, torch.bfloat16),
    "stochastic": ({"master_weights": "stochastic", "rounding_seed": 3}, torch.bfloat16),
    "8bit-stochastic": ({"moments_dtype": "8bit", "master_weights": "stochastic"}, torch.bfloat16),
    "spike": ({"expert_clipping": "spike", "spike_threshold": 1.5}, torch.bfloat16),
    "accumulation": ({"accumulation_steps": 2}, torch.bfloat16),
}


@pytest.fixture
def chunks_of(monkeypatch):
    """Force the split path's chunks to ``n`` experts (the bound itself: test_split_chunk_follows_the_
    documented_bound); returns the setter."""

    def force(n: int) -> None:
        monkeypatch.setattr(wgrad_update, "split_chunk", lambda weight, grad_dtype: n)

    return force


@pytest.fixture
def chunk_calls(monkeypatch):
    """The experts of each chunk the split path's AdamW kernel is launched on, in order (the tuner's trials
    included)."""
    calls = []
    original = wgrad_update._Update._adamw

    def spy(self, part, *args):
        calls.append(part.weight.shape[0])
        return original(self, part, *args)

    monkeypatch.setattr(wgrad_update._Update, "_adamw", spy)
    return calls


def _train(device, weight_dtype, options, *, fused):
    """STEPS optimizer steps on SHAPE (bf16 activations); returns the expert tensors and the optimizer."""
    torch.manual_seed(0)
    x, index, weights, w1, w2 = SHAPE.make(torch.bfloat16, weight_dtype=weight_dtype, device=device)
    params = [torch.nn.Parameter(w.clone()) for w in (w1, w2)]
    optimizer = sonar_kernels.ExpertAdamW(params, **HYPER, fused_epilogue=fused, **options)
    micro = options.get("accumulation_steps", 1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for _ in range(micro):
            grad_out = torch.randn(SHAPE.T, SHAPE.H, generator=generator).to(torch.bfloat16).to(device)
            sonar_kernels.moe_mlp(x, index, weights, *params, backend="triton").backward(grad_out)
        optimizer.step()
    return params, optimizer


def _snapshot(params, optimizer):
    """Per expert tensor, every bit its update wrote: the weight, every state tensor, the telemetry."""
    out = []
    for p in params:
        state = [v.clone() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
        telemetry = [optimizer.expert_grad_norm([p]), optimizer.expert_skipped_updates([p])]
        if optimizer.expert_clipping != "none":
            telemetry.append(optimizer.expert_clipped_elements([p]))
        out.append([p.detach().clone(), *state, *telemetry])
    return out


def _bits(t):
    t = t.reshape(-1)
    return t.view(torch.uint8) if t.is_floating_point() else t


def _assert_bits_equal(got, expected):
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(_bits(a), _bits(b)), f"tensor {i} differs"


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_chunked_split_path_equals_the_fused_path(kind, chunks_of, chunk_calls, device):
    options, weight_dtype = KINDS[kind]
    fused = _snapshot(*_train(device, weight_dtype, options, fused=True))
    chunks_of(2)
    split = _snapshot(*_train(device, weight_dtype, options, fused=False))
    # Chunks of 2, 2 and 1 experts for each of the two tensors, at each step.
    assert chunk_calls == [2, 2, 1] * 2 * STEPS
    for got, expected in zip(split, fused, strict=True):
        _assert_bits_equal(got, expected)
    if kind == "spike":
        assert sum(int(t[-1]) for t in fused) > 0  # the rule replaced entries: counts compared, not zeros


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_a_non_finite_gradient_in_the_last_chunk_skips_every_chunk(fused, chunks_of, device):
    # top_k 1: an inf input on the tokens of the last expert with tokens makes only that expert's gradient
    # non-finite, in the last chunk of one expert; the earlier chunks' gradients are finite. The skip is
    # decided for the whole tensor before any chunk is updated: nothing changes, step stays 0.
    chunks_of(1)
    torch.manual_seed(0)
    case = Case(12, 32, 32, 5, 1)
    x, index, weights, w1, w2 = case.make(torch.bfloat16, device=device)
    params = [torch.nn.Parameter(w.clone()) for w in (w1, w2)]
    optimizer = sonar_kernels.ExpertAdamW(params, **HYPER, fused_epilogue=fused)
    before = _snapshot(params, optimizer)
    x[index[:, 0] == int(index.max())] = float("inf")
    grad_out = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1)).to(x)
    sonar_kernels.moe_mlp(x, index, weights, *params, backend="triton").backward(grad_out)
    assert [int(optimizer.expert_skipped_updates([p])) for p in params] == [1, 1]
    for got, expected in zip(_snapshot(params, optimizer), before, strict=True):
        _assert_bits_equal(got[:-2], expected[:-2])  # weight and state (the telemetry records the skip)


def test_split_chunk_follows_the_documented_bound():
    # 1/8 of the tensor's gradient bytes or 64 MiB, whichever is larger, in whole experts, at least one;
    # the whole tensor when its experts are not the outermost dimension in memory.
    meta = torch.device("meta")
    olmoe_w1 = torch.empty(64, 2048, 2048, dtype=torch.bfloat16, device=meta)  # 8 MiB per expert
    assert wgrad_update.split_chunk(olmoe_w1, torch.bfloat16) == 8  # 64 MiB bound: 8 experts
    assert wgrad_update.split_chunk(olmoe_w1, torch.float32) == 8  # 1/8 of 1 GiB: 8 experts of 16 MiB
    granite_w2 = torch.empty(40, 1536, 512, dtype=torch.bfloat16, device=meta)  # 1.5 MiB per expert
    assert wgrad_update.split_chunk(granite_w2, torch.bfloat16) == 40  # 60 MiB: under the 64 MiB floor
    huge = torch.empty(128, 8192, 8192, dtype=torch.bfloat16, device=meta)  # 128 MiB per expert
    assert wgrad_update.split_chunk(huge, torch.bfloat16) == 16  # 2 GiB bound
    wide = torch.empty(4, 16384, 16384, dtype=torch.bfloat16, device=meta)  # 512 MiB per expert
    assert wgrad_update.split_chunk(wide, torch.bfloat16) == 1  # at least one expert
    # Granite-3.1-3B-A800M's W1 (3 MiB per expert, 120 MiB in all): 21 experts fit 64 MiB, 20 taken (a
    # multiple of 4: every chunk's slice of the int32 expert offsets stays 16-byte aligned).
    granite_w1 = torch.empty(40, 1024, 1536, dtype=torch.bfloat16, device=meta)
    assert wgrad_update.split_chunk(granite_w1, torch.bfloat16) == 20
    three = torch.empty(9, 3 << 20, dtype=torch.bfloat16, device=meta)  # 6 MiB per expert, 54 MiB in all
    with wgrad_update.split_scratch(fraction=3, min_bytes=0):  # 18 MiB: 3 experts, under 4 kept as they are
        assert wgrad_update.split_chunk(three, torch.bfloat16) == 3
    transposed = torch.empty(64, 2048, 2048, dtype=torch.bfloat16, device=meta).transpose(0, 1)
    assert wgrad_update.split_chunk(transposed, torch.bfloat16) == 2048
    # The bound set for a block: the whole gradient (the paper's method), or 1/4 without a floor.
    with wgrad_update.split_scratch(fraction=1):
        assert wgrad_update.split_chunk(olmoe_w1, torch.bfloat16) == 64
    with wgrad_update.split_scratch(fraction=4, min_bytes=0):
        assert wgrad_update.split_chunk(olmoe_w1, torch.bfloat16) == 16
    assert wgrad_update.split_chunk(olmoe_w1, torch.bfloat16) == 8  # restored
    for bad in ({"fraction": 0}, {"fraction": 2.0}, {"min_bytes": -1}):
        with pytest.raises(ValueError, match="must be an int"), wgrad_update.split_scratch(**bad):
            pass


@pytest.mark.parametrize("kind", ["bf16", "8bit"])
def test_the_tuner_chooses_a_path_and_applies_the_update_once(kind, chunks_of, device):
    # With tuning on, the first step times the fused and the split path at every candidate tile (on
    # scratch copies of the first chunk's experts); the update is applied once, and equals an untuned
    # run pinned to the chosen path and tiles bit for bit. Exact moments: the fused path at every wgrad
    # candidate, the split path at those without the prefetched epilogue (a duplicate there). 8-bit moments:
    # the fused path at its own tiles, the split path at its default tiles and every plain wgrad candidate,
    # each with today's and the closed-form quantizer.
    options, weight_dtype = KINDS[kind]
    chunks_of(2)
    configs.pin()
    try:
        with configs.tuning(True):
            tuned = _snapshot(*_train(device, weight_dtype, options, fused=None))
            picks = {k: v for k, v in configs.chosen().items() if " update " in f" {k} "}
            timed = configs.timings()
        assert len(picks) == 2  # W1 and W2
        candidates = configs.candidates("wgrad", torch.bfloat16, torch.device(device))
        plain = [c for c in candidates if not c.EPILOGUE_PREFETCH]
        if kind == "8bit":
            split = [configs.WGRAD_8BIT, *plain]
            expected = [("fused", c) for c in configs.OWN_CANDIDATES[9]] + [
                ("split", c) for c in (*split, *(c._replace(EPILOGUE_PREFETCH=True) for c in split))
            ]
        else:
            expected = [("fused", c) for c in candidates] + [("split", c) for c in plain]
        for key, choice in picks.items():
            assert isinstance(choice, configs.UpdateChoice) and choice.path in ("fused", "split")
            assert [(c.path, c.config) for c, _ in timed[key]] == expected
            assert all(seconds > 0 for _, seconds in timed[key])
        # Each tensor equals an untuned run on its chosen path and tiles.
        configs.pin()
        for key, choice in picks.items():
            ordinal = 0 if " gate_up_proj " in f" {key} " else 1
            configs.pin("wgrad", choice.config)
            again = _snapshot(*_train(device, weight_dtype, options, fused=choice.path == "fused"))
            _assert_bits_equal(again[ordinal], tuned[ordinal])
    finally:
        configs.pin()


def test_a_path_pinned_after_a_tuned_choice_is_still_taken(chunks_of, chunk_calls, device):
    # The tuner's choice for an update that may take either path, or is pinned to one, is its own: a
    # tensor pinned to the split path after one pinned to the fused path (same shapes, dtypes and state
    # kind) runs the split path, and the reverse.
    chunks_of(2)
    configs.pin()
    try:
        with configs.tuning(True):
            for fused in (True, False, True):
                chunk_calls.clear()
                _train(device, torch.bfloat16, {}, fused=fused)
                # The split path's last chunk (1 expert of 5) is in the real updates only (the tuner's trials
                # run the first chunk, 2 experts): one per tensor and step.
                assert chunk_calls == [] if fused else chunk_calls.count(1) == 2 * STEPS, (fused, chunk_calls)
            paths = {choice.path for key, choice in configs.chosen().items() if " update " in f" {key} "}
    finally:
        configs.pin()
    assert paths == {"fused", "split"}  # one choice per tensor and path pinned


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_prefetched_epilogue_gives_the_plain_epilogues_bits(kind, device):
    # EPILOGUE_PREFETCH only moves each slice's loads before the previous slice's stores: at the same tiles,
    # the same bits for every state kind (exact moments at the default tiles; 8-bit moments and bf16 master
    # weights at their own).
    options, weight_dtype = KINDS[kind]
    if "moments_dtype" in options or "master_weights" in options:
        plain, prefetched = configs.WGRAD_8BIT, configs.WGRAD_8BIT._replace(EPILOGUE_PREFETCH=True)
        assert prefetched in configs.OWN_CANDIDATES[9]
    else:
        plain, prefetched = configs.Config(128, 64, 32, 8, 5, 4), configs.Config(128, 64, 32, 8, 5, 4, True)
        assert prefetched in configs.CANDIDATES["wgrad"][("16bit", 9)]
    results = []
    try:
        for config in (plain, prefetched):
            configs.pin("wgrad", config)
            results.append(_snapshot(*_train(device, weight_dtype, options, fused=True)))
    finally:
        configs.pin()
    for got, expected in zip(results[1], results[0], strict=True):
        _assert_bits_equal(got, expected)
