"""Approximate prefix-cache index (GIE's approx-prefix-cache design)."""
