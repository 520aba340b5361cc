"""Long Range Arena harness: models with every variant, training (overfit, exact resume, best
checkpoint tested, time budget, refused resumes, bad arguments), recipes and schedules, data
parallelism over two gloo processes (gradients, all-reduced loss, per-rank dropout, kill and exact
resume), and the reports."""
import json
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.lra import report, tasks
from benchmarks.lra.__main__ import main as lra_main
from benchmarks.lra.model import Classifier, ModelConfig
from benchmarks.lra.train import TrainConfig, Trainer, train
from benchmarks.lra.variants import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
TINY = {"sizes": [64, 32, 32], "min_length": 8, "max_length": 40}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread (the runs are tiny, and the CI machine is shared), restored afterwards: the
    trainer's ``threads=`` setting is process-wide."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lra-cache")


@pytest.fixture(scope="module")
def tiny(cache):
    return tasks.load_task("listops", cache_dir=cache, overrides=TINY)


def small_cfg(tmp_path, cache, **kw):
    base = dict(task="listops", recipe="demo", out=str(tmp_path / "run"), steps=10, batch_size=8, warmup=3,
                eval_every=4, lr=3e-3, log_every=1000, cache_dir=str(cache), overrides=TINY, threads=1)
    base.update(kw)
    return TrainConfig(**base)


# ----------------------------------------------------------------------------------- models

