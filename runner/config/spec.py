"""The run spec: one typed schema for every setting, and its frozen on-disk form.

Every user-facing setting is defined here, once, with its default and allowed
values documented under it; the data section (`data.*`) in runner.config.data_spec and
the preference objective's (`preference.*`) in runner.config.preference_spec, whose
names this module re-exports. Hydra composes YAML on top of this schema (so an
unknown key or a wrong type fails at compose time); `runner.config.validate` then
checks what only makes sense across fields. Workers never run Hydra: they read
the resolved `run_spec.yaml` through `load_spec`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

# Re-exported: the package imports every section and enum of the schema from here.
from runner.config.data_spec import DataFormat, DataSpec, MixtureSource, MixtureStop, TooLong  # noqa: F401
from runner.config.preference_spec import PreferenceLoss, PreferenceSpec, ReferenceMode  # noqa: F401
from runner.config.rl_spec import RLSpec, RewardSpec  # noqa: F401

SPEC_FILENAME = "run_spec.yaml"


class StrategyKind(str, enum.Enum):
    ddp = "ddp"
    zero2 = "zero2"
    zero3 = "zero3"
    fsdp = "fsdp"  # PyTorch FSDP2 (fully_shard) through Accelerate
    accelerate_config = "accelerate_config"  # read from strategy.config_file, then one of the above


class PrecisionKind(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class OffloadDevice(str, enum.Enum):
    none = "none"
    cpu = "cpu"


class StartMethod(str, enum.Enum):
    auto = "auto"  # forkserver on a machine without CUDA, spawn with it
    spawn = "spawn"
    forkserver = "forkserver"


class LaunchEngine(str, enum.Enum):
    local = "local"  # this launcher: in its own process at world size 1, else torch elastic
    ray = "ray"  # Ray Train's TorchTrainer on a Ray cluster (runner/launch/ray_engine.py)


class TrackingKind(str, enum.Enum):
    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"
    trackio = "trackio"
    none = "none"


class OptimKind(str, enum.Enum):
    adamw = "adamw"


class LrScaling(str, enum.Enum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class ScheduleKind(str, enum.Enum):
    linear = "linear"
    cosine = "cosine"
    constant = "constant"


class PeftKind(str, enum.Enum):
    none = "none"
    lora = "lora"
    dora = "dora"  # weight-decomposed LoRA (peft's use_dora)


class ObjectiveKind(str, enum.Enum):
    causal_lm = "causal_lm"  # next-token cross-entropy over the trained tokens
    dpo = "dpo"  # preference optimisation on chosen/rejected pairs (PreferenceSpec's loss_type)
    grpo = "grpo"  # online RL: sampled completions scored by rewards, group-relative advantages (RLSpec)
    rloo = "rloo"  # online RL: the same sampling and rewards, REINFORCE leave-one-out advantages (RLSpec)

    @property
    def online_rl(self) -> bool:
        """It samples completions and learns from their rewards (rl.*, data.format=prompts)."""
        return self in (ObjectiveKind.grpo, ObjectiveKind.rloo)


class AttnImplementation(str, enum.Enum):
    eager = "eager"
    sdpa = "sdpa"


@dataclass
class ModelSpec:
    name_or_path: Optional[str] = None
    """Pretrained weights: a hub id (`gpt2`) or a local folder with config.json and
    weights. null: build `model_type` from scratch (random init), like run_clm."""
    model_type: str = "gpt2"
    """Architecture built from scratch when `name_or_path` is null (any transformers
    model type with a causal LM head)."""
    config_overrides: Optional[str] = None
    """run_clm's form, applied to the config before building: "n_embd=10,resid_pdrop=0.2"."""
    tokenizer_name: Optional[str] = None
    """A hub id or local folder. null: the tokenizer that ships with `name_or_path`.
    `${asset:gpt2_tokenizer}` is the vendored GPT-2 tokenizer (works offline)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about 30% more compute."""
    compile: bool = False
    """Compile each transformer layer in place with torch.compile (inductor), under every
    strategy; compile time and recompilations are reported apart from the steps."""
    chunked_loss: bool = True
    """Compute the output head and the loss over chunks of tokens, never holding the whole
    (tokens x vocabulary) logits: same loss and gradients (runner/components/chunked_loss.py).
    On a GPU with liger-kernel installed (`pip install "runner[liger]"`), Liger's fused
    linear cross-entropy computes it. Left off, with the reason said, for a model whose
    forward changes its logits before the loss or whose head is not a plain linear layer."""
    attn_implementation: Optional[AttnImplementation] = None
    """eager | sdpa. null: transformers' default for the model."""
    fused_activations: bool = True
    """Compute the tanh-approximated GELU written in Python (`gelu_new`, `gelu_fast`: GPT-2,
    GPT-Neo, GPT-J, CodeGen, Phi) with torch's fused kernel, as transformers'
    `gelu_pytorch_tanh` does: the same function to float rounding, one pass over the MLP's
    activations instead of seven (runner/components/activations.py). The saved model keeps
    its config's activation."""


