"""preference.reference=frozen (runner/components/objectives/frozen.py): a second copy of
the starting weights, built as the worker builds the policy, scores every pair as
`precomputed`'s table does (within 1e-6), before training and after the policy has
trained through it, on GPT-2 and a grouped-query Llama. Under one process the strategy
(ddp) keeps it whole, without gradients; zero3 and fsdp shard it
(tests/train/test_preference_multiprocess.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runner.certify.architectures import TINY
from runner.components.data.preference_batch import pad_pairs
from runner.components.objectives import build_objective
from runner.components.objectives.base import ObjectiveSetup
from runner.components.objectives.frozen import frozen_reference
from runner.components.objectives.reference import score_pairs
from runner.distributed.strategies import build_strategy
from runner.train.worker import build_seeded_model

PAIRS, BATCH = 6, 3


def one_process() -> SimpleNamespace:
    """What the reference asks of Accelerate's Accelerator, for one process in fp32."""
    return SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"), is_main_process=True,
                           gather=lambda t: t, wait_for_everyone=lambda: None, native_amp=False, autocast_handler=None)


def pairs(count: int, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(count):
        prompt = torch.randint(0, vocab, (2 + index % 3,), generator=generator).tolist()
        chosen = torch.randint(0, vocab, (1 + index % 4,), generator=generator).tolist()
        rejected = torch.randint(0, vocab, (3,), generator=generator).tolist()
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected,
                     "pair_index": index})
    return rows


def scored(reference, batches: list[dict]) -> torch.Tensor:
    """[pairs, 2]: the reference's (chosen, rejected) log-probs, batch after batch."""
    rows = []
    for batch in batches:
        logps = reference.logps(None, batch, "train")
        half = len(logps) // 2
        rows.append(torch.stack([logps[:half], logps[half:]], 1))
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_frozen_scores_the_precomputed_table_before_and_after_the_policy_trains(compose_spec, arch):
    spec = compose_spec("recipe=gpt2_dpo_tiny", "preference.reference=frozen", f"model.model_type={arch}",
                        f"model.config_overrides='{TINY[arch]}'")
    policy = build_seeded_model(spec)  # the worker's own build: the starting weights, its chunked head
    assert policy.chunked is not None
    accelerator, strategy = one_process(), build_strategy(spec.strategy, spec.precision)
    frozen = frozen_reference(spec, strategy, accelerator, chunked_head=True)
    assert frozen.chunked is not None and not frozen.model.training
    assert not any(p.requires_grad for p in frozen.model.parameters())
    rows = pairs(PAIRS, 500)
    collate = lambda batch: pad_pairs(batch, pad_id=0)  # noqa: E731
    batches = [collate(rows[i:i + BATCH]) for i in range(0, PAIRS, BATCH)]
    table = score_pairs(policy.model, rows, collate, BATCH, accelerator, cache=True, chunked=policy.chunked)
    before = (scored(frozen, batches) - table).abs().max().item()
    print(f"{arch}: frozen vs precomputed before training: {before:.3g}")
    assert before <= 1e-6

    # The policy trains through the DPO objective against the frozen copy: it moves, the copy does not.
    objective = build_objective(spec.train.objective, ObjectiveSetup(
        policy.model, 1, 1, policy.chunked, preference=spec.preference, reference=frozen))
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    policy.model.train()
    for _ in range(3):
        for batch in objective.open_window([dict(b) for b in batches[:1]], accelerator.device, False).batches:
            objective.loss(policy.model, batch).backward.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = score_pairs(policy.model, rows, collate, BATCH, accelerator, cache=True, chunked=policy.chunked)
    moved = (trained - table).abs().max().item()
    after = (scored(frozen, batches) - table).abs().max().item()
    print(f"{arch}: the policy moved {moved:.3g}; frozen vs precomputed after 3 steps: {after:.3g}")
    assert moved > 1e-2
    assert after <= 1e-6
