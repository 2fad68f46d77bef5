"""Wall-clock marks of each training step's phases, for bench/step_phases.py.

Imported by a process when this folder is on PYTHONPATH and RUNNER_BENCH_PHASES names an
output file; nothing is changed but the marks are taken (perf_counter, read on the host,
which on a CPU is when the work is done). Works in runner's worker and in the Trainer's
alike: it hooks torch, not either loop. Marks, per step of a GPT-2 (`*LMHeadModel` with
`transformer.ln_f` and `transformer.wte`):
  fwd0 the model's forward starts; body1 its last LayerNorm has run (the transformer body
  done); fwd1 the model's forward returned (with its loss); bodybwd0 the gradient reached
  the body's output (the head's backward done); bodybwd1 it reached the embedding's output
  (the body's backward done); acc the token embedding's gradient accumulated; bwd1 the
  backward call returned; opt0 / opt1 around the optimizer's step. From bwd1 to opt0 each
  loop computes its gradient norm and clips (runner's exact float64 norm, the Trainer's
  torch float32 one).
Written as JSON [[mark, seconds], ...] after RUNNER_BENCH_PHASES_STEPS optimizer steps.
A bench instrument, not part of runner."""

import os

if os.environ.get("RUNNER_BENCH_PHASES"):
    import json
    import time

    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _marks: list = []
    _steps = [0]

    def _mark(name: str) -> None:
        _marks.append((name, time.perf_counter()))

    def _is_model(module) -> bool:
        return type(module).__name__.endswith("LMHeadModel") and hasattr(module, "transformer")

    def _before(module, args) -> None:
        if not _is_model(module):
            return
        body = module.transformer
        if not getattr(body, "_phases_hooked", False):
            body._phases_hooked = True
            body.ln_f._phases_mark = ("body1", "bodybwd0")
            body.wte._phases_mark = (None, "bodybwd1")
            body.wte.weight.register_post_accumulate_grad_hook(lambda p: _mark("acc"))
        _mark("fwd0")

    def _after(module, args, output) -> None:
        if _is_model(module):
            _mark("fwd1")
            return
        marks = getattr(module, "_phases_mark", None)
        if marks is None or not torch.is_tensor(output):
            return
        done, backward = marks
        if done:
            _mark(done)
        if output.requires_grad:
            output.register_hook(lambda grad: _mark(backward))

    register_module_forward_pre_hook(_before)
    register_module_forward_hook(_after)

    _backward = torch.autograd.backward

    def _timed_backward(*args, **kwargs):
        result = _backward(*args, **kwargs)
        _mark("bwd1")
        return result

    torch.autograd.backward = _timed_backward

    def _step_started(optimizer, args, kwargs) -> None:
        _mark("opt0")

    def _step_done(optimizer, args, kwargs) -> None:
        _mark("opt1")
        _steps[0] += 1
        if _steps[0] == int(os.environ.get("RUNNER_BENCH_PHASES_STEPS", "11")):
            with open(os.environ["RUNNER_BENCH_PHASES"], "w") as handle:
                json.dump(_marks, handle)

    register_optimizer_step_pre_hook(_step_started)
    register_optimizer_step_post_hook(_step_done)