@dataclass
class PeftSpec:
    kind: PeftKind = PeftKind.none
    """none: train every weight | lora: low-rank adapters on a frozen pretrained base (peft's
    LoRA) | dora: weight-decomposed LoRA (peft's use_dora). Needs model.name_or_path: a
    random base is not fine-tuning. See docs/adapters.md."""
    rank: int = 8
    """The adapters' rank r: each adapted weight W (out x in) gains B (out x r) @ A (r x in)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's update is (alpha / rank) B A."""
    dropout: float = 0.05
    """Dropout on the adapters' input (0 disables; the base's own dropout is model config)."""
    target_modules: Optional[list[str]] = None
    """Which layers get adapters. null: every linear layer of the transformer blocks (peft's
    "all-linear": the output head is left out), found on the model itself, for any
    architecture. Or a list of names matched against the end of each module's name,
    e.g. [q_proj, v_proj] or [c_attn]."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained fully beside the adapters and saved with them, e.g. [wte] (GPT-2) or
    [embed_tokens] when new tokens are added. Where the head is tied to the input
    embedding (GPT-2, small Llama and Qwen models), naming either trains the one shared
    weight for both (peft's ensure_weight_tying)."""
    save_merged: bool = False
    """Also write model/: the base with the adapters merged into its weights, a plain
    Hugging Face model. false: the run's output is adapter/ alone."""


@dataclass
class OptimSpec:
    kind: OptimKind = OptimKind.adamw
    """adamw (torch.optim.AdamW)."""
    lr: float = 5e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay; never applied to biases and LayerNorm weights."""
    beta1: float = 0.9
    """AdamW's decay rate of the gradient's running mean, in [0, 1)."""
    beta2: float = 0.999
    """AdamW's decay rate of the squared gradient's running mean, in [0, 1)."""
    eps: float = 1e-8
    """Added to AdamW's denominator for numerical stability (> 0)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value before each step. 0 disables."""
    fused: bool = True
    """torch's fused AdamW kernel (one kernel for all parameters; the HF Trainer's default
    optimizer too). false: torch's default (foreach) implementation."""
    scale_lr: LrScaling = LrScaling.none
    """Rescale lr when the global batch B differs from reference_global_batch B_ref:
    none | linear (lr x B / B_ref) | sqrt (lr x sqrt(B / B_ref))."""
    reference_global_batch: Optional[int] = None
    """The global batch `lr` was tuned at (needed by scale_lr)."""


@dataclass
class ScheduleSpec:
    kind: ScheduleKind = ScheduleKind.linear
    """linear | cosine | constant (after warmup)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `optim.lr`."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of total steps; used when warmup_steps is 0."""


