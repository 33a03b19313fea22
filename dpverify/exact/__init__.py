"""Exact mode: dyadic float64 copies of a case, every operation of its step shown exact,
and comparisons without tolerance (``grid``, ``rules``, ``proof``, ``case``)."""
