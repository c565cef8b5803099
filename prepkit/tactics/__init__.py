"""Tactics: which kernel variant serves a GEMM problem on a GPU, and the DB that remembers it.

- :mod:`~prepkit.tactics.schema`: the one definition of ``tactics.db`` (tables, ids, version);
- :mod:`~prepkit.tactics.keys`: problem, environment and tactic keys and their hashes;
- :mod:`~prepkit.tactics.points` and :mod:`~prepkit.tactics.ranges`: the token series and the range rule;
- :mod:`~prepkit.tactics.paths`: where the user's and the bundled DB are;
- :mod:`~prepkit.tactics.table`, :mod:`~prepkit.tactics.resolver`, :mod:`~prepkit.tactics.adapters`:
  the lookup (gathered under :mod:`~prepkit.tactics.lookup`), and :mod:`~prepkit.tactics.suggest`,
  the tune command a miss names;
- :mod:`~prepkit.tactics.choose`: the one chooser every kernel caller asks, and the lookup Protocols;
- :mod:`~prepkit.tactics.store`: the writer (sqlite-utils): migrations, rows, merge, export;
- :mod:`~prepkit.tactics.validate`: what a merge accepts, and the damage a reader names.

All but ``store`` use the standard library only, so the runtime stays cheap to import; ``store``
needs sqlite-utils and is imported only by the tuner and the CLI.
"""
