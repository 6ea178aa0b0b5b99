"""The engine's ``generate`` jitted at XLA's -O1, for tests bound by running
their programs rather than compiling them (tens of thousands of rows, or
hundreds of steps): those run ~2.4x as fast as at the suite's -O0
(tests/conftest.py) and compile about as fast, with the same draws. The
suite keeps -O0, where compiling dominates (docs/DESIGN.md, "Compile
level")."""

import jax

from specjax.core import engine

generate_o1 = jax.jit(engine.generate, static_argnames=("target", "dcfg"),
                      compiler_options={"xla_backend_optimization_level": 1})
