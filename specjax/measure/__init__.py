"""The measuring tools: benchmarks that print JSON (``bench``), the theory
of expected tokens per verify and its cost model (``theory``), and the
tuner that picks a method from measured priors (``tuner``)."""
