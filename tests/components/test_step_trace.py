"""One micro-batch traced on fake tensors: activations by what the run would compute."""

import pytest
from transformers import GPT2Config, LlamaConfig, MixtralConfig

from runner.components.step_trace import Numerics, trace_evaluation, trace_step
from runner.config.spec import ModelSpec

GPT2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128)
# grouped-query attention and a gated MLP
LLAMA = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, vocab_size=50257)


def act(config, micro_batch=4, block=64, how=Numerics.fp32, checkpointing=False, precision="fp32", chunked=False):
    """The plain loss unless `chunked` (its own trace: tests/components/test_chunked_loss.py)."""
    spec = ModelSpec(gradient_checkpointing=checkpointing, chunked_loss=chunked)
    return trace_step(spec, config, micro_batch, block, precision, how)


def test_activations_grow_with_the_micro_batch_and_the_logits_are_counted():
    one, four = act(GPT2, 1), act(GPT2, 4)
    assert 3.5 < four.activation_peak / one.activation_peak < 4.1
    # at least the fp32 logits of the micro-batch (4 x 64 tokens x 50,257)
    assert four.activation_peak > 4 * 64 * 50257 * 4


def test_gradient_checkpointing_keeps_fewer_activations():
    deep = GPT2Config(n_embd=64, n_layer=8, n_head=4, n_positions=128, vocab_size=512)
    plain, checkpointed = act(deep, 8, 128), act(deep, 8, 128, checkpointing=True)
    assert checkpointed.activation_peak < 0.6 * plain.activation_peak


def test_low_precision_weights_halve_the_layers_activations_and_gradients():
    # a small vocabulary: the layers dominate (the loss upcasts the logits to fp32 whatever the weights)
    small = LlamaConfig(**{**LLAMA.to_dict(), "vocab_size": 512})
    full, half = act(small), act(small, how=Numerics.half, precision="bf16")
    assert half.grad_bytes == 2 and full.grad_bytes == 4
    assert 0.4 < half.activation_peak / full.activation_peak < 0.75


def test_autocast_over_fp32_weights_also_holds_their_low_precision_copies():
    weights = LLAMA.hidden_size * LLAMA.vocab_size  # the largest matrix the autocast caches a copy of
    autocast = act(LLAMA, how=Numerics.autocast, precision="bf16")
    assert autocast.grad_bytes == 4  # gradients of fp32 weights
    assert autocast.activation_peak > act(LLAMA, how=Numerics.half_autocast, precision="bf16").activation_peak + weights


def test_the_gradients_backward_writes_are_sampled_beside_the_activations():
    trace = act(LLAMA)
    assert trace.samples[-1][1] == 4 * trace.parameters  # every gradient written by the end
    assert trace.peak_with_gradients(1.0) >= trace.peak_with_gradients(0.0) == trace.activation_peak


@pytest.mark.parametrize("chunked", [False, True], ids=["plain_loss", "chunked_loss"])
def test_a_mixture_of_experts_traces_its_grouped_matmul_not_a_weight_copy_per_token(chunked):
    """transformers' default grouped expert matmul, through its fallback operator (any
    dtype). batched_mm, the probe's choice, would copy each chosen expert's weights per
    token: here 64 tokens x 2 experts x 3 MB = 384 MB. With the chunked loss (the
    default), its probe forward runs through the experts too."""
    from transformers.integrations import moe

    wide = MixtralConfig(hidden_size=64, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=512,
                         output_router_logits=True)
    plain = moe._can_use_grouped_mm
    for how, precision in ((Numerics.fp32, "fp32"), (Numerics.autocast, "bf16"), (Numerics.half, "bf16")):
        trace = act(wide, 1, 64, how=how, precision=precision, chunked=chunked)
        # the experts' activations (128 x 8,192 in fp32: 4 MB) and their weights' gradient (8 MB)
        assert 4 * 2**20 < trace.activation_peak < 64 * 2**20, how
    assert moe._can_use_grouped_mm is plain  # put back after the trace


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_trace_holds_no_memory(config):
    # 64 x 128 tokens of fp32 logits over 50,257 words alone are 1.6 GB, which this process never holds
    assert act(config, 64, 128).activation_peak > 2**30


