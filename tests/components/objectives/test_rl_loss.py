"""The online-RL policy losses (runner/components/objectives/rl_loss.py) against TRL
1.16's own code on fixed inputs: GRPOTrainer._compute_loss and RLOOTrainer._compute_loss
run as unbound functions on stand-in trainers whose model pass returns our log-probs, and
the advantage lines of their _generate_and_score_completions cut out of TRL's source and
run as they stand. And the step's normalisation, the same in any layout of micro-batches."""

from __future__ import annotations

import inspect
import textwrap
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer
from trl.trainer.utils import nanstd

from runner.components.objectives.rl_loss import (
    BNPO_REFUSED, PolicyTerms, figure_sums, group_advantages, loss_share, policy_terms, reward_figures, rloo_advantages,
    rloo_sequence_kl, rloo_share, rloo_terms, step_normaliser)
from runner.config.rl_spec import RLLoss, ScaleRewards

TOL = dict(atol=1e-6, rtol=0)
LOSSES = ["grpo", "dr_grpo", "dapo", "cispo"]
LEVELS = ["token", "sequence"]
# Each completion's loss tokens: ragged, two fully padded (masked after generation), one of one token.
LENGTHS = (7, 3, 0, 1, 5, 6, 2, 0)
ROWS, WIDTH, MAX_LENGTH = len(LENGTHS), max(LENGTHS), 10
ADVANTAGES = (1.2, -0.7, 0.4, -1.5, 0.9, -0.3, 1.1, -0.8)
# Each completion's shift of the sampling pass's log-probs: one ratio a completion then
# clips high (row 0), low (rows 1, 3), or not.
SHIFTS = (-0.7, 0.8, 0.0, 0.6, 0.0, -0.3, 0.1, 0.0)
EPS_LOW = 0.2


def eps_high(loss_type: str) -> float:
    return 1.5 if loss_type == "cispo" else 0.28  # cispo's is the ratio's cap itself


@pytest.fixture(scope="module")
def batch() -> SimpleNamespace:
    """One optimizer step's completions: the policy's log-probs, the sampling pass's
    (far enough off to clip on both sides), the reference's, entropies, the mask."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(WIDTH) < torch.tensor(LENGTHS).unsqueeze(1)).long()
    logps = -(torch.rand(ROWS, WIDTH, generator=g) * 2 + 0.05)
    old = logps + torch.randn(ROWS, WIDTH, generator=g) * 0.6 + torch.tensor(SHIFTS).unsqueeze(1)
    ref = logps + torch.randn(ROWS, WIDTH, generator=g) * 0.5
    return SimpleNamespace(mask=mask, logps=logps, old=old, ref=ref, advantages=torch.tensor(ADVANTAGES),
                           entropies=torch.rand(ROWS, WIDTH, generator=g) * 3,
                           completion_ids=torch.randint(0, 50, (ROWS, WIDTH), generator=g))


def accelerator(num_processes: int = 1) -> SimpleNamespace:
    """Accelerate's collectives as on one process; the count of processes is what TRL's normaliser reads."""
    same = lambda tensor, reduction="sum": tensor  # noqa: E731
    return SimpleNamespace(num_processes=num_processes, reduce=same, gather=same, gather_for_metrics=same)


def stand_in(rows: list[int], b: SimpleNamespace, **attributes: Any) -> tuple[SimpleNamespace, torch.Tensor]:
    """A trainer whose model pass returns our log-probs (a leaf, to take the gradient at)."""
    logps = b.logps[rows].clone().requires_grad_(True)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), aux_loss_enabled=False,
                              _metrics=defaultdict(lambda: defaultdict(list)), **attributes,
                              _get_per_token_logps_and_entropies=lambda *_, **__: (logps, b.entropies[rows], None))
    return trainer, logps


def model_inputs(rows: list[int], b: SimpleNamespace) -> dict[str, torch.Tensor]:
    prompt = torch.ones(len(rows), 2, dtype=torch.long)
    return {"prompt_ids": prompt, "prompt_mask": prompt, "completion_ids": b.completion_ids[rows],
            "completion_mask": b.mask[rows]}


def trl_grpo(loss_type: str, beta: float, level: str, b: SimpleNamespace, rows: list[int], *,
             accumulation: int = 1, trl_steps_per_generation: int = 1, processes: int = 1,
             generation_tokens: Optional[torch.Tensor] = None, correction: bool = True) -> SimpleNamespace:
    """GRPOTrainer._compute_loss on the rows, one micro-batch of a step of `accumulation`
    on each of `processes`: its loss, the gradient at the log-probs, its logged metrics.
    `correction`: TRL's use_bias_correction_kl (its default: on)."""
    args = SimpleNamespace(delta=None, use_bias_correction_kl=correction, steps_per_generation=trl_steps_per_generation)
    trainer, logps = stand_in(
        rows, b, loss_type=loss_type, beta=beta, epsilon_low=EPS_LOW, epsilon_high=eps_high(loss_type),
        importance_sampling_level=level, top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False, args=args,
        current_gradient_accumulation_steps=accumulation, max_completion_length=MAX_LENGTH,
        accelerator=accelerator(processes))
    tokens = b.mask.sum() if generation_tokens is None else generation_tokens
    inputs = {**model_inputs(rows, b), "advantages": b.advantages[rows], "old_per_token_logps": b.old[rows],
              "ref_per_token_logps": b.ref[rows], "num_items_in_batch": tokens}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return SimpleNamespace(loss=loss.detach(), grad=logps.grad, metrics=trainer._metrics["train"])


