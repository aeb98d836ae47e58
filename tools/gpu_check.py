"""The GPU path in one run: correctness, precision, throughput/MFU, checkpoint I/O, offload, context attention, a hang drill.

Run by tools/gpu_check.sh on a CUDA machine (the call: 8 minutes on one H200,
every check with its own deadline from tools/gpu_check_budget.py); writes
--out/gpu_check.json after each check and prints a short table last. Each
check is independent: one that fails (or passes its deadline) records its
error and the others still run. Every result has a `status`: ok, skipped
(with the reason) or failed.

    python tools/gpu_check.py [--out DIR] [--dry-run]

--dry-run runs every check's logic on the CPU at toy sizes (what the test
suite does, so the script is known to work before the first GPU is at hand);
the CUDA-only parts (the CUDA-vs-CPU comparison, the NCCL drill) say skipped
and why; the others run as their CPU stand-ins.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megaresil.config import load_recipe  # noqa: E402
from megaresil.events import read_events, read_metrics  # noqa: E402
from megaresil.model.gpt import GPT  # noqa: E402
from megaresil.model.init import initialize  # noqa: E402
from megaresil.parallel.layout import ParallelLayout  # noqa: E402
from megaresil.ports import free_port  # noqa: E402
from megaresil.train.compiling import compile_blocks  # noqa: E402
from megaresil.train.loop import Trainer  # noqa: E402
from megaresil.train.optim import param_groups  # noqa: E402

from gpu_check_budget import BUDGET_S, deadline_s  # noqa: E402  (tools/, beside this file)

H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's spec sheet, dense (no sparsity)
TINY_RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"
LLAMA_1B = ROOT / "recipes" / "llama-1b.yaml"
GPT2_124M = ROOT / "recipes" / "gpt2-124m.yaml"  # the call's ~100M model
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "data.source=synthetic",
          "train.eval_batches=0", "checkpoint.interval=0", "logging.progress=false",
          "logging.tensorboard=false"]
TOY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=300",
       "data.seq_len=32", "model.max_seq_len=32", "train.micro_batch_size=2",
       "train.global_batch_size=4", "optimizer.warmup_steps=2"]
LLAMA_TOY = ["model.flavour=llama", "model.num_kv_heads=2", "model.ffn_hidden_size=128"]


class Check:
    """The run's settings: sizes shrink to toys under --dry-run."""

    def __init__(self, dry_run: bool, workdir: Path):
        self.dry_run, self.workdir = dry_run, workdir
        self.device = torch.device("cpu" if dry_run or not torch.cuda.is_available() else "cuda")

    def recipe_args(self, base: Path, extra: list[str], name: str) -> list[str]:
        """The recipe's path and overrides, for load_recipe or another process."""
        sizes = TOY + (LLAMA_TOY if base == LLAMA_1B else []) if self.dry_run else []
        return [str(TINY_RECIPE if self.dry_run else base), *SINGLE, *sizes, *extra,
                f"run.dir={self.workdir / name}"]

    def recipe(self, base: Path, extra: list[str], name: str):
        path, *overrides = self.recipe_args(base, extra, name)
        return load_recipe(path, overrides)

    def trainer(self, cfg) -> Trainer:
        return Trainer(cfg, ParallelLayout(device=self.device))

    def deadline_s(self, part: str) -> int:
        return deadline_s(part, self.dry_run)


# --- checks ---------------------------------------------------------------------------


def logits_cuda_vs_cpu(check: Check) -> dict:
    """fp32 logits on the GPU equal the CPU's within 1e-5 (TF32 off), both flavours."""
    if check.device.type != "cuda":
        return {"skipped": "no CUDA device"}
    with tf32_off():
        return compare_logits(check)


