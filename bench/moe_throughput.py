"""megaresil's mixture-of-experts step against Megatron-Core's MoE layer, side by side.

The `moe-tiny` recipe's shapes (4 Llama layers of 128, the first dense, then 8
SwiGLU experts of width 128, top-2, aux and z losses; 512 tokens a micro-batch,
16 sequences a step) on synthetic data, tp=1 and pp=1, at three layouts: one
rank; dp=2 (ep=1, every rank all experts); dp=2 with ep=2 (each rank 4 experts,
tokens exchanged). megaresil's side is `megaresil train` end to end (step time
from metrics.jsonl's `elapsed_s`, peak resident set from its `mem_peak_mb`);
Megatron-Core's is bench/mcore_loop.py (its GPTModel with the local layer spec
and its MoE layer at the same shapes: SequentialMLP experts, the "allgather"
token dispatcher, which is the one that runs on the CPU; see its docstring).
Every process has one intra-op thread; the sides alternate, `--rounds` times,
and each round gives a ratio, so load that comes and goes hits both alike.

Then one untimed run per side at dp=2 ep=2 with bench/collective_bytes/ on the
PYTHONPATH counts the bytes each rank sends to its peers in all-to-alls,
all-gathers and reduce-scatters, against the theory of `a2a_bytes_per_step`.

    python bench/moe_throughput.py [--steps 8] [--rounds 3] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from train_throughput import ONE_THREAD, WARMUP_STEPS, mcore_missing, run_side

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "megaresil" / "recipes" / "moe-tiny.yaml"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
COUNTER = Path(__file__).resolve().parent / "collective_bytes"
COMMON = ["data.source=synthetic", "train.eval_batches=0", "checkpoint.interval=0",
          "logging.progress=false", "logging.tensorboard=false", "parallel.tp=1",
          "parallel.pp=1"]
LAYOUTS = {"1 rank": (1, 1), "dp2": (2, 1), "dp2 ep2": (2, 2)}  # name: (dp, ep)
FP32_BYTES = 4


def a2a_bytes_per_step(tokens: int, top_k: int, hidden: int, dtype_bytes: int,
                       moe_layers: int, micro_batches: int, ep: int) -> float:
    """Bytes one rank sends to its expert-parallel peers per optimizer step
    when the router spreads tokens evenly: each of a micro-batch's
    tokens x top_k routed rows (hidden x dtype_bytes each) crosses to a peer
    unless its expert is local (1/ep of them), twice in the forward
    (dispatch, combine) and twice in the backward (their grads), in every
    MoE layer of every micro-batch."""
    row = hidden * dtype_bytes
    return tokens * top_k * row * (ep - 1) / ep * 2 * 2 * moe_layers * micro_batches


def overrides(layout: str, steps: int) -> list[str]:
    dp, ep = LAYOUTS[layout]
    return [*COMMON, f"parallel.dp={dp}", f"parallel.ep={ep}", f"train.steps={steps}"]


def run_megaresil(layout: str, steps: int, env: dict | None = None) -> dict:
    """`megaresil train` end to end: the median time from one step's end to
    the next's (as bench/train_throughput.py), and the largest peak resident
    set a metrics line reported (rank 0's)."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [str(RECIPE), *overrides(layout, steps), f"run.dir={run_dir}"]
        run_side([[sys.executable, "-m", "megaresil", "train", *args]], env=env)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    steps_done = [r for r in records if "elapsed_s" in r]
    ends = [r["elapsed_s"] for r in steps_done]
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    return {"step_s": statistics.median(step_s[WARMUP_STEPS - 1:]),
            "peak_rss_mb": max(r.get("mem_peak_mb", 0.0) for r in steps_done)}


def run_mcore(layout: str, steps: int, env: dict | None = None) -> dict:
    """bench/mcore_loop.py at the layout, one process per rank: rank 0's
    median step time and every rank's peak resident set. Each rank has a
    session of its own, as each of `megaresil train`'s workers has (torch
    elastic starts them so): the kernel's autogroup scheduler (on here)
    shares a loaded machine among sessions, not processes."""
    from megaresil.ports import free_port
    dp, ep = LAYOUTS[layout]
    command = [sys.executable, str(ROOT / "bench" / "mcore_loop.py"), "recipe", "--steps",
               str(steps), "--dp", str(dp), "--ep", str(ep), "--port", str(free_port())]
    tail = ["--", str(RECIPE), *overrides(layout, steps)]
    outs = run_side([command + ["--rank", str(rank), *tail] for rank in range(dp)], env=env)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {"step_s": results[0]["step_s"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results)}


def measure(steps: int, rounds: int) -> list[dict]:
    rows = []
    for layout in LAYOUTS:
        runs = []
        for _ in range(rounds):  # alternate, so load on the machine hits both sides
            ours, theirs = run_megaresil(layout, steps), run_mcore(layout, steps)
            runs.append({"megaresil": ours, "mcore": theirs,
                         "ratio": theirs["step_s"] / ours["step_s"], "load_1min": load()})
            print(layout, json.dumps(runs[-1]), flush=True)
        rows.append(summary(layout, runs))
    return rows


def summary(layout: str, runs: list[dict]) -> dict:
    best = {side: min(r[side]["step_s"] for r in runs) for side in ("megaresil", "mcore")}
    return {"layout": layout, "megaresil_step_s": best["megaresil"], "mcore_step_s": best["mcore"],
            "ratio_of_best": best["mcore"] / best["megaresil"],
            "ratio_median_of_rounds": statistics.median(r["ratio"] for r in runs),
            "megaresil_peak_rss_mb": max(r["megaresil"]["peak_rss_mb"] for r in runs),
            "mcore_peak_rss_mb": max(r["mcore"]["peak_rss_mb"] for r in runs), "rounds": runs}


def counted_bytes(side, steps: int) -> dict:
    """One untimed run of `side` at dp2 ep2 with the byte counter on: bytes
    per step and calls per step each rank sent, by collective (the mean of
    the ranks)."""
    with tempfile.TemporaryDirectory() as counts:
        env = {**ONE_THREAD, "MEGARESIL_BENCH_BYTES_DIR": counts,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(COUNTER),
                                                           os.environ.get("PYTHONPATH")]))}
        side("dp2 ep2", steps, env)
        per_rank = [json.loads(f.read_text()) for f in Path(counts).glob("*.json")]
    kinds = sorted({kind for totals in per_rank for kind in totals})
    return {kind: {field: statistics.mean(t.get(kind, {}).get(field, 0) for t in per_rank) / steps
                   for field in ("bytes", "calls")} for kind in kinds}