def test_a_gpus_fused_attention_keeps_no_t_by_t_probabilities():
    """GPT-2 trains with attention dropout, under which the CPU's SDPA keeps each head's
    T x T probabilities and mask; a GPU's flash / memory-efficient kernels do not."""
    long = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, vocab_size=512)
    cpu = trace_step(ModelSpec(), long, 2, 1024, "fp32", Numerics.fp32)
    gpu = trace_step(ModelSpec(), long, 2, 1024, "fp32", Numerics.fp32, gpu_kernels=True)
    probabilities = 2 * 4 * 1024 * 1024 * 4  # one layer's, fp32
    assert cpu.activation_peak - gpu.activation_peak > 2 * probabilities
    # eager attention computes the probabilities on a GPU too: left as it is
    from runner.config.spec import AttnImplementation

    eager = ModelSpec(attn_implementation=AttnImplementation.eager)
    assert (trace_step(eager, long, 2, 1024, "fp32", Numerics.fp32, gpu_kernels=True).activation_peak
            > gpu.activation_peak + 2 * probabilities)


@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked"])
def test_a_preference_micro_batch_is_traced_as_its_two_sequences_a_pair(chunked):
    """4 pairs are 8 sequences: with a small vocabulary, where the layers' activations
    dominate, about those of 8 text blocks (measured 14.9 against 13.9 MiB plain, 15.2
    against 15.2 chunked). With GPT-2's vocabulary the chunked pair head (a chunk of pairs
    at a time: 8 pairs of 256 tokens are 4 chunks of 1,024 tokens) holds far less than
    the pairs' whole logits."""
    small = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=512)

    def peak(config, is_chunked: bool, micro_batch: int, pairs: bool = False, block: int = 64) -> int:
        return trace_step(ModelSpec(chunked_loss=is_chunked), config, micro_batch, block, "fp32", Numerics.fp32,
                          pairs=pairs).activation_peak

    pairs, blocks = peak(small, chunked, 4, pairs=True), peak(small, chunked, 8)
    assert 0.9 * blocks < pairs < 1.15 * blocks, (pairs, blocks)
    if chunked:
        assert peak(GPT2, True, 8, pairs=True, block=256) < 0.75 * peak(GPT2, False, 8, pairs=True, block=256)


def test_a_preference_evaluation_is_traced_on_its_pairs_logits_unless_chunked():
    """A preference evaluation of 8 pairs scores 16 sequences: from their whole logits
    (2 x 16 x 256 x 50,257 x 4 bytes with logsumexp's temporary), as a text evaluation of
    16 blocks holds them; through the chunked pair head a chunk of pairs at a time (here
    2 pairs, 1,024 tokens)."""
    def peak(chunked: bool, batch: int, pairs: bool) -> int:
        return trace_evaluation(ModelSpec(chunked_loss=chunked), GPT2, batch, 256, "fp32", Numerics.fp32,
                                pairs=pairs).peak

    logits = 16 * 256 * 50257 * 4
    plain_pairs, plain_blocks = peak(False, 8, True), peak(False, 16, False)
    assert 1.95 * logits <= plain_pairs < 2.2 * logits  # the temporary: all tokens but the last
    assert 0.95 * plain_blocks < plain_pairs <= plain_blocks  # the blocks' scores also hold an argmax
    assert peak(True, 8, True) < 0.6 * plain_pairs


def test_the_plan_traces_the_activation_the_run_computes():
    """model.fused_activations: torch's fused tanh-GELU keeps its input alone for backward
    where transformers' gelu_new keeps three more tensors of the MLP's width per layer
    (measured 24.0 of them over 8 layers); the plan traces the one the run computes."""
    deep = GPT2Config(n_embd=64, n_layer=8, n_head=4, n_positions=128, vocab_size=512)

    def peak(spec: ModelSpec) -> int:
        return trace_step(spec, deep, 8, 128, "fp32", Numerics.fp32).activation_peak

    fused, python = peak(ModelSpec()), peak(ModelSpec(fused_activations=False))
    mlp_tensor = 8 * 128 * 4 * 64 * 4  # one fp32 tensor of the MLP's 4 x 64 features
    assert python - fused >= 0.95 * 8 * 3 * mlp_tensor, (fused, python)
