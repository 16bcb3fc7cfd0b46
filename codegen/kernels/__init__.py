"""Triton / Gluon kernels, one folder per op."""

# log2(e): the kernels take exponentials as exp2 of log2(e)-scaled arguments (one MUFU.EX2 an entry)
LOG2E = 1.4426950408889634