@dataclass
class TrainSpec:
    per_device_batch_size: Any = 8
    """Sequences per device per micro-batch, or auto: the largest micro-batch that fits
    (the plan proposes it, a two-step probe run confirms it), with train.global_batch_size
    kept and the accumulation derived from it. The frozen run_spec.yaml holds the number
    chosen. (Any, not int: OmegaConf has no int-or-"auto" type; config/validate.py checks it.)"""
    per_device_eval_batch_size: Optional[int] = None
    """null: same as per_device_batch_size."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step.
    Global batch = per_device_batch_size x world size x grad_accum_steps."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step. When set, grad_accum_steps is derived from it:
    global_batch_size / (per_device_batch_size x world size), which must divide."""
    max_steps: Optional[int] = None
    """Optimizer steps to run. null: run `num_epochs` epochs."""
    num_epochs: float = 3.0
    """Passes over the training blocks when max_steps is null."""
    seed: int = 42
    """Seeds python, numpy and torch on every rank (model init and data order)."""
    log_every: int = 10
    """Log train loss every N optimizer steps. 0 disables."""
    eval_every: int = 0
    """Evaluate every N optimizer steps (and always at the end). 0 disables."""
    save_every: int = 0
    """Write a resumable checkpoint every N optimizer steps. 0 disables."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    dataloader_num_workers: int = 0
    """DataLoader worker processes (0: load in the training process)."""
    objective: ObjectiveKind = ObjectiveKind.causal_lm
    """What the model is trained to do, and what evaluation reports. causal_lm: next-token
    cross-entropy over the trained tokens (every token of text; the answers of
    instruction data), token-weighted across micro-batches and ranks; evaluation reports
    eval_loss, perplexity and eval_accuracy (runner/components/objectives/)."""
    deterministic: bool = False
    """Deterministic GPU kernels: torch.use_deterministic_algorithms(True),
    CUBLAS_WORKSPACE_CONFIG=:4096:8, cudnn.deterministic=True and cudnn.benchmark=False.
    A GPU run then repeats bit for bit, and a resume in the same layout continues bit for
    bit, as on a CPU (where nothing changes); slower on GPUs (attention and embedding
    backward lose their atomics), and an op with no deterministic kernel stops the run
    naming itself. A change on resume is accepted: it only picks other kernels."""


@dataclass
class LaunchSpec:
    nproc_per_node: str = "auto"
    """Worker processes on this machine. auto: one per visible GPU, or 1 on a CPU."""
    nnodes: int = 1
    """Machines taking part."""
    node_rank: int = 0
    """This machine's index, 0..nnodes-1."""
    rdzv_endpoint: Optional[str] = None
    """host:port of the c10d rendezvous (node 0's address). null: a free local port (one node)."""
    rdzv_timeout: int = 900
    """Seconds a node waits at the rendezvous (launch.nnodes>1): for launch.rdzv_endpoint to
    answer, and for every node to join. A node may start up to this long after the first;
    past it, the run stops with a message naming the endpoint."""
    max_restarts: int = 0
    """Restart all workers up to N times after a crash (they resume from the newest checkpoint).
    Any world size: with N > 0 a single worker runs in its own process, so it can be restarted."""
    timeout_minutes: float = 30.0
    """How long a collective may wait for the other ranks before the run fails (process-group timeout)."""
    debug: bool = False
    """Distributed debug logs on every rank: TORCH_DISTRIBUTED_DEBUG=DETAIL, and NCCL_DEBUG=INFO on GPUs."""
    start_method: StartMethod = StartMethod.auto
    """How this node's workers start: auto | spawn | forkserver. spawn: each worker a fresh
    interpreter that imports torch and transformers again (seconds of CPU a worker).
    forkserver: forked from a clean server process that imported them once for all of this
    process's launches. auto: forkserver on a machine without CUDA, spawn with CUDA (a
    library that touches CUDA while imported would leave the server's forks without it).
    See runner/launch/start_method.py."""
    retain_freed_memory: bool = True
    """Keep freed host (CPU) memory in each worker for reuse instead of returning it to the
    OS every step (glibc mallopt; see runner/train/host_memory.py): much faster CPU steps, but a
    worker's resident memory stays near its peak. false: every freed block above 128 KiB goes
    back to the OS at once (glibc's thresholds fixed, not adaptive), so resident memory follows
    what the worker holds; use it to compare strategies' memory on a CPU."""
    device_memory: Optional[str] = None
    """The memory each rank has, for the fit check and the plan: a GPU's name (A40, H100,
    A100-40GB) or a size (80GB, 48GiB). null: this machine's GPU, or on a CPU the host memory
    available shared by this node's ranks. `dry_run=true launch.device_memory=A40
    launch.nproc_per_node=8` plans a run for hardware you do not have."""
    check_fit: bool = True
    """Refuse, before any worker starts, a run whose predicted peak per rank exceeds that
    memory (the message names the micro-batch and accumulation that fit). false: start anyway."""
    mtbf_hours: Optional[float] = None
    """Mean time between failures of the job's machines, in hours: with it, a run suggests a
    checkpoint interval from its measured save time (Young/Daly, sqrt(2 x save time x MTBF))
    and says how far train.save_every is from it (all_results.json `goodput`). null: no suggestion."""
    engine: LaunchEngine = LaunchEngine.local
    """Who starts the workers: local | ray. local: this launcher (in its own process at world
    size 1, else torch elastic; under torchrun or srun it joins them). ray: Ray Train's
    TorchTrainer on the cluster launch.ray_address names, launch.nnodes x
    launch.nproc_per_node workers that Ray places on the cluster's nodes itself (run the
    command once; no launch.node_rank or launch.rdzv_endpoint), with a GPU each where the
    launcher sees CUDA; each checkpoint is reported to Ray, and launch.max_restarts is
    Ray's FailureConfig(max_failures). Needs `pip install "runner[ray]"`; see
    docs/clusters-and-slurm.md (Ray)."""
    ray_address: str = "auto"
    """launch.engine=ray only: the Ray cluster. auto: the one RAY_ADDRESS names (set by
    `ray job submit` and KubeRay), else a local Ray started for this run (no dashboard,
    usage stats off) and stopped after it. HOST:PORT or ray://HOST:PORT: a running
    cluster's head (`ray start --head` prints it); the run folder must be on storage that
    every node of it sees."""
    min_workers: Optional[int] = None
    """launch.engine=ray only: elastic. The fewest workers the run goes on with (Ray Train's
    num_workers=(min_workers, launch.nnodes x launch.nproc_per_node)). Ray starts as many as
    the cluster holds, at least this many; after a worker or node is lost it restarts the
    group on what is left (launch.max_restarts >= 1 needed), and grows it again when
    resources come back. Each group resumes from the newest checkpoint on its own world
    size with the global batch kept: the accumulation is derived at each size, so each
    must divide the global batch. null: always all of them."""