@contextlib.contextmanager
def tf32_off():
    """TF32 off for an exact fp32 comparison, restored after it: the later
    checks measure throughput with the process's own settings."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def compare_logits(check: Check) -> dict:
    result = {}
    for flavour, extra in (("gpt2", []), ("llama", LLAMA_TOY)):
        cfg = load_recipe(TINY_RECIPE, SINGLE + TOY + extra).model
        model = GPT(cfg)
        initialize(model, cfg, seed=0)
        tokens = torch.randint(cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            cpu = model.logits(tokens)
            gpu = model.to(check.device).logits(tokens.to(check.device)).cpu()
        diff = (gpu - cpu).abs().max().item()
        result[flavour] = {"max_abs_diff": diff, "ok": diff <= 1e-5}
    result["ok"] = all(r["ok"] for r in result.values())
    return result


# The ~100M model's drift run: short sequences and one micro-batch a step keep a
# few hundred steps of fp32 (no TF32 in its matmuls) inside the check's deadline.
DRIFT_SIZES = ["data.seq_len=256", "model.max_seq_len=256", "train.micro_batch_size=8",
               "train.global_batch_size=8", "optimizer.warmup_steps=20"]


def losses_of(check: Check, precision: str, steps: int) -> list[float]:
    cfg = check.recipe(GPT2_124M, ([] if check.dry_run else DRIFT_SIZES) + [
        f"train.precision={precision}", f"train.steps={steps}", "train.deterministic=true"],
        f"loss_{precision}")
    trainer = check.trainer(cfg)
    trainer.run()
    return [r["loss"] for r in read_metrics(Path(cfg.run.dir)) if "loss" in r]


def bf16_vs_fp32_loss(check: Check) -> dict:
    """bf16 (Megatron style: fp32 main state) follows fp32's loss trajectory
    over a few hundred steps of the ~100M GPT-2; the drift, stated three ways."""
    steps = 5 if check.dry_run else 160
    fp32, bf16 = losses_of(check, "fp32", steps), losses_of(check, "bf16", steps)
    relative = [abs(b - f) / f for b, f in zip(bf16, fp32)]
    tail = relative[-max(1, steps // 10):]  # the last tenth: where drift has accumulated
    return {"steps": steps, "fp32_first_last": [fp32[0], fp32[-1]],
            "bf16_first_last": [bf16[0], bf16[-1]], "max_relative_drift": max(relative),
            "final_relative_drift": relative[-1],
            "mean_relative_drift_last_tenth": sum(tail) / len(tail),
            # Judged where drift has accumulated, on a mean: one step's noise is not drift.
            "ok": sum(tail) / len(tail) < 2e-2}


def te_vs_local(check: Check) -> dict:
    """Transformer Engine's layers give the local backend's logits on the same weights."""
    from megaresil.model import te
    if not te.available():
        return {"skipped": f"transformer_engine does not import: {te.import_error()}"}
    cfg = load_recipe(TINY_RECIPE, SINGLE + TOY + LLAMA_TOY).model
    local = GPT(cfg)
    initialize(local, cfg, seed=0)
    local = local.to(check.device)
    engine = GPT(cfg).to(check.device)
    initialize(engine, cfg, seed=0)
    with te.device_context(check.device):
        engine = te.convert(engine, check.device)
    tokens = torch.randint(cfg.vocab_size, (2, 32), device=check.device)
    with torch.no_grad():
        diff = (engine.logits(tokens) - local.logits(tokens)).abs().max().item()
    # TE's fused modules name parameters their way; the checkpoint keys are the map's.
    keys = sorted(te.local_key(k, cfg.flavour.value) for k, _ in engine.named_parameters())
    same_keys = keys == sorted(k for k, _ in local.named_parameters())
    return {"max_abs_diff": diff, "same_keys": same_keys, "ok": diff <= 1e-3 and same_keys}


def model_flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 x matmul parameters + causal attention scores."""
    m = cfg.model
    head_dim = m.hidden_size // m.num_heads
    kv = m.num_kv_heads or m.num_heads
    attn = m.hidden_size * (m.num_heads + 2 * kv) * head_dim + m.hidden_size * m.hidden_size
    mlp = 3 * m.hidden_size * (m.ffn_hidden_size or 4 * m.hidden_size)
    matmul_params = m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size
    scores = 6 * m.num_layers * m.hidden_size * cfg.data.seq_len  # QK^T and PV, fwd+bwd, causal
    return 6 * matmul_params + scores


