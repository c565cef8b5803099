"""Turning a prepared folder into text: sampling, streaming, the generate and bench runs."""