def ours(loss_type: str, beta: float, level: str, b: SimpleNamespace, rows: list[int], *, step_completions: int = ROWS,
         steps_per_generation: int = 1, generation_tokens: Optional[torch.Tensor] = None,
         trim: bool = False, correction: bool = True) -> SimpleNamespace:
    """Our share of the step's loss for the rows (trimmed to their longest, as a rank pads)."""
    width = max(max(LENGTHS[r] for r in rows), 1) if trim else WIDTH
    logps = b.logps[rows, :width].clone().requires_grad_(True)
    mask = b.mask[rows, :width]
    terms = policy_terms(logps, b.old[rows, :width], b.ref[rows, :width] if beta else None, b.advantages[rows], mask,
                         loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=eps_high(loss_type), beta=beta,
                         importance_sampling_level=level, bias_correction_kl=correction)
    tokens = b.mask.sum() if generation_tokens is None else generation_tokens
    normaliser = step_normaliser(loss_type, step_completions, tokens, steps_per_generation, MAX_LENGTH)
    share = loss_share(terms, mask, loss_type, normaliser)
    share.backward()
    grad = torch.zeros(len(rows), WIDTH)
    grad[:, :width] = logps.grad
    return SimpleNamespace(loss=share.detach(), grad=grad, terms=terms,
                           figures=figure_sums(terms, mask, b.entropies[rows, :width]))


def means(figures: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    return {name: (n / d.clamp(min=1.0)).item() for name, (n, d) in figures.items()}


def assert_both_sides_clipped(terms: PolicyTerms, mask: torch.Tensor) -> None:
    """The fixture must make the clip act, low and high, else the comparison proves little."""
    real = mask.bool() if not terms.per_sequence else mask.sum(-1, keepdim=True) > 0
    if terms.cispo_clip is not None:
        capped = terms.cispo_clip & real
        assert 0 < capped.sum() < real.sum()
    else:
        assert (terms.is_low_clipped & real).any() and (terms.is_high_clipped & real).any()


# --- GRPOTrainer._compute_loss as the oracle -------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("beta, correction", [(0.0, True), (0.04, True), (0.04, False)],
                         ids=["beta 0", "beta 0.04 (KL bias-corrected, TRL's default)", "beta 0.04 uncorrected"])
@pytest.mark.parametrize("loss_type", LOSSES)
def test_the_step_in_one_piece_equals_trl_grpo_trainer(batch, loss_type, beta, correction, level):
    everything = list(range(ROWS))
    trl = trl_grpo(loss_type, beta, level, batch, everything, correction=correction)
    mine = ours(loss_type, beta, level, batch, everything, correction=correction)
    assert_both_sides_clipped(mine.terms, batch.mask)
    torch.testing.assert_close(mine.loss, trl.loss, **TOL)
    torch.testing.assert_close(mine.grad, trl.grad, **TOL)
    assert mine.grad.abs().sum() > 0  # a gradient to compare at all
    figures = means(mine.figures)
    assert ("kl" in figures) == (beta != 0.0)
    for name, value in figures.items():
        assert value == pytest.approx(trl.metrics[name][0], abs=1e-6), name


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSSES)
def test_a_micro_batch_share_is_trl_loss_over_the_processes(batch, loss_type, level):
    """The normaliser's algebra: 2 processes x 2 accumulation steps of 2 rows, TRL's
    steps_per_generation 4 (2 optimizer steps a generation batch, whose tokens are more
    than this step's). TRL's micro-batch loss is processes x our share, gradient too
    (DDP then averages over the processes)."""
    generation_tokens = batch.mask.sum() + 17
    for start in range(0, ROWS, 2):
        rows = [start, start + 1]
        trl = trl_grpo(loss_type, 0.04, level, batch, rows, accumulation=2, trl_steps_per_generation=4, processes=2,
                       generation_tokens=generation_tokens)
        mine = ours(loss_type, 0.04, level, batch, rows, steps_per_generation=2, generation_tokens=generation_tokens)
        torch.testing.assert_close(2 * mine.loss, trl.loss, **TOL)
        torch.testing.assert_close(2 * mine.grad, trl.grad, **TOL)


