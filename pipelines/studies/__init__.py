"""Reproduction studies: arms x seeds trained by a Ray Tune grid, compared at equal steps and equal FLOPs."""
