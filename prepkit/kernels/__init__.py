"""The bundled Triton MXFP4 MoE kernel. Imports nothing heavy at package import time."""