def measured_matmul_flops(check: Check) -> float:
    n = 512 if check.dry_run else 8192
    dtype = torch.float32 if check.device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, device=check.device, dtype=dtype)
    b = torch.randn(n, n, device=check.device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(check)
    reps = 2 if check.dry_run else 50
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(check)
    return 2 * n**3 * reps / (time.perf_counter() - started)


def sync(check: Check) -> None:
    if check.device.type == "cuda":
        torch.cuda.synchronize()


def plain_loop(check: Check, cfg, steps: int, compile_backend: str | None = None) -> dict:
    """The same model in a plain PyTorch bf16 loop: fp32 params under bf16
    autocast, fused AdamW, F.cross_entropy, clip_grad_norm_; tokens/s, peak MB
    and the first step's seconds. `compile_backend`: compile its blocks as
    train.compile=blocks does (train/compiling.py), with this backend."""
    reset_peak_memory(check)
    model = GPT(cfg.model).to(check.device)
    if compile_backend is not None:
        compile_blocks([model], cfg, check.device, backend=compile_backend)
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(param_groups(list(model.parameters()), o.weight_decay),
                                  lr=o.lr, betas=(o.beta1, o.beta2), fused=True)
    t = cfg.train
    accum, vocab = t.global_batch_size // t.micro_batch_size, cfg.model.vocab_size
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        for _ in range(accum):
            tokens = torch.randint(vocab, (t.micro_batch_size, cfg.data.seq_len + 1),
                                   device=check.device)
            with torch.autocast(check.device.type, dtype=torch.bfloat16):
                logits = model.stage_forward(tokens[:, :-1], None)[..., :vocab]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(check)
        times.append(time.perf_counter() - started)
    del model, optimizer
    return {"tokens_per_s": t.global_batch_size * cfg.data.seq_len / median(times[1:]),
            "peak_memory_mb": peak_memory_mb(check), "first_step_s": times[0]}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def reset_peak_memory(check: Check) -> None:
    if check.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_mb(check: Check) -> float | None:
    """CUDA's peak allocated since the last reset; None on CPU (a process's
    peak resident set cannot be reset between sides)."""
    return torch.cuda.max_memory_allocated() / 2**20 if check.device.type == "cuda" else None


THROUGHPUT_SIZES = ["train.global_batch_size=16", "train.micro_batch_size=4"]


def throughput_overrides(check: Check, steps: int) -> list[str]:
    return ([] if check.dry_run else THROUGHPUT_SIZES) + ["train.precision=bf16",
                                                          f"train.steps={steps}"]


def throughput_1b(check: Check) -> dict:
    """tokens/s, MFU and peak memory of the ~1B Llama recipe on one GPU,
    megaresil vs a plain PyTorch loop of the same model (Megatron-Core's side
    is the next check, mcore_1b)."""
    steps = 3 if check.dry_run else 12
    cfg = check.recipe(LLAMA_1B, throughput_overrides(check, steps), "throughput")
    plain = plain_loop(check, cfg, steps)
    reset_peak_memory(check)
    trainer = check.trainer(cfg)
    trainer.run()
    del trainer
    ours_peak = peak_memory_mb(check)
    records = [r for r in read_metrics(Path(cfg.run.dir)) if "tokens_per_s" in r]
    ours = median([r["tokens_per_s"] for r in records[1:]])
    peak = measured_matmul_flops(check)
    flops = model_flops_per_token(cfg)
    return {"tokens_per_s": ours, "plain_tokens_per_s": plain["tokens_per_s"],
            "ratio_vs_plain": ours / plain["tokens_per_s"],
            "peak_memory_mb": ours_peak, "plain_peak_memory_mb": plain["peak_memory_mb"],
            "model_tflops_per_token": flops / 1e12, "measured_matmul_tflops": peak / 1e12,
            "mfu_vs_measured_matmul": ours * flops / peak,
            "mfu_vs_h200_spec": ours * flops / H200_BF16_DENSE_FLOPS,
            "plain_mfu_vs_h200_spec": plain["tokens_per_s"] * flops / H200_BF16_DENSE_FLOPS,
            "torch_compile": "off on both sides (train.compile=none; compile_vs_eager measures it)",
            "ok": ours > 0}


def compile_vs_eager(check: Check) -> dict:
    """train.compile=blocks against eager: step time, MFU and the compile's
    cost (the first step's extra seconds) of the ~100M GPT-2 in the plain bf16
    loop, the model's compute being what compiling changes. On the CPU (the
    rehearsal) the backend is aot_eager: inductor's C++ compile takes minutes
    there, and the rehearsal proves the plumbing, not the speed."""
    steps = 3 if check.dry_run else 8
    cfg = check.recipe(GPT2_124M, throughput_overrides(check, steps) + ["train.compile=blocks"],
                       "compile")
    eager = plain_loop(check, cfg, steps)
    compiled = plain_loop(check, cfg, steps,
                          compile_backend="aot_eager" if check.dry_run else "inductor")
    flops = model_flops_per_token(cfg)
    return {"eager_tokens_per_s": eager["tokens_per_s"],
            "compiled_tokens_per_s": compiled["tokens_per_s"],
            "speedup": compiled["tokens_per_s"] / eager["tokens_per_s"],
            "compile_s": compiled["first_step_s"] - eager["first_step_s"],
            "eager_mfu_vs_h200_spec": eager["tokens_per_s"] * flops / H200_BF16_DENSE_FLOPS,
            "compiled_mfu_vs_h200_spec": compiled["tokens_per_s"] * flops / H200_BF16_DENSE_FLOPS,
            "eager_peak_memory_mb": eager["peak_memory_mb"],
            "compiled_peak_memory_mb": compiled["peak_memory_mb"],
            "ok": compiled["tokens_per_s"] > 0}


MOE_RECIPE = ROOT / "recipes" / "moe-tiny.yaml"
# Experts in the toy (dry run) and the GPU check: a dense first layer, then top-2 of 8.
MOE_TOY = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.first_dense_layers=1",
           "model.moe.aux_loss_coeff=0.01"]
