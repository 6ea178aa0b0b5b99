"""The run on a lent GPU machine: ``python -m benchmarks.gpu COMMAND``
(``kit``'s docstring has the sequence; ``cost_curve`` is its verify-cost
curve, also ``python -m benchmarks.gpu curve``)."""
