"""Run in each worker by `patch_train_step` (exec'd with `self`, the Trainer, in scope)
from its second step on: writes `state_probe_rank<R>.json` to the run folder with the
Adam state the rank's optimizer holds after the first step (exp_avg and exp_avg_sq
elements, the local shard's under FSDP2, DeepSpeed's flat partitions under ZeRO) and
the frozen parameters that have a gradient after the next backward (none should)."""

import json
import os

trainer = self
if not getattr(trainer, "_state_probed", False):
    trainer._state_probed = True
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # Accelerate's wrapper, DeepSpeed's ZeRO optimizer: the torch one inside
        optimizer = optimizer.optimizer
    adam = sum((v.to_local() if hasattr(v, "to_local") else v).numel()
               for state in optimizer.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    plain = trainer.strategy.backward

    def backward(accelerator, loss):
        plain(accelerator, loss)
        del trainer.strategy.backward  # once
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        with_grad = [name for name, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        (trainer.run_dir / f"state_probe_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(
            {"adam_elements": adam, "frozen": len(frozen), "frozen_with_grad": with_grad}))

    trainer.strategy.backward = backward
