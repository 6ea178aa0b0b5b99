"""Training the draft heads: data and feature caches (``data``,
``features``, ``regenerate``), the training-time test (``ttt``,
``fused_ce``), the run's config (``config``: ml_collections files,
sweeps), the optax/orbax trainer (``train``) and held-out evaluation
(``evaluate``). Decoding never imports this package."""
