"""The GPU path in one run: correctness, precision, throughput/MFU, checkpoint I/O, a hang drill.

Run by tools/gpu_check.sh on a CUDA machine (budget: 8 minutes on one H200);
writes --out/gpu_check.json after each check and prints a short table last.
Each check is independent: one that fails records its error and the others
still run.

    python tools/gpu_check.py [--out DIR] [--dry-run]

--dry-run runs every check's logic on the CPU at toy sizes (what the test
suite does, so the script is known to work before the first GPU is at hand);
the CUDA-only parts (the CUDA-vs-CPU comparison, the NCCL drill) say skipped.
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
from megaresil.train.loop import Trainer  # noqa: E402
from megaresil.train.optim import param_groups  # noqa: E402

H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's spec sheet, dense (no sparsity)
TINY_RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"
LLAMA_1B = ROOT / "recipes" / "llama-1b.yaml"
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

    def recipe(self, base: Path, extra: list[str], name: str):
        sizes = TOY + (LLAMA_TOY if base == LLAMA_1B else []) if self.dry_run else []
        overrides = SINGLE + sizes + extra + [f"run.dir={self.workdir / name}"]
        return load_recipe(TINY_RECIPE if self.dry_run else base, overrides)

    def trainer(self, cfg) -> Trainer:
        return Trainer(cfg, ParallelLayout(device=self.device))


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


def losses_of(check: Check, precision: str, steps: int) -> list[float]:
    cfg = check.recipe(TINY_RECIPE, [f"train.precision={precision}", f"train.steps={steps}",
                                     "train.deterministic=true"], f"loss_{precision}")
    trainer = check.trainer(cfg)
    trainer.run()
    return [r["loss"] for r in read_metrics(Path(cfg.run.dir)) if "loss" in r]


def bf16_vs_fp32_loss(check: Check) -> dict:
    """bf16 (fp32 main state) follows fp32's loss trajectory."""
    steps = 5 if check.dry_run else 30
    fp32, bf16 = losses_of(check, "fp32", steps), losses_of(check, "bf16", steps)
    drift = max(abs(b - f) / f for b, f in zip(bf16, fp32))
    return {"fp32": fp32, "bf16": bf16, "max_relative_drift": drift, "ok": drift < 2e-2}


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


