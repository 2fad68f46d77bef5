"""The rollouts of online RL: which prompts each generation batch holds, their sampled
completions on every rank, and the rewards and advantages they earn.

The training loop counts optimizer steps; a step's global batch is B completions, a
generation batch is `rl.steps_per_generation` steps' worth (S x B completions, S x B / G
prompt groups), trained `rl.num_iterations` times. Everything here is a function of the
step number and the seed, never of the layout:
- the prompt stream: group q is prompt perm_e[q mod N] of epoch e = q div N, where perm_e is
  a permutation of the N prompts seeded by (seed, e): every prompt once an epoch, and a
  prompt count that does not divide the batch simply runs on into the next epoch;
- generation g holds groups [g Q, (g + 1) Q), Q = S x B / G; rank r samples groups r,
  r + W, ... (runner/components/generation.py: each completion its own seeded generator),
  and every rank gathers every group, so each holds the whole generation batch;
- step k trains share k mod S of generation k div (S x mu): B completions, whose places
  in the step are the loader's slots (runner/components/objectives/grpo.py).
Rewards are computed on every rank for every completion (the same strings and columns
on each), so the advantages, the group statistics and the logged figures agree without
another collective.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from runner.components.generation import sample_group, sample_seed
from runner.components.rewards import RewardInputs, build_rewards, score_all, total
from runner.config.rl_spec import RLSpec


@dataclass(frozen=True)
class StreamLayout:
    """The arithmetic of the prompt stream (see the module's docstring)."""

    prompts: int  # N
    group: int  # G
    global_batch: int  # B completions an optimizer step
    steps_per_generation: int  # S
    iterations: int  # mu

    @property
    def groups_per_generation(self) -> int:
        return self.steps_per_generation * self.global_batch // self.group

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps to pass over every prompt once (the loader's epoch), rounded up."""
        return max(1, math.ceil(self.prompts * self.group * self.iterations / self.global_batch))

    def generation_of(self, step: int) -> int:
        return step // (self.steps_per_generation * self.iterations)

    def share_of(self, step: int) -> int:
        return step % self.steps_per_generation


def stream_layout(prompts: int, settings: RLSpec, global_batch: int) -> StreamLayout:
    """The prompt stream of `prompts` prompts at `global_batch` completions a step."""
    return StreamLayout(prompts, settings.num_generations, global_batch, settings.steps_per_generation,
                        settings.num_iterations)


def prompt_order(prompts: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s permutation of the prompts, from (seed, epoch) alone."""
    digest = hashlib.blake2b(f"prompts/{seed}/{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randperm(prompts, generator=generator).tolist()


def prompts_of_generation(layout: StreamLayout, seed: int, generation: int) -> list[int]:
    """The prompt ids of generation `generation`'s groups, in order."""
    first = generation * layout.groups_per_generation
    ids, orders = [], {}
    for q in range(first, first + layout.groups_per_generation):
        epoch = q // layout.prompts
        if epoch not in orders:
            orders[epoch] = prompt_order(layout.prompts, seed, epoch)
        ids.append(orders[epoch][q % layout.prompts])
    return ids


@dataclass
class Rollouts:
    """One generation batch, the same on every rank: completions in group order."""

    generation: int
    prompt_ids: list[int]  # one a group
    completion_ids: torch.Tensor  # [n, L] int64 (n = groups x G)
    lengths: torch.Tensor  # [n] int64
    ended: torch.Tensor  # [n] bool
    sampling_logps: torch.Tensor  # [n, L] float32
    rewards_per_func: torch.Tensor  # [n, F] float32 (NaN: a reward that did not score it)
    rewards: torch.Tensor  # [n]
    advantages: torch.Tensor  # [n]
    figures: dict[str, float] = field(default_factory=dict)  # the generation's logged figures
    old_logps: Optional[torch.Tensor] = None  # [n, L]: the policy's at generation, when it trains later
    ref_logps: Optional[torch.Tensor] = None  # [n, L]: the reference's (rl.beta > 0)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Rollouts":
        return cls(**state)


@dataclass
class PromptSet:
    """The prompts of a split: each record's fields and its prompt's tokens."""

    records: list[dict[str, Any]]
    ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.records)


def prompt_tokens(tokenizer: Any, prompt: Any, as_chat: bool = False) -> list[int]:
    """A prompt's ids: a string as the tokenizer encodes it (with `as_chat`, rl.chat_prompts,
    as the user's one message); messages through the chat template with the generation
    prompt (as TRL renders them)."""
    if as_chat and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt)["input_ids"])


def prompt_set(rows: Any, field_name: str, tokenizer: Any, as_chat: bool = False) -> PromptSet:
    records = [dict(row) for row in rows]
    return PromptSet(records, [prompt_tokens(tokenizer, record[field_name], as_chat) for record in records])


