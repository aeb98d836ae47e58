"""megaresil's training step against a plain PyTorch loop and Megatron-Core, side by side.

End to end: megaresil's side is `megaresil train` (the CLI, its launcher and a
worker, metrics.jsonl's per-step times); the baseline is the same GPT module
(megaresil's, at tp=1 its layers are plain F.linear/F.embedding), the same
initial weights, batch shapes, fused AdamW, F.cross_entropy and
clip_grad_norm_, in a 20-line loop with nothing else. Each side runs in its
own process with the same thread count; the two alternate, `--rounds` times,
and each keeps its best round (a shared machine can only make a run slower).

Layouts: 1x1x1 (one worker) and tp=2 (two workers), each worker with one
thread, against the same single-process, single-thread plain loop.

The third side, when megatron-core is installed (a test dependency; skipped
with a one-line reason otherwise): Megatron-Core's GPTModel at the same sizes,
tp=1 and tp=2 (gloo), in bench/mcore_loop.py, under the CPU shim that
tests/harness/mcore.py lists (torch.cuda.current_device -> "cpu"; a no-op CUDA
RNG-tracker fork).

    python bench/train_throughput.py [--sizes tiny small] [--steps 8] [--rounds 2]
        [--out bench/results]
    python bench/train_throughput.py --plain SIZE --steps N   (one baseline run; prints JSON)
    python bench/train_throughput.py --compile [--sizes ...] [--layouts ...] [--rounds 1]
        (megaresil eager against train.compile=blocks, alternating; train_compile.md)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
WARMUP_STEPS = 2  # first steps pay allocation and thread-pool start-up
# One intra-op thread per process on every side: on a small machine shared with
# other work, multi-threaded ops spin-wait on busy cores and time the machine's
# load, not the step (measured: 7-12 s steps at 2 threads for 0.3-0.7 s at 1).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}

COMMON = ["data.source=synthetic", "train.eval_batches=0", "checkpoint.interval=0",
          "logging.progress=false", "logging.tensorboard=false", "parallel.pp=1",
          "parallel.dp=1"]
# tiny: the CPU demo's model. small: the profiled case of the issue, 1024 tokens
# per micro-batch against a 32768-token vocabulary (the cross-entropy matters).
SIZES = {
    "tiny": ["model.num_layers=4", "model.hidden_size=192", "model.num_heads=6",
             "model.vocab_size=4096", "data.seq_len=128", "model.max_seq_len=128",
             "train.micro_batch_size=4", "train.global_batch_size=16"],
    "small": ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=8",
              "model.vocab_size=32768", "data.seq_len=256", "model.max_seq_len=256",
              "train.micro_batch_size=4", "train.global_batch_size=8"],
}
LAYOUTS = {"1x1x1": ["parallel.tp=1"], "tp2": ["parallel.tp=2"]}
LAYOUT_TP = {"1x1x1": 1, "tp2": 2}


def recipe(size: str, steps: int, extra: list[str] = ()):
    from megaresil.config import load_recipe
    return load_recipe(RECIPE, COMMON + SIZES[size] + [f"train.steps={steps}", *extra])


def plain_loop(size: str, steps: int) -> dict:
    """The baseline: megaresil's model in a plain PyTorch loop; per-step seconds."""
    import torch
    import torch.nn.functional as F

    from megaresil.model.gpt import GPT
    from megaresil.model.init import initialize
    from megaresil.train.optim import param_groups

    cfg = recipe(size, steps)
    model = GPT(cfg.model)
    initialize(model, cfg.model, cfg.train.seed)
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(param_groups(list(model.parameters()), o.weight_decay),
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    micro, accum = cfg.train.micro_batch_size, cfg.train.global_batch_size // cfg.train.micro_batch_size
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        for _ in range(accum):
            tokens = torch.randint(cfg.model.vocab_size, (micro, cfg.data.seq_len + 1),
                                   generator=generator)
            logits = model.stage_forward(tokens[:, :-1], None)[..., : cfg.model.vocab_size]
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    return {"step_s": statistics.median(seconds[WARMUP_STEPS:])}


# Every side of the bench ends by this deadline: a Megatron-Core tp=2 rank once
# waited 13 minutes on a peer that had already failed.
SIDE_DEADLINE_S = 900


def run_side(commands: list[list[str]], deadline_s: float = SIDE_DEADLINE_S,
             env: dict | None = None) -> list[str]:
    """Run one side's processes (one per rank), each in a session of its own,
    with `env` (default: one intra-op thread); their stdouts. When one fails,
    or the deadline passes, every process tree of the side is killed (a rank
    left waiting on a dead peer never ends)."""
    with tempfile.TemporaryDirectory() as logs:
        outs = [open(Path(logs) / f"{i}.out", "w+") for i in range(len(commands))]
        errs = [open(Path(logs) / f"{i}.err", "w+") for i in range(len(commands))]
        procs = [subprocess.Popen(command, env=env or ONE_THREAD, cwd=ROOT, stdout=out, stderr=err,
                                  text=True, start_new_session=True)
                 for command, out, err in zip(commands, outs, errs)]
        try:
            wait_side(procs, errs, time.monotonic() + deadline_s)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        return [out.seek(0) or out.read() for out in outs]


def wait_side(procs: list[subprocess.Popen], errs: list, ends: float) -> None:
    """Until every process exited 0; raises at the first failure or at `ends`."""
    while not all(proc.poll() == 0 for proc in procs):
        for proc, err in zip(procs, errs):
            if proc.poll() not in (None, 0):
                err.seek(0)
                tail = (err.read().strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"{' '.join(proc.args[:3])}... failed: {tail}")
        if time.monotonic() > ends:
            raise RuntimeError(f"{' '.join(procs[0].args[:3])}... passed its deadline")
        time.sleep(0.2)


def run_plain(size: str, steps: int) -> float:
    out = run_side([[sys.executable, __file__, "--plain", size, "--steps", str(steps)]])[0]
    return json.loads(out.strip().splitlines()[-1])["step_s"]


def mcore_missing() -> str:
    """Why the Megatron-Core side cannot run here ("" when it can): megatron-core
    is a test dependency, not a megaresil one."""
    try:
        with warnings.catch_warnings():  # its CUDA-extension fallbacks warn on import
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError as error:
        return f"megatron-core is not installed ({error}); pip install --no-deps megatron-core"
    return ""


def run_mcore(size: str, tp: int, steps: int) -> float:
    """Megatron-Core's GPTModel in its own loop (bench/mcore_loop.py), one
    process per TP rank; rank 0's median step time."""
    from megaresil.ports import free_port
    command = [sys.executable, str(ROOT / "bench" / "mcore_loop.py"), size, "--steps", str(steps),
               "--tp", str(tp), "--port", str(free_port())]
    outputs = run_side([command + ["--rank", str(rank)] for rank in range(tp)])
    return json.loads(outputs[0].strip().splitlines()[-1])["step_s"]


def megaresil_records(size: str, layout: str, steps: int, extra: list[str] = ()) -> list[dict]:
    """metrics.jsonl's step records of one `megaresil train` run, end to end."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [str(RECIPE), *COMMON, *SIZES[size], *LAYOUTS[layout], f"train.steps={steps}",
                f"run.dir={run_dir}", *extra]
        run_side([[sys.executable, "-m", "megaresil", "train", *args]])
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return [r for r in records if "elapsed_s" in r]


def loop_step_s(records: list[dict]) -> float:
    """The median time from one step's end to the next's, as metrics.jsonl's
    `elapsed_s` records it: the whole loop iteration (data, step, the metrics
    line, the checks between steps), the span the plain loop times."""
    ends = [r["elapsed_s"] for r in records]
    step_s = [b - a for a, b in zip(ends, ends[1:])]  # steps 2, 3, ...
    return statistics.median(step_s[WARMUP_STEPS - 1:])  # the steps the plain loop keeps


def run_megaresil(size: str, layout: str, steps: int) -> float:
    """`megaresil train` end to end; its loop's step time (loop_step_s)."""
    return loop_step_s(megaresil_records(size, layout, steps))


def measure(sizes: list[str], steps: int, rounds: int, with_mcore: bool) -> list[dict]:
    rows = []
    for size in sizes:
        best_plain = float("inf")
        best = {layout: float("inf") for layout in LAYOUTS}
        best_mcore = {layout: float("inf") for layout in LAYOUTS}
        for _ in range(rounds):  # alternate, so load on the machine hits every side
            best_plain = min(best_plain, run_plain(size, steps))
            for layout, tp in LAYOUT_TP.items():
                best[layout] = min(best[layout], run_megaresil(size, layout, steps))
                if with_mcore:
                    best_mcore[layout] = min(best_mcore[layout], run_mcore(size, tp, steps))
        for layout in LAYOUTS:
            row = {"size": size, "layout": layout, "megaresil_step_s": best[layout],
                   "plain_step_s": best_plain, "ratio": best_plain / best[layout]}
            if with_mcore:
                row.update(mcore_step_s=best_mcore[layout],
                           mcore_ratio=best_mcore[layout] / best[layout])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def measure_compile(sizes: list[str], layouts: list[str], steps: int, rounds: int) -> list[dict]:
    """megaresil eager against train.compile=blocks, alternating, each its best
    round; the compile's cost (the first compiled step against the first eager
    one, each paying its warm-up) and the largest loss difference over the run."""
    rows = []
    for size in sizes:
        cpu = run_compile_cpu_times(size)
        for layout in layouts:
            best, first, losses = {}, {}, {}
            for _ in range(rounds):
                for mode in ("none", "blocks"):
                    records = megaresil_records(size, layout, steps, [f"train.compile={mode}"])
                    best[mode] = min(best.get(mode, float("inf")), loop_step_s(records))
                    first[mode] = records[0]["step_time_s"]
                    losses[mode] = [r["loss"] for r in records]
            row = {"size": size, "layout": layout, "eager_step_s": best["none"],
                   "compiled_step_s": best["blocks"], "speedup": best["none"] / best["blocks"],
                   "compile_s": first["blocks"] - first["none"],
                   "max_loss_diff": max(abs(a - b) for a, b in zip(losses["none"], losses["blocks"])),
                   **(cpu if layout == "1x1x1" else {})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def compile_cpu_times(size: str, reps: int = 5) -> dict:
    """In one process, one thread: the median CPU seconds of a micro-batch's
    forward and backward, through the blocks alone and through the whole model
    (embedding, blocks, head, cross-entropy), eager and with compiled blocks,
    deterministic kernels on as in `megaresil train` on the CPU. CPU time, not
    wall time: other work on a shared machine does not count."""
    import torch

    from megaresil.model.gpt import GPT
    from megaresil.model.init import initialize
    from megaresil.train.compiling import compile_blocks
    from megaresil.train.precision import set_kernel_determinism

    cfg = recipe(size, reps, ["train.compile=blocks"])
    set_kernel_determinism(None, torch.device("cpu"))
    models = {}
    for mode in ("eager", "compiled"):
        models[mode] = GPT(cfg.model)
        initialize(models[mode], cfg.model, cfg.train.seed)
        if mode == "compiled":
            compile_blocks([models[mode]], cfg, torch.device("cpu"))
    micro, seq, width = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.hidden_size
    tokens = torch.randint(cfg.model.vocab_size, (micro, seq + 1))
    layers = list(range(cfg.model.num_layers))

    def blocks(model):
        x = torch.randn(micro, seq, width, requires_grad=True)
        model.run_layers(layers, x, None, documents=None).sum().backward()

    def whole(model):
        model(tokens[:, :-1], tokens[:, 1:]).backward()

    times = {}
    for part, run in (("blocks", blocks), ("whole", whole)):
        for mode, model in models.items():
            run(model)  # the compile (and warm-up)
            run(model)
            spans = []
            for _ in range(reps):
                started = time.process_time()
                run(model)
                spans.append(time.process_time() - started)
            times[f"{part}_{mode}_cpu_s"] = statistics.median(spans)
    return times


def run_compile_cpu_times(size: str) -> dict:
    out = run_side([[sys.executable, __file__, "--compile-cpu", size]])[0]
    return json.loads(out.strip().splitlines()[-1])


def write_compile_results(rows: list[dict], out: Path, steps: int, rounds: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "steps": steps,
            "rounds": rounds, "load_avg_1_5_15": load, "torch": torch_version()}
    (out / "train_compile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# megaresil step, eager against train.compile=blocks (CPU, inductor)", "",
             f"{steps} steps per run (first {WARMUP_STEPS} dropped, median), best of {rounds} "
             f"alternating rounds, {os.cpu_count()} cores, one thread per rank, load average "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) when written, torch "
             f"{meta['torch']}.", "",
             "| size | layout | eager s/step | compiled s/step | eager/compiled | compile s "
             "(first step) | max abs loss diff |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['layout']} | {r['eager_step_s']:.3f} | "
              f"{r['compiled_step_s']:.3f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} | "
              f"{r['max_loss_diff']:.1e} |" for r in rows]
    lines += ["", "CPU seconds of one micro-batch's forward and backward, one process, one "
              "thread (compile_cpu_times):", "",
              "| size | blocks eager | blocks compiled | eager/compiled | whole model eager | "
              "whole compiled | eager/compiled | blocks' share of the whole |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['blocks_eager_cpu_s']:.3f} | {r['blocks_compiled_cpu_s']:.3f} | "
              f"{r['blocks_eager_cpu_s'] / r['blocks_compiled_cpu_s']:.2f}x | "
              f"{r['whole_eager_cpu_s']:.3f} | {r['whole_compiled_cpu_s']:.3f} | "
              f"{r['whole_eager_cpu_s'] / r['whole_compiled_cpu_s']:.2f}x | "
              f"{r['blocks_eager_cpu_s'] / r['whole_eager_cpu_s']:.2f} |"
              for r in rows if "blocks_eager_cpu_s" in r]
    (out / "train_compile.md").write_text("\n".join(lines) + "\n")


def torch_version() -> str:
    import torch
    return torch.__version__


NOTES = """\
Notes
- plain/megaresil = plain loop step time / megaresil step time, Mcore/megaresil =
  Megatron-Core's step time / megaresil's: above 1, megaresil's step is faster.
- All sides ran on the same machine in alternation, each keeping its best of the
  rounds; when the load average is above the core count other agents' work shared the
  2 cores, so absolute times are noisy and the ratios are the figures to read (tp=2
  needs both cores at once, so it suffers most from a busy machine).
- megaresil's side is end to end through `megaresil train` (launcher, worker, watchdog
  heartbeats, metrics); its step time is the time from one step's end to the next's
  (metrics.jsonl's `elapsed_s`), the whole loop iteration, as the plain loop is timed.
- Same model, weights, shapes, fused AdamW, F.cross_entropy (megaresil uses it at tp=1
  too) and fp32-norm clipping on both sides. Where megaresil differs: its grads live in
  flat buffers (no per-step allocation), and it runs torch's deterministic mode on CPU
  (bit-exact resume) without torch's NaN-fill of every new tensor (a debugging aid that
  cost ~900 extra fills per gpt-tiny step). In one process, alternating steps, the two
  steps take the same CPU time (tiny: 0.48 vs 0.50 s, small: 1.79 vs 1.94 s user per
  step), so a wall-clock gap at 1x1x1 is the machine's load, not megaresil's step.
- At `small`, a third of either side's CPU time is the kernel's: glibc unmaps every
  freed block over its mmap threshold (32 MiB at most), so each micro-batch's 128 MiB
  logits, log-softmax and their grads are faulted in again, zeroed, the next time
  (~315k page faults, ~0.8 s system time per step). Keeping freed memory in the heap
  (mallopt M_MMAP_MAX=0, no trim) removes the faults but was not adopted: posix_memalign
  fragments that heap, and the resident set grew from 734 MiB to 1.7 GiB in 14 steps
  and kept growing.
- Megatron-Core side: megatron-core 0.16.1 (bench-only; `pip install --no-deps
  megatron-core==0.16.1`, torch untouched), its GPTModel with the local (non-TE) layer
  spec at the same sizes (layers, hidden, heads, 4h MLP, vocab, sequence, micro-batch,
  learned positions, LayerNorm, tanh GELU, biases, tied embeddings, no dropout), its
  own init, in a loop like the plain one (bench/mcore_loop.py): torch's fused AdamW
  (no decay on 1-D params), Mcore's clipping rule (norm over non-TP-duplicate grads,
  all-reduced over TP, coefficient max/(norm+1e-6)) in torch ops, F.cross_entropy at
  tp=1, Mcore's own loss (labels in, its vocab-parallel CE) at tp=2, one gloo process
  per TP rank (initialize_model_parallel(2, 1)), same timing rule. Its tp=1 and tp=2
  losses agree to 1e-6 over 3 steps. Mcore's own training loop needs CUDA, so it is
  not used. The CPU shim, in that side's processes only: (1) torch.cuda.current_device
  returns "cpu", because Mcore allocates its attention score buffer
  (dot_product_attention.py:189 via utils.py:631) and TP communication buffers with
  device=torch.cuda.current_device(); (2) tensor_parallel.get_cuda_rng_tracker returns
  a tracker whose fork() does nothing, because the attention forks the CUDA RNG around
  its probability dropout (p=0 here, no number is drawn). The causal mask is passed as
  an input (Mcore's default one is built with device="cuda"); Mcore's fusions (CUDA
  kernels) are off. Mcore's local-spec attention is unfused (baddbmm, masked softmax,
  bmm) where megaresil and the plain loop use SDPA.
- Where tp=2's time goes at `tiny` (rank 0, torch.profiler, and per-thread CPU over
  5 s): ~0.27 s/step of compute on the main thread (the plain loop: ~0.39 s on one
  core; halving the matmuls does not halve per-op overheads, norms and attention at 3
  heads per rank), ~0.04 s in gloo's TCP thread, and ~0.1 s waiting inside gloo
  all-reduces. A gloo all_reduce between two 1-thread processes here costs 0.27 ms for
  384 KiB (one (4, 128, 192) activation; 10th percentile of 400, median 1-2 ms when
  other work runs) and 0.12-0.18 ms for 2 KiB. A step has 64 activation all-reduces (4
  per layer per micro-batch), 4 for the embedding and 12 small ones in the
  cross-entropy: ~21 ms of transfer; the rest of the wait is the two ranks drifting
  apart on two cores that also run gloo's threads and other agents' work. Mcore's tp=2
  pays the same collectives.
- Tried and not adopted: Megatron's overlap of the input grad's all-reduce with the
  weight-grad matmul in the column-parallel backward (async gloo all-reduce). A/B
  against the synchronous one, alternating: 0.96-1.03x at tiny, 0.99-1.03x at small,
  no gain on CPU/gloo, where both cores are busy computing while it is in flight.
- Adopted: the vocab-parallel cross-entropy builds exp and softmax in one buffer and
  scales its grad in place, and under GPT.forward (not the pipeline) in the logits' own
  buffer, as Megatron does. Alone, at small's tp=2 shard (1024 x 16384 fp32 logits),
  its forward + backward went from 209-226 ms to 120-148 ms per micro-batch (no 64 MiB
  tensors to fault in); end to end the A/B stayed inside the machine's noise.
- The 8-rank 3D demo (tp=2 x pp=2 x dp=2 of gpt-tiny) runs at ~0.63-0.65x of 1x1x1 on
  2 cores, and that is expected, not overhead to remove: 8 processes share 2 cores
  (1 thread each, 4x oversubscribed, so context switches and cache misses at every
  gloo wait); each rank's matmuls are 1/4 of the model on 1/2 of the batch, too small to
  run at the kernel's speed; TP adds 4 gloo all-reduces per layer per micro-batch; 1F1B
  with p=2 stages and m=2 micro-batches per DP rank idles each stage for
  (p-1)/(m+p-1) = 1/3 of the step (the bubble; bench/pipeline_bubble.py); and DP adds a
  grad all-reduce per step. On GPUs, where each rank has its own device, these costs
  are what the layout buys memory with, not a slowdown of the same hardware.
"""


def table(rows: list[dict], mcore_skipped: str) -> list[str]:
    lines = ["| size | layout | megaresil s/step | plain loop s/step | plain/megaresil "
             "| Mcore s/step | Mcore/megaresil |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mcore = (f"{r['mcore_step_s']:.3f} | {r['mcore_ratio']:.2f}x" if not mcore_skipped
                 else "- | -")
        lines.append(f"| {r['size']} | {r['layout']} | {r['megaresil_step_s']:.3f} | "
                     f"{r['plain_step_s']:.3f} | {r['ratio']:.2f}x | {mcore} |")
    if mcore_skipped:
        lines += ["", f"Megatron-Core side skipped: {mcore_skipped}"]
    return lines


def write_results(rows: list[dict], out: Path, steps: int, rounds: int,
                  mcore_skipped: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[1]  # 5-minute load average: how busy the shared machine was
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "steps": steps,
            "rounds": rounds, "warmup_steps_dropped": WARMUP_STEPS, "load_avg_5min": load,
            "mcore_skipped": mcore_skipped}
    (out / "train_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    busy = (" (above the core count: other agents' work shared the cores, and alternating "
            "the sides keeps that noise in every side alike)" if load > os.cpu_count() else "")
    lines = ["# megaresil step vs a plain PyTorch loop and Megatron-Core (CPU)", "",
             f"{steps} steps per run (first {WARMUP_STEPS} dropped, median), best of {rounds} "
             f"alternating rounds, {os.cpu_count()} cores, 5-minute load average {load:.1f} "
             f"when written{busy}.", "", *table(rows, mcore_skipped)]
    (out / "train_throughput.md").write_text("\n".join(lines) + "\n\n" + NOTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plain", choices=list(SIZES), help="run one baseline and print JSON")
    parser.add_argument("--compile", action="store_true",
                        help="megaresil eager against train.compile=blocks only")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--compile-cpu", choices=list(SIZES),
                        help="one size's compile_cpu_times; prints JSON")
    args = parser.parse_args()
    if args.compile_cpu:
        print(json.dumps(compile_cpu_times(args.compile_cpu)))
        return
    if args.compile:
        rows = measure_compile(args.sizes, args.layouts, args.steps, args.rounds)
        write_compile_results(rows, args.out, args.steps, args.rounds)
        return
    if args.plain:
        print(json.dumps(plain_loop(args.plain, args.steps)))
        return
    mcore_skipped = mcore_missing()
    if mcore_skipped:
        print(f"Megatron-Core side skipped: {mcore_skipped}", flush=True)
    rows = measure(args.sizes, args.steps, args.rounds, with_mcore=not mcore_skipped)
    write_results(rows, args.out, args.steps, args.rounds, mcore_skipped)


if __name__ == "__main__":
    main()
