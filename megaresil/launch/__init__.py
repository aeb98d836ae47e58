"""Start training: as the TorchElastic launcher (outside torchrun) or as one
worker (inside torchrun or our own launch).

- membership: which agents (nodes) form the job and where they meet
- from_hf: `train RECIPE --from-hf DIR` resolved to overrides, and its checks
- checks: what is refused before any worker starts (GPUs, links, data)
- agent: the launcher: local workers under a TorchElastic agent, and how the job ended
- worker: one rank's bootstrap (process group, restarts), also as a Slurm task
"""
