"""Training one task with one attention variant: AdamW with warmup, full dev evaluation, the test
set scored on the best dev checkpoint, atomic checkpoints and exact resume, a time budget, and data
parallelism under ``torchrun`` (gloo on CPU, NCCL on GPU).

Determinism: the model is initialized from ``seed``; epoch ``e`` visits the training set in the
order ``permutation(seed, e)`` (a new order every epoch), split into global batches of
``batch_size * world_size``, rank ``r`` taking the ``r``-th slice of each. A checkpoint holds the
model, the optimizer, the step, the position in the epoch and the torch RNG state (dropout), so a
resumed run takes the same steps as one that was never stopped.
"""
from __future__ import annotations

import gc
import hashlib
import math
import os
import platform
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cache import atomic_write
from .model import Classifier, ModelConfig
from .recipes import SCHEDULES, recipe
from .tasks import PAD, Split, TaskData, load_task
from .variants import clamp_spans, span_loss

#: settings that only steer a run (where it writes, how long it may take, how it logs): a checkpoint
#: resumes under other values of these; any other difference is refused
RUN_CONTROL = ("out", "resume", "max_minutes", "workers", "threads", "log_every", "cache_dir", "eval_batch_size",
               "save_first_grads", "kill_at_step")


#: settings added later, with the value that reproduces a checkpoint written without them
BEFORE = {"buckets": 0}


@dataclass
class TrainConfig:
    """A run. Fields left None come from the recipe (`recipes`): ``lra`` (the published LRA
    Transformer per task), ``small`` (the small model of Nystromformer / Skyformer) or ``demo``."""
    task: str = "listops"
    variant: str = "softmax"
    recipe: str = "lra"
    out: str = "lra-runs/run"
    data_dir: Optional[str] = None
    preset: Optional[str] = None          # generated data size: "full" or "short" (default: the recipe's)
    seed: int = 0                         # model initialization, batch order, dropout
    data_seed: int = 0                    # generated data (the same set for every seed)
    steps: Optional[int] = None
    batch_size: Optional[int] = None      # per process
    lr: Optional[float] = None
    schedule: Optional[str] = None        # "linear", "cosine" or "rsqrt" (see lr_at)
    weight_decay: Optional[float] = None
    warmup: Optional[int] = None
    clip: Optional[float] = None          # gradient-norm clip, 0 = none
    buckets: Optional[int] = None         # batches drawn from pools of this many sorted by length (0 = none)
    eval_every: Optional[int] = None
    eval_batch_size: int = 64
    max_minutes: Optional[float] = None
    max_length: Optional[int] = None
    block_size: int = 64
    window: int = 128
    backend: str = "auto"
    device: str = "auto"
    amp: str = "auto"                     # "auto" (bf16 on CUDA), "bf16", "off"
    dropout: Optional[float] = None       # overrides the recipe's
    workers: int = 1                      # processes generating data
    threads: Optional[int] = None         # torch CPU threads (default: torch's)
    resume: bool = False
    log_every: int = 50
    cache_dir: Optional[str] = None
    overrides: Dict = field(default_factory=dict)     # generated-set parameters (sizes, lengths)
    save_first_grads: Optional[str] = None            # write the first step's gradients there and stop
    kill_at_step: Optional[int] = None                # SIGKILL every process after this step (resume tests)


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its None fields filled from its recipe, checked: a bad value is a ValueError
    naming the command-line option."""
    from .tasks import TASKS, check_overrides
    from .variants import VARIANTS
    if cfg.task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {cfg.task!r}")
    if cfg.variant not in VARIANTS:
        raise ValueError(f"--variant must be one of {', '.join(VARIANTS)}, got {cfg.variant!r}")
    r = recipe(cfg.recipe, cfg.task)
    filled = {k: getattr(r, k) for k in ("steps", "batch_size", "lr", "schedule", "weight_decay", "warmup", "clip",
                                         "eval_every", "preset", "buckets") if getattr(cfg, k) is None}
    if cfg.dropout is None:
        filled["dropout"] = r.model.dropout
    cfg = replace(cfg, **filled)
    for name in ("steps", "batch_size", "eval_every", "eval_batch_size", "log_every", "block_size", "window",
                 "workers"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    for name, ok, what in (("warmup", cfg.warmup >= 0, ">= 0"), ("buckets", cfg.buckets >= 0, ">= 0"), ("lr", cfg.lr > 0, "> 0"),
                           ("weight_decay", cfg.weight_decay >= 0, ">= 0"), ("clip", cfg.clip >= 0, ">= 0"),
                           ("dropout", 0 <= cfg.dropout < 1, "in [0, 1)"),
                           ("max_minutes", cfg.max_minutes is None or cfg.max_minutes > 0, "> 0"),
                           ("max_length", cfg.max_length is None or cfg.max_length > 0, "> 0"),
                           ("threads", cfg.threads is None or cfg.threads > 0, "> 0")):
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')} must be {what}, got {getattr(cfg, name)!r}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.preset not in ("full", "short"):
        raise ValueError(f"--preset must be 'full' or 'short', got {cfg.preset!r}")
    check_device(cfg.device)
    if cfg.data_dir is None:
        check_overrides(cfg.task, cfg.overrides)
    return cfg


def check_device(name: str) -> None:
    """A ValueError for ``--device cuda...`` where no CUDA GPU is visible."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is visible here (torch.cuda.is_available() is False)")


