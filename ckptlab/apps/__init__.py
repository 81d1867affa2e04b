"""The user-facing top: the command line, the notebook runner, the explorer, the GPU check."""
