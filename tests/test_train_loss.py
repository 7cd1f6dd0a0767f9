"""sonar-train's chunked causal-LM loss (sonar_kernels/train/loss.py, ``--loss-chunk-tokens``): transformers'
own ``.loss`` and gradients of tiny OLMoE, Granite MoE and Qwen3-MoE models, and the sonar arm's bits equal
to its control's with it on."""

import pytest
import torch

from sonar_kernels import train

pytest.importorskip("transformers", minversion="5.13")

# Tiny models of each family (H 64, 4 experts of I 32, top-2, 2 layers, vocabulary 300); Granite with its
# logits divided by logits_scaling, Qwen3-MoE with its own head_dim and normalised top-k.
FAMILIES = {
    "olmoe": train.Preset("olmoe", 64, 32, 4, 2, 2, 4, 2, 300),
    "granitemoe": train.Preset(
        "granitemoe", 64, 32, 4, 2, 2, 4, 2, 300,
        extra={"logits_scaling": 6.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22},
    ),
    "qwen3_moe": train.Preset("qwen3_moe", 64, 32, 4, 2, 2, 4, 2, 300, extra={"head_dim": 32, "norm_topk_prob": True}),
}  # fmt: skip


def _model(family, dtype):
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    return hf.set_backend(train.build_model(FAMILIES[family], None, 0, dtype, torch.device("cpu")), "torch")


def _loss_and_grads(model, tokens, labels, chunk):
    model.zero_grad(set_to_none=True)
    if chunk is None:
        loss = model(input_ids=tokens, labels=labels).loss
    else:
        loss = train.chunked_causal_lm_loss(model, tokens, labels, chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_chunked_loss_is_transformers_loss_with_its_gradients(family, dtype):
    from numerics import assert_close

    torch.manual_seed(0)
    model = _model(family, dtype)
    model.config.router_aux_loss_coef = 0.5  # the load-balancing loss weighs in the loss and the gradients
    tokens = torch.randint(0, 300, (2, 24))
    labels = tokens.clone()
    labels[0, 5:9] = -100  # transformers' ignore_index: left out of the sum and of the count
    expected, expected_grads = _loss_and_grads(model, tokens, labels, None)
    # 48 tokens: chunks of 10 (the last one 8 tokens), one token each, all in one chunk
    for chunk in (10, 1, 64):
        loss, grads = _loss_and_grads(model, tokens, labels, chunk)
        assert loss.dtype == torch.float32
        tolerance = 1e-6 if dtype == torch.float32 else 2.0**-8
        assert abs(float(loss) / float(expected) - 1) < tolerance, (chunk, float(loss), float(expected))
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            assert grad.dtype == dtype
            assert_close(grad, expected_grads[name], dtype, what=f"{family} chunk {chunk}: {name}")


def test_the_chunked_loss_refuses_bad_chunks_and_unknown_models():
    model = _model("olmoe", torch.float32)
    tokens = torch.randint(0, 300, (1, 8))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        train.chunked_causal_lm_loss(model, tokens, tokens, 0)
    with pytest.raises(TypeError, match="chunk must be an int"):
        train.chunked_causal_lm_loss(model, tokens, tokens, 2.0)
    model.config.model_type = "gemma"
    with pytest.raises(ValueError, match="model: the chunked loss knows"):
        train.chunked_causal_lm_loss(model, tokens, tokens, 4)


def test_the_chunked_loss_holds_one_chunks_logits_at_a_time():
    # The loss alone (hidden [64, 16] fp32, V 4096): autograd's [T, V] tensors against one chunk's.
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(4096, 16, requires_grad=True)
    labels = torch.randint(0, 4096, (64,))
    peaks = {}
    for chunk in (None, 8):
        tracker = MemTracker()
        with tracker:
            if chunk is None:
                loss = torch.nn.functional.cross_entropy((hidden @ weight.T).float(), labels)
            else:
                loss = train.loss.ChunkedCausalLMLoss.apply(hidden, weight, labels, chunk, None)
            loss.backward()
        peaks[chunk] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        hidden.grad = weight.grad = None
    full, one = 64 * 4096 * 4, 8 * 4096 * 4  # one fp32 [T, V] tensor, one [chunk, V]
    gradients = 2 * weight.numel() * 4  # the weight's gradient, and one chunk's before it is added
    assert peaks[None] > 3 * full
    assert peaks[8] < 4 * one + gradients + full // 4, peaks


def test_sonar_equals_its_control_bitwise_with_the_chunked_loss():
    # sonar and standard-dense-clip (tiny-olmoe, one layer, torch backend, checkpointing on) with the
    # chunked loss: the same weights bit for bit after 3 steps, the dense gradients clipped.
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    initial = hf.set_backend(
        train.build_model(train.PRESETS["tiny-olmoe"], 1, 0, torch.float32, torch.device("cpu")), "torch"
    )
    args = train.parse_args(["--max-grad-norm", "0.05", "--loss-chunk-tokens", "24", "--quiet"])
    assert args.loss_chunk_tokens == 24
    data = train.ByteData(train.default_text(), 32, 2, seed=0)
    arms = {name: train.build_arm(name, initial, args, steps=3) for name in ("standard-dense-clip", "sonar")}
    losses = {name: [] for name in arms}
    for step in range(3):
        for name, arm in arms.items():
            assert arm.loss_chunk_tokens == 24
            loss, norm = train.train_step(arm, data.batch(step), args.max_grad_norm)
            losses[name].append(loss)
            assert norm > args.max_grad_norm
    assert all(torch.equal(a, b) for a, b in zip(losses["sonar"], losses["standard-dense-clip"], strict=True))
    control, sonar = arms["standard-dense-clip"].model, arms["sonar"].model
    for (name, p), q in zip(sonar.named_parameters(), control.parameters(), strict=True):
        assert torch.equal(p, q), name
    # the first step's loss is transformers' own (the initial model, the same batch)
    with torch.no_grad():
        expected = initial(input_ids=data.batch(0), labels=data.batch(0)).loss
    assert abs(float(losses["sonar"][0]) / float(expected) - 1) < 1e-6


def _reference_gradients(tokens, labels):
    """Single-process training on the concatenated batch with transformers' own loss: the mean over the
    ranks of each rank's ``.loss`` (DDP's and FSDP2's convention: each rank's loss a mean over its tokens,
    the gradients averaged over the ranks)."""
    torch.manual_seed(0)
    model = _model("olmoe", torch.float32)
    model.config.router_aux_loss_coef = 0.5
    halves = [
        model(input_ids=t, labels=y).loss for t, y in zip(tokens.chunk(2), labels.chunk(2), strict=True)
    ]
    (sum(halves) / 2).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (4, 24), generator=generator)
    labels = tokens.clone()
    labels[1, 3:7] = -100  # rank 0's ignored positions: ranks count different labelled tokens
    return tokens, labels


