"""Kernels of the decode step (one token per row): the pieces between the MoE launches, fused so
that a layer is a handful of launches that each stream their weights at the memory's pace.

Each kernel module registers a :class:`~prepkit.kernels.decode.variants.DecodeKernel` (its
tunable variants, a launcher, and a reference on tensors) by name in
:data:`~prepkit.kernels.decode.variants.KERNELS`, so the tuner and the step find them in one place.
"""