@dataclass
class StrategySpec:
    kind: StrategyKind = StrategyKind.ddp
    """ddp (DistributedDataParallel) | zero2 | zero3 (DeepSpeed ZeRO through Accelerate) |
    fsdp (PyTorch FSDP2, fully_shard, through Accelerate; 2 processes or more) |
    accelerate_config (translate strategy.config_file into one of those)."""
    offload_optimizer: OffloadDevice = OffloadDevice.none
    """ZeRO only (refused under ddp): none | cpu. DeepSpeed then steps its own
    DeepSpeedCPUAdam on the CPU (the banner says so); optim.fused does not apply."""
    offload_params: OffloadDevice = OffloadDevice.none
    """ZeRO-3 or fsdp only (refused otherwise: ZeRO-2 does not partition parameters): none | cpu.
    Under fsdp, FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step live
    on the CPU (needs a GPU: on a CPU-only machine they are in host memory already)."""
    reshard_after_forward: bool = True
    """fsdp only: free each block's gathered parameters after its forward and gather them
    again in backward (fully sharded, least memory). false keeps them gathered from
    forward to backward: one all-gather fewer per block, ZeRO-2-like memory."""
    zero3_save_16bit_model: bool = True
    """ZeRO-3 only: gather full weights when saving, so model/ is a complete HF model.
    Must stay true: model/ is always the full fp32 weights (false is refused)."""
    config_file: Optional[str] = None
    """An accelerate config YAML (as `accelerate config` writes) to read the strategy,
    precision, accumulation, clipping and process layout from (strategy=accelerate_config)."""


@dataclass
class PrecisionSpec:
    kind: PrecisionKind = PrecisionKind.fp32
    """fp32 | bf16 (autocast; CPU or Ampere+ GPU) | fp16 (autocast + loss scaling, GPU only)."""
    max_consecutive_skipped_steps: int = 25
    """fp16: stop the run (exit 3) after this many optimizer steps in a row were skipped on
    overflow (inf/NaN gradients at the current loss scale; each skip halves the scale). A
    healthy run skips a few at the start while the scale settles (2^16 halved 25 times is
    below 1e-2); more in a row means the gradients are non-finite at any scale. fp32 and
    bf16 never skip: a non-finite gradient stops them at once. >= 1."""


@dataclass
class SweepSpec:
    parity_baseline: Optional[str] = None
    """The job a sweep's summary compares every other job's per-step loss and gradient
    norm with (runner/sweep/parity.py): null: the first job; an index ("2": the job's place
    in the sweep's job list, 0 first, as Hydra numbers jobs and the summary lists them; job
    folders are named by a hash); or overrides the job was run with ("strategy=ddp", quoted
    on the command line). It must name exactly one job, or the summary says why not."""
    retry_failed: bool = False
    """With resume=auto: run again the jobs that failed last time (a divergence, a crash,
    a killed worker). false: they are listed with their reasons and left as they are, since
    a deterministic failure would only repeat. A retried job resumes from its newest
    complete checkpoint; add overwrite=true to start it over (its checkpoints are deleted)."""