# ~0.39B parameters: 16 experts (top-2) 1024 wide, 8 layers (the first dense), seq 1024.
MOE_SIZES = ["model.num_layers=8", "model.hidden_size=1024", "model.num_heads=16",
             "model.num_kv_heads=4", "model.ffn_hidden_size=2816", "model.moe.num_experts=16",
             "model.moe.expert_ffn_hidden_size=1024", "data.seq_len=1024",
             "model.max_seq_len=1024", "train.micro_batch_size=8", "train.global_batch_size=8",
             "optimizer.warmup_steps=2"]


def moe_logits_and_step(check: Check) -> dict:
    """A mixture of experts on the GPU: fp32 logits equal the CPU's within
    1e-5 (TF32 off; the grouped experts are torch's grouped_mm on both), then
    a short bf16 run of a ~0.39B MoE: finite losses, tokens/s, MFU on the
    active parameters and the routing's balance (metrics' moe_imbalance)."""
    result = {}
    if check.device.type == "cuda":
        with tf32_off():
            cfg = load_recipe(TINY_RECIPE, SINGLE + TOY + LLAMA_TOY + MOE_TOY).model
            model = GPT(cfg)
            initialize(model, cfg, seed=0)
            tokens = torch.randint(cfg.vocab_size, (2, 32),
                                   generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                cpu = model.logits(tokens)
                gpu = model.to(check.device).logits(tokens.to(check.device)).cpu()
            diff = (gpu - cpu).abs().max().item()
            result["logits"] = {"max_abs_diff": diff, "ok": diff <= 1e-5}
    steps = 3 if check.dry_run else 10
    extra = (TOY + LLAMA_TOY + MOE_TOY if check.dry_run else MOE_SIZES) + [
        "train.precision=bf16", f"train.steps={steps}"]
    path = TINY_RECIPE if check.dry_run else MOE_RECIPE
    cfg = load_recipe(path, [*SINGLE, *extra, f"run.dir={check.workdir / 'moe'}"])
    reset_peak_memory(check)
    trainer = check.trainer(cfg)
    trainer.run()
    del trainer
    records = [r for r in read_metrics(Path(cfg.run.dir)) if "loss" in r]
    losses = [r["loss"] for r in records]
    timed = records[1:] or records
    result["train"] = {
        "losses_first_last": [losses[0], losses[-1]],
        "tokens_per_s": median([r["tokens_per_s"] for r in timed]),
        "mfu": median([r.get("mfu", 0.0) for r in timed]),
        "moe_imbalance_last": records[-1].get("moe_imbalance"),
        "peak_memory_mb": peak_memory_mb(check),
        "ok": len(losses) == steps and all(l == l and abs(l) != float("inf") for l in losses)}
    result["ok"] = all(r["ok"] for r in result.values())
    return result


def mcore_1b(check: Check) -> dict:
    """Megatron-Core's GPTModel at the same ~1B Llama shape, batch and steps
    (bench/mcore_loop.py in a process of its own; its CPU shims only on CPU)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput  # bench/: the bench's own reason when megatron-core is absent

    missing = train_throughput.mcore_missing()
    if missing:
        return {"skipped": missing}
    steps = 3 if check.dry_run else 12
    args = check.recipe_args(LLAMA_1B, throughput_overrides(check, steps), "mcore")
    cfg = load_recipe(args[0], args[1:])
    command = [sys.executable, str(ROOT / "bench" / "mcore_loop.py"), "recipe", "--steps",
               str(steps), "--port", str(free_port()), "--", *args]
    code, stdout, stderr = run_tree(command, check.deadline_s("mcore_1b") - 5)
    if code != 0:
        return {"ok": False, "error": f"mcore_loop exited {code}", "stderr": stderr[-1500:]}
    measured = json.loads(stdout.strip().splitlines()[-1])
    tokens_per_s = cfg.train.global_batch_size * cfg.data.seq_len / measured["step_s"]
    return {"tokens_per_s": tokens_per_s,
            "mfu_vs_h200_spec": tokens_per_s * model_flops_per_token(cfg) / H200_BF16_DENSE_FLOPS,
            "peak_memory_mb": measured["peak_memory_mb"],
            "differs": "no activation recompute (the recipe's is selective); Mcore's unfused "
                       "local-spec attention where megaresil uses SDPA",
            "ok": tokens_per_s > 0}


CKPT_STEPS, CKPT_INTERVAL = 7, 2  # saves after steps 2, 4, 6: later steps may wait on them


def saved_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "checkpoint_saved"]


def step_seconds(run_dir: Path) -> dict[int, float]:
    """{step: its wall seconds} from metrics.jsonl's elapsed_s."""
    records = [r for r in read_metrics(run_dir) if "elapsed_s" in r]
    return {b["step"]: b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])}


