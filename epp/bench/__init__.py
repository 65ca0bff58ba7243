"""Workloads and load runners shared by `epp demo` and the benchmarks."""