@dataclass
class RolloutSource:
    """What generates a generation batch: the prompts, the settings, the ranks."""

    prompts: PromptSet
    evaluation: PromptSet
    settings: RLSpec
    layout: StreamLayout
    tokenizer: Any
    seed: int
    rank: int = 0
    world: int = 1
    lockstep: bool = False  # the parameters are sharded: every rank runs the same forwards
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # all ranks' tensors, concatenated on dim 0
    rewards: list[Any] = field(default_factory=list)
    prompt_field: str = "prompt"  # data.prompt_field

    def __post_init__(self) -> None:
        if not self.rewards:
            self.rewards = build_rewards(self.settings.rewards, self.settings.max_completion_length)

    @property
    def row_length(self) -> int:
        """The longest training row: the longest prompt and a whole completion."""
        return max(len(ids) for ids in self.prompts.ids) + self.settings.max_completion_length

    @property
    def pad_id(self) -> int:
        """What pads a completion past its end: the tokenizer's pad token, else its end-of-sequence."""
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.eos_ids()[0]

    def eos_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

    def per_group(self, run: Callable[[int], Any], groups: int, gather: bool = True) -> list[torch.Tensor]:
        """`run(q)` for each of `groups` groups, shared by the ranks in turn (rank r: groups
        r, r + W, ...) and gathered, in group order: each result's tensors stacked over the
        groups and their G rows flattened. Every rank runs the same number of groups (one
        short of a share runs its first again, unread): a sharded forward is collective."""
        world, rank = (self.world, self.rank) if gather else (1, 0)
        mine = list(range(rank, groups, world))
        per_rank = math.ceil(groups / world)
        results = [run(mine[k] if k < len(mine) else (mine[0] if mine else 0)) for k in range(per_rank)]
        parts = list(zip(*results)) if isinstance(results[0], tuple) else [results]
        stacked = [torch.stack(list(p)) for p in parts]
        if world > 1 and self.gather is not None:
            stacked = [self.gather(t) for t in stacked]  # [W x per_rank, G, ...], rank r's block at r x per_rank
        order = [(q % world) * per_rank + q // world for q in range(groups)]
        return [t[order].reshape(groups * t.shape[1], *t.shape[2:]).cpu() for t in stacked]

    def sample(self, model: Any, generation: int, prompt_ids: Sequence[int], prompts: Optional[PromptSet] = None,
               gather: bool = True) -> tuple[torch.Tensor, ...]:
        """Every group of `prompt_ids` (of `prompts`: the training set by default), sampled
        and gathered in group order: (completion ids [n, L], lengths [n], ended [n],
        sampling log-probs [n, L])."""
        g, length = self.settings.num_generations, self.settings.max_completion_length
        prompts = prompts if prompts is not None else self.prompts

        def one(q: int) -> tuple[torch.Tensor, ...]:
            pid = prompt_ids[q]
            seeds = [sample_seed(self.seed, generation, pid, i) for i in range(g)]
            group = sample_group(model, prompts.ids[pid], seeds, length, self.settings.temperature, self.eos_ids(), self.pad_id,
                                 lockstep=self.lockstep)
            return group.completion_ids, group.lengths, group.ended.long(), group.logps

        ids, lengths, ended, logps = self.per_group(one, len(prompt_ids), gather)
        return ids, lengths, ended.bool(), logps

    def score(self, prompt_ids: Sequence[int], ids: torch.Tensor, lengths: torch.Tensor,
              prompts: Optional[PromptSet] = None) -> torch.Tensor:
        """The rewards matrix [n, F] of the completions (in group order) of `prompt_ids`."""
        g, field_name = self.settings.num_generations, self.prompt_field
        prompts = prompts if prompts is not None else self.prompts
        records = [prompts.records[pid] for pid in prompt_ids for _ in range(g)]
        completion_ids = [row[: int(n)].tolist() for row, n in zip(ids, lengths)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        columns = {name: [r[name] for r in records] for name in records[0] if name != field_name}
        inputs = RewardInputs(prompts=[r[field_name] for r in records], completions=texts,
                              completion_ids=completion_ids, columns=columns)
        return score_all(self.rewards, inputs)

    def total(self, matrix: torch.Tensor) -> torch.Tensor:
        """The reward: the rewards' weighted sum (TRL's, NaN-skipping)."""
        return total(matrix, [r.weight for r in self.rewards])

    def generate(self, model: Any, generation: int) -> Rollouts:
        """Generation batch `generation`: sampled, gathered, scored (see the module's docstring)."""
        prompt_ids = prompts_of_generation(self.layout, self.seed, generation)
        ids, lengths, ended, logps = self.sample(model, generation, prompt_ids)
        matrix = self.score(prompt_ids, ids, lengths)
        rewards = self.total(matrix)
        advantages = torch.zeros_like(rewards)  # the objective's to compute (runner/components/objectives/grpo.py)
        figures = self.named_figures(matrix, lengths, ended)
        return Rollouts(generation, prompt_ids, ids, lengths, ended, logps, matrix, rewards, advantages, figures)

    def named_figures(self, matrix: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor) -> dict[str, float]:
        """TRL's per-reward and completion figures of a generation batch."""
        out: dict[str, float] = {}
        for j, reward in enumerate(self.rewards):
            column = matrix[:, j]
            out[f"rewards/{reward.name}/mean"] = float(torch.nanmean(column))
            out[f"rewards/{reward.name}/std"] = float(torch.std(column[~column.isnan()])) if int((~column.isnan()).sum()) > 1 else 0.0
        out["completions/mean_length"] = float(lengths.float().mean())
        out["completions/clipped_ratio"] = float((~ended).float().mean())
        return out