OWN_ENCODER = ("reformer", "transformer-xl")       # not an effattn.nn.TransformerEncoder (benchmarks.lra.encoders)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_forward_backward_and_padding_invariance(variant):
    torch.manual_seed(0)
    pooling = "cls" if variant in ("softmax", "bigbird", "linear") else "mean"
    cfg = ModelConfig(d_model=32, heads=2, layers=2, ff=64, dropout=0.0, pooling=pooling)
    model = Classifier(17, 100, 10, cfg, variant, block_size=16, window=8)
    x = torch.randint(2, 17, (3, 70))
    x[1, 40:] = 0
    x[2, 21:] = 0
    logits = model(x)
    logits.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items() if n != "encoder.embed.weight")
    if variant not in OWN_ENCODER:
        assert grads["encoder.encoder.layers.0.self_attn.in_proj_weight"].abs().sum() > 0
        assert all(layer.self_attn.last_path in ("fused", "linear") for layer in model.encoder.encoder.layers)
    else:
        assert all(g.abs().sum() > 0 for n, g in grads.items() if "attn" in n)
    model.eval()
    with torch.no_grad():
        full = model(x)
        alone = model(x[1:2, :40])                           # no padding at all
        other = x.clone()
        other[0] = torch.randint(2, 17, (70,))               # other sequences of the batch change
        more = torch.cat([other, torch.zeros(3, 29, dtype=torch.long)], dim=1)   # and the padding grows
        padded = model(more)
    if variant == "reformer":     # LSH: padding tokens take part in the sort and the chunks (as in Reformer)
        torch.testing.assert_close(model(x), full)           # but evaluation hashes deterministically
        return
    torch.testing.assert_close(full[1], alone[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(full[1:], padded[1:], atol=2e-5, rtol=1e-4)


def test_two_tower_retrieval_model():
    torch.manual_seed(0)
    model = Classifier(258, 64, 2, ModelConfig(32, 2, 1, 64, 0.0, "mean"), "local", pair=True, window=8)
    a, b = torch.randint(2, 258, (2, 50)), torch.randint(2, 258, (2, 30))
    out = model(a, b)
    assert out.shape == (2, 2)
    with pytest.raises(ValueError, match="x2"):
        model(a)


# ----------------------------------------------------------------------------------- training

def test_overfits_64_samples(tmp_path, cache, tiny):
    cfg = small_cfg(tmp_path, cache, steps=120, batch_size=32, warmup=10, eval_every=1000, lr=3e-3, dropout=0.0,
                    weight_decay=0.0)
    tr = Trainer(cfg, quiet=True)
    tr.run()
    assert tr.evaluate(tr.data.train) >= 0.95
    assert np.mean(tr.state["losses"][-10:]) < 0.3 * np.mean(tr.state["losses"][:10])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_trains_a_few_steps(tmp_path, cache, variant):
    """Each variant, the own-encoder ones (reformer, transformer-xl) included, goes through the
    trainer on tiny ListOps: its loss falls on 16 repeated examples, its row names it and is tested."""
    tr = Trainer(small_cfg(tmp_path, cache, variant=variant, steps=12, batch_size=16, warmup=2, eval_every=6,
                           dropout=0.0, weight_decay=0.0, block_size=16, window=8,
                           overrides={**TINY, "sizes": [16, 16, 16]}), quiet=True)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "attn" in n}
    row = tr.run()
    losses = tr.state["losses"]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert any(not torch.equal(p, before[n]) for n, p in tr.model.named_parameters() if n in before)
    assert row["variant"] == variant and row["finished"] and 0.0 <= row["test_accuracy"] <= 1.0


def test_demo_runs_every_variant_with_three_seeds(tmp_path):
    from benchmarks.lra.demo import demo_configs
    cfgs = demo_configs(tmp_path, 1.0)
    assert {"reformer", "transformer-xl"} <= set(VARIANTS)
    assert sorted((c.variant, c.seed) for c in cfgs) == sorted((v, s) for v in VARIANTS for s in (0, 1, 2))
    assert all(c.recipe == "demo" and c.max_minutes == 1.0 for c in cfgs)


def test_demo_time_shares_follow_cost_and_give_back_what_runs_leave():
    from benchmarks.lra.demo import COST, Shares
    sh = Shares(jobs=2, deadline=600.0)
    cheap, dear = "softmax", max(COST, key=COST.get)
    a = sh.start(0, dear, [cheap], now=0.0)            # 1200 core-seconds for two runs, split by cost
    assert a == pytest.approx(1200 * COST[dear] / (COST[dear] + COST[cheap]))
    b = sh.start(1, cheap, [], now=0.0)                # what the first was not promised
    assert b == pytest.approx(1200 - a)
    assert sh.overhead() == 2.0                        # BUILD until a run has finished
    # stopped half way through its steps: 20 s training, 10 s else, so a whole run is 50 s
    sh.finish(1, cheap, seconds=30.0, budget=25.0, train_seconds=20.0, steps=150, target=300)
    assert sh.weight(cheap) == 50.0 and sh.weight("no-such-variant") == pytest.approx(2.0 * 50.0)
    assert sh.overhead() == 5.0                        # 5 s beyond its trainer's budget
    c = sh.start(2, cheap, [cheap], now=100.0)         # 2 x 500 s left, less the first run's 100 s to go ...
    assert c == pytest.approx((1000 - (a - 100)) / 2)  # ... shared by two runs of equal cost
    assert sh.start(3, cheap, [], now=599.0) == 6.0    # however late, enough for a few steps


def test_batches_by_length_are_a_deterministic_partition():
    from benchmarks.lra.train import epoch_order
    lengths = np.random.default_rng(0).integers(16, 128, 1000)
    order = epoch_order(3, 1, 1000, 32, lengths, buckets=5)
    assert sorted(order) == list(range(1000))
    assert np.array_equal(order, epoch_order(3, 1, 1000, 32, lengths, buckets=5))
    assert not np.array_equal(order, epoch_order(3, 2, 1000, 32, lengths, buckets=5))
    spread = np.ptp(lengths[order[:31 * 32]].reshape(31, 32), axis=1)
    assert spread.mean() < 0.25 * np.ptp(lengths)      # a batch holds similar lengths ...
    assert np.ptp(lengths[order[:31 * 32]].reshape(31, 32).mean(1)) > 50   # ... batches differ
    assert np.array_equal(epoch_order(3, 1, 1000, 32, lengths, buckets=0), epoch_order(3, 1, 1000))


def test_demo_cpu_cost_adds_its_measured_pieces(cache, tiny):
    from benchmarks.lra.demo import cpu_cost, cpu_cost_markdown
    res = cpu_cost(str(cache), ("softmax", "reformer"), seeds=3, jobs=2, steps=2, data=TINY, startup=1.5)
    assert res["startup"] == 1.5 and set(res["variants"]) == {"softmax", "reformer"}
    for d in res["variants"].values():
        assert d["step"] > 0 and d["dev_eval"] > 0
        assert d["run"] == pytest.approx(d["build"] + 300 * d["step"] + 5 * d["dev_eval"])
    assert res["variants"]["softmax"]["relative"] == 1.0
    assert res["variants"]["reformer"]["relative"] == pytest.approx(res["variants"]["reformer"]["run"] /
                                                                    res["variants"]["softmax"]["run"])
    assert res["idle_minutes_estimate"] == pytest.approx(
        (3 * sum(d["run"] for d in res["variants"].values()) + 2 * 1.5) / 120)
    assert "| reformer |" in cpu_cost_markdown(res)


def test_resume_equals_uninterrupted_run(tmp_path, cache, tiny):
    a = Trainer(small_cfg(tmp_path / "a", cache, dropout=0.1), quiet=True)
    a.run()
    b1 = Trainer(small_cfg(tmp_path / "b", cache, dropout=0.1), quiet=True)
    assert b1.run(stop_after_steps=5)["step"] == 5       # checkpointed between evaluations
    b2 = Trainer(small_cfg(tmp_path / "b", cache, dropout=0.1, resume=True), quiet=True)
    b2.run()
    assert b2.state["losses"] == a.state["losses"] and len(a.state["losses"]) == 10
    assert b2.state["evals"] == a.state["evals"]
    for (n, p), (_, q) in zip(a.model.state_dict().items(), b2.model.state_dict().items()):
        assert torch.equal(p, q), n
    # every epoch has its own order (64 examples, global batch 8: epoch 2 starts at step 8)
    from benchmarks.lra.train import epoch_order
    assert not np.array_equal(epoch_order(0, 0, 64), epoch_order(0, 1, 64))


def test_best_dev_checkpoint_is_tested_not_the_last(tmp_path, cache, tiny):
    scripted = iter([0.5, 0.9, 0.3])
    snapshots = {}

    class Scripted(Trainer):
        def evaluate(self, split):
            if split is self.data.dev:
                snapshots[self.state["step"]] = {k: v.clone() for k, v in self.model.state_dict().items()}
                return next(scripted)
            return super().evaluate(split)

    tr = Scripted(small_cfg(tmp_path, cache, steps=12), quiet=True)
    row = tr.run()
    assert row["best_step"] == 8 and row["dev_accuracy"] == 0.9
    for k, v in tr.tested_state.items():
        assert torch.equal(v, snapshots[8][k]), k
    assert any(not torch.equal(v, snapshots[12][k]) for k, v in tr.tested_state.items())
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved[0]["task"] == "listops (8-40 tokens)" and saved[0]["variant"] == "softmax"
    assert 0 <= saved[0]["test_accuracy"] <= 1 and saved[0]["steps_per_s"] > 0 and saved[0]["peak_mib"] > 0
    assert (tmp_path / "run" / "results.csv").exists() and "| listops (8-40 tokens) | softmax |" in \
        (tmp_path / "run" / "results.md").read_text()


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path, cache, tiny, capsys):
    Trainer(small_cfg(tmp_path, cache), quiet=True).run(stop_after_steps=2)
    with pytest.raises(ValueError,
                       match=r"other settings: .*lr 0\.003 \(now 0\.001\).*variant 'softmax' \(now 'local'\)"):
        Trainer(small_cfg(tmp_path, cache, variant="local", lr=1e-3, resume=True), quiet=True).run()
    # the command line says it in one line, without a traceback
    argv = ["train", "--task", "listops", "--recipe", "demo", "--variant", "local", "--out", str(tmp_path / "run"),
            "--resume", "--steps", "10", "--batch-size", "8", "--warmup", "3", "--eval-every", "4", "--lr", "3e-3",
            "--threads", "1", "--cache-dir", str(cache), "--set", "sizes=[64,32,32]", "--set", "min_length=8",
            "--set", "max_length=40"]
    capsys.readouterr()
    assert lra_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "variant 'softmax' (now 'local')" in err, err
    # settings that only steer the run may change
    row = Trainer(small_cfg(tmp_path, cache, resume=True, max_minutes=60, log_every=7), quiet=True).run()
    assert row["steps"] == 10