def task_data(cfg: TrainConfig, wait: bool = False, progress: bool = False) -> TaskData:
    """The data a resolved ``cfg`` trains on (generated and cached when missing)."""
    return load_task(cfg.task, cfg.data_dir, preset=cfg.preset, seed=cfg.data_seed, cache_dir=cfg.cache_dir,
                     workers=cfg.workers, max_length=cfg.max_length, overrides=cfg.overrides, wait=wait,
                     progress=progress)


def config_differences(saved: Dict, cfg: TrainConfig) -> List[str]:
    """The settings (other than `RUN_CONTROL`) in which a checkpoint's config and ``cfg`` differ."""
    now = asdict(cfg)
    return sorted(k for k in set(saved) | set(now)
                  if k not in RUN_CONTROL and saved.get(k, BEFORE.get(k)) != now.get(k))


def rank_seed(seed: int, rank: int) -> int:
    """The dropout stream of process ``rank`` (every process draws its own masks)."""
    return int.from_bytes(hashlib.sha256(f"lra-dropout:{seed}:{rank}".encode()).digest()[:8], "little") >> 1


# ----------------------------------------------------------------------------------- helpers

def world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def pad_batch(seqs: List[np.ndarray], max_length: int) -> torch.Tensor:
    L = min(max(len(s) for s in seqs), max_length)
    out = np.full((len(seqs), max(L, 1)), PAD, dtype=np.int64)
    for i, s in enumerate(seqs):
        n = min(len(s), L)
        out[i, :n] = s[:n]
    return torch.from_numpy(out)


def batch_of(split: Split, idx, max_length: int, device):
    x = pad_batch([split.x[i] for i in idx], max_length).to(device)
    x2 = pad_batch([split.x2[i] for i in idx], max_length).to(device) if split.x2 is not None else None
    return x, x2, torch.as_tensor(split.y[idx], dtype=torch.long, device=device)


