"""The two sides of tests/train/test_grpo_vs_trl.py: runner's grpo run and TRL 1.16's
GRPOTrainer (runner's rloo run and its RLOOTrainer), trained on the same fixed rollouts.

Sampling is the one part the two cannot share (runner draws each completion from its own
seeded generator, TRL from `generate`'s one stream), so both are handed the same fixed
completions, as TRL's own tests do (tests/test_grpo_trainer.py patches
`transformers.GenerationMixin.generate`):
- runner: `runner.components.rollouts.sample_group` returns a prompt's G fixed completions
  (padded with the pad id, their lengths, the end-of-sequence flags, and each token's
  log-prob under the model at the temperature, computed exactly from the whole logits);
- TRL: `GenerationMixin.generate` returns the prompts followed by the same completions,
  padded with the end-of-sequence token (TRL masks after the first).
Completion i of a prompt is a function of (the prompt's text, i) alone: a right answer,
a wrong one, no number, or a text cut at max_completion_length without an end.

Everything else is aligned, not patched: the saved starting weights (dropout off, fp32),
the prompts in runner's order (rollouts.prompt_order over the epochs the run consumes,
fed to TRL in that order with shuffle_dataset=False), G, the batch (one optimizer step =
TRL's per_device_train_batch_size completions, no accumulation), steps_per_generation
(runner's counts optimizer steps, TRL's micro-batches: equal here, with no accumulation),
AdamW (fused, betas, eps, no weight decay), a constant learning rate without warmup,
max_grad_norm, the temperature (0.7, so that scoring at the wrong one shows), beta (TRL's
use_bias_correction_kl as each case sets it, on by default on both sides), epsilon, loss_type, and the rewards (runner's
built-in exact_match/last_number + regex, weighted 1 and 0.5; TRL's two functions
computing the same, reward_weights [1, 0.5]). One TRL choice is random and is made the
identity: it shuffles a generation batch's rows before splitting it into its steps
(`shuffle_sequence_dict`, which RLOOTrainer imports too); runner trains share k of the
batch in group order.

All prompts have the same token count (8): TRL left-pads a batch's prompts and gives the
model no position ids, which would move a learned-position model's positions.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

G, BATCH, MAX_LEN, TEMPERATURE, LR, SEED = 4, 8, 8, 0.7, 1e-3, 11
PROMPT_TOKENS = 8


# --------------------------------------------------------------------------- shared inputs


def tokenizer_dir() -> str:
    from runner.config.paths import asset_path

    return str(asset_path("gpt2_tokenizer"))


def save_model(folder: Path, arch: str) -> Path:
    """A tiny random model, fp32, dropout off, saved with the vendored GPT-2 tokenizer.
    llama: grouped-query attention (4 heads over 2), rotary positions, untied head."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                                             eos_token_id=tokenizer.eos_token_id))
    else:
        raise ValueError(arch)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_prompts(path: Path, count: int, offset: int) -> list[dict]:
    """`count` of the offline sums ("What is 71 + 98? Answer:", answer "169"), all of
    PROMPT_TOKENS tokens, as a prompts jsonl."""
    from transformers import AutoTokenizer

    from runner.config.paths import asset_path

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    with gzip.open(asset_path("arith.jsonl.gz"), "rt") as handle:
        rows = [json.loads(line) for line in handle][offset:offset + 4 * count]
    rows = [r for r in rows if len(tokenizer(r["prompt"])["input_ids"]) == PROMPT_TOKENS][:count]
    assert len(rows) == count
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def runner_order(prompts: int, groups: int, seed: int) -> list[int]:
    """The prompt of each of the run's first `groups` groups: runner's stream (epoch e's
    permutation seeded by (seed, e); rollouts.prompts_of_generation)."""
    from runner.components.rollouts import prompt_order

    orders: dict[int, list[int]] = {}
    out = []
    for q in range(groups):
        epoch = q // prompts
        orders.setdefault(epoch, prompt_order(prompts, seed, epoch))
        out.append(orders[epoch][q % prompts])
    return out


# --------------------------------------------------------------------------- the fixed completions


class FixedCompletions:
    """Completion i of each prompt (known by its token ids), the same for both trainers."""

    def __init__(self, records: Sequence[dict], tokenizer: Any, max_len: int = MAX_LEN) -> None:
        self.tokenizer, self.max_len, self.eos = tokenizer, max_len, int(tokenizer.eos_token_id)
        self.by_prompt = {tuple(tokenizer(r["prompt"])["input_ids"]): r for r in records}
        self.calls = 0

    def ids(self, prompt_ids: Sequence[int], i: int) -> list[int]:
        record = self.by_prompt[tuple(int(t) for t in prompt_ids)]
        answer = int(record["answer"])
        kind = random.Random(f"{record['prompt']}/{i}").randrange(6)
        text, ended = [(f" {answer}", True), (f" The sum is {answer}.", True), (f" {answer + 1}", True),
                       (" I do not know", True), (f" {answer - 10}, then {answer} and more and more words", False),
                       (" no idea at all, none, not a single clue here", False)][kind]
        ids = self.tokenizer(text)["input_ids"]
        assert self.eos not in ids
        if ended:
            ids = ids[: self.max_len - 1] + [self.eos]
        else:
            assert len(ids) >= self.max_len
            ids = ids[: self.max_len]
        return ids


