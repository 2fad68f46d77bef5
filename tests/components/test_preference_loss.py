"""The preference losses (runner/components/objectives/preference_loss.py) against TRL
1.16's own code, run on the same log-probs: DPOTrainer._compute_loss for sigmoid, ipo
and hinge (on a stand-in trainer and a stand-in model that returns the per-token
log-probs, as TRL's fused head does), CPOTrainer.cpo_loss for simpo and
ORPOTrainer.odds_ratio_loss for orpo (each fed TRL's own length-normalised log-probs,
from its get_batch_logps). And the per-sequence log-probs against TRL's."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import DPOConfig
from trl.experimental.cpo import CPOConfig
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.experimental.orpo import ORPOConfig
from trl.experimental.orpo.orpo_trainer import ORPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.utils import add_fused_lm_head, selective_log_softmax

from runner.certify.architectures import TINY
from runner.components.model import build_config
from runner.components.objectives.preference_loss import PairTerms, pair_terms, sequence_logps
from runner.config.spec import ModelSpec, PreferenceLoss, PreferenceSpec

TOL = dict(atol=1e-6, rtol=0)
UNUSED = dict(output_dir="unused", report_to=[], bf16=False)  # TrainingArguments TRL's configs need
PAIRS, LENGTH, VOCAB = 6, 14, 13
# Each pair's prompt length and its chosen and rejected answers' token counts (EOS
# included): different within and across pairs, so length normalisation shows.
PROMPTS = (1, 3, 2, 4, 1, 2)
CHOSEN = (4, 1, 7, 3, 9, 5)
REJECTED = (6, 2, 3, 8, 2, 5)


def labels_for(prompts: tuple[int, ...], answers: tuple[int, ...], seed: int) -> torch.Tensor:
    """Rows of token ids with the prompt and the right padding at -100, as DPO trains."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((len(prompts), LENGTH), -100)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        labels[row, prompt:prompt + answer] = torch.randint(0, VOCAB, (answer,), generator=g)
    return labels


def trl_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs as TRL's fused head returns them: [rows, LENGTH - 1], zero where
    the label is -100."""
    shifted = labels[:, 1:]
    return selective_log_softmax(logits[:, :-1], shifted.clamp(min=0)) * (shifted != -100)


@pytest.fixture(scope="module")
def pairs() -> SimpleNamespace:
    """Chosen rows then rejected rows (TRL's concatenated batch), random logits for the
    policy and the reference, and what each side is given."""
    labels = torch.cat([labels_for(PROMPTS, CHOSEN, 1), labels_for(PROMPTS, REJECTED, 2)])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2 * PAIRS, LENGTH, VOCAB, generator=g) * 2
    ref_logits = logits + torch.randn(2 * PAIRS, LENGTH, VOCAB, generator=g)
    per_token = trl_token_logps(logits, labels)
    ref_sums = trl_token_logps(ref_logits, labels).sum(dim=1)
    counts = (labels[:, 1:] != -100).sum(dim=1)
    assert counts.tolist() == [*CHOSEN, *REJECTED]
    return SimpleNamespace(labels=labels, logits=logits, per_token=per_token, sums=per_token.sum(dim=1),
                           ref_sums=ref_sums, counts=counts)


def ours(settings: PreferenceSpec, p: SimpleNamespace, rows=slice(None), reference: bool = True) -> PairTerms:
    s, c, r = p.sums, p.counts, p.ref_sums
    refs = (r[:PAIRS][rows], r[PAIRS:][rows]) if reference else ()
    return pair_terms(settings, s[:PAIRS][rows], s[PAIRS:][rows], c[:PAIRS][rows], c[PAIRS:][rows], *refs)


# --- DPOTrainer._compute_loss, run on stand-ins -----------------------------------------


class FusedHeadModel(torch.nn.Module):
    """Stands in for a model with TRL's fused LM head: returns the given per-token
    log-probs (and zeros for the figures TRL only logs)."""

    def __init__(self, per_token: torch.Tensor, labels: torch.Tensor):
        super().__init__()
        self.per_token, self.labels = per_token, labels

    def forward(self, labels, fused_lm_head, **_):
        assert fused_lm_head and torch.equal(labels, self.labels)  # TRL masked exactly our answers
        zeros = torch.zeros_like(self.per_token)
        return SimpleNamespace(log_probs=self.per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


class Gathering:
    """Accelerate's gathers on one process, keeping what `gather` was handed: the
    per-pair rewards TRL logs the mean of."""

    device = torch.device("cpu")

    def __init__(self):
        self.gathered: list[torch.Tensor] = []

    def gather(self, tensor):
        self.gathered.append(tensor)
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor


def trl_dpo(loss_type: str, beta: float, p: SimpleNamespace, pairs: list[int]) -> SimpleNamespace:
    """DPOTrainer._compute_loss on the given pairs, with precomputed reference log-probs:
    its loss (the mean over the pairs), each pair's rewards, its logged metrics."""
    args = DPOConfig(**UNUSED, loss_type=[loss_type], beta=beta, precompute_ref_log_probs=True)
    rows = pairs + [PAIRS + i for i in pairs]
    labels = p.labels[rows]
    model = FusedHeadModel(p.per_token[rows], labels)
    trainer = SimpleNamespace(  # the attributes DPOTrainer.__init__ sets from args and _compute_loss reads
        model=model, accelerator=Gathering(), args=args, beta=args.beta, loss_types=args.loss_type,
        loss_weights=args.loss_weights or [1.0], ld_alpha=args.ld_alpha, label_smoothing=args.label_smoothing,
        precompute_ref_logps=args.precompute_ref_log_probs, f_divergence_type=args.f_divergence_type,
        f_alpha_divergence_coef=args.f_alpha_divergence_coef, use_weighting=args.use_weighting,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    # The collator's completion mask: the answer's tokens (as TRL's labels are the ids where it is 1).
    inputs = {"input_ids": labels.clamp(min=0), "attention_mask": torch.ones_like(labels),
              "completion_mask": (labels != -100).long(),
              "ref_chosen_logps": p.ref_sums[pairs], "ref_rejected_logps": p.ref_sums[[PAIRS + i for i in pairs]]}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    chosen_rewards, rejected_rewards = trainer.accelerator.gathered[:2]
    return SimpleNamespace(loss=loss, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                           metrics=trainer._metrics["train"])


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.3), ("ipo", 0.4), ("hinge", 0.25)])
def test_reference_losses_equal_trl_dpo_trainer(pairs, loss_type, beta):
    settings = PreferenceSpec(loss_type=PreferenceLoss(loss_type), beta=beta)
    got = ours(settings, pairs)
    everything = trl_dpo(loss_type, beta, pairs, list(range(PAIRS)))
    torch.testing.assert_close(got.loss.mean(), everything.loss, **TOL)
    torch.testing.assert_close(got.chosen_rewards, everything.chosen_rewards, **TOL)
    torch.testing.assert_close(got.rejected_rewards, everything.rejected_rewards, **TOL)
    logged = everything.metrics  # what TRL logs: the means of the per-pair rewards above
    assert logged["rewards/chosen"] == [pytest.approx(got.chosen_rewards.mean().item(), abs=1e-6)]
    assert logged["rewards/rejected"] == [pytest.approx(got.rejected_rewards.mean().item(), abs=1e-6)]
    assert not got.chosen_rewards.requires_grad
    for i in range(PAIRS):  # each pair's loss: TRL's on that pair alone
        torch.testing.assert_close(got.loss[i], trl_dpo(loss_type, beta, pairs, [i]).loss, **TOL)
    if loss_type == "hinge":  # both sides of the hinge are exercised
        assert (got.loss == 0).any() and (got.loss > 0).any()