# --- the layout of the step ------------------------------------------------------------

LAYOUTS = {"1x8": [8], "2x4": [4, 4], "2 ranks x 2": [2, 2, 2, 2], "8x1": [1] * 8, "3+5": [3, 5]}


def pieces(sizes: list[int]) -> list[list[int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSSES)
def test_the_shares_sum_to_the_step_loss_in_any_layout(batch, loss_type, level, layout):
    whole = ours(loss_type, 0.04, level, batch, list(range(ROWS)))
    parts = [ours(loss_type, 0.04, level, batch, rows, trim=True) for rows in pieces(LAYOUTS[layout])]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss, **TOL)
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), whole.grad, **TOL)
    pooled = {name: tuple(sum(p.figures[name][i] for p in parts) for i in (0, 1)) for name in whole.figures}
    assert means(pooled) == pytest.approx(means(whole.figures), abs=1e-6)


def ours_rloo(b: SimpleNamespace, rows: list[int]) -> SimpleNamespace:
    """Our share of RLOO's step loss for the rows, its gradient, its terms."""
    logps = b.logps[rows].clone().requires_grad_(True)
    terms = rloo_terms(logps, b.old[rows], b.advantages[rows], b.mask[rows], epsilon_low=EPS_LOW, epsilon_high=0.28)
    share = rloo_share(terms, ROWS)
    share.backward()
    return SimpleNamespace(loss=share.detach(), grad=logps.grad, terms=terms)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rloo_shares_sum_to_the_step_loss_in_any_layout(batch, layout):
    whole = ours_rloo(batch, list(range(ROWS)))
    parts = [ours_rloo(batch, rows) for rows in pieces(LAYOUTS[layout])]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss, **TOL)
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), whole.grad, **TOL)


# --- advantages: TRL's own lines, cut out of its source --------------------------------


def trl_lines(method: Any, first: str, last: str) -> str:
    """The lines of a TRL method from the one holding `first` to the one holding `last`,
    dedented to run on their own (TRL 1.16 is pinned: a moved line fails here, loudly)."""
    source = inspect.getsource(method)
    start = source.rindex("\n", 0, source.index(first)) + 1
    end = source.index("\n", source.index(last, start))
    return textwrap.dedent(source[start:end])


WEIGHTS = torch.tensor([1.0, 0.5])


