"""The device call's time budget: every part's deadline, in seconds.

One H200 is lent for about 15 minutes of device time in all, machine start
included: one call of tools/gpu_check.sh must fit in CALL_BUDGET_S (8 min)
so that a rerun of most of it still fits. gpu_check.sh reads its outer limits here
(`python tools/gpu_check_budget.py PART [--dry-run]`, no torch import) and gpu_check.py
gives each check its own deadline from the same table; a test asserts the
parts add up to no more than the call's budget.
"""
from __future__ import annotations

import sys

CALL_BUDGET_S = 480

BUDGET_S = {
    "install": 20,  # pip install of the carried wheels, offline
    "startup": 10,  # gpu_check.py's imports, CUDA start, the run's summary and table
    # gpu_check.py's checks, in their order (gpu_check.CHECKS):
    "logits_cuda_vs_cpu": 10,
    "bf16_vs_fp32_loss": 32,
    "te_vs_local": 5,
    "throughput_1b": 55,
    # eager and train.compile=blocks on the ~100M GPT-2, 8 steps each; most of it is
    # inductor's compile of one block graph (a cold cache)
    "compile_vs_eager": 30,
    "mcore_1b": 40,
    "moe_logits_and_step": 30,  # MoE logits vs the CPU, a 10-step bf16 run of a ~0.39B MoE
    "checkpoint_io": 40,
    "activation_offload": 25,
    "context_attention_vs_sdpa": 8,  # cp=2 and 4's attention blocks vs SDPA at 8192 tokens
    "fsdp_mixed_precision": 8,  # FSDP2's bf16 policy on the ~100M GPT-2, 20 steps each side
    "nccl_hang_drill": 110,  # chaos: a reference, the drill, its relaunch
    "not_on_this_device": 1,
    "pytest_gpu": 55,  # pytest -m gpu on the GPU test files
}
SHELL_PARTS = ("install", "pytest_gpu")  # timed by gpu_check.sh itself
# --dry-run (the rehearsal, the tests) runs the stand-ins on a shared CPU, whose speed says
# nothing about the H200's: they get this many times the device's deadlines.
DRY_RUN_SLACK = 3


def checks_budget_s() -> int:
    """The limit of gpu_check.py's whole process: every part but the shell's."""
    return sum(s for part, s in BUDGET_S.items() if part not in SHELL_PARTS)


def deadline_s(part: str, dry_run: bool) -> int:
    seconds = checks_budget_s() if part == "checks" else BUDGET_S[part]
    return seconds * (DRY_RUN_SLACK if dry_run else 1)


def main() -> int:
    """PART [--dry-run]: its deadline in seconds ("checks": gpu_check.py's whole process)."""
    print(deadline_s(sys.argv[1], "--dry-run" in sys.argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