def _chunked_loss_rank(rank, world_size, layout, out):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _model("olmoe", torch.float32)
    model.config.router_aux_loss_coef = 0.5
    if layout == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        if layout == "fsdp2-lm-head":
            fully_shard(model.lm_head)
        wrapped = fully_shard(model)
    tokens, labels = (t.chunk(world_size)[rank] for t in _batch())
    train.chunked_causal_lm_loss(wrapped, tokens, labels, 10).backward()
    grads = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in model.named_parameters()
    }
    if rank == 0:
        torch.save(grads, out)


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "fsdp2-lm-head"])
def test_the_chunked_loss_under_ddp_and_fsdp2_matches_single_process_training(tmp_path, layout):
    # 2 gloo ranks, each its own half of the batch: the gradients DDP averages, and FSDP2's (each decoder
    # layer sharded, the root holding the embedding and the lm_head; or the lm_head sharded on its own,
    # resharded after its forward of no tokens and gathered again for the loss), against single-process
    # training with transformers' loss.
    import ranks
    from numerics import assert_close

    ranks.run(_chunked_loss_rank, 2, layout, tmp_path / "grads.pt")
    grads, expected = torch.load(tmp_path / "grads.pt"), _reference_gradients(*_batch())
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert_close(grad, expected[name], torch.float32, what=f"{layout}: {name}")


def test_the_heldout_loss_with_the_chunked_loss_is_transformers_without_the_load_balancing_loss():
    torch.manual_seed(0)
    model = _model("olmoe", torch.float32)
    model.config.router_aux_loss_coef = 0.5  # weighs in training's loss, never in the held-out one
    batches = [torch.randint(0, 300, (2, 24)) for _ in range(3)]
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b, output_router_logits=False).loss for b in batches]
        with_balancing = model(input_ids=batches[0], labels=batches[0], output_router_logits=True).loss
    assert float(with_balancing) > float(losses[0]) + 1e-3  # the load-balancing loss would show
    expected = sum(float(x) for x in losses) / len(losses)
    for chunk in (None, 10):
        got = train.arms.heldout_loss(model, batches, loss_chunk_tokens=chunk)
        assert abs(got / expected - 1) < 1e-6, (chunk, got, expected)
    assert model.training  # left in training mode