@dataclass
class EvalSpec:
    """Benchmark evaluation of the saved model (runner/report/benchmarks.py), by EleutherAI's
    lm-evaluation-harness (`pip install "runner[eval]"`), after training and on demand as
    `runner eval RUN_DIR eval.tasks=[...]`."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (austen_next ships with runner and runs offline; hellaswag,
    arc_easy and lm-eval's others read the hub) or paths to task YAML files. Empty: none."""
    num_fewshot: Optional[int] = None
    """Examples shown before each question. null: each task's own default."""
    limit: Optional[int] = None
    """At most this many documents per task (a quick look; the scores are then not the
    benchmark's). null: all."""
    batch_size: int = 8
    """Requests scored together: changes the speed, not the scores (float rounding aside)."""
    device: Optional[str] = None
    """Where the model is evaluated. null: the first GPU when one is visible, else the CPU."""
    dtype: str = "auto"
    """The weights' dtype for evaluation: auto (as saved: fp32), bfloat16, float16, float32."""


@dataclass
class RunSpec:
    name: str = "run"
    """Names the run; the default run folder is outputs/<name>/<time>_<hash>."""
    model: ModelSpec = field(default_factory=ModelSpec)
    peft: PeftSpec = field(default_factory=PeftSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    preference: PreferenceSpec = field(default_factory=PreferenceSpec)
    rl: RLSpec = field(default_factory=RLSpec)
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    strategy: StrategySpec = field(default_factory=StrategySpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    sweep: SweepSpec = field(default_factory=SweepSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    overwrite: bool = False
    """Allow writing into a run folder that already holds results."""
    tracking: TrackingKind = TrackingKind.tensorboard
    """Experiment tracker, through Accelerate's trackers: tensorboard (in run_dir/tensorboard)
    | wandb | mlflow | trackio | none. The spec is logged as hyperparameters."""
    dry_run: bool = False
    """Print the resolved spec and the run's plan (batch arithmetic, steps, parameters,
    each rank's peak memory with activations, and whether it fits on launch.device_memory
    under ddp / zero2 / zero3 / fsdp), then stop without training."""
    resume: Optional[str] = None
    """auto: continue from the newest complete checkpoint in the run folder (fresh if
    there is none, and it says so); PATH: continue from that checkpoint; null: start fresh."""
    run_dir: str = ""
    """Set by the launcher: the run folder (hydra.run.dir). Not for users to set."""
    probe: bool = False
    """Set by the launcher for train.per_device_batch_size=auto's probe run: train its steps,
    log their metrics, save nothing (no checkpoint, model/ or results). Not for users to set."""


# The group options under conf/ are merged into these nodes; the root schema is
# what makes an unknown key or a wrong type a compose-time error.
SCHEMA_NAME = "runner_schema"


def to_spec(cfg: Any) -> RunSpec:
    """A composed (Hydra) config -> a typed, fully resolved RunSpec."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, RunSpec), type(obj)
    return obj


def spec_to_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(spec))


def save_spec(spec: RunSpec, path: Path, notes: Sequence[str] = ()) -> None:
    """Write the frozen spec; `notes` (what the libraries will do with it that the keys do
    not say) become comments at the top, so a reader sees them and a loader ignores them."""
    tmp = path.with_suffix(".tmp")
    header = "".join(f"# {note}\n" for note in notes)
    tmp.write_text(header + spec_to_yaml(spec))
    tmp.replace(path)


@functools.cache
def _schema() -> Any:
    """RunSpec's structured config, built once a process: building it was half of each
    read of a frozen spec (0.27 s; every worker reads one, and a resume its checkpoint's).
    OmegaConf.merge copies its first argument, so every read starts from it untouched."""
    return OmegaConf.structured(RunSpec)


def spec_from_yaml(text: str) -> RunSpec:
    """Parse a frozen spec, still checked against the schema (a hand-edited typo fails)."""
    return to_spec(OmegaConf.merge(_schema(), OmegaConf.create(text)))


def load_spec(path: Path) -> RunSpec:
    return spec_from_yaml(Path(path).read_text())


def spec_dict(spec: RunSpec) -> dict[str, Any]:
    """Plain JSON-able dict (enums as their values), for results and trackers."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(spec))


def flat_spec_dict(spec: RunSpec) -> dict[str, Any]:
    """{"train.max_steps": 300, ...}: the spec with dotted keys, as overrides name them."""

    def walk(node: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(walk(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    return walk(spec_dict(spec), "")
