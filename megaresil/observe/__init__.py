"""Seeing a run: model FLOPs and MFU, section times, memory, goodput, loggers,
profiler traces and the HTML report. Reads the run directory and the recipe;
knows nothing of the trainer or of resilience."""
