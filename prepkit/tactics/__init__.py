"""Tactics: which kernel variant serves a GEMM problem on a GPU, and the DB that remembers it.

- :mod:`~prepkit.tactics.schema`: the one definition of ``tactics.db`` (tables, ids, version);
- :mod:`~prepkit.tactics.keys`: problem, environment and tactic keys and their hashes;
- :mod:`~prepkit.tactics.lookup`: token ranges, where tables come from, the resolver;
- :mod:`~prepkit.tactics.choose`: the one chooser every kernel caller asks, and the lookup Protocols;
- :mod:`~prepkit.tactics.store`: the writer (sqlite-utils): migrations, merge, export;
- :mod:`~prepkit.tactics.validate`: what a merge accepts, and the damage a reader names.

``schema``, ``keys``, ``lookup`` and ``validate`` use the standard library only, so the runtime stays cheap to
import; ``store`` needs sqlite-utils and is imported only by the tuner and the CLI.
"""