def epoch_order(seed: int, epoch: int, n: int, batch: int = 1, lengths: Optional[np.ndarray] = None,
                buckets: int = 0) -> np.ndarray:
    """The order in which epoch ``epoch`` visits ``n`` examples: a permutation drawn from
    ``(seed, epoch)``. With ``buckets`` > 0 (and the examples' ``lengths``), each run of ``batch``
    consecutive entries holds examples of similar length, so batches carry little padding: the
    permutation is cut into pools of ``buckets`` batches, each pool sorted by length and cut into
    batches, and the whole epoch's batches shuffled; a remainder that fills no batch stays last."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    if not buckets or lengths is None or batch < 1:
        return order
    full = n // batch * batch
    pool = buckets * batch
    for start in range(0, full, pool):
        part = order[start:min(start + pool, full)]
        order[start:start + len(part)] = part[np.argsort(lengths[part], kind="stable")]
    blocks = order[:full].reshape(-1, batch)[rng.permutation(full // batch)]
    return np.concatenate([blocks.reshape(-1), order[full:]])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of step ``step`` (0-based). ``linear``: warmup over ``warmup`` steps, then
    linear decay to 0 at ``steps``. ``rsqrt`` (LRA's ListOps, Text, Retrieval):
    ``lr * min(1, s / warmup) / sqrt(max(s, warmup))`` with ``s = step + 1``, so ``lr`` is the
    constant and the peak is ``lr / sqrt(warmup)``. ``cosine`` (LRA's images): the warmup, then
    ``0.5 (1 + cos(pi (step - warmup) / steps))``, as LRA's cycle of ``steps``."""
    s = step + 1
    warm = min(1.0, s / cfg.warmup) if cfg.warmup else 1.0
    if cfg.schedule == "rsqrt":
        return cfg.lr * warm / math.sqrt(max(s, cfg.warmup, 1))
    if cfg.schedule == "cosine":
        progress = max(0.0, (step - cfg.warmup) / cfg.steps)
        return cfg.lr * warm * 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0)))
    if step < cfg.warmup:
        return cfg.lr * warm
    return cfg.lr * max(0.0, (cfg.steps - step) / max(1, cfg.steps - cfg.warmup))