def checkpoint_recipe(check: Check, mode: str):
    extra = ["train.precision=bf16", f"train.steps={CKPT_STEPS}",
             f"checkpoint.interval={CKPT_INTERVAL}", "checkpoint.keep=1",
             f"checkpoint.async={'true' if mode == 'async' else 'false'}"]
    return check.recipe(GPT2_124M, extra + ([] if check.dry_run else DRIFT_SIZES), f"ckpt_{mode}")


def raw_write_gb_per_s(nbytes: int, directory: Path) -> float:
    """The floor to compare with: the same number of bytes written from host
    memory to one file in the checkpoints' directory, then fsync'd."""
    chunk = bytes(64 * 2**20)
    path = directory / "raw_write.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, len(chunk)):
            f.write(chunk[:min(len(chunk), nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return nbytes / 1e9 / seconds


def checkpoint_io(check: Check) -> dict:
    """Save/load GB/s of the ~100M model's training state from GPU memory
    against raw writes of the same bytes; the async save's stall over several
    steps (the steps after a save, which may wait on its copy, vs the others)."""
    result = {}
    for mode in ("sync", "async"):
        cfg = checkpoint_recipe(check, mode)
        check.trainer(cfg).run()
        run_dir = Path(cfg.run.dir)
        saves, steps = saved_events(run_dir), step_seconds(run_dir)
        after_save = [steps[e["step"] + 1] for e in saves if e["step"] + 1 in steps]
        others = [s for step, s in steps.items() if step - 1 not in {e["step"] for e in saves}]
        gb = saves[-1]["bytes"] / 1e9
        result[mode] = {"saves": len(saves), "gb": gb,
                        "gb_per_s": median([e["bytes"] / 1e9 / e["seconds"] for e in saves]),
                        "blocking_seconds": [e["blocking_seconds"] for e in saves],
                        "step_s_after_a_save": median(after_save) if after_save else None,
                        "step_s_others": median(others) if others else None}
        if after_save and others:  # the stall a save costs the step that follows it
            result[mode]["stall_s"] = median(after_save) - median(others)
    result["raw_write_gb_per_s"] = raw_write_gb_per_s(int(result["sync"]["gb"] * 1e9),
                                                     Path(cfg.checkpoint.dir or cfg.run.dir))
    result["sync_vs_raw"] = result["sync"]["gb_per_s"] / result["raw_write_gb_per_s"]
    started = time.perf_counter()
    loading = checkpoint_recipe(check, "sync")
    check.trainer(loading)  # resumes from the sync run's newest save
    sync(check)
    seconds = time.perf_counter() - started  # includes building the model
    loaded = [e for e in read_events(Path(loading.run.dir)) if e["event"] == "checkpoint_loaded"]
    result["load"] = {"seconds_with_build": seconds,
                      "gb_per_s_lower_bound": result["sync"]["gb"] / seconds,
                      "step": loaded[-1]["step"] if loaded else None}
    result["page_cache"] = ("saves and the raw write end in fsync (on disk); the load reads "
                            "the newest save back warm, from the page cache (not dropped)")
    result["ok"] = (result["sync"]["saves"] > 0 and result["async"]["saves"] > 0
                    and result["load"]["step"] == CKPT_STEPS)
    return result


def offload_run(check: Check, offload: str) -> dict:
    extra = ["train.precision=bf16", "train.steps=4", "model.recompute=full",
             f"model.activation_offload={offload}"]
    cfg = check.recipe(GPT2_124M, extra + ([] if check.dry_run else [
        "train.micro_batch_size=8", "train.global_batch_size=8"]), f"offload_{offload}")
    reset_peak_memory(check)
    check.trainer(cfg).run()
    steps = step_seconds(Path(cfg.run.dir))
    return {"peak_memory_mb": peak_memory_mb(check), "step_s": median(list(steps.values()))}


def activation_offload(check: Check) -> dict:
    """The activation-offload side stream: the ~100M model with full
    recomputation, its checkpointed inputs offloaded to host memory vs kept."""
    result = {offload: offload_run(check, offload) for offload in ("none", "cpu")}
    if check.device.type == "cuda":
        result["memory_saved_mb"] = (result["none"]["peak_memory_mb"]
                                     - result["cpu"]["peak_memory_mb"])
    result["step_time_ratio"] = result["cpu"]["step_s"] / result["none"]["step_s"]
    result["ok"] = True
    return result


def context_attention_vs_sdpa(check: Check) -> dict:
    """Context-parallel attention's blocks (model/context_attention.py) on the
    device at a long sequence: every rank of cp=2 and cp=4 in this one
    process (one GPU: no cp group of two), the keys and values as the
    all-gather hands them; output and q, k, v grads against SDPA's causal
    attention, fp32, TF32 off, as max |error| / max |reference|."""
    from megaresil.model import context_attention as ca
    from megaresil.parallel.context_parallel import CPGroup

    T = 256 if check.dry_run else 8192
    B, H, G, D = 1, 8, 4, 64
    gen = torch.Generator(device=check.device).manual_seed(0)
    q, dout = (torch.randn(B, H, T, D, device=check.device, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, G, T, D, device=check.device, generator=gen) for _ in range(2))
    scale = D ** -0.5

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got - want).abs().max() / want.abs().max()).item()

    result: dict = {"seq": T, "heads": H, "kv_heads": G, "head_dim": D}
    with tf32_off():
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
        ref.backward(dout)
        assert qr.grad is not None and kr.grad is not None and vr.grad is not None
        for cp in (2, 4):
            chunks = list(zip(torch.stack([k, v]).chunk(2 * cp, dim=-2), range(2 * cp)))
            dkv = torch.zeros(2, B, G, T, D, device=check.device)
            worst = {"out": 0.0, "dq": 0.0}
            for rank in range(cp):
                group = CPGroup(None, cp, rank)
                q_r, dout_r = group.slice_sequence(q, dim=2), group.slice_sequence(dout, dim=2)
                spans = ca._spans(group, T // cp, ca._Mask(None, scale, None))
                out, lse = ca._forward(q_r, spans, iter(chunks))
                dq = [torch.zeros_like(half) for half in ca._halves(q_r)]
                grads = [ca._key_grads(q_r, out, dout_r, lse, spans, kv, c, dq) for kv, c in chunks]
                dkv += torch.cat(grads, dim=-2)
                worst["out"] = max(worst["out"], error(out, group.slice_sequence(ref, dim=2)))
                worst["dq"] = max(worst["dq"],
                                  error(torch.cat(dq, dim=-2), group.slice_sequence(qr.grad, dim=2)))
            worst |= {"dk": error(dkv[0], kr.grad), "dv": error(dkv[1], vr.grad)}
            result[f"cp{cp}"] = {name: float(f"{e:.2e}") for name, e in worst.items()}
    result["ok"] = all(e <= 1e-4 for cp in (2, 4) for e in result[f"cp{cp}"].values())
    return result


def fsdp_mixed_precision(check: Check) -> dict:
    """FSDP2 as parallel/fsdp.py wraps a model, on the device: the ~100M
    GPT-2's blocks and root sharded over a one-rank mesh (one GPU: no shard
    group of two; the sharded layouts' arithmetic is the CPU suite's),
    computing in bf16 from fp32 sharded weights and reducing in fp32, against
    the unwrapped model in fp32 on the same batches: the loss drift, and
    each side's peak memory and step time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megaresil.config import Precision
    from megaresil.parallel.fsdp import shard_chunks
    from megaresil.parallel.sharding import SHARDED_OVER

    steps = 3 if check.dry_run else 20
    cfg = check.recipe(GPT2_124M, [] if check.dry_run else DRIFT_SIZES, "fsdp")
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if check.device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    result: dict = {"steps": steps}
    try:
        # A one-rank layout whose shard mesh is this GPU alone.
        mesh = init_device_mesh(check.device.type, (1,), mesh_dim_names=(SHARDED_OVER,))
        layout = ParallelLayout(device=check.device, data_shard_meshes={SHARDED_OVER: mesh})
        for side in ("fp32", "fsdp_bf16"):
            model = GPT(cfg.model)
            initialize(model, cfg.model, seed=0)
            model = model.to(check.device)
            if side == "fsdp_bf16":
                shard_chunks([model], layout, Precision.bf16)
            optimizer = torch.optim.AdamW(param_groups(list(model.parameters()), 0.1), lr=3e-4)
            batches = torch.Generator().manual_seed(1)
            reset_peak_memory(check)
            losses, seconds = [], []
            for _ in range(steps):
                tokens = torch.randint(cfg.model.vocab_size, shape, generator=batches)
                tokens = tokens.to(check.device)
                started = time.perf_counter()
                loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                seconds.append(time.perf_counter() - started)
            result[side] = {"first_last_loss": [losses[0], losses[-1]], "losses": losses,
                            "peak_memory_mb": peak_memory_mb(check),
                            "step_s": median(seconds[1:])}
    finally:
        if own_group:
            dist.destroy_process_group()
    drift = [abs(b - f) / f for b, f in zip(result["fsdp_bf16"].pop("losses"),
                                            result["fp32"].pop("losses"))]
    result["max_relative_drift"] = max(drift)
    result["ok"] = max(drift) < 2e-2
    return result


def not_on_this_device(check: Check) -> dict:
    """What the call cannot measure on the lent machine, and why."""
    return {"skipped": "TE, apex and multi-GPU NCCL: see the reasons",
            "transformer_engine": "cannot be installed there: its CUDA-13 core wheel is ~276 MB "
                                  "(64 MiB may be carried), its torch extension is source only",
            "apex": "NVIDIA apex is built from source with CUDA (many minutes; PyPI's apex is "
                    "another package)",
            "multi_gpu_nccl": "one GPU: NCCL refuses two ranks of one communicator on one device "
                              "(hang-in-collective, TP/DP over NCCL need two GPUs)",
            "context_parallel_ranks": "one GPU: world 1, so no cp group; its attention's blocks "
                                      "are checked in one process (context_attention_vs_sdpa)"}


# The chaos tests' watchdog settings: 1 s budgets, so a drill takes seconds.
# Deterministic kernels: chaos compares the drill's final loss with the
# reference's bit for bit, which CUDA's default kernels do not promise.
DRILL = ["parallel.tp=1", "parallel.pp=1", "train.steps=12", "data.source=synthetic",
         "train.deterministic=true",
         "train.eval_batches=0", "logging.tensorboard=false",
         "resilience.watchdog.floor_s=1.0", "resilience.watchdog.calibration_steps=2"]


def chaos_drill(check: Check, scenario: str, dp: int) -> dict:
    run_dir = check.workdir / scenario
    command = [sys.executable, "-m", "megaresil", "chaos", str(TINY_RECIPE), "--scenario",
               scenario, "--timeout", str(DRILL_TIMEOUT_S - 15), *DRILL, f"parallel.dp={dp}",
               f"run.dir={run_dir}"]
    code, stdout, stderr = run_tree(command, DRILL_TIMEOUT_S)
    events = [e for e in read_events(run_dir) if e["event"] in DRILL_EVENTS] if (
        run_dir / "events.jsonl").exists() else []
    return {"dp": dp, "exit_code": code, "report": stdout[-1500:], "stderr": stderr[-1500:],
            "events": events[:8], "ok": code == 0}


DRILL_EVENTS = {"hang_detected", "restart", "worker_error", "checkpoint_loaded"}
DRILL_TIMEOUT_S = BUDGET_S["nccl_hang_drill"] - 5  # chaos's own timeout ends it first


def run_tree(command: list[str], timeout_s: float) -> tuple[int, str, str]:
    """Run `command` in a session of its own; past `timeout_s` kill its whole
    process tree (chaos's agent and workers hold the GPU), exit code 124."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return 124, stdout, stderr
    finally:  # the check's own deadline may interrupt the wait: the tree goes too
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def nccl_hang_drill(check: Check) -> dict:
    """The watchdog on NCCL. One GPU: a rank's kernel never ends (hang-on-device):
    the watchdog declares the hang at its hard limit (the host thread spins in
    a synchronize, so it looks busy), aborts the NCCL communicators, finds the
    thread still blocked, and exits for a relaunch that resumes. Two GPUs also:
    a rank hangs in an NCCL collective (hang-in-collective at dp=2; NCCL refuses
    two ranks of one communicator on one GPU, so that drill needs two)."""
    gpus = torch.cuda.device_count() if check.device.type == "cuda" else 0
    if gpus == 0:
        return {"skipped": "no CUDA device (hang-on-device hangs a CUDA kernel; the CPU drills "
                           "are the test suite's)"}
    result = {"hang-on-device": chaos_drill(check, "hang-on-device", min(gpus, 2))}
    if gpus >= 2:
        result["hang-in-collective"] = chaos_drill(check, "hang-in-collective", 2)
    result["ok"] = all(r["ok"] for r in result.values())
    if gpus < 2:
        result["unproven"] = DRILL_UNPROVEN
    return result


DRILL_UNPROVEN = (
    "one GPU allows a world of 1: its NCCL communicator is made at the first CUDA collective "
    "and may not exist when the hang is declared, so the abort of a live communicator with a "
    "peer, a rank hung inside an NCCL collective (hang-in-collective) and NCCL's own timeout "
    "stay unproven until two GPUs")


CHECKS = [logits_cuda_vs_cpu, bf16_vs_fp32_loss, te_vs_local, throughput_1b, compile_vs_eager,
          mcore_1b,
          moe_logits_and_step, checkpoint_io, activation_offload, context_attention_vs_sdpa,
          fsdp_mixed_precision,
          nccl_hang_drill, not_on_this_device]


class PastDeadline(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise PastDeadline in this (the main) thread after `seconds`, so a
    slow check ends as a failure and the call's other checks still run."""
    def expire(signum, frame):
        raise PastDeadline(f"past its {seconds} s deadline (tools/gpu_check_budget.py)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def status_of(result: dict) -> str:
    if "skipped" in result:
        return "skipped"
    return "ok" if result.get("ok") is True else "failed"


def run_check(fn, check: Check) -> dict:
    started = time.perf_counter()
    try:
        with deadline(check.deadline_s(fn.__name__)):
            result = fn(check)
    except Exception as err:  # a failed check is a result; the others still run
        result = {"ok": False, "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["status"] = status_of(result)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def run_checks(check: Check, out: Path | None = None) -> dict:
    """Every check in turn; with `out` (a directory), gpu_check.json there is
    rewritten after each, so a call cut short still brings back what ran."""
    summary = {"device": torch.cuda.get_device_name() if check.device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dry_run": check.dry_run}
    for fn in CHECKS:
        summary[fn.__name__] = run_check(fn, check)
        print(json.dumps({fn.__name__: summary[fn.__name__]}, default=str)[-2000:], flush=True)
        if out is not None:
            (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
        reset_peak_memory(check)  # each check's peak memory is its own
    return summary


def table(summary: dict) -> str:
    """One line per check: ok / FAILED / skipped (and why), and its seconds."""
    rows = [f"{'check':<22} {'seconds':>7}  result"]
    for name, result in summary.items():
        if not isinstance(result, dict):
            continue
        state = {"skipped": "skipped: " + str(result.get("skipped"))[:80],
                 "failed": "FAILED: " + str(result.get("error", ""))[:80]}.get(result["status"],
                                                                               "ok")
        rows.append(f"{name:<22} {result['seconds']:>7}  {state}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"),
                        help="directory (made if missing) for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        summary = run_checks(Check(args.dry_run, Path(workdir)), args.out)
    print(table(summary))
    failed = [k for k, v in summary.items() if isinstance(v, dict) and v["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