def scored(unscorable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """12 completions in 3 groups of 4 scored by two reward functions (TRL's rewards_per_func),
    the second group all alike (zero std), and their weighted sum (runner's reward). `unscorable`:
    one completion both functions returned None for (NaN, its reward NaN too)."""
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(12, 2, generator=g)
    scores[4:8] = torch.tensor([0.5, 1.0])
    if unscorable:
        scores[9] = float("nan")
    return scores, (scores * WEIGHTS).nansum(dim=1).masked_fill(torch.isnan(scores).all(dim=1), float("nan"))


def trl_run(method: Any, blocks: list[tuple[str, str]], self: SimpleNamespace, **names: Any) -> dict[str, Any]:
    scope = dict(torch=torch, nanstd=nanstd, device="cpu", mode="train", num_generations=4, self=self,
                 gather=lambda t: t, **names)
    for first, last in blocks:
        exec(trl_lines(method, first, last), scope)
    return scope


REWARD_LOGS = ("rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)",
               'self._metrics[mode]["frac_reward_zero_std"]')


@pytest.mark.parametrize("unscorable", [False, True])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl_grpo_lines(scale, unscorable):
    scores, rewards = scored(unscorable)
    trainer = SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
                              reward_weights=WEIGHTS, _metrics=defaultdict(lambda: defaultdict(list)))
    trl = trl_run(GRPOTrainer._generate_and_score_completions,
                  [("unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
                    "advantages = torch.nan_to_num(advantages, nan=0.0)"), REWARD_LOGS],
                  trainer, rewards_per_func=scores)
    torch.testing.assert_close(group_advantages(rewards, 4, ScaleRewards(scale)), trl["advantages"], **TOL)
    figures = reward_figures(rewards, 4, ScaleRewards(scale))
    logged = trainer._metrics["train"]
    assert (figures.reward.item(), figures.reward_std.item()) == pytest.approx(
        (logged["reward"][0], logged["reward_std"][0]), abs=1e-6)
    assert figures.frac_reward_zero_std.item() == logged["frac_reward_zero_std"][0]
    assert figures.frac_reward_zero_std.item() == pytest.approx(0.0 if scale == "batch" else 1 / 3)  # the alike group


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("unscorable", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_rloo_advantages_equal_trl_rloo_lines(batch, beta, unscorable, normalize):
    scores, rewards = scored(unscorable)
    old, ref = torch.cat([batch.old, batch.old[:4]]), torch.cat([batch.ref, batch.ref[:4]])
    mask = torch.cat([batch.mask, batch.mask[:4]])
    trainer = SimpleNamespace(beta=beta, reward_weights=WEIGHTS, reward_clip_range=None, normalize_advantages=normalize,
                              accelerator=accelerator(), _metrics=defaultdict(lambda: defaultdict(list)))
    trl = trl_run(RLOOTrainer._generate_and_score_completions,
                  [("unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
                    "is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))"),
                   ("kl_stats = self.accelerator.reduce(", 'self._metrics[mode]["kl"].append'), REWARD_LOGS],
                  trainer, rewards_per_func=scores, old_per_token_logps=old, ref_per_token_logps=ref,
                  completion_mask=mask, per_token_kl=old - ref)
    kl = rloo_sequence_kl(old, ref, mask)
    advantages = rloo_advantages(rewards, 4, kl if beta else None, beta, normalize=normalize)
    torch.testing.assert_close(advantages, trl["advantages"], **TOL)
    figures = reward_figures(rewards, 4, ScaleRewards.group, zero_std_of=rewards - beta * kl)
    logged = trainer._metrics["train"]
    assert figures.reward_std.item() == pytest.approx(logged["reward_std"][0], abs=1e-6)
    assert figures.frac_reward_zero_std.item() == logged["frac_reward_zero_std"][0]
    assert (kl.sum() / mask.sum()).item() == pytest.approx(logged["kl"][0], abs=1e-6)


# --- RLOOTrainer._compute_loss as the oracle -------------------------------------------


def test_rloo_loss_equals_trl_rloo_trainer(batch):
    everything = list(range(ROWS))
    trainer, trl_logps = stand_in(everything, batch, epsilon_low=EPS_LOW, epsilon_high=0.28, accelerator=accelerator())
    inputs = {**model_inputs(everything, batch), "advantages": batch.advantages,
              "old_logps": (batch.old * batch.mask).sum(1)}
    trl_loss = RLOOTrainer._compute_loss(trainer, None, inputs)
    trl_loss.backward()
    mine = ours_rloo(batch, everything)
    assert_both_sides_clipped(mine.terms, batch.mask)
    torch.testing.assert_close(mine.loss, trl_loss.detach(), **TOL)
    torch.testing.assert_close(mine.grad, trl_logps.grad, **TOL)
    for name, value in means(figure_sums(mine.terms, batch.mask, batch.entropies)).items():
        assert value == pytest.approx(trainer._metrics["train"][name][0], abs=1e-6), name


# --- refusals -----------------------------------------------------------------------------


def test_bnpo_and_a_kl_term_without_its_inputs_are_refused(batch):
    inputs = (batch.logps, batch.old, None, batch.advantages, batch.mask)
    with pytest.raises(ValueError, match="bnpo normalises over each micro-batch's own tokens"):
        policy_terms(*inputs, loss_type=RLLoss.bnpo, epsilon_low=0.2, epsilon_high=0.2)
    with pytest.raises(ValueError, match="use dapo"):
        step_normaliser("bnpo", ROWS, 40, 1, MAX_LENGTH)
    terms = policy_terms(*inputs, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2)
    with pytest.raises(ValueError) as refused:
        loss_share(terms, batch.mask, "bnpo", 1.0)
    assert str(refused.value) == BNPO_REFUSED
    with pytest.raises(ValueError, match="reference"):
        policy_terms(*inputs, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.04)
    with pytest.raises(ValueError, match="KL"):
        rloo_advantages(torch.zeros(8), 4, None, beta=0.05)