def reset_peak_rss() -> bool:
    """Restarts the process's peak resident set (Linux: ``/proc/self/clear_refs``), so that a process
    running several trainings reports each one's own peak; False where the system does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mib(device: torch.device) -> tuple:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "peak CUDA memory allocated"
    try:                # since the last reset_peak_rss (else since the process started)
        with open("/proc/self/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM:"))
        return int(hwm.split()[1]) / 2**10, "peak RSS of the training process (data included)"
    except (OSError, StopIteration, ValueError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "peak RSS of the training process (data included)"


def save_atomic(obj, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


class Progress:
    """A redrawn status line on a terminal; elsewhere one line per logged step or evaluation."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.tty = enabled and sys.stderr.isatty()

    def step(self, step: int, text: str, force: bool = False, every: int = 50):
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        line = f"{self.desc} [{'#' * int(frac * 25):<25}] {step}/{self.total} {text}"
        if self.tty:
            sys.stderr.write("\r" + line[:160].ljust(160))
            sys.stderr.flush()
        elif force or step % every == 0:
            print(line, file=sys.stderr, flush=True)

    def note(self, text: str):
        if self.enabled:
            print(("\n" if self.tty else "") + f"{self.desc} {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- trainer

class Trainer:
    def __init__(self, cfg: TrainConfig, data: Optional[TaskData] = None, quiet: bool = False):
        cfg = self.cfg = resolve(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        setup_distributed(dev)
        self.rank, self.world = world()
        if dev == "cuda" and self.world > 1:
            dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        self.device = torch.device(dev)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.amp = cfg.amp == "bf16" or (cfg.amp == "auto" and self.device.type == "cuda")
        if data is None:
            # rank 0 generates (and caches) a missing set; the others wait for the cache file, not on a
            # collective, so a generation of any length trips no process-group timeout
            data = task_data(cfg, wait=self.rank > 0, progress=not quiet and self.rank == 0)
        self.data = data
        self.train_lengths = np.array([len(s) for s in self.data.train.x])
        lengths = self.train_lengths[:2000]
        self.max_length = cfg.max_length or max(max(len(s) for s in sp.x) for sp in
                                                (self.data.train, self.data.dev, self.data.test))
        self.recipe = recipe(cfg.recipe, cfg.task)
        mcfg = self.model_cfg = ModelConfig(**dict(self.recipe.model.as_dict(), dropout=cfg.dropout))
        torch.manual_seed(cfg.seed)         # the same initial weights on every process
        self.model = Classifier(self.data.vocab_size, self.max_length, self.data.num_classes, mcfg, cfg.variant,
                                pair=self.data.pair, block_size=cfg.block_size, window=cfg.window,
                                backend=cfg.backend).to(self.device)
        torch.manual_seed(rank_seed(cfg.seed, self.rank))     # but each its own dropout masks
        self.net = self.model
        if self.world > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.recipe == "lra":       # LRA: Adam(0.9, 0.98, eps 1e-9), decoupled decay on every parameter
            decay, eps = list(self.model.parameters()), 1e-9
        else:                         # decay on the weight matrices only: not embeddings, positions, biases, norms
            decay, eps = [p for n, p in self.model.named_parameters()
                          if p.dim() >= 2 and "embed" not in n and n != "encoder.pos"], 1e-8
        rest = [p for p in self.model.parameters() if not any(p is q for q in decay)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98), eps=eps)
        self.out = Path(cfg.out)
        self.state = dict(step=0, epoch=0, pos=0, best_dev=-1.0, best_step=-1, losses=[], evals=[],
                          train_seconds=0.0, timed_steps=0)
        self.progress = Progress(cfg.steps, f"{self.data.label}/{cfg.variant}", enabled=not quiet and self.rank == 0)
        self.mean_length = float(np.mean(lengths)) if len(lengths) else 0.0

    # ---- checkpoints
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def rng_states(self) -> List[Dict]:
        """Every process's RNG state (CPU, and CUDA on a GPU), in rank order."""
        mine = {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        if self.world == 1:
            return [mine]
        states: List = [None] * self.world
        dist.all_gather_object(states, mine)
        return states

    def save_checkpoint(self) -> None:
        rng = self.rng_states()
        if self.rank == 0:
            save_atomic({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "state": self.state,
                         "rng": rng, "world_size": self.world, "config": asdict(self.cfg)},
                        self.checkpoint_path())
        self.barrier()

    def load_checkpoint(self) -> bool:
        """Restores the run folder's checkpoint; refuses one written under other settings (naming
        them) or by another number of processes."""
        path = self.checkpoint_path()
        if not path.exists():
            return False
        ck = torch.load(path, map_location=self.device, weights_only=False)
        diff = config_differences(ck["config"], self.cfg)
        if diff:
            raise ValueError(f"--resume: {path} was written with other settings: " + ", ".join(
                f"{k} {ck['config'].get(k)!r} (now {getattr(self.cfg, k, None)!r})" for k in diff))
        if ck["world_size"] != self.world:
            raise ValueError(f"--resume: {path} was written by {ck['world_size']} process(es), this run has "
                             f"{self.world}; the batches and dropout streams would differ")
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        self.state = ck["state"]
        mine = ck["rng"][self.rank]
        torch.set_rng_state(mine["cpu"].cpu())
        if mine["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        return True

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    # ---- evaluation
    @torch.no_grad()
    def evaluate(self, split: Split) -> float:
        self.model.eval()
        idx = np.arange(len(split))[self.rank::self.world]
        correct = 0
        # sorted by length so padding stays small; accuracy does not depend on the order
        idx = idx[np.argsort([len(split.x[i]) for i in idx], kind="stable")]
        for i in range(0, len(idx), self.cfg.eval_batch_size):
            x, x2, y = batch_of(split, idx[i:i + self.cfg.eval_batch_size], self.max_length, self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                logits = self.model(x, x2)
            correct += int((logits.argmax(-1) == y).sum())
        totals = torch.tensor([correct, len(idx)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(totals)
        self.model.train()
        return float(totals[0] / totals[1])

    def dev_eval(self) -> float:
        acc = self.evaluate(self.data.dev)
        s = self.state
        s["evals"].append((s["step"], acc))
        if acc > s["best_dev"]:
            s["best_dev"], s["best_step"] = acc, s["step"]
            if self.rank == 0:
                save_atomic({"model": self.model.state_dict(), "step": s["step"], "dev_accuracy": acc},
                            self.out / "best.pt")
        self.barrier()
        self.progress.note(f"step {s['step']}: dev accuracy {acc:.4f} (best {s['best_dev']:.4f} at {s['best_step']})")
        return acc

    # ---- training
    def out_of_time(self, projected: float, budget: float) -> bool:
        """Whether training must stop now to finish within ``budget`` seconds; under torchrun every
        process takes the decision of the slowest, or they would wait for each other forever."""
        if budget == math.inf:
            return False
        late = torch.tensor([1.0 if projected > budget else 0.0])
        if self.world > 1:
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
        return bool(late.item())

    def train_step(self, x, x2, y) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.state["step"], self.cfg)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = F.cross_entropy(self.net(x, x2).float(), y)
        logged = loss.detach().clone()
        loss = loss + span_loss(self.model)         # the adaptive-span variant's penalty (0 otherwise)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:        # the logged loss is the global batch's: the mean over the processes
            dist.all_reduce(logged)
            logged /= self.world
        if self.cfg.save_first_grads:
            if self.rank == 0:
                grads = {n: p.grad.detach().cpu() for n, p in self.model.named_parameters() if p.grad is not None}
                torch.save({"grads": grads, "loss": float(logged)}, self.cfg.save_first_grads)
            raise _StopForGradients
        if self.cfg.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.opt.step()
        clamp_spans(self.model)
        return float(logged)

    def run(self, stop_after_steps: Optional[int] = None) -> Dict:
        """Trains to ``cfg.steps`` (or until the time budget or ``stop_after_steps`` steps of this
        call), evaluates, scores the test set on the best dev checkpoint and writes the results."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume and self.load_checkpoint():
            self.progress.note(f"resumed at step {self.state['step']}")
        s = self.state
        t_start = time.perf_counter()
        budget = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
        eval_cost = 0.0
        n, G = len(self.data.train), cfg.batch_size * self.world
        per_epoch = n // G
        if per_epoch == 0:
            raise ValueError(f"train: {n} training examples cannot fill one global batch of {G}")
        this_call, stopped = 0, None
        order, order_epoch = None, -1
        self.model.train()
        try:
            while s["step"] < cfg.steps:
                if stop_after_steps is not None and this_call >= stop_after_steps:
                    stopped = "stop_after_steps"
                    break
                # time spent + one more dev evaluation + the test (scaled from the last evaluation)
                finish = eval_cost * (1 + len(self.data.test) / max(len(self.data.dev), 1))
                if self.out_of_time(time.perf_counter() - t_start + finish, budget):
                    stopped = "max_minutes"
                    break
                if s["pos"] >= per_epoch:
                    s["epoch"], s["pos"] = s["epoch"] + 1, 0
                if order_epoch != s["epoch"]:
                    order, order_epoch = epoch_order(cfg.seed, s["epoch"], n, G, self.train_lengths, cfg.buckets), \
                        s["epoch"]
                b = s["pos"]
                idx = order[b * G + self.rank * cfg.batch_size: b * G + (self.rank + 1) * cfg.batch_size]
                x, x2, y = batch_of(self.data.train, idx, self.max_length, self.device)
                t0 = time.perf_counter()
                loss = self.train_step(x, x2, y)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                s["train_seconds"] += time.perf_counter() - t0
                s["timed_steps"] += 1
                s["step"] += 1
                s["pos"] += 1
                this_call += 1
                s["losses"].append(loss)
                sps = s["timed_steps"] / max(s["train_seconds"], 1e-9)
                self.progress.step(s["step"], f"loss {loss:.3f} lr {lr_at(s['step'] - 1, cfg):.2e} {sps:.2f} steps/s",
                                   every=cfg.log_every)
                if s["step"] % cfg.eval_every == 0 or s["step"] == cfg.steps:
                    t0 = time.perf_counter()
                    self.dev_eval()
                    self.save_checkpoint()
                    eval_cost = time.perf_counter() - t0
                if s["step"] == cfg.kill_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
        except _StopForGradients:
            return {}
        if stopped:
            self.save_checkpoint()
            self.progress.note(f"stopped ({stopped}) at step {s['step']}; --resume continues from here")
            if stopped == "stop_after_steps":
                return {"stopped": stopped, "step": s["step"]}
            if not s["evals"] or s["evals"][-1][0] != s["step"]:
                self.dev_eval()
                self.save_checkpoint()
        return self.finish(finished=stopped is None)

    def finish(self, finished: bool) -> Dict:
        s = self.state
        best = torch.load(self.out / "best.pt", map_location=self.device, weights_only=False)
        current = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(best["model"])
        self.tested_state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        test_acc = self.evaluate(self.data.test)
        self.model.load_state_dict(current)
        peak, peak_kind = peak_memory_mib(self.device)
        row = result_row(self, test_acc, best["step"], peak, peak_kind, finished)
        if self.rank == 0:
            from .report import write_run
            write_run([row], self.out)
            self.progress.note(f"test accuracy {test_acc:.4f} (best dev {s['best_dev']:.4f} at step {best['step']}); "
                               f"{row['steps_per_s']:.2f} steps/s, {peak:.0f} MiB {peak_kind} -> {self.out}")
        self.barrier()
        return row


class _StopForGradients(Exception):
    pass


def environment(device: torch.device) -> Dict:
    import effattn
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), name)
            name = f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
        except OSError:
            pass
    return {"device": name, "torch": torch.__version__, "effattn": effattn.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def result_row(tr: Trainer, test_acc: float, best_step: int, peak: float, peak_kind: str, finished: bool) -> Dict:
    s, cfg, d = tr.state, tr.cfg, tr.data
    majority = int(np.bincount(d.train.y, minlength=d.num_classes).argmax())
    return dict(task=d.label, variant=cfg.variant, test_accuracy=test_acc, dev_accuracy=s["best_dev"],
                best_step=best_step, steps=s["step"], target_steps=cfg.steps, finished=finished,
                steps_per_s=s["timed_steps"] / max(s["train_seconds"], 1e-9), peak_mib=peak, memory=peak_kind,
                train_minutes=s["train_seconds"] / 60, batch_size=cfg.batch_size * tr.world, world_size=tr.world,
                recipe=cfg.recipe, recipe_source=tr.recipe.source, model=tr.model_cfg.as_dict(), lr=cfg.lr,
                schedule=cfg.schedule, warmup=cfg.warmup, weight_decay=cfg.weight_decay, clip=cfg.clip,
                backend=cfg.backend, amp=tr.amp, mean_train_length=tr.mean_length, max_length=tr.max_length,
                standin=d.standin, data_kind=d.kind, data=d.source, seed=cfg.seed, data_seed=cfg.data_seed,
                majority_test_accuracy=float(np.mean(d.test.y == majority)), chance=1.0 / d.num_classes,
                evals=[list(e) for e in s["evals"]], **environment(tr.device))


def train(cfg: TrainConfig, data: Optional[TaskData] = None, stop_after_steps: Optional[int] = None,
          quiet: bool = False) -> Dict:
    tr = Trainer(cfg, data, quiet=quiet)
    row = tr.run(stop_after_steps)
    if tr.world > 1 and dist.is_initialized():
        # every process is past its last collective; DDP's reducer goes before its process group (a
        # reducer outliving the group can hang its process at exit)
        dist.barrier()
        tr.net = tr.model = tr.opt = None
        gc.collect()
        dist.destroy_process_group()
    return row