def exact_logps(model: Any, prompt_ids: Sequence[int], completion: Sequence[int], temperature: float) -> torch.Tensor:
    """Each completion token's log-prob under `model`: the whole logits of the row, / T, log_softmax."""
    device = next(model.parameters()).device
    row = torch.tensor([list(prompt_ids) + list(completion)], device=device)
    logits = model(input_ids=row, attention_mask=torch.ones_like(row), use_cache=False).logits[0].float()
    p = len(prompt_ids)
    scores = torch.log_softmax(logits[p - 1:p - 1 + len(completion)] / temperature, dim=-1)
    return scores.gather(1, torch.tensor(list(completion), device=device)[:, None]).squeeze(1).cpu()


def runner_sampler(fixed: FixedCompletions) -> Callable[..., Any]:
    """A stand-in for runner.components.generation.sample_group returning the fixed completions."""
    from runner.components.generation import Group

    @torch.no_grad()
    def sample_group(model: Any, prompt_ids: Sequence[int], seeds: Sequence[int], max_new_tokens: int,
                     temperature: float, eos_ids: Sequence[int], pad_id: int, lockstep: bool = False) -> Group:
        assert max_new_tokens == fixed.max_len
        fixed.calls += 1
        g = len(seeds)
        tokens = torch.full((g, max_new_tokens), pad_id, dtype=torch.long)
        logps = torch.zeros((g, max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(g, dtype=torch.long)
        ended = torch.zeros(g, dtype=torch.bool)
        for i in range(g):
            ids = fixed.ids(prompt_ids, i)
            tokens[i, :len(ids)] = torch.tensor(ids)
            logps[i, :len(ids)] = exact_logps(model, prompt_ids, ids, temperature)
            lengths[i], ended[i] = len(ids), ids[-1] in eos_ids
        return Group(tokens, lengths, logps, ended)

    return sample_group


def trl_generate(fixed: FixedCompletions, group: int = G) -> Callable[..., Any]:
    """A stand-in for transformers.GenerationMixin.generate: the prompts, then row r's
    fixed completion (sample r mod G: TRL's batch holds each prompt's G rows in a run),
    padded with the end-of-sequence token."""

    def generate(self: Any, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 **_: Any) -> torch.Tensor:
        fixed.calls += 1
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        rows = [fixed.ids(ids[m.bool()].tolist(), r % group) for r, (ids, m) in enumerate(zip(input_ids, mask))]
        width = max(len(c) for c in rows)
        completions = torch.full((len(rows), width), fixed.eos, dtype=torch.long)
        for r, c in enumerate(rows):
            completions[r, :len(c)] = torch.tensor(c)
        return torch.cat([input_ids, completions.to(input_ids.device)], dim=1)

    return generate


# --------------------------------------------------------------------------- rewards


RUNNER_REWARDS = ("rl.rewards=[{kind:exact_match,column:answer,extract:last_number},"
                  "{kind:regex,name:has_digit,pattern:'[0-9]',match:search,weight:0.5}]")


def exact_match(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """TRL's side of exact_match with extract=last_number (these completions write plain integers)."""
    out = []
    for text, want in zip(completions, answer):
        numbers = re.findall(r"-?\d+", text)
        out.append(float(bool(numbers) and int(numbers[-1]) == int(want)))
    return out


def has_digit(completions: list[str], **_: Any) -> list[float]:
    return [float(re.search(r"[0-9]", text) is not None) for text in completions]


# --------------------------------------------------------------------------- the two runs


def runner_command(run_dir: Path, model: Path, train: Path, validation: Path, steps: int, *extra: str) -> list[str]:
    base = ["model=gpt2", f"model.name_or_path={model}", f"model.tokenizer_name={model}", "objective=grpo",
            "data=arith", f"data.train_file={train}", f"data.validation_file={validation}",
            f"train.per_device_batch_size={BATCH}", f"train.max_steps={steps}", "train.log_every=1",
            "train.eval_every=0", f"train.seed={SEED}", f"optim.lr={LR}", "optim.weight_decay=0",
            "optim.max_grad_norm=1.0",
            "schedule=constant", "schedule.warmup_steps=0", "tracking=none", f"rl.num_generations={G}",
            f"rl.max_completion_length={MAX_LEN}", f"rl.temperature={TEMPERATURE}", RUNNER_REWARDS,
            f"hydra.run.dir={run_dir}"]
    overridden = {e.split("=", 1)[0] for e in extra}
    return [o for o in base if o.split("=", 1)[0] not in overridden] + list(extra)


def runner_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"eval_loss"' not in line]


def _trl_dataset_and_settings(train_rows: Sequence[dict], order: Sequence[int], steps: int) -> tuple[Any, dict]:
    """The prompts in `order` (runner's) and the settings both TRL trainers share with runner."""
    from datasets import Dataset

    dataset = Dataset.from_list([dict(train_rows[i]) for i in order])
    settings: dict[str, Any] = dict(
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, num_generations=G,
        max_completion_length=MAX_LEN, temperature=TEMPERATURE, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="adamw_torch_fused", max_grad_norm=1.0, max_steps=steps, logging_steps=1, seed=SEED,
        shuffle_dataset=False, disable_dropout=True, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        eval_strategy="no", dataloader_num_workers=0, reward_weights=[1.0, 0.5])
    return dataset, settings


def trl_trainer(out: Path, model: Path, train_rows: Sequence[dict], order: Sequence[int], steps: int,
                **options: Any) -> Any:
    """TRL's GRPOTrainer on the prompts in `order` (runner's), with the shared settings."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    dataset, settings = _trl_dataset_and_settings(train_rows, order, steps)
    args = GRPOConfig(output_dir=str(out), **{**settings, **options})
    return GRPOTrainer(model=str(model), reward_funcs=[exact_match, has_digit], args=args, train_dataset=dataset,
                       processing_class=AutoTokenizer.from_pretrained(model))


def trl_rloo_trainer(out: Path, model: Path, train_rows: Sequence[dict], order: Sequence[int], steps: int,
                     **options: Any) -> Any:
    """TRL's RLOOTrainer on the prompts in `order` (runner's), with the shared settings
    (num_generations G, not RLOOConfig's default 2; beta RLOOConfig's 0.05 unless set).
    RLOOTrainer has GRPOTrainer's layout: generation batch of steps_per_generation steps,
    shuffled by its own `shuffle_sequence_dict` import, scored through add_fused_lm_head
    (the policy with log_probs and entropy, the reference with log_probs)."""
    from transformers import AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    dataset, settings = _trl_dataset_and_settings(train_rows, order, steps)
    args = RLOOConfig(output_dir=str(out), **{**settings, **options})
    return RLOOTrainer(model=str(model), reward_funcs=[exact_match, has_digit], args=args, train_dataset=dataset,
                       processing_class=AutoTokenizer.from_pretrained(model))


def trl_steps(trainer: Any) -> list[dict]:
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]


# --------------------------------------------------------------------------- TRL's fused head against the exact scores


def fused_head_gap(model_dir: Path, fixed: FixedCompletions, prompts: Sequence[Sequence[int]],
                   temperature: float = TEMPERATURE) -> tuple[float, float]:
    """(largest |log-prob| difference, relative gradient-norm difference) between TRL's
    fused LM head (add_fused_lm_head, as GRPOTrainer scores) and the exact computation
    (the whole logits / T, torch's log_softmax), on G completions of each prompt, right-padded
    as TRL pads them, with a DAPO-like loss sum(-A x logp) / tokens of fixed advantages."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    completions = [fixed.ids(p, i) for p in prompts for i in range(G)]
    width = max(len(c) for c in completions)
    p_len = len(prompts[0])
    ids = torch.full((len(completions), p_len + width), fixed.eos, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for r, c in enumerate(completions):
        ids[r, :p_len] = torch.tensor(list(prompts[r // G]))
        ids[r, p_len:p_len + len(c)] = torch.tensor(c)
        attention[r, :p_len + len(c)] = 1
    mask = attention[:, p_len:].float()
    advantages = torch.linspace(-1.5, 1.5, len(completions))[:, None]

    def step(fused: bool) -> tuple[torch.Tensor, float]:
        model.zero_grad()
        if fused:  # GRPOTrainer._get_per_token_logps_and_entropies
            labels = ids.masked_fill(attention == 0, -100)
            labels[:, :-width] = -100
            out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
            logps = out.log_probs[:, -width:]
        else:
            logits = model(input_ids=ids, attention_mask=attention).logits[:, p_len - 1:-1].float()
            logps = torch.log_softmax(logits / temperature, -1).gather(2, ids[:, p_len:, None]).squeeze(2)
        loss = (-advantages * logps * mask).sum() / mask.sum()
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        return logps.detach() * mask, float(norm)

    fused_logps, fused_norm = step(True)
    exact, exact_norm = step(False)
    return float((fused_logps - exact).abs().max()), abs(fused_norm - exact_norm) / exact_norm


def exact_trl_scores(self: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     batch_size: Any = None, compute_entropy: bool = False, compute_aux_loss: bool = False,
                     **_: Any) -> tuple[torch.Tensor, Any, Any]:
    """GRPOTrainer._get_per_token_logps_and_entropies without the fused head: the whole
    logits (the model's own forward: fused_lm_head off) / T, torch's log_softmax. Patched
    in to measure what the fused head changes in a whole run."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logp_all = torch.log_softmax(logits[:, -logits_to_keep - 1:-1].float() / self.temperature, dim=-1)
    logps = logp_all.gather(2, input_ids[:, -logits_to_keep:, None]).squeeze(2)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if compute_entropy else None
    return logps, entropy, None
