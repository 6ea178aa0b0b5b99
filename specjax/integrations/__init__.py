"""Adapters that put specjax inside other libraries' loops (each imports
its library only when imported itself)."""