def plain_loop_tokens_per_s(check: Check, cfg, steps: int) -> float:
    """The same model in a plain PyTorch bf16 loop: fp32 params under bf16
    autocast, fused AdamW, F.cross_entropy, clip_grad_norm_."""
    model = GPT(cfg.model).to(check.device)
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
    return t.global_batch_size * cfg.data.seq_len / sorted(times[1:])[len(times[1:]) // 2]


def throughput_1b(check: Check) -> dict:
    """tokens/s and MFU of the ~1B Llama recipe on one GPU, megaresil vs a plain loop."""
    steps = 3 if check.dry_run else 12
    extra = [] if check.dry_run else ["train.global_batch_size=16", "train.micro_batch_size=4"]
    cfg = check.recipe(LLAMA_1B, extra + ["train.precision=bf16", f"train.steps={steps}"],
                       "throughput")
    plain = plain_loop_tokens_per_s(check, cfg, steps)
    trainer = check.trainer(cfg)
    trainer.run()
    del trainer
    records = [r for r in read_metrics(Path(cfg.run.dir)) if "tokens_per_s" in r]
    ours = sorted(r["tokens_per_s"] for r in records[1:])[len(records[1:]) // 2]
    peak = measured_matmul_flops(check)
    flops = model_flops_per_token(cfg)
    return {"tokens_per_s": ours, "plain_tokens_per_s": plain, "ratio_vs_plain": ours / plain,
            "model_tflops_per_token": flops / 1e12, "measured_matmul_tflops": peak / 1e12,
            "mfu_vs_measured_matmul": ours * flops / peak,
            "mfu_vs_h200_spec": ours * flops / H200_BF16_DENSE_FLOPS,
            "plain_mfu_vs_h200_spec": plain * flops / H200_BF16_DENSE_FLOPS}


def checkpoint_io(check: Check) -> dict:
    """Save/load GB/s of the ~1B model's training state from GPU memory; async stall."""
    result = {}
    for mode in ("sync", "async"):
        extra = ["train.precision=bf16", "train.steps=2", "train.exit_at_step=1",
                 f"checkpoint.async={'true' if mode == 'async' else 'false'}"]
        if not check.dry_run:
            extra += ["train.global_batch_size=4", "train.micro_batch_size=4"]
        cfg = check.recipe(LLAMA_1B, extra, f"ckpt_{mode}")
        check.trainer(cfg).run()
        saved = [e for e in read_events(Path(cfg.run.dir)) if e["event"] == "checkpoint_saved"][-1]
        result[mode] = {"gb": saved["bytes"] / 1e9, "seconds": saved["seconds"],
                        "gb_per_s": saved["bytes"] / 1e9 / saved["seconds"],
                        "blocking_seconds": saved["blocking_seconds"]}
    started = time.perf_counter()
    check.trainer(check.recipe(LLAMA_1B, ["train.precision=bf16", "train.steps=2"], "ckpt_sync"))
    sync(check)
    seconds = time.perf_counter() - started  # includes building the model
    result["load"] = {"seconds_with_build": seconds,
                      "gb_per_s_lower_bound": result["sync"]["gb"] / seconds}
    return result


# The chaos tests' watchdog settings: 1 s budgets, so a drill takes seconds.
# Deterministic kernels: chaos compares the drill's final loss with the
# reference's bit for bit, which CUDA's default kernels do not promise.
DRILL = ["parallel.tp=1", "parallel.pp=1", "train.steps=12", "data.source=synthetic",
         "train.deterministic=true",
         "train.eval_batches=0", "logging.tensorboard=false",
         "resilience.watchdog.floor_s=1.0", "resilience.watchdog.calibration_steps=2"]


def chaos_drill(check: Check, scenario: str, dp: int) -> dict:
    command = [sys.executable, "-m", "megaresil", "chaos", str(TINY_RECIPE), "--scenario",
               scenario, "--timeout", str(DRILL_TIMEOUT_S - 20), *DRILL, f"parallel.dp={dp}",
               f"run.dir={check.workdir / scenario}"]
    code, stdout, stderr = run_tree(command, DRILL_TIMEOUT_S)
    return {"dp": dp, "exit_code": code, "report": stdout[-1500:], "stderr": stderr[-1500:],
            "ok": code == 0}


DRILL_TIMEOUT_S = 150


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


def nccl_hang_drill(check: Check) -> dict:
    """The watchdog on NCCL. One GPU: a rank's kernel never ends (hang-on-device):
    the watchdog declares the hang at its hard limit (the host thread spins in
    a synchronize, so it looks busy), aborts the NCCL communicators, finds the
    thread still blocked, and exits for a relaunch that resumes. Two GPUs also:
    a rank hangs in an NCCL collective (hang-in-collective at dp=2; NCCL refuses
    two ranks of one communicator on one GPU, so that drill needs two)."""
    gpus = torch.cuda.device_count() if check.device.type == "cuda" else 0
    if gpus == 0:
        return {"skipped": "no CUDA device"}
    result = {"hang-on-device": chaos_drill(check, "hang-on-device", min(gpus, 2))}
    if gpus >= 2:
        result["hang-in-collective"] = chaos_drill(check, "hang-in-collective", 2)
    result["ok"] = all(r["ok"] for r in result.values())
    return result


CHECKS = [logits_cuda_vs_cpu, bf16_vs_fp32_loss, te_vs_local, throughput_1b, checkpoint_io,
          nccl_hang_drill]


def run_checks(check: Check, out: Path | None = None) -> dict:
    """Every check in turn; with `out` (a directory), gpu_check.json there is
    rewritten after each, so a call cut short still brings back what ran."""
    summary = {"device": torch.cuda.get_device_name() if check.device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dry_run": check.dry_run}
    for fn in CHECKS:
        started = time.perf_counter()
        try:
            summary[fn.__name__] = fn(check)
        except Exception as err:  # a failed check is a result; the others still run
            summary[fn.__name__] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                    "traceback": traceback.format_exc()[-3000:]}
        summary[fn.__name__]["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps({fn.__name__: summary[fn.__name__]}, default=str)[-2000:], flush=True)
        if out is not None:
            (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
        if check.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # each check's peak memory is its own
    return summary


def table(summary: dict) -> str:
    """One line per check: ok / FAILED / skipped, and its seconds."""
    rows = []
    for name, result in summary.items():
        if not isinstance(result, dict):
            continue
        state = ("skipped: " + str(result["skipped"])[:60] if "skipped" in result
                 else "FAILED" if result.get("ok") is False else "ok")
        rows.append(f"{name:<22} {result.get('seconds', ''):>7}  {state}")
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
    failed = [k for k, v in summary.items() if isinstance(v, dict) and v.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
