"""Running one prepared gpt-oss set over several processes, one GPU each (tensor and expert
parallel): the launch's environment, the process group, the checks every rank passes before
any weight loads, the collectives of the decode step, each rank's share of the dense weights,
and a launcher for ``--nproc``.

Every module here imports torch.distributed only when a function needs it, so that a
single-process run never initialises it.
"""