def theory(steps_cfg) -> float:
    from megaresil.model.moe.block import has_experts
    m, t = steps_cfg.model, steps_cfg.train
    dp, ep = LAYOUTS["dp2 ep2"]
    moe_layers = sum(has_experts(m.moe, i) for i in range(m.num_layers))
    return a2a_bytes_per_step(t.micro_batch_size * steps_cfg.data.seq_len, m.moe.top_k,
                              m.hidden_size, FP32_BYTES, moe_layers,
                              t.global_batch_size // (t.micro_batch_size * dp), ep)


def cpu_per_step(steps: int) -> dict:
    """Both models' forward and backward over a step's micro-batches at one
    rank, in this one process, alternating step by step: the median thread
    CPU seconds per step of each. CPU time counts the work, not the waits a
    loaded machine adds, so this is the same-kernels comparison the wall
    times cannot give here (run by `--cpu-ab` in a process of its own: it
    applies Mcore's CPU shim)."""
    import mcore_loop
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from megaresil.config import load_recipe
    from megaresil.model.gpt import GPT
    from megaresil.model.init import initialize
    from megaresil.ports import free_port

    mcore_loop.cpu_shim()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cfg = load_recipe(str(RECIPE), overrides("1 rank", steps))
    theirs = mcore_loop.build_model(cfg, torch.device("cpu"))
    ours = GPT(cfg.model)
    initialize(ours, cfg.model, cfg.train.seed)
    micro, seq, vocab = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    positions = torch.arange(seq).unsqueeze(0).expand(micro, -1)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
    generator = torch.Generator().manual_seed(0)

    def megaresil_loss(tokens: torch.Tensor) -> torch.Tensor:
        logits = ours.stage_forward(tokens[:, :-1], None)[..., :vocab]
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    sides = {"megaresil": megaresil_loss,
             "mcore": lambda tokens: mcore_loop.micro_batch_loss(theirs, tokens, positions,
                                                                 mask, 1)}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(WARMUP_STEPS + steps):
        for side, loss in sides.items():
            started = time.thread_time()
            for _ in range(cfg.train.global_batch_size // micro):
                loss(torch.randint(vocab, (micro, seq + 1), generator=generator)).backward()
            seconds[side].append(time.thread_time() - started)
    dist.destroy_process_group()
    return {side: statistics.median(s[WARMUP_STEPS:]) for side, s in seconds.items()}


def run_cpu_ab(steps: int) -> dict:
    out = run_side([[sys.executable, __file__, "--cpu-ab", "--steps", str(steps)]])[0]
    return json.loads(out.strip().splitlines()[-1])


def load() -> float:
    return os.getloadavg()[0]


def write_results(rows: list[dict], cpu: dict, traffic: dict, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_throughput.json").write_text(json.dumps(
        {"meta": meta, "cpu_s_per_step_one_process": cpu, "rows": rows, "bytes_dp2_ep2": traffic},
        indent=1))
    lines = ["# megaresil MoE step vs Megatron-Core's MoE layer (CPU, moe-tiny shapes)", "",
             f"{meta['steps']} steps a run (first {WARMUP_STEPS} dropped, median), "
             f"{meta['rounds']} alternating rounds, {meta['cpus']} cores shared with other "
             f"work, 1-minute load {meta['load_start']:.1f} at the start and "
             f"{meta['load_end']:.1f} at the end.", "",
             "| layout | megaresil s/step | Mcore s/step | Mcore/megaresil (best) "
             "| Mcore/megaresil (median of rounds) | peak RSS megaresil / Mcore, MB |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['megaresil_step_s']:.3f} | {r['mcore_step_s']:.3f} "
                     f"| {r['ratio_of_best']:.2f}x | {r['ratio_median_of_rounds']:.2f}x "
                     f"| {r['megaresil_peak_rss_mb']:.0f} / {r['mcore_peak_rss_mb']:.0f} |")
    lines += ["", "Forward and backward of a step at one rank, both models in one process, "
              f"alternating: thread CPU s/step megaresil {cpu['megaresil']:.3f}, Mcore "
              f"{cpu['mcore']:.3f} (Mcore/megaresil {cpu['mcore'] / cpu['megaresil']:.2f}x)."]
    if traffic:
        lines += ["", "Bytes a rank sends to peers per step at dp2 ep2 (mean of the ranks):", "",
                  "| side | collective | MB/step | calls/step |", "|---|---|---:|---:|"]
        for side, kinds in traffic.get("measured", {}).items():
            for kind, v in kinds.items():
                lines.append(f"| {side} | {kind} | {v['bytes'] / 1e6:.3f} | {v['calls']:.0f} |")
        lines += ["", f"Theory, megaresil's all-to-all rows with even routing: "
                      f"{traffic['theory_bytes'] / 1e6:.3f} MB/step."]
    (out / "moe_throughput.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cpu-ab", action="store_true",
                        help="only the one-process CPU-time comparison; prints JSON")
    args = parser.parse_args()
    skipped = mcore_missing()
    if skipped:
        print(f"Megatron-Core side skipped, nothing to compare: {skipped}")
        return
    if args.cpu_ab:
        print(json.dumps(cpu_per_step(args.steps)))
        return
    for layout in list(LAYOUTS):
        if layout not in args.layouts:
            del LAYOUTS[layout]
    started, load_start = time.monotonic(), load()
    cpu = run_cpu_ab(args.steps)
    print("cpu s/step, one process:", json.dumps(cpu), flush=True)
    rows = measure(args.steps, args.rounds)
    traffic = {}
    if "dp2 ep2" in LAYOUTS:
        from megaresil.config import load_recipe
        cfg = load_recipe(str(RECIPE), overrides("dp2 ep2", args.steps))
        traffic = {"theory_bytes": theory(cfg),
                   "measured": {"megaresil": counted_bytes(run_megaresil, args.steps),
                                "mcore": counted_bytes(run_mcore, args.steps)}}
        print(json.dumps(traffic), flush=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "steps": args.steps,
            "rounds": args.rounds, "warmup_steps_dropped": WARMUP_STEPS,
            "load_start": load_start, "load_end": load(),
            "minutes": (time.monotonic() - started) / 60}
    write_results(rows, cpu, traffic, args.out, meta)


if __name__ == "__main__":
    main()