def test_ipo_divides_each_log_ratio_by_its_own_answer_length(pairs):
    """Lengths matter to ipo: the same sums with every count doubled give another loss."""
    settings = PreferenceSpec(loss_type=PreferenceLoss.ipo, beta=0.4)
    p = pairs
    doubled = pair_terms(settings, p.sums[:PAIRS], p.sums[PAIRS:], 2 * p.counts[:PAIRS], 2 * p.counts[PAIRS:],
                         p.ref_sums[:PAIRS], p.ref_sums[PAIRS:])
    assert (doubled.loss - ours(settings, p).loss).abs().min() > 1e-3


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_sigmoid_with_label_smoothing_is_conservative_dpo(pairs, smoothing):
    """TRL 1.16's sigmoid has no label smoothing (only its robust, exo and aot losses read
    it), so this holds the closed form of conservative DPO (TRL's sigmoid before 1.0):
    -(1-eps) logsigmoid(beta d) - eps logsigmoid(-beta d); and, as a second oracle that
    runs TRL's code, CPOTrainer.cpo_loss with loss_type=sigmoid, the same form, fed the
    log-ratios (with a reference of zero, CPO's logits are DPO's d)."""
    beta = 0.3
    got = ours(PreferenceSpec(loss_type=PreferenceLoss.sigmoid, beta=beta, label_smoothing=smoothing), pairs)
    chosen = pairs.sums[:PAIRS] - pairs.ref_sums[:PAIRS]
    rejected = pairs.sums[PAIRS:] - pairs.ref_sums[PAIRS:]
    d = chosen - rejected
    closed = (-(1 - smoothing) * torch.nn.functional.logsigmoid(beta * d)
              - smoothing * torch.nn.functional.logsigmoid(-beta * d))
    torch.testing.assert_close(got.loss, closed, **TOL)
    args = CPOConfig(**UNUSED, loss_type="sigmoid", beta=beta, label_smoothing=smoothing)
    cpo = SimpleNamespace(alpha=args.alpha, beta=args.beta, label_smoothing=args.label_smoothing,
                          loss_type=args.loss_type, accelerator=Gathering())
    losses, chosen_rewards, _ = CPOTrainer.cpo_loss(cpo, chosen, rejected)
    torch.testing.assert_close(got.loss, losses, **TOL)
    torch.testing.assert_close(got.chosen_rewards, chosen_rewards, **TOL)  # beta x the log-ratio, as DPO's
    # and with no smoothing, TRL 1.16's sigmoid (the parametrized test above) is this form at eps=0
    plain = ours(PreferenceSpec(loss_type=PreferenceLoss.sigmoid, beta=beta), pairs)
    assert (got.loss - plain.loss).abs().max() > 1e-3


