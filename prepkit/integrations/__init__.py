"""Glue between prepared shards and model code of other projects; each module needs its own extra
(``prepkit-gpt-oss[transformers]`` for :mod:`prepkit.integrations.transformers`)."""
