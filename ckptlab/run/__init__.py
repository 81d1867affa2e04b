"""Running grids of cells: the cell loop, local / isolated / submitit runners, the run store and provenance."""
