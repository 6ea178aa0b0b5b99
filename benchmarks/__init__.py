"""specjax's maintained benchmarks: each module prints JSON and is run from
the repository root as ``python -m benchmarks.NAME`` (its docstring says
how); ``benchmarks.gpu`` is the run on a lent GPU machine. Results kept in
``benchmarks/results/`` are the ones docs/RESULTS.md cites."""