def test_a_checkpoint_from_before_buckets_resumes_only_without_them():
    from dataclasses import asdict

    from benchmarks.lra.train import config_differences, resolve
    cfg = resolve(TrainConfig(task="listops", recipe="small"))
    old = {k: v for k, v in asdict(cfg).items() if k != "buckets"}       # written before the setting existed
    assert cfg.buckets == 0 and config_differences(old, cfg) == []
    assert config_differences(old, resolve(TrainConfig(task="listops", recipe="small", buckets=50))) == ["buckets"]


@pytest.mark.parametrize("argv, needle", [
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--eval-every", "0"], "--eval-every must be a positive integer, got 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--set", "nodes=3"], "--set nodes: not a parameter of the listops generator"),
    (["--set", "sizes=[1,2"], "--set 'sizes=[1,2': expected KEY=JSON"),
    (["--set", "sizes=[5,5]"], "--set sizes: expected [train, dev, test] counts"),
    (["--recipe", "demo", "--task", "image"], "recipe 'demo' is short ListOps only"),
] + ([(["--device", "cuda"], "--device cuda: no CUDA GPU is visible")] if not torch.cuda.is_available() else []))
def test_bad_arguments_are_one_line_errors(argv, needle, capsys, tmp_path):
    assert lra_main(["train", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err and "Traceback" not in err, err
    for argv in (["demo", "--jobs", "0"], ["speed", "--batch-size", "0"]):
        assert lra_main(argv) == 2
        assert "must be positive" in capsys.readouterr().err


def test_recipes_and_schedules():
    from benchmarks.lra.recipes import LRA, SMALL, recipe
    from benchmarks.lra.train import lr_at, resolve
    # the published Transformers: 1 layer d=128 8 heads on Image, 4 layers d=32 4 heads on Pathfinder
    assert (LRA["image"].model.layers, LRA["image"].model.d_model, LRA["image"].model.heads) == (1, 128, 8)
    pf = LRA["pathfinder"].model
    assert (pf.layers, pf.d_model, pf.heads) == (4, 32, 4)
    assert LRA["image"].steps == 200 * (45000 // 256) and LRA["pathfinder"].batch_size == 512
    assert set(LRA) == set(SMALL) == set(tasks.TASKS)
    cfg = resolve(TrainConfig(task="listops", recipe="lra"))
    assert (cfg.steps, cfg.batch_size, cfg.warmup, cfg.weight_decay, cfg.schedule) == (5000, 32, 1000, 0.1, "rsqrt")
    # rsqrt: lr * min(1, s / warmup) / sqrt(max(s, warmup)), s = step + 1: peak lr / sqrt(warmup) at the warmup's end
    assert lr_at(999, cfg) == pytest.approx(0.05 / 1000 ** 0.5)
    assert lr_at(3999, cfg) == pytest.approx(0.05 / 4000 ** 0.5)
    assert lr_at(499, cfg) == pytest.approx(0.5 * 0.05 / 1000 ** 0.5)
    img = resolve(TrainConfig(task="image", recipe="lra"))
    assert lr_at(174, img) == pytest.approx(5e-4)
    assert lr_at(175 + img.steps // 2, img) == pytest.approx(2.5e-4, rel=1e-3)
    small = resolve(TrainConfig(task="retrieval", recipe="small", steps=100, warmup=10))
    assert lr_at(4, small) == pytest.approx(0.5e-4) and lr_at(55, small) == pytest.approx(0.5e-4)
    assert resolve(TrainConfig(task="listops", recipe="small", lr=0.5)).lr == 0.5      # an option overrides
    with pytest.raises(ValueError, match="recipe must be one of"):
        recipe("paper", "listops")


def test_tasks_command_lists_six_tasks_with_data_and_commands(capsys):
    assert lra_main(["tasks"]) == 0
    out = capsys.readouterr().out
    for task, kind in (("listops", "generated"), ("text", "stand-in*"), ("retrieval", "stand-in*"),
                       ("image", "stand-in*"), ("pathfinder", "regenerated*"), ("pathx", "regenerated*")):
        line = next(l for l in out.splitlines() if l.startswith(f"| {task} |"))
        assert f"| {kind} |" in line and f"train --task {task} --recipe lra" in line
    assert "| pathx | 16384 | 2 |" in out


def test_max_minutes_stops_tests_and_resumes(tmp_path, cache, tiny):
    row = train(small_cfg(tmp_path, cache, max_minutes=1e-6), quiet=True)
    assert row["finished"] is False and row["steps"] < 10 and 0 <= row["test_accuracy"] <= 1
    row = train(small_cfg(tmp_path, cache, resume=True), quiet=True)
    assert row["finished"] is True and row["steps"] == 10


# ----------------------------------------------------------------------------------- data parallel

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_rank(rank: int, world: int, port: int, fn, args) -> None:
    """A forked process's body: rank ``rank`` of ``world`` (the variables torchrun sets), then ``fn(*args)``.
    The objects inherited from the parent are frozen out of the garbage collector's reach: a collection
    (the trainer runs one before leaving its process group) would otherwise walk, and copy, all of them."""
    import gc
    gc.freeze()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    fn(*args)


def forked_ranks(fn, *args, world: int = 2, timeout: float = 120.0) -> list:
    """``fn(*args)`` in ``world`` processes forked from this one, as the ranks of a gloo group; their
    exit codes (-9: SIGKILLed). Forked, they share the imports already made here: a rank starts in
    milliseconds where a fresh interpreter (torchrun's) takes seconds of CPU to import torch and effattn."""
    import multiprocessing
    ctx, port = multiprocessing.get_context("fork"), _free_port()
    procs = [ctx.Process(target=_as_rank, args=(r, world, port, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish in {timeout} s"
    return [p.exitcode for p in procs]


def _train_quietly(cfg: TrainConfig) -> None:
    train(cfg, quiet=True)


def test_two_gloo_processes_batch_8_equal_one_process_batch_16(tmp_path, cache, tiny):
    """Two forked gloo ranks, 8 examples each, take the first step's gradients and loss of one process on
    the 16 examples."""
    one = tmp_path / "one.pt"
    train(small_cfg(tmp_path / "single", cache, batch_size=16, dropout=0.0, device="cpu", save_first_grads=str(one)),
          quiet=True)
    two = tmp_path / "two.pt"
    cfg = small_cfg(tmp_path / "ddp", cache, batch_size=8, dropout=0.0, device="cpu", save_first_grads=str(two))
    assert forked_ranks(_train_quietly, cfg) == [0, 0]
    g1, g2 = torch.load(one), torch.load(two)
    assert g1["grads"].keys() == g2["grads"].keys() and len(g1["grads"]) > 10
    for name in g1["grads"]:
        torch.testing.assert_close(g2["grads"][name], g1["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
    # the logged loss is the global batch's (averaged over the processes), not rank 0's own
    assert g2["loss"] == pytest.approx(g1["loss"], rel=1e-5)


def test_two_gloo_processes_killed_and_resumed_equal_an_uninterrupted_run(tmp_path, cache, tiny):
    """With dropout: each process draws its own masks, every process's RNG state is checkpointed, so a
    run SIGKILLed after step 5 (last checkpoint: step 4) and resumed takes the very same steps."""
    def cfg(out, **kw):
        return small_cfg(tmp_path / out, cache, steps=8, eval_every=4, dropout=0.1, device="cpu", **kw)
    assert forked_ranks(_train_quietly, cfg("whole")) == [0, 0]
    codes = forked_ranks(_train_quietly, cfg("cut", kill_at_step=5))
    assert codes[0] == -signal.SIGKILL and all(c != 0 for c in codes), codes
    cut = torch.load(tmp_path / "cut" / "run" / "checkpoint.pt", weights_only=False)
    assert cut["state"]["step"] == 4 and not (tmp_path / "cut" / "run" / "results.json").exists()
    # two processes, two different dropout streams (same seed, different rank)
    assert len(cut["rng"]) == 2 and not torch.equal(cut["rng"][0]["cpu"], cut["rng"][1]["cpu"])
    assert forked_ranks(_train_quietly, cfg("cut", resume=True)) == [0, 0]
    a = torch.load(tmp_path / "whole" / "run" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "run" / "checkpoint.pt", weights_only=False)
    assert len(a["state"]["losses"]) == 8 and a["state"]["losses"] == b["state"]["losses"]    # bitwise
    assert a["state"]["evals"] == b["state"]["evals"]
    for name, p in a["model"].items():
        assert torch.equal(p, b["model"][name]), name
    ra = json.loads((tmp_path / "whole" / "run" / "results.json").read_text())[0]
    rb = json.loads((tmp_path / "cut" / "run" / "results.json").read_text())[0]
    assert ra["test_accuracy"] == rb["test_accuracy"] and ra["world_size"] == 2 and ra["batch_size"] == 16


def _dropout_outputs(cfg: TrainConfig, folder: Path) -> None:
    """One rank's classifier outputs on the same 8 training examples, in training mode (dropout on)
    and in evaluation mode, saved as ``folder/<rank>.pt``."""
    import torch.distributed as dist

    from benchmarks.lra.train import batch_of
    tr = Trainer(cfg, quiet=True)
    x, x2, _ = batch_of(tr.data.train, np.arange(8), tr.max_length, tr.device)
    tr.model.train()
    drop = tr.model(x, x2).detach()
    tr.model.eval()
    with torch.no_grad():
        plain = tr.model(x, x2)
    torch.save({"train": drop, "eval": plain}, folder / f"{tr.rank}.pt")
    dist.barrier()          # both saved; the forked process then leaves by os._exit (no teardown to hang)


def test_two_gloo_processes_draw_different_dropout_masks(tmp_path, cache, tiny):
    """Under data parallelism each process draws its own dropout masks (not the same masks on every
    rank, which would make the global batch's dropout that of one process): the same weights on the
    same examples give the same outputs in evaluation mode and different ones in training mode."""
    assert forked_ranks(_dropout_outputs, small_cfg(tmp_path, cache, dropout=0.3, device="cpu"), tmp_path) == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert torch.equal(r0["eval"], r1["eval"])
    assert not torch.equal(r0["train"], r0["eval"]) and not torch.equal(r0["train"], r1["train"])
    from benchmarks.lra.train import rank_seed
    seeds = {rank_seed(s, r) for s in range(3) for r in range(4)}
    assert len(seeds) == 12 and all(0 <= x < 2**63 for x in seeds)


def test_other_ranks_wait_for_the_cache_file_not_a_collective(tmp_path, cache, tiny):
    """Rank > 0 polls for rank 0's file however long the generation takes (no process-group
    timeout), and never generates itself."""
    import threading
    over = dict(TINY, sizes=[20, 4, 4])
    path = tasks.cache_path("listops", dict(tasks.PRESETS["listops"]["full"], **over, seed=0), tmp_path)
    box = {}
    waiter = threading.Thread(target=lambda: box.update(d=tasks.load_task(
        "listops", cache_dir=tmp_path, overrides=over, wait=True)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not path.exists()      # still waiting, and generating nothing
    first = tasks.load_task("listops", cache_dir=tmp_path, overrides=over)     # "rank 0" makes the file
    assert path.exists()
    waiter.join(30)
    assert not waiter.is_alive() and np.array_equal(box["d"].test.y, first.test.y)


# ----------------------------------------------------------------------------------- reports

def test_tables_average_present_tasks_and_mark_standins(tmp_path):
    ref = dict(majority_test_accuracy=0.17, chance=0.1)
    rows = [dict(task="listops", variant="softmax", test_accuracy=0.4, steps_per_s=1.0, peak_mib=10.0, **ref),
            dict(task="image*", variant="softmax", test_accuracy=0.8, steps_per_s=1.0, peak_mib=10.0, chance=0.1),
            dict(task="listops", variant="linear", test_accuracy=0.3, steps_per_s=2.0, peak_mib=5.0, **ref)]
    t1 = report.table1(rows)
    assert "| listops | image* |" in t1
    assert "| softmax | 40.0 | 80.0 | 60.0 (2/2) |" in t1
    assert "| linear | 30.0 | - | 30.0 (1/2) |" in t1          # a missing task is not a 0
    assert "| *majority class* | 17.0 | - | |" in t1 and "| *chance* | 10.0 | 10.0 | |" in t1
    # seeds: mean +- sample std (n); a re-run of one seed replaces it
    seeded = [dict(task="listops", variant="local", seed=s, test_accuracy=a, dev_accuracy=a, steps=10, steps_per_s=1.0,
                   peak_mib=1.0, recipe="demo", **ref) for s, a in ((0, 0.3), (1, 0.4), (2, 0.9), (2, 0.35))]
    assert "| local | 35.0 ± 5.0 (3) | 35.0 (1/1) |" in report.table1(seeded)
    md = report.seeds_markdown(seeded)
    assert "| listops | local | demo | 3 | 35.0 ± 5.0 (3) | 35.0 ± 5.0 (3) | 10 |" in md
    assert "| listops | *majority class* | | | 17.0 |" in md
    speed = [dict(task="text (speed)", variant=v, length=L, steps_per_s=s, peak_mib=m, test_accuracy=None)
             for v, L, s, m in (("softmax", 1024, 2.0, 100.0), ("linear", 1024, 5.0, 25.0))]
    t2 = report.table2(speed)
    assert "| linear | 2.50x |" in t2 and "| linear | 0.25x |" in t2 and "| softmax | 2.00 |" in t2
    for i, r in enumerate(rows + speed):
        d = tmp_path / "runs" / str(i)
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps([r]))
    assert lra_main(["report", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "results.md").read_text()
    assert "Table 1" in md and "Table 2" in md and "stand-in" in md
    assert len(json.loads((tmp_path / "rep" / "results.json").read_text())) == 5
    assert (tmp_path / "rep" / "results.csv").exists()


def test_gpu_plan_within_total_minutes_cuts_budgets_and_leaves_the_rest(tmp_path, monkeypatch, capsys):
    import types

    from benchmarks.lra import gpu
    ran = []
    monkeypatch.setattr(gpu.subprocess, "run", lambda argv, timeout=None: ran.append((argv, timeout))
                        or types.SimpleNamespace(returncode=0))
    steps = gpu.plan(str(tmp_path), minutes=8.0)
    assert gpu.run_plan(steps, total_minutes=1.0) == 0 and not ran       # less than MIN_START_MINUTES
    assert capsys.readouterr().out.count("left for the next call") == len(steps)
    assert gpu.run_plan(steps, total_minutes=5.0) == 0 and len(ran) == len(steps)
    for argv, timeout in ran:
        assert timeout <= 300
        if "--max-minutes" in argv:                      # 8 minutes cut to what is left less one
            assert float(argv[argv.index("--max-minutes") + 1]) <= 4.0
    assert ran[0][0][3] == "speed" and ran[-1][0][3] == "report"    # Table 2 first: minutes, not hours


def test_speed_row_on_cpu():
    from benchmarks.lra.speed import measure
    row = measure("linear", 64, 2, steps=1, warmup=0)
    assert row["status"] == "ok" and row["steps_per_s"] > 0 and row["peak_mib"] >= 0 and row["length"] == 64


def test_gpu_plan_covers_every_variant_and_table_2(tmp_path, capsys):
    from benchmarks.lra import gpu
    steps = gpu.plan(str(tmp_path))
    listops = [s for s in steps if s.argv[:3] == ["train", "--task", "listops"]]
    assert {s.argv[s.argv.index("--variant") + 1] for s in listops} == set(VARIANTS)
    assert all("--resume" in s.argv and s.argv[s.argv.index("--recipe") + 1] == "lra" for s in listops)
    assert [s.target for s in listops if "softmax" in s.argv] == [0.36]
    speeds = [s.argv for s in steps if s.argv[0] == "speed"]
    assert any("4096" in a and "1024" in a and "text" in a for a in speeds) and any("16384" in a and "pathx" in a
                                                                                      for a in speeds)
    soft = next(s for s in listops if "softmax" in s.argv)
    assert not gpu.finished(soft)
    Path(soft.done_file).parent.mkdir(parents=True)
    Path(soft.done_file).write_text(json.dumps([{"finished": False, "test_accuracy": 0.2}]))
    assert not gpu.finished(soft)                 # stopped by its time budget: the next call resumes it
    Path(soft.done_file).write_text(json.dumps([{"finished": True, "test_accuracy": 0.37}]))
    assert gpu.finished(soft)
    # Pathfinder*'s learnability at LRA's contour length on more images, after the softmax run
    names = [s.name for s in steps]
    learn = next(s for s in steps if s.argv[0] == "learnability")
    assert names.index(learn.name) == names.index(soft.name) + 1 and "contour_length" not in " ".join(learn.argv)
    assert not gpu.finished(learn)
    Path(learn.done_file).parent.mkdir(parents=True)
    Path(learn.done_file).write_text(json.dumps({"small CNN, test accuracy (best dev epoch)": 0.5}))
    assert gpu.finished(learn)
    assert lra_main(["gpu-plan", "--out", str(tmp_path)]) == 0 and "test >= 36%" in capsys.readouterr().out