# --- CPOTrainer (simpo) and ORPOTrainer ---------------------------------------------------


def trl_means(trainer: type, p: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's mean token log-prob, by the trainer's own get_batch_logps."""
    means = trainer.get_batch_logps(p.logits, p.labels, average_log_prob=True)
    return means[:PAIRS], means[PAIRS:]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_trainer(pairs, smoothing):
    beta, gamma = 2.5, 1.2
    settings = PreferenceSpec(loss_type=PreferenceLoss.simpo, beta=beta, gamma=gamma, label_smoothing=smoothing)
    got = ours(settings, pairs, reference=False)
    args = CPOConfig(**UNUSED, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=gamma, beta=beta,
                     label_smoothing=smoothing)
    cpo = SimpleNamespace(alpha=args.alpha, beta=args.beta, label_smoothing=args.label_smoothing,
                          loss_type=args.loss_type, simpo_gamma=args.simpo_gamma, accelerator=Gathering())
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, *trl_means(CPOTrainer, pairs))
    torch.testing.assert_close(got.loss, losses, **TOL)
    torch.testing.assert_close(got.chosen_rewards, chosen_rewards, **TOL)
    torch.testing.assert_close(got.rejected_rewards, rejected_rewards, **TOL)
    # the same sums over other lengths are other mean log-probs: lengths matter
    longer = pair_terms(settings, pairs.sums[:PAIRS], pairs.sums[PAIRS:], pairs.counts[:PAIRS] + 1,
                        pairs.counts[PAIRS:])
    assert (longer.loss - got.loss).abs().min() > 1e-4


def test_orpo_odds_ratio_term_equals_trl_orpo_trainer(pairs):
    """ORPO's loss is the chosen answers' NLL minus the mean of odds_ratio_loss's `losses`
    (lambda x logsigmoid of the log odds ratio): our per-pair term is that negated."""
    lam = 0.25
    got = ours(PreferenceSpec(loss_type=PreferenceLoss.orpo, beta=lam), pairs, reference=False)
    args = ORPOConfig(**UNUSED, beta=lam)
    orpo = SimpleNamespace(beta=args.beta, accelerator=Gathering())
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(orpo, *trl_means(ORPOTrainer, pairs))
    torch.testing.assert_close(got.loss, -losses, **TOL)
    torch.testing.assert_close(got.chosen_rewards, chosen_rewards, **TOL)
    torch.testing.assert_close(got.rejected_rewards, rejected_rewards, **TOL)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_a_reference_loss_without_reference_log_probs_is_refused(pairs, loss_type):
    with pytest.raises(ValueError, match=f"loss_type={loss_type} needs the reference"):
        ours(PreferenceSpec(loss_type=PreferenceLoss(loss_type)), pairs, reference=False)


# --- sequence_logps ---------------------------------------------------------------------


def test_sequence_logps_equal_trl_selective_log_softmax(pairs):
    """Rows with a prompt, right padding, and (the last) left padding: every untrained
    position is -100."""
    labels = pairs.labels.clone()
    labels[-1] = torch.roll(labels[-1], 5)  # a left-padded row: -100s, then the prompt's, then the answer
    sums, counts = sequence_logps(pairs.logits, labels)
    expected = trl_token_logps(pairs.logits, labels).sum(dim=1)
    torch.testing.assert_close(sums, expected, **TOL)
    assert counts.tolist() == (labels[:, 1:] != -100).sum(dim=1).tolist()
    assert sums.dtype == torch.float32
    # bf16 logits reduce in fp32, as TRL's log_softmax path does
    half = pairs.logits.bfloat16()
    torch.testing.assert_close(sequence_logps(half, labels)[0], trl_token_logps(half.float(), labels).sum(dim=1),
                               **TOL)


def test_sequence_logps_equal_what_dpo_trainer_sums_from_its_fused_head():
    """On a tiny GPT-2 with padded rows: our sums from the model's logits equal TRL's
    fused LM head's per-token log-probs summed (what DPOTrainer._compute_loss sums).
    The head projects in chunks, so the tolerance is fp32 matmul's, not 1e-6 exact."""
    config = build_config(ModelSpec(model_type="gpt2", config_overrides=TINY["gpt2"] + ",vocab_size=97"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (4, 12), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # padded rows
    attention[3, 6:] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :3] = -100  # the prompt
    with torch.no_grad():
        sums, counts = sequence_logps(model(input_ids=ids, attention_mask=attention).logits, labels)
        add_fused_lm_head(model)
        fused = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(sums, fused.log_probs.sum(dim=1), atol=1e-5, rtol=0)
    assert counts.tolist() == fused.label_mask.sum(dim=1).tolist() == [9, 6, 9, 3]
