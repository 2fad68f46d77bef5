"""TRL's trainers set up to train what a runner preference run trains: one copy, used by
bench/preference.py and tests/train/test_preference_vs_trl.py (trl is a dev extra).

One process on the CPU in fp32, no saving, no evaluation, no reporting, no loader
workers, no accumulation, and the pairs fed in the order given (runner's epoch order,
runner.components.data.epoch_batches.EpochSampler), not TRL's own shuffle. Everything a caller compares
(batch, learning rate, schedule, optimizer, loss, max_length, dropout, reference) is its
own argument, passed to DPOConfig as is.
"""

from __future__ import annotations

from typing import Any, Sequence


def runner_order(count: int, seed: int) -> list[int]:
    """The order in which a one-process runner run takes `count` rows in its first epoch."""
    from runner.components.data.epoch_batches import EpochSampler

    return list(EpochSampler(count, seed))


def trl_trainer(trainer_class: Any, config_class: Any, model: Any, tokenizer: Any, dataset: Any, order: Sequence[int],
                output_dir: str, **settings: Any) -> Any:
    """A TRL trainer (DPOTrainer; CPOTrainer, TRL's SimPO) on `dataset` (prompt / chosen /
    rejected records) taken in `order`, with `tokenizer` (its pad token set to its EOS);
    `settings` are the config class's (per_device_train_batch_size, learning_rate, ...)."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_class):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return SequentialSampler(self.train_dataset)  # the order is in the dataset already

    tokenizer.pad_token = tokenizer.eos_token
    args = config_class(output_dir=output_dir, gradient_accumulation_steps=1, report_to=[], use_cpu=True, bf16=False,
                        save_strategy="no", eval_strategy="no", dataloader_num_workers=0, **settings)
    return InOrder(model=model, args=args, train_dataset=dataset.select(list(order)), processing_class=tokenizer)


def dpo_trainer(model: Any, tokenizer_dir: str, dataset: Any, order: Sequence[int], output_dir: str,
                **settings: Any) -> Any:
    """A DPOTrainer on `dataset` taken in `order`; `settings` are DPOConfig's."""
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    return trl_trainer(DPOTrainer, DPOConfig, model, AutoTokenizer.from_pretrained(tokenizer_dir), dataset, order,
                       output_dir, **settings)
